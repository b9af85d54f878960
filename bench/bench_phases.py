"""Speed of the change-point phases (stability/phases.py) and the baseline comparison (stability/baseline.py).

One command: ``python bench/bench_phases.py [--steps 200000] [--ranks 1]``. Builds a synthetic run in memory (loss
decaying with noise, LR warm-up, grad norm; a second run that drifts after 60 %), then times
:func:`~stability.phases.run_phases` and :func:`~stability.baseline.compare_runs`. The baseline measured in the same
run is a bare pass that reads every record's loss into a sorted array; the ratio says how much slower the analysis
is than touching the data. The 1M-step figure is extrapolated linearly. ruptures is imported before timing.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import ruptures  # noqa: F401  # imported once, outside the timings

from stability.baseline import compare_runs
from stability.phases import run_phases
from stability.records import StepRecord


def make(steps: int, ranks: int, drift: bool) -> list[StepRecord]:
    rng = random.Random(0)
    out = []
    for s in range(steps):
        up = 1 + (0.5 * (s - 0.6 * steps) / steps if drift and s > 0.6 * steps else 0.0)
        for rank in range(ranks):
            loss = (2 + 8 * math.exp(-s / (steps / 40)) + rng.gauss(0, 0.02)) * up
            out.append(StepRecord(run_id="b", step=s, rank=rank,
                                  signals={"loss": loss, "lr": 3e-4 * min(1.0, (s + 1) / (steps / 100)),
                                           "grad_norm": 1.0 * up + rng.gauss(0, 0.05)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    run, base = make(args.steps, args.ranks, True), make(args.steps, args.ranks, False)
    t = time.perf_counter()
    bare = sorted(r.signals["loss"] for r in run)
    t_bare = time.perf_counter() - t
    t = time.perf_counter()
    phases = run_phases(run)
    t_phases = time.perf_counter() - t
    t = time.perf_counter()
    cmp = compare_runs(run, base)
    t_cmp = time.perf_counter() - t
    scale = 1_000_000 / args.steps
    print(f"records {len(run)} ({args.steps} steps x {args.ranks} ranks), {len(bare)} losses")
    print(f"bare pass      {t_bare:7.3f} s")
    print(f"phases         {t_phases:7.3f} s  x{t_phases / t_bare:5.1f} bare  1M est {t_phases * scale:6.1f} s  "
          f"{[(p.label, p.first_step, p.last_step) for p in phases]}")
    print(f"compare_runs   {t_cmp:7.3f} s  x{t_cmp / t_bare:5.1f} bare  1M est {t_cmp * scale:6.1f} s  "
          f"parts at {cmp['parts_at']} in {[r['signal'] for r in cmp['signals'] if r['parts_at'] is not None]}")


if __name__ == "__main__":
    main()
