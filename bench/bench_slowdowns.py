"""Slowdown detectors on simulated timing records, and the cost of the profiler hook while inactive.

    python bench/bench_slowdowns.py

1. clean: 4 ranks x 2,000 steps, each rank's data/compute time log-normal with 10 % (and 25 %) independent noise,
   recurring checkpoint steps every 500 steps (20x slower, all ranks) -> findings (target: none).
2. straggler: the same with rank 2 (host node-c) 20 % slower from step 300 -> steps until it is named (target <= 50),
   over 10 seeds.
3. profiler inactive: the per-step hook with the profiler idle vs the timing alone (min over rounds).
4. profiler active: step time while torch.profiler records vs idle, and the cost of writing the trace.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from stability.detectors.engine import RunDiagnoser
from stability.detectors.steptime import PERF_KINDS
from stability.records import StepRecord


def simulate(steps: int, ranks: int, seed: int, noise: float, slow_rank: int | None = None, slow_from: int = 0,
             factor: float = 1.2) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    out = []
    wall = 1_000.0
    for step in range(steps):
        works = {}
        for rank in range(ranks):
            data = 0.02 * float(rng.lognormal(0.0, noise))
            compute = 0.2 * float(rng.lognormal(0.0, noise))
            if slow_rank == rank and step >= slow_from:
                data, compute = data * factor, compute * factor
            works[rank] = (data, compute)
        step_time = max(d + c for d, c in works.values()) + 0.1
        if step and step % 500 == 0:
            step_time *= 20  # a checkpoint save: every rank, recurring
        wall += step_time
        for rank, (data, compute) in works.items():
            out.append(StepRecord(run_id="sim", step=step, rank=rank, wall_time=wall, host=f"node-{'abcd'[rank]}",
                                  coords={"world_size": ranks}, signals={
                                      "loss": 2.0 + 0.01 * float(rng.standard_normal()), "step_time": step_time,
                                      "data_time": data, "compute_time": compute,
                                      "host_rss": 3e9 + 1e6 * float(rng.standard_normal())}))
    return out


def run(records: list[StepRecord]) -> list:
    diag = RunDiagnoser()
    found = []
    for record in records:
        found += diag.update(record)
    return found + diag.finish()


def main() -> int:
    for noise in (0.1, 0.25):
        false = [f for seed in range(2) for f in run(simulate(2000, 4, seed, noise)) if f.kind in PERF_KINDS]
        print(f"clean 4 ranks x 2000 steps, noise {noise:.0%}, 2 seeds: {len(false)} findings "
              f"{sorted({f.kind for f in false})}")
    delays = []
    for seed in range(10):
        found = [f for f in run(simulate(600, 4, 100 + seed, 0.1, slow_rank=2, slow_from=300))
                 if f.kind == "straggler"]
        named = [f for f in found if f.rank == 2 and f.host == "node-c"]
        wrong = [f for f in found if f.rank != 2]
        delays.append(named[0].step - 300 if named else 10**9)
        assert not wrong, wrong
    print(f"straggler 20% slower, 4 ranks, 10 seeds: named after median {statistics.median(delays)} steps, "
          f"max {max(delays)} (target <= 50)")
    print(profiler_overhead())
    print(profiler_active())
    return 0


def profiler_overhead(rounds: int = 15, calls: int = 20_000) -> str:
    """Per-step cost of the capture's performance hook with the profiler idle vs the timing alone (min of rounds:
    the machine's load only adds time), and the profiler's share of a 1 ms step."""
    import timeit
    from pathlib import Path

    import torch

    from stability.hooks.timing import Performance, TimingConfig

    perf = Performance("bench", Path("/nonexistent"), None, lambda s, x: None, lambda: 0,
                       TimingConfig(watchdog=False))
    cpu = torch.device("cpu")
    perf.end_step(0, cpu, {})  # makes the (idle) profiler
    timing = perf.timing
    with_profiler = min(timeit.repeat(lambda: perf.end_step(1, cpu, {}), number=calls, repeat=rounds)) / calls
    timing_only = min(timeit.repeat(lambda: timing.end_step(1, cpu, {}), number=calls, repeat=rounds)) / calls
    profiler = perf.profiler
    check = min(timeit.repeat(lambda: profiler.active or profiler.pending, number=calls, repeat=rounds)) / calls
    return (f"step-end hook: timing + idle profiler {with_profiler * 1e6:.2f} us, timing alone "
            f"{timing_only * 1e6:.2f} us (difference within noise); the idle profiler's check alone: "
            f"{check * 1e9:.0f} ns per step "
            f"({check / 1e-3:.4%} of a 1 ms step)")


def profiler_active(steps: int = 20) -> str:
    """Step time of a small MLP while ``torch.profiler`` records (CPU) vs idle, and the cost of writing the trace."""
    import tempfile
    from pathlib import Path

    import torch

    from stability.hooks.profiler import Profiler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        prof = Profiler(Path(tmp), 0)
        for _ in range(20):
            step()
        idle = [step() for _ in range(steps)]
        prof.request(steps)
        prof.step_end(0, None)  # starts the profile
        active = []
        for i in range(steps - 1):
            active.append(step())
            prof.step_end(i + 1, None)
        active.append(step())
        t0 = time.perf_counter()
        prof.step_end(steps, None)  # stops it, writes the trace and the summary
        write = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.json.gz"))
    ratio = statistics.median(active) / statistics.median(idle)
    return (f"profiler active (CPU, {steps} steps of a 256-wide MLP): step {statistics.median(active) * 1e3:.2f} ms vs "
            f"{statistics.median(idle) * 1e3:.2f} ms idle (x{ratio:.2f}); stopping + writing the trace "
            f"{write:.2f} s, {size / 1024:.0f} KiB gzipped")


if __name__ == "__main__":
    sys.exit(main())
