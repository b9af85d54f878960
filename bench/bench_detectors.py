"""Per-module detector cost: the vectorised rules against the per-value loop, in the same run (issue #14 item 8).

``OMP_NUM_THREADS=1 python bench/bench_detectors.py`` builds ``bench/_records.py`` records (one rank, 40 modules
= 206 signals per record, and 3 modules = 21 signals) and times, in CPU seconds (best of ``--repeat``):

* the vanishing-gradient, growth, per-layer jump (``layer_grad``) and Adam-lag detectors alone, forced onto their
  per-value path (the baseline: the code these detectors ran before) and onto their vectorised path
  (``VECTOR_MIN``), and with the default switch;
* the whole suite (``RunDiagnoser.update``) with those detectors on each path (the rest of the suite is the same
  code in all three columns);
* ``records.decode`` of the same records, checking every signal name on every record (as before) and once.

It prints microseconds per record and the ratio to the per-value baseline. The findings of both paths are the same
(``tests/test_vectorised.py``); this measures only their cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RecordFactory

from stability import records as records_module
from stability.detectors import growth, update, vanish
from stability.detectors.engine import RunDiagnoser
from stability.records import StepRecord, decode, encode

PATHS = {"per-value": 10**9, "vectorised": 1, "default": vanish.VECTOR_MIN}


def _cpu_per_record(make: Callable[[], Any], records: list[StepRecord], warm: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        det = make()
        for rec in records[:warm]:
            det.update(rec)
        start = time.process_time()
        for rec in records[warm:]:
            det.update(rec)
        best = min(best, (time.process_time() - start) / (len(records) - warm))
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="records per case (default 600; the first 200 warm up)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    for modules in (40, 3):
        factory = RecordFactory(run_id="bench", rank=0, modules=modules)
        records = [factory.record(s, 1000.0 + s) for s in range(args.steps)]
        print(f"{factory.signal_count} signals per record ({modules} modules), us per record (CPU), best of "
              f"{args.repeat}:")
        cases: dict[str, Callable[[], Any]] = {
            "vanish": vanish.GradVanishingDetector, "growth": growth.GrowthDetector,
            "layer jumps": lambda: update.LayerJumpDetector(update.LAYER_GRAD), "adam lag": update.AdamLagDetector,
            "whole suite": RunDiagnoser}
        for label, make in cases.items():
            times = {}
            for path, least in PATHS.items():
                vanish.VECTOR_MIN = growth.VECTOR_MIN = update.VECTOR_MIN = least
                times[path] = _cpu_per_record(make, records, 200, args.repeat)
            base = times["per-value"]
            print(f"  {label:12s} " + "  ".join(f"{k} {v:7.0f} ({base / v:4.2f}x)" for k, v in times.items())
                  + f"  -> {1e6 / times['default']:,.0f} records/CPU-s")
        vanish.VECTOR_MIN = growth.VECTOR_MIN = update.VECTOR_MIN = PATHS["default"]
        blobs = [encode(r) for r in records]
        known = records_module._known_names
        rates = {}
        for label, check in (("names checked per record", lambda names: False), ("names checked once", known)):
            records_module._known_names = check
            best = float("inf")
            for _ in range(args.repeat):
                start = time.process_time()
                for blob in blobs:
                    decode(blob)
                best = min(best, time.process_time() - start)
            rates[label] = len(blobs) / best
        records_module._known_names = known
        base = rates["names checked per record"]
        print("  decode       " + "  ".join(f"{k} {v:,.0f}/CPU-s ({v / base:4.2f}x)" for k, v in rates.items()))


if __name__ == "__main__":
    main()
