"""What one step collects until its record is staged, and the per-tensor statistics kept between passes.

:class:`StepState` is the capture's state for the step in progress (a fresh one per step): device tensors and host
values gathered by the hooks, which :meth:`~stability.hooks.capture.Capture._submit` stages. :class:`Snapshot` is a
sampled step's copy of the parameters before the update (for update ratios); :class:`Unchanged` keeps per-tensor
statistics valid while their tensors are not changed in place, so a later statistic of the same values needs no
second pass. :func:`forward_tail` and :func:`observed_win` are the two edits a step's state gets as it ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stability.hooks import stats

__all__ = ["Snapshot", "StepState", "Unchanged", "forward_tail", "observed_win"]


@dataclass(frozen=True)
class Snapshot:
    """The parameters before a sampled step (in buffers kept for the capture's life) and their per-tensor squared
    norms (``‖w before‖²`` of the update ratio)."""

    buffers: list[torch.Tensor]
    sq_norms: torch.Tensor


def _storage(t: torch.Tensor | None) -> int:
    """Where a tensor's values live (0 for None; a sparse gradient has no single storage: its identity and version
    stand for it)."""
    return 0 if t is None or t.is_sparse else t.data_ptr()


@dataclass
class Unchanged:
    """Per-tensor statistics of some tensors, valid while each is still the same tensor object with the same
    storage at the same version (torch bumps a tensor's ``_version`` with every in-place change: clipping,
    unscaling, an optimizer step, ``copy_``/``load_state_dict``). Used so that a later statistic of the same
    values needs no second pass over them. Not seen: in-place changes made through ``tensor.data``, which torch does
    not count."""

    values: torch.Tensor
    tensors: list[torch.Tensor | None]
    versions: list[int]
    storage: list[int]

    @classmethod
    def now(cls, values: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> Unchanged:
        kept = list(tensors)
        return cls(values, kept, [-1 if t is None else t._version for t in kept],
                   [_storage(t) for t in kept])

    def holds_for(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """True when ``tensors`` are the same tensors, unchanged since the statistics were taken."""
        return len(tensors) == len(self.tensors) and all(
            t is k and (t is None or (t._version == v and _storage(t) == d))
            for t, k, v, d in zip(tensors, self.tensors, self.versions, self.storage, strict=True)
        )


@dataclass
class StepState:
    """What has been collected for the step in progress."""

    losses: list[torch.Tensor] = field(default_factory=list)
    parts: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)
    grads_measured: bool = False
    grad_parts: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)
    """Gradient statistics, kept apart so a later measurement of the same step replaces them."""
    grad_norms: Unchanged | None = None
    """Per-tensor norms of the gradients as they are now (Adam's statistic reuses them on sampled steps)."""
    clip_measured: bool = False
    """The gradients were measured by the ``clip_grad_norm_`` in progress, with the norms it clips with."""
    lr_recorded: bool = False
    scaler: Any = None
    snapshot: Snapshot | None = None
    acts: dict[str, list[stats.ActStat]] = field(default_factory=dict)
    logit_z: list[torch.Tensor] = field(default_factory=list)
    batch: str | None = None
    observed: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    observed_host: dict[str, float] = field(default_factory=dict)
    framework_losses: list[torch.Tensor] = field(default_factory=list)
    next_batch: str | None = None
    """A batch id set after a ``backward()`` of this step, before it was known to end."""
    closure: bool = False
    """The tracked optimizer steps with a closure (``step(closure)``)."""
    closure_done: bool = False
    """Its first call returned: what later calls backpropagate or run forward is left out."""
    objectives: int = 1
    """1 + the other optimizers that stepped on losses of their own in this step's window (a GAN: 2)."""
    forward_marks: tuple[dict[str, int], int] | None = None
    """Activation / logit entries at the last ``backward()`` (loops without an optimizer: later entries belong to
    the next step when this one ends at the next ``backward()``)."""



def forward_tail(state: StepState) -> tuple[dict[str, list[stats.ActStat]], list[torch.Tensor]]:
    """Remove and return the activation / logit entries recorded after the step's last ``backward()``."""
    acts_at, logits_at = state.forward_marks if state.forward_marks is not None else ({}, 0)
    tail: dict[str, list[stats.ActStat]] = {}
    for name, values in list(state.acts.items()):
        keep = acts_at.get(name, 0)
        if len(values) > keep:
            tail[name] = values[keep:]
            del values[keep:]
            if not values:
                del state.acts[name]
    logits = state.logit_z[logits_at:]
    del state.logit_z[logits_at:]
    return tail, logits


def observed_win(state: StepState) -> None:
    """Make observed values override Capture's own values of the same name (device ones are staged last)."""
    if not state.observed and not state.observed_host:
        return
    for name in state.observed_host:
        state.host.pop(name, None)
    own = {n for names, _ in state.parts for n in names}
    for name, value in list(state.observed_host.items()):
        if name in own:  # a device value of Capture's own would win in the record: stage this one after it
            del state.observed_host[name]
            device = state.parts[0][1].device
            state.observed.append((name, torch.tensor([value], dtype=torch.float64).to(device, non_blocking=True)))
    for name, _ in state.observed:
        state.host.pop(name, None)
    state.host.update(state.observed_host)
    state.parts.extend(([name], tensor) for name, tensor in state.observed)

