"""Overhead of the capture hooks on a CPU training step: steps/s without stability, with defaults, with stats_every=1.

Model: :class:`stability.testing.TinyGPT` with its defaults (4 layers, d=256, vocab 1024, 128 tokens, ~3.7M
parameters in 53 tensors), AdamW, ``clip_grad_norm_(1.0)``, batch 8. The three modes are interleaved in rounds
(ABC ABC ...) so the noise of a shared machine hits them alike; each mode's time per step is the median over its
rounds. Capture runs in auto mode (``attach()`` with no arguments, as ``import stability.auto`` does) into an
in-memory sink, so the transport is not measured here.

    OMP_NUM_THREADS=1 python bench/bench_overhead.py [--rounds 7] [--steps 10] [--batch 8]
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
from stability.testing import ListSink, TinyGPT


def make_loop(batch: int) -> tuple[Callable[[int], None], TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    vocab, block = model.cfg.vocab, model.cfg.block
    data = torch.randint(0, vocab, (batch, block + 1))

    def run(steps: int) -> None:
        for _ in range(steps):
            logits = model(data[:, :-1])
            assert isinstance(logits, torch.Tensor)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run, model


def timed(run: Callable[[int], None], steps: int, config: WatchConfig | None) -> float:
    """Seconds per step over ``steps`` steps (after 2 untimed warm-up steps), capturing with ``config`` if given."""
    capture = Capture(config, ListSink()).attach() if config is not None else None
    try:
        run(2)
        start = time.perf_counter()
        run(steps)
        return (time.perf_counter() - start) / steps
    finally:
        if capture is not None:
            capture.close()
            assert capture.errors == 0, "capture hooks raised"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    run, model = make_loop(args.batch)
    modes: dict[str, WatchConfig | None] = {
        "baseline (no stability)": None,
        "capture, defaults": WatchConfig(run_id="bench"),
        "capture, stats_every=1": WatchConfig(run_id="bench", stats_every=1),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyGPT {n_params / 1e6:.2f}M params, {len(list(model.parameters()))} tensors, batch {args.batch}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    run(3)  # warm up allocator and kernels
    for _ in range(args.rounds):
        for name, config in modes.items():
            times[name].append(timed(run, args.steps, config))
    base = statistics.median(times["baseline (no stability)"])
    for name, samples in times.items():
        med = statistics.median(samples)
        print(
            f"{name:26s} {1 / med:7.2f} steps/s  {med * 1e3:8.1f} ms/step  overhead x{med / base:.4f} "
            f"({(med / base - 1) * 100:+.2f} %)  [min {min(samples) * 1e3:.1f}, max {max(samples) * 1e3:.1f} ms]"
        )


if __name__ == "__main__":
    main()
