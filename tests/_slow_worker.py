"""Rank process of the slowdown tests (spawned by ``stability.evaluation.ddp.run_ranks``): a tiny DDP model on gloo,
with one rank slower in its forward and one rank stopping for a while."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.records import encode
from stability.testing import ListSink


@dataclass(frozen=True)
class SlowSpec:
    name: str
    run_dir: str
    ranks: int = 2
    steps: int = 60
    compute_s: float = 0.02
    slow_rank: int = 1
    slow_factor: float = 2.0
    hang_rank: int = 1
    hang_step: int = 50
    hang_s: float = 3.0


def slow_worker(rank: int, spec: SlowSpec, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      STABILITY_HANG_MIN_S="1.0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.ranks)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
        pause = spec.compute_s * (spec.slow_factor if rank == spec.slow_rank else 1.0)
        model.register_forward_pre_hook(lambda m, a: time.sleep(pause))  # this rank's compute
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        sink = ListSink()
        capture = Capture(WatchConfig(run_id=spec.name, run_dir=spec.run_dir, layer_every=0, stats_every=0), sink,
                          coords={"dp": rank}).attach(ddp, opt)
        try:
            for step in range(spec.steps):
                if rank == spec.hang_rank and step == spec.hang_step:
                    time.sleep(spec.hang_s)  # this rank stops; the other one waits in the all-reduce
                loss = ddp(torch.randn(8, 16)).pow(2).mean()
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad()
        finally:
            capture.close()
        out.put((rank, [encode(r) for r in sink.records]))
    finally:
        dist.destroy_process_group()
