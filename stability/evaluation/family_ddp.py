"""Replicated runs of the families corpus as a real data-parallel job: ``spec.ranks`` CPU processes, gloo,
``DistributedDataParallel``, one :class:`~stability.hooks.capture.Capture` per process attached as a user would
(``attach(model, optimizer)``), records sent back encoded.

The arithmetic matches the simulated path of :mod:`~stability.evaluation.families` (each replica draws its own
batches, DDP's all-reduce averages the gradients, the ``dp_rank`` fault multiplies every third gradient tensor of
the faulty rank *after* the all-reduce), but the gradients really travel through gloo and DDP's reducer, and the
capture sees what it sees in a real job: DDP's bucketed backward, the clip, the optimizer hooks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from stability.evaluation.ddp import corrupt_gradients, run_ranks
from stability.records import StepRecord, encode
from stability.testing import ListSink

__all__ = ["train_gloo"]

REPORT_TIMEOUT_S = 1200.0
"""How long the parent waits for every rank's records (8 processes on 2 busy cores are slow, not stuck)."""


def _worker(rank: int, spec: Any, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from stability.evaluation import families as fam
    from stability.hooks.capture import Capture

    dist.init_process_group("gloo", rank=rank, world_size=spec.ranks)
    try:
        torch.manual_seed(spec.seed)
        task = fam._task(spec, stream=rank)
        inner = task.model
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        if hasattr(inner, "embed"):  # LM families embed outside forward (as the legacy DDP run does)
            object.__setattr__(ddp, "embed", inner.embed)
        task.model = ddp
        opt = fam._optimizer(spec, task)
        sink = ListSink()
        capture = Capture(fam._config(spec), sink, rank=rank,
                          coords={"dp": rank, "world_size": spec.ranks}).attach(inner, opt)
        params = list(inner.parameters())
        try:
            for step in range(spec.steps):
                fam._set_lr(spec, step, opt)
                capture.set_batch(f"{spec.name}:{step}:r{rank}")
                loss = task.loss(task.sample(), capture.observe, bf16=spec.precision == "bf16")
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                if spec.fault == "dp_rank" and rank == spec.faulty_rank and fam._in_fault(spec, step):
                    corrupt_gradients(params, spec.magnitude)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
        finally:
            capture.close()
        out.put((rank, [encode(r) for r in sink.records]))
    finally:
        dist.destroy_process_group()


def train_gloo(spec: Any) -> list[StepRecord]:
    """Train ``spec`` with ``spec.ranks`` gloo processes; return every rank's records (by step, then rank)."""
    return run_ranks(_worker, spec, timeout=REPORT_TIMEOUT_S)
