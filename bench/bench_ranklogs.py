"""Reading multi-rank logs (issue #11): what the rank / host attribution costs over reading one rank's log.

One command: ``python bench/bench_ranklogs.py [--lines 100000] [--ranks 4]``. It writes the same Megatron-LM
``iteration N/ M | ...`` lines (``--lines`` of them, spread over ``--ranks`` ranks, the last rank printing the losses
as Megatron's ``print_rank_last`` does, the others a warning every 10 iterations) twice: as one combined torchrun
``--tee`` console (``[default3]:`` prefixes: read by :mod:`stability.sources.ranks`) and, as the baseline measured in
the same run, without prefixes (the single-rank text reader); then times :func:`stability.postmortem.load_source`
of each (best of 3) and prints the ratio.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

from stability.postmortem import load_source


def write(path: Path, lines: int, ranks: int, prefixed: bool) -> None:
    rng = random.Random(0)
    last = ranks - 1
    with path.open("w") as out:
        step = 0
        written = 0
        while written < lines:
            step += 1
            loss = 2.0 + 8.0 * math.exp(-step / 5000) + rng.gauss(0, 0.02)
            head = f"[default{last}]:" if prefixed else ""
            out.write(f"{head} iteration {step:>8d}/ 10000000 | consumed samples: {step * 128:>12d} | elapsed time "
                      f"per iteration (ms): 812.3 | learning rate: 3.000000E-04 | global batch size:   128 | lm loss: "
                      f"{loss:.6E} | loss scale: 65536.0 | grad norm: {1 + rng.gauss(0, 0.05):.3f} | num zeros: 0.0 "
                      f"| number of skipped iterations:   0 | number of nan iterations:   0 |\n")
            written += 1
            if step % 10 == 0:
                for rank in range(last):
                    head = f"[default{rank}]:" if prefixed else ""
                    out.write(f"{head}[W ProcessGroupNCCL.cpp:1856] Warning: some rank {rank} message\n")
                    written += 1


def best(path: Path) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        load_source(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain, combined = Path(tmp) / "plain.log", Path(tmp) / "combined.log"
        write(plain, args.lines, args.ranks, prefixed=False)
        write(combined, args.lines, args.ranks, prefixed=True)
        base, ranked = best(plain), best(combined)
        log = load_source(combined)
        assert {r.rank for r in log.records} == {args.ranks - 1}
    print(f"{args.lines} lines, {args.ranks} ranks: single-rank reader {base:.2f} s ({args.lines / base:,.0f} lines/s),"
          f" multi-rank reader {ranked:.2f} s ({args.lines / ranked:,.0f} lines/s): x{ranked / base:.2f}")


if __name__ == "__main__":
    main()
