"""Full evaluation benchmark: the full synthetic corpus (5 seeds x 13 fault/clean variants: 65 runs, 22k
records, generated on the CPU through the real capture and cached) plus the real logs, scored for stability
and the baselines.

Run: ``python bench/eval_full.py [--json eval-full.json] [--cache DIR] [--misses]``. The first run trains every
model (about 5-10 minutes on one core); later runs read the msgpack cache (``$STABILITY_EVAL_CACHE`` or
``~/.cache/stability/eval``) and take well under a minute. Same output as ``python -m stability.evaluation --full``:
the per-kind table, the overall table and the issue #4 targets with pass/fail (docs/evaluation.md).

``python bench/eval_full.py --corpus families --split all [--json fam.json] [--misses]`` scores the families corpus
instead (issue #8: calibration and frozen test split side by side, the issue #8 targets; ``--full`` has no effect
there): about 6 + 10 minutes of training on an idle core the first time, then cached.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str]) -> int:
    from stability.evaluation.runner import main as run_main

    start = time.perf_counter()
    rc = run_main(["--full", *argv])
    print(f"\neval_full: {time.perf_counter() - start:.1f} s wall", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
