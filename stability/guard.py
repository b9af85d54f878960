"""``stability.guard``: let the training loop act on anomalies (opt-in).

See :mod:`stability.hooks.guard` for the details; typical use::

    guard = stability.guard.Guard.for_handle(handle, stability.guard.GuardConfig())
    opt = guard.wrap(torch.optim.AdamW(model.parameters()))
    ...
    guard.check(loss, grad_norm)   # 0-d bool tensor on the device, agreed across ranks; no host sync
    opt.step()                     # skipped on the device when the check said so
    guard.write_skip_lists(run_dir)  # iterations_to_skip.txt (Megatron), skip_batches.json (Lightning)
"""

from __future__ import annotations

from stability.hooks.guard import (
    LIGHTNING_FILE,
    MEGATRON_FILE,
    Advice,
    Guard,
    GuardConfig,
    GuardedOptimizer,
    SkippedStep,
)

__all__ = ["LIGHTNING_FILE", "MEGATRON_FILE", "Advice", "Guard", "GuardConfig", "GuardedOptimizer", "SkippedStep"]
