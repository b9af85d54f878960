"""Real data-parallel runs for the corpus: ``torch.distributed`` with the gloo backend and
``DistributedDataParallel`` in ``ranks`` CPU processes, one :class:`~stability.hooks.capture.Capture` per process
(auto mode: the patched ``backward``, ``clip_grad_norm_`` and the optimizer hooks), records sent back encoded.

The ``dp_rank`` fault multiplies the faulty rank's gradients after DDP's all-reduce (``loss.backward()`` has
returned), so only that rank's post-reduce gradient norm and, from then on, its weights differ.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stability.config import WatchConfig
from stability.embedded import free_port
from stability.evaluation.model import MarkovData, TinyGPT, next_token_loss
from stability.hooks.capture import Capture
from stability.records import StepRecord, decode, encode
from stability.testing import ListSink

__all__ = ["corrupt_gradients", "run_ranks", "train_ddp"]


def _worker(rank: int, spec: Any, port: int, out: Any, lr_at: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.ranks)
    try:
        torch.manual_seed(spec.seed)
        model = TinyGPT()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
        data = MarkovData(seed=spec.seed, stream=rank)
        sink = ListSink()
        capture = Capture(WatchConfig(run_id=f"eval-{spec.name}", stats_every=spec.stats_every, layer_every=1,
                                      max_act_modules=8, timing=False), sink, coords={"dp": rank}).attach()
        try:
            for step in range(spec.steps):
                for group in opt.param_groups:
                    group["lr"] = lr_at(spec, step)
                batch = data.sample()
                capture.set_batch(f"{spec.name}:{step}:r{rank}")
                loss = next_token_loss(ddp(model.embed(batch[:, :-1])), batch, capture.observe)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                if (spec.fault == "dp_rank" and rank == spec.faulty_rank
                        and spec.fault_step <= step < spec.fault_step + spec.duration):
                    corrupt_gradients(model.parameters(), spec.magnitude)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
        finally:
            capture.close()
        out.put((rank, [encode(r) for r in sink.records]))
    finally:
        dist.destroy_process_group()


def corrupt_gradients(params: Iterable[torch.nn.Parameter], factor: float) -> None:
    """The ``dp_rank`` fault: every third gradient tensor of this rank times ``factor``, after the all-reduce (a
    silent corruption on one replica only)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            if i % 3 == 0 and p.grad is not None:
                p.grad.mul_(factor)


def train_ddp(spec: Any, lr_at: Any) -> list[StepRecord]:
    """Train ``spec`` with ``spec.ranks`` gloo processes; return every rank's records (by step, then rank)."""
    return run_ranks(_worker, spec, (lr_at,), timeout=600.0)


def run_ranks(worker: Callable[..., None], spec: Any, extra: tuple[Any, ...] = (), *,
              timeout: float) -> list[StepRecord]:
    """Start ``worker(rank, spec, port, out, *extra)`` in ``spec.ranks`` spawned processes (one gloo group on a
    free port); each puts ``(rank, [encoded records])`` on ``out``. Returns every rank's records by step, then rank.

    Raises:
        RuntimeError: a rank did not report within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, spec, port, out, *extra), daemon=True) for r in range(spec.ranks)]
    for p in procs:
        p.start()
    records: list[StepRecord] = []
    try:
        for _ in procs:
            _, blobs = out.get(timeout=timeout)
            records += [decode(b) for b in blobs]
    except queue.Empty:
        raise RuntimeError(f"DDP run {spec.name}: a rank did not report within {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sorted(records, key=lambda r: (r.step, r.rank))
