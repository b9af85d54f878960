"""Side by side: what a training step costs with stability's capture and with what users would otherwise run.

One process, one model (``stability.testing.TinyGPT``: 4 layers, d=256, 53 parameter tensors; AdamW,
``clip_grad_norm_(1.0)``, batch 8), the modes alternating in rounds (ABCDEFG ABCDEFG ...) so the noise of a shared
machine hits them alike; per mode the median time per step over its rounds, as a ratio to no hooks measured in
the same run:

* ``no hooks``: the plain loop;
* ``stability defaults``: ``Capture(WatchConfig()).attach()`` as ``import stability.auto`` does (auto mode), into
  an in-memory sink (the transport runs on its own thread and is measured in ``bench_transport.py``);
* ``stability all signals``: the same with ``stats_every=1, layer_every=1`` (every statistic on every step);
* ``wandb.watch(log="all", log_freq=1)``: W&B offline (``WANDB_MODE=offline``, a temporary directory), gradient and
  parameter histograms every step, one ``run.log`` per step to commit them;
* ``naive .norm().item()``: a per-parameter ``{name: p.grad.norm().item()}`` after ``backward()``;
* ``lightning grad_norm``: ``lightning.pytorch.utilities.grad_norm(model, 2)`` after ``backward()``;
* ``HF DebugUnderflowOverflow``: ``transformers.debug_utils.DebugUnderflowOverflow(model)`` (forward hooks on every
  module checking for inf/NaN).

Two clocks: wall time, and the CPU time of this process (all its threads; far less disturbed by other processes
on a shared machine, but W&B's work in its separate service process is not in it). Modes whose library is
missing are skipped and said so. Also reported: host RSS after each mode's blocks (the
largest, and its difference to no hooks) and, on CUDA, the peak device memory of a step above no hooks.

    OMP_NUM_THREADS=1 python bench/bench_side_by_side.py [--rounds 5] [--steps 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import torch
from torch.nn import functional as F

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.testing import ListSink, TinyGPT, TinyGPTConfig

AfterBackward = Callable[[], None]
WARMUP_STEPS = 2
"""Untimed steps after a mode's hooks are installed in each block (as ``bench_overhead.py``): with defaults the
timed steps are then normal ones; a sampled step every 50 adds ~0.1-0.2 % amortised."""


@dataclass
class Mode:
    name: str
    session: Callable[[], contextlib.AbstractContextManager[AfterBackward | None]]
    """Enter: install the mode's hooks (the callable, if any, runs after each ``backward()``); exit: remove them."""


@contextlib.contextmanager
def no_hooks() -> Iterator[None]:
    yield None


def stability_mode(config: WatchConfig) -> Callable[[], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def session() -> Iterator[None]:
        capture = Capture(config, ListSink()).attach()
        try:
            yield None
            capture.flush()  # the reader thread's work belongs to these steps
        finally:
            capture.close()
            assert capture.errors == 0, "capture hooks raised"

    return session


def naive_mode(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[AfterBackward]]:
    @contextlib.contextmanager
    def session() -> Iterator[AfterBackward]:
        def after_backward() -> None:
            norms = {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}
            assert norms

        yield after_backward

    return session


def lightning_mode(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[AfterBackward]] | None:
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        return None

    @contextlib.contextmanager
    def session() -> Iterator[AfterBackward]:
        def after_backward() -> None:
            assert grad_norm(model, 2)

        yield after_backward

    return session


def hf_mode(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError:
        return None

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        before = {id(m): set(m._forward_hooks) for m in model.modules()}
        DebugUnderflowOverflow(model)
        try:
            yield None
        finally:  # it has no removal API: drop the hooks it added
            for m in model.modules():
                for key in set(m._forward_hooks) - before.get(id(m), set()):
                    del m._forward_hooks[key]

    return session


def wandb_mode(model: torch.nn.Module, tmp: Path) -> tuple[Callable[[], contextlib.AbstractContextManager[Any]],
                                                           Callable[[], None]] | None:
    try:
        import wandb
    except ImportError:
        return None
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    try:
        run = wandb.init(project="stability-bench", dir=str(tmp), mode="offline")
    except Exception as exc:  # e.g. no writable directory or service on the machine: skip this mode, say why
        print(f"wandb.init failed ({type(exc).__name__}: {exc}); the wandb.watch mode is skipped")
        return None

    @contextlib.contextmanager
    def session() -> Iterator[AfterBackward]:
        run.watch(model, log="all", log_freq=1)
        step = [0]

        def after_backward() -> None:
            step[0] += 1
            run.log({"bench_step": step[0]})  # commits the histograms the hooks added

        try:
            yield after_backward
        finally:
            run.unwatch(model)

    return session, run.finish


def make_loop(model: TinyGPT, batch: int, device: str) -> Callable[[int, AfterBackward | None], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    vocab, block = model.cfg.vocab, model.cfg.block
    data = torch.randint(0, vocab, (batch, block + 1), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(steps: int, after_backward: AfterBackward | None) -> None:
        for _ in range(steps):
            logits = model(data[:, :-1])
            assert isinstance(logits, torch.Tensor)
            F.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1)).backward()
            if after_backward is not None:
                after_backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()

    return run


def build_modes(model: TinyGPT, tmp: Path) -> tuple[list[Mode], Callable[[], None] | None, list[str]]:
    """The modes to compare, a clean-up to run at the end (W&B's ``finish``), and what was skipped."""
    modes = [
        Mode("no hooks", no_hooks),
        Mode("stability defaults", stability_mode(WatchConfig(run_id="sbs"))),
        Mode("stability all signals", stability_mode(WatchConfig(run_id="sbs", stats_every=1, layer_every=1))),
    ]
    finish: Callable[[], None] | None = None
    skipped = []
    wb = wandb_mode(model, tmp)
    if wb is None:
        skipped.append("wandb.watch (wandb not installed)")
    else:
        modes.append(Mode('wandb.watch(log="all", log_freq=1)', wb[0]))
        finish = wb[1]
    modes.append(Mode("naive .norm().item() loop", naive_mode(model)))
    for label, factory in (("lightning grad_norm", lightning_mode), ("HF DebugUnderflowOverflow", hf_mode)):
        session = factory(model)
        if session is None:
            skipped.append(f"{label} (not installed)")
        else:
            modes.append(Mode(label, session))
    return modes, finish, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=args.layers)).to(args.device)
    run = make_loop(model, args.batch, args.device)
    process = psutil.Process()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="stability-bench-sbs-") as tmp:
        modes, finish, skipped = build_modes(model, Path(tmp))
        times: dict[str, list[float]] = {m.name: [] for m in modes}
        cpus: dict[str, list[float]] = {m.name: [] for m in modes}
        rss: dict[str, int] = {m.name: 0 for m in modes}
        peak: dict[str, int] = {m.name: 0 for m in modes}
        run(3, None)  # warm up
        for mode in modes:  # one untimed block each: first-call costs (imports, allocations) stay out of the figures
            with mode.session() as after_backward:
                run(1, after_backward)
        for _ in range(args.rounds):
            for mode in modes:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                with mode.session() as after_backward:
                    run(WARMUP_STEPS, after_backward)  # untimed: a fresh capture's first step finds the model
                    start, cpu = time.perf_counter(), time.process_time()
                    run(args.steps, after_backward)
                    times[mode.name].append((time.perf_counter() - start) / args.steps)
                    cpus[mode.name].append((time.process_time() - cpu) / args.steps)
                rss[mode.name] = max(rss[mode.name], process.memory_info().rss)
                if cuda:
                    peak[mode.name] = max(peak[mode.name], torch.cuda.max_memory_allocated())
        if finish is not None:
            finish()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyGPT {args.layers} layers, {n_params / 1e6:.2f}M params, {len(list(model.parameters()))} tensors, "
          f"batch {args.batch}, {args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps, median per step")
    base = statistics.median(times["no hooks"])
    base_cpu = statistics.median(cpus["no hooks"])
    for mode in modes:
        t, c = statistics.median(times[mode.name]), statistics.median(cpus[mode.name])
        line = (f"{mode.name:36s} wall {t * 1e3:7.1f} ms/step x{t / base:6.3f} | process CPU x{c / base_cpu:6.3f}"
                f" | host RSS {rss[mode.name] / 2**20:7.0f} MiB "
                f"({(rss[mode.name] - rss['no hooks']) / 2**20:+5.0f})")
        if cuda:
            line += f"  device peak {(peak[mode.name] - peak['no hooks']) / 2**20:+7.1f} MiB"
        print(line)
    for what in skipped:
        print(f"skipped: {what}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
