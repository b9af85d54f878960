"""Detector state per rank: what one rank costs a worker in memory and Redis in snapshot bytes (sizing of sharded runs).

Run ``python bench/bench_rank_state.py``. Feeds ``--ranks`` ranks x ``--steps`` steps of load-generator records
(``bench/_records.py``) with 1, 8 and 40 modules through one :class:`RunDiagnoser` and prints, per rank, the Python
memory it holds (``tracemalloc``) and the msgpack snapshot size, with the ratio to the smallest record as baseline.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RecordFactory

from stability.detectors.engine import RunDiagnoser


def measure(modules: int, ranks: int, steps: int) -> tuple[int, float, float]:
    """(signals, KB in memory per rank, KB of snapshot per rank)."""
    factories = [RecordFactory(run_id="x", rank=r, modules=modules) for r in range(ranks)]
    tracemalloc.start()
    diag = RunDiagnoser()
    for step in range(steps):
        for factory in factories:
            diag.update(factory.record(step, 1e9 + step, None))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    snapshot = msgpack.packb(diag.state_dict(), use_bin_type=True)
    return factories[0].signal_count, held / ranks / 1024, len(snapshot) / ranks / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    rows = [measure(m, args.ranks, args.steps) for m in (1, 8, 40)]
    base_mem, base_snap = rows[0][1], rows[0][2]
    print(f"{args.ranks} ranks x {args.steps} steps; per rank:")
    for signals, mem, snap in rows:
        print(f"  {signals:4d} signals: {mem:8,.0f} KB in memory ({mem / base_mem:4.1f}x), "
              f"{snap:6,.0f} KB snapshot ({snap / base_snap:4.1f}x)")


if __name__ == "__main__":
    main()
