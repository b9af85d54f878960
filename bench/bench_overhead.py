"""Overhead of the capture hooks on a training step: steps/s without stability, with defaults, with every signal on
every step (``stats_every=1``, ``layer_every=1``).

Model: :class:`stability.testing.TinyGPT` with its defaults (4 layers, d=256, vocab 1024, 128 tokens, ~3.7M
parameters in 53 tensors; ``--layers 24``: 19.5M parameters in 293 tensors), AdamW, ``clip_grad_norm_(1.0)``,
batch 8. The three modes are interleaved in rounds
(ABC ABC ...) so the noise of a shared machine hits them alike; each mode's time per step is the median over its
rounds. Two clocks are reported: wall time, and the CPU time of the whole process (all threads, so the reader
thread's work is included) which is far less disturbed by other processes on a shared machine. Capture runs in
auto mode (``attach()`` with no arguments, as ``import stability.auto`` does) into an in-memory sink, so the
transport is not measured here.

A third clock, the least disturbed by a shared machine: the training thread's CPU time spent *inside* the capture's
hooks (every hook the capture registers or the torch patches call), per step, against the baseline step's process
CPU time: ``hooks`` in the output.

    OMP_NUM_THREADS=1 python bench/bench_overhead.py [--rounds 9] [--steps 6] [--batch 8] [--layers 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.testing import ListSink, TinyGPT, TinyGPTConfig


def make_loop(batch: int, device: str = "cpu", layers: int = 4) -> tuple[Callable[[int], None], TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=layers)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    vocab, block = model.cfg.vocab, model.cfg.block
    data = torch.randint(0, vocab, (batch, block + 1), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(steps: int) -> None:
        for _ in range(steps):
            logits = model(data[:, :-1])
            assert isinstance(logits, torch.Tensor)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()  # on a GPU, time the work, not the launches

    return run, model


HOOKS = ("on_backward", "before_backward", "before_zero_grad", "before_clip", "after_clip", "on_scale",
         "before_scaler_step", "after_scaler_step", "_on_pre_step", "_on_post_step", "_on_any_forward_pre",
         "_on_any_forward", "_on_model_forward", "_on_activation", "_on_model_output")
"""The capture's entry points on the training thread (nested calls are not counted twice)."""
_in_hooks = [0.0, 0]


def _count_hook_time() -> None:
    """Wrap the capture's entry points to add the thread CPU time spent in them to ``_in_hooks[0]``."""

    def wrap(method: Callable[..., None]) -> Callable[..., None]:
        def counted(*args: object, **kwargs: object) -> None:
            _in_hooks[1] += 1
            start = time.thread_time() if _in_hooks[1] == 1 else 0.0
            try:
                method(*args, **kwargs)
            finally:
                _in_hooks[1] -= 1
                if _in_hooks[1] == 0:
                    _in_hooks[0] += time.thread_time() - start

        return counted

    for name in HOOKS:
        setattr(Capture, name, wrap(getattr(Capture, name)))


def timed(run: Callable[[int], None], steps: int, config: WatchConfig | None) -> tuple[float, float, float]:
    """(wall, process CPU, CPU in hooks) seconds per step over ``steps`` steps after 2 untimed ones, capturing with
    ``config``."""
    capture = Capture(config, ListSink()).attach() if config is not None else None
    try:
        run(2)
        if capture is not None:
            capture.flush()
        wall, cpu, _in_hooks[0] = time.perf_counter(), time.process_time(), 0.0
        run(steps)
        if capture is not None:
            capture.flush()  # the reader thread's work belongs to these steps
        return ((time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps, _in_hooks[0] / steps)
    finally:
        if capture is not None:
            capture.close()
            assert capture.errors == 0, "capture hooks raised"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (24: 293 parameter tensors)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bench/gpu_check.sh uses cuda)")
    args = parser.parse_args()
    _count_hook_time()
    run, model = make_loop(args.batch, args.device, args.layers)
    modes: dict[str, WatchConfig | None] = {
        "baseline (no stability)": None,
        "capture, defaults": WatchConfig(run_id="bench"),
        "capture, every signal every step": WatchConfig(run_id="bench", stats_every=1, layer_every=1),
    }
    walls: dict[str, list[float]] = {name: [] for name in modes}
    cpus: dict[str, list[float]] = {name: [] for name in modes}
    hooks: dict[str, list[float]] = {name: [] for name in modes}
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyGPT {args.layers} layers, {n_params / 1e6:.2f}M params, {len(list(model.parameters()))} tensors, "
        f"batch {args.batch}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} rounds x {args.steps} steps"
    )
    run(3)  # warm up allocator and kernels
    for _ in range(args.rounds):
        for name, config in modes.items():
            wall, cpu, in_hooks = timed(run, args.steps, config)
            walls[name].append(wall)
            cpus[name].append(cpu)
            hooks[name].append(in_hooks)
    base_wall = statistics.median(walls["baseline (no stability)"])
    base_cpu = statistics.median(cpus["baseline (no stability)"])
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name in modes:
        wall, cpu, in_hooks = (statistics.median(x[name]) for x in (walls, cpus, hooks))
        print(
            f"{name:33s} {1 / wall:6.2f} steps/s  wall {wall * 1e3:6.1f} ms/step x{wall / base_wall:.4f}"
            f"  | process CPU {cpu * 1e3:6.1f} ms/step x{cpu / base_cpu:.4f} ({(cpu / base_cpu - 1) * 100:+.2f} %)"
            f"  | hooks {in_hooks * 1e3:5.2f} ms/step x{1 + in_hooks / base_cpu:.4f}"
        )


if __name__ == "__main__":
    main()
