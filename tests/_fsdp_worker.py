"""One rank of the two-process FSDP tests (run by ``torchrun --nproc_per_node 2``; see tests/test_fsdp.py).

``python _fsdp_worker.py OUT fsdp2|fsdp1``. Trains a small MLP sharded with FSDP2's ``fully_shard`` or FSDP1's
``FullyShardedDataParallel`` (gloo, CPU) with AdamW and ``clip_grad_norm_`` (FSDP1: its own method) under a
:class:`Capture` and a :class:`ListSink`, and notes per step the norm of this rank's shard of the gradients before
clipping and the whole model's norm that torch's clipping used. Then trains the same model again without the
capture. Writes ``<out>/rank-<rank>.json``: the records, those references, and whether both trainings ended with
bit-identical parameters (the capture must not change training, e.g. by clipping with a shard's norm).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.testing import ListSink

STEPS = 12


def adam_ratios(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    """Per module, Adam's ``sum g^2 / sum v_prev`` (bias-corrected, before this step) over this rank's shards,
    from the gradients as the optimizer saw them (clipped)."""
    beta2 = opt.param_groups[0]["betas"][1]
    out = {}
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        g2 = sum(float(_local(p.grad).double().square().sum()) for p in params)
        v = sum(float(opt.state[p]["exp_avg_sq"].to_local().double().sum()) for p in params)
        t = float(opt.state[params[0]]["step"])
        if t > 1:
            out[name] = g2 / (max(v - (1 - beta2) * g2, 0.0) / beta2 / (1 - beta2 ** (t - 1)))
    return out


class Block(nn.Sequential):
    """FSDP1's wrapping unit."""


def train(capture: bool, kind: str) -> tuple[list[torch.Tensor], list[dict[str, float]], list[dict], int]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[Block(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2)],
                                     nn.Linear(16, 4))
    if kind == "fsdp2":
        for block in list(model)[:2]:
            fully_shard(block)
        fully_shard(model)
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = ListSink()
    cap = Capture(WatchConfig(run_id="fsdp-two", stats_every=2), sink).attach(model, opt) if capture else None
    gen = torch.Generator().manual_seed(100 + rank)
    seen = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        local = torch.stack([_local(p.grad).norm() for p in model.parameters() if p.grad is not None]).norm()
        if kind == "fsdp2":  # 0.1: below every step's norm, so every step clips
            total = nn.utils.clip_grad_norm_(model.parameters(), 0.1).full_tensor()
        else:
            total = model.clip_grad_norm_(0.1)  # type: ignore[operator]
        opt.step()
        seen.append({"loss": float(loss), "local_grad_norm": float(local), "total": float(total),
                     "adam_v_ratio": adam_ratios(model, opt) if kind == "fsdp2" else {}})
    errors = 0
    if cap is not None:
        cap.close()
        errors = cap.errors
    records = [{"step": r.step, "rank": r.rank, "coords": dict(r.coords), "signals": dict(r.signals)}
               for r in sorted(sink.records, key=lambda r: r.step)]
    return [_local(p).detach().clone() for p in model.parameters()], seen, records, errors


def _local(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.to_local() if hasattr(t, "to_local") else t


def main(out: Path, kind: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with_capture, seen, records, errors = train(capture=True, kind=kind)
    without, _, _, _ = train(capture=False, kind=kind)
    same = all(torch.equal(a, b) for a, b in zip(with_capture, without, strict=True))
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"records": records, "seen": seen, "errors": errors, "training_unchanged": same}))
    # FSDP1's modules live in reference cycles; left to the interpreter's teardown, their process group references
    # abort the process now and then ("terminate called without an active exception", exit -6 after the files are
    # written), with or without a capture: 1 in 12 runs of this script with no capture and the collector disabled
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
