"""One rank of the two-process DeepSpeed test (run by ``torchrun --nproc_per_node 2``; see tests/test_deepspeed.py).

Trains a tiny model with ZeRO-2 (fp32, gloo) for 3 optimizer steps with a capture attached through
``attach_deepspeed`` and a :class:`ListSink`, then writes ``<out>/rank-<rank>.json`` with the records and what the
engine itself reported after each step.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.hooks.deepspeed import attach_deepspeed
from stability.records import StepRecord
from stability.testing import ListSink

GAS, MICRO = 2, 4


def main(out: Path) -> None:
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("inp", torch.nn.Linear(8, 16))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("out", torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="ds-two", stats_every=2), sink).attach()
    attachment = attach_deepspeed(engine, capture)
    assert attachment is not None
    seen = []
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(3):
        losses = []
        for _ in range(GAS):
            x, y = torch.randn(MICRO, 8, generator=gen), torch.randn(MICRO, 1, generator=gen)
            loss = ((engine(x) - y) ** 2).mean()
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        seen.append(
            {
                "loss": sum(losses) / len(losses),
                "grad_norm": float(engine.get_global_grad_norm()),
                "samples": engine.global_samples,
            }
        )
    capture.close()
    attachment.detach()
    records = [_plain(r) for r in sorted(sink.records, key=lambda r: r.step)]
    (out / f"rank-{rank}.json").write_text(json.dumps({"records": records, "seen": seen, "errors": capture.errors}))
    torch.distributed.barrier()


def _plain(record: StepRecord) -> dict[str, object]:
    return {"step": record.step, "rank": record.rank, "coords": dict(record.coords), "signals": dict(record.signals)}


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(Path(sys.argv[1]))
