"""Post-mortem speed and memory on large sources (issue #11: 1M steps x 100 signals in < 30 s, < 2 GB).

One command: ``python bench/bench_postmortem.py [--steps 100000 1000000] [--signals 4 100] [--format csv megatron]
[--exact]``. For each size it writes a synthetic source (a CSV with ``step, loss, grad_norm, lr, loss_scale`` +
per-module ``grad_norm/h.K`` columns; or a Megatron-LM stdout log with the same global signals), then in a fresh
subprocess measures what ``stability postmortem`` does: read (a CSV as columns, :mod:`stability.sources.columnar`;
``--exact`` or a log: one record per row), detectors (:func:`stability.fast_postmortem.analyze_columns`, or
:func:`stability.postmortem.analyze`), findings + HTML report, and the peak RSS. The baseline measured in the same
run is a bare ``csv.reader`` / line-split pass over the same file; the ratios say how much slower the post-mortem
is than reading the bytes. The 1M-step column is extrapolated linearly from the size measured (run ``--steps
1000000`` to measure it directly). ``cpu s``: the child's CPU seconds to read and analyse (less sensitive than the
wall clock to other jobs on a shared machine). ``--stages``: also the seconds of each stage of ``stability
postmortem`` (:data:`STAGES`) on the same file, in another fresh process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_STEPS = 1_000_000


def write_csv(path: Path, steps: int, signals: int) -> None:
    rng = random.Random(0)
    modules = [f"grad_norm/h.{k}" for k in range(max(0, signals - 4))]
    with path.open("w") as out:
        out.write(",".join(["step", "loss", "grad_norm", "lr", "loss_scale", *modules]) + "\n")
        for s in range(steps):
            loss = 2.0 + 8.0 * math.exp(-s / 5000) + rng.gauss(0, 0.02)
            cells = [str(s), f"{loss:.5f}", f"{1 + rng.gauss(0, 0.05):.4f}", "0.0003", "65536.0"]
            cells += [f"{0.1 + rng.random() * 0.01:.5f}" for _ in modules]
            out.write(",".join(cells) + "\n")


def write_megatron(path: Path, steps: int, signals: int) -> None:
    rng = random.Random(0)
    with path.open("w") as out:
        for s in range(1, steps + 1):
            loss = 2.0 + 8.0 * math.exp(-s / 5000) + rng.gauss(0, 0.02)
            out.write(f" iteration {s:>8d}/ {steps:>8d} | consumed samples: {s * 128:>12d} | elapsed time per "
                      f"iteration (ms): 812.3 | learning rate: 3.000000E-04 | global batch size:   128 | lm loss: "
                      f"{loss:.6E} | loss scale: 65536.0 | grad norm: {1 + rng.gauss(0, 0.05):.3f} | num zeros: 0.0 | "
                      f"number of skipped iterations:   0 | number of nan iterations:   0 |\n")


def measure(path: str, exact: bool) -> None:
    """Child process: read + analyse + write the findings and report of ``path`` as ``stability postmortem`` does
    (``exact``: the row-by-row reference path); print JSON timings and peak RSS."""
    from stability import postmortem
    from stability.fast_postmortem import analyze_columns
    from stability.sources.columnar import read_columns

    out = Path(path).with_suffix(".out")
    t0 = time.perf_counter()
    c0 = time.process_time()
    table = None if exact else read_columns(path, loss_averaged=False)
    if table is None:
        log = postmortem.load_source(path, loss_averaged=False)
        t1 = time.perf_counter()
        records = log.records
        result = postmortem.analyze(records, "bench", segments=log.segments, events=log.events, progress=False)
    else:
        t1 = time.perf_counter()
        result, records = analyze_columns(table, "bench", progress=False)
    t2 = time.perf_counter()
    c2 = time.process_time()
    postmortem.write_outputs(result, records, json_out=f"{out}.json", html_out=f"{out}.html")
    t3 = time.perf_counter()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"parse_s": t1 - t0, "analyze_s": t2 - t1, "report_s": t3 - t2, "rss_mb": rss_mb,
                      "cpu_s": c2 - c0,
                      "records": len(records), "incidents": len(result.incidents),
                      "columnar": table is not None}))


def per_detector(path: str) -> None:
    """Child process: CPU microseconds a record of each detector of a rank's suite alone (and the lazy history's
    push) over the light records the columnar post-mortem replays (global signals only: the per-layer columns of
    the bench file are screened out)."""
    from stability.detectors.engine import DiagnoserConfig, RunDiagnoser
    from stability.fast_postmortem import _rows
    from stability.sources.columnar import read_columns

    table = read_columns(path, loss_averaged=False)
    assert table is not None, "the bench CSV is read as columns"
    records = list(_rows(table, [i for i, n in enumerate(table.names) if "/" not in n], "bench"))
    suite = RunDiagnoser(DiagnoserConfig())._suite(0)
    cost: dict[str, float] = {}
    for detector in suite.detectors:
        t0 = time.process_time()
        for record in records:
            detector.update(record)
        cost[detector.name] = time.process_time() - t0
    t0 = time.process_time()
    for record in records:
        suite.history.push(record)
    cost["history"] = time.process_time() - t0
    for name, seconds in sorted(cost.items(), key=lambda kv: -kv[1]):
        print(f"{name:12} {seconds * 1e6 / len(records):7.1f} us")
    print(f"{'sum':12} {sum(cost.values()) * 1e6 / len(records):7.1f} us")


STAGES = (("stability.sources.columnar", "read_columns"), ("stability.postmortem", "load_source"),
          ("stability.fast_postmortem", "quiet_columns"), ("stability.fast_postmortem", "_rows"),
          ("stability.fast_postmortem", "_widen"), ("stability.sources.analysis", "apply_log_context"),
          ("stability.report._data", "perf_summary"), ("stability.postmortem", "_phases"),
          ("stability.postmortem", "analyze"), ("stability.report._html", "_payload"),
          ("stability.postmortem", "write_outputs"))
"""The functions ``--stages`` times (module, name): reading, the screen, the light records, the analysis and what
it does after the detectors (log context, performance lines, phases), the report."""


def stages(path: str) -> None:
    """Child process: ``stability postmortem PATH`` (:func:`stability.postmortem.run`) with the seconds spent in each
    of :data:`STAGES` (``analyze`` includes the phases, log context and performance lines; the detectors are
    ``analyze`` less those), the whole run and the peak RSS."""
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _timing import tally_calls

    spent: dict[str, float] = {}

    t0 = time.perf_counter()
    from stability import postmortem
    spent["import"] = time.perf_counter() - t0
    for module, name in STAGES:
        tally_calls(importlib.import_module(module), name, spent)
    out = Path(path).with_suffix(".out")
    t0 = time.perf_counter()
    postmortem.run(path, json_out=f"{out}.json", html_out=f"{out}.html", progress=False)
    spent["total"] = time.perf_counter() - t0
    detectors = spent.get("analyze", 0.0) - sum(spent.get(k, 0.0) for k in ("apply_log_context", "perf_summary",
                                                                               "_phases"))
    print("  ".join(f"{k} {v:.2f}" for k, v in [*spent.items(), ("detectors", detectors)]) +
          f"  rss_mb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


def baseline(path: Path, fmt: str) -> float:
    """Seconds for a bare pass over the file (csv.reader rows / split lines on '|')."""
    import csv

    t0 = time.perf_counter()
    with path.open(newline="") as handle:
        if fmt == "csv":
            for _ in csv.reader(handle):
                pass
        else:
            for line in handle:
                line.split("|")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 40_000])
    parser.add_argument("--signals", type=int, nargs="+", default=[4, 100])
    parser.add_argument("--format", nargs="+", default=["csv", "megatron"], choices=["csv", "megatron"])
    parser.add_argument("--exact", action="store_true", help="the row-by-row reference path (postmortem --exact)")
    parser.add_argument("--detectors", action="store_true",
                        help="also print each detector's CPU us a record alone (csv, first size)")
    parser.add_argument("--stages", action="store_true",
                        help="also print the seconds of each stage of `stability postmortem` (read, screen, light "
                             "records, detectors, phases, report) in another fresh process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-stages", help=argparse.SUPPRESS)
    parser.add_argument("--child-detectors", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.child, args.exact)
        return
    if args.child_detectors:
        per_detector(args.child_detectors)
        return
    if args.child_stages:
        stages(args.child_stages)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    print(f"{'format':9} {'signals':>7} {'steps':>8} {'parse s':>8} {'detect s':>9} {'report s':>8} {'rss MB':>7} "
          f"{'bare s':>7} {'x bare':>7} {'1M est s':>9} {'cpu s':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.format:
            for signals in args.signals if fmt == "csv" else [12]:
                for steps in args.steps:
                    path = Path(tmp) / f"bench-{signals}-{steps}.{'csv' if fmt == 'csv' else 'log'}"
                    (write_csv if fmt == "csv" else write_megatron)(path, steps, signals)
                    bare = baseline(path, fmt)
                    command = [sys.executable, __file__, "--child", str(path), *(["--exact"] if args.exact else [])]
                    child = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
                    data = json.loads(child.stdout.strip().splitlines()[-1])
                    total = data["parse_s"] + data["analyze_s"] + data["report_s"]
                    if args.detectors and fmt == "csv" and steps == args.steps[0]:
                        detectors = [sys.executable, __file__, "--child-detectors", str(path)]
                        print(subprocess.run(detectors, env=env, check=True, capture_output=True,
                                             text=True).stdout, end="")
                    print(f"{fmt:9} {signals:>7} {steps:>8} {data['parse_s']:>8.2f} {data['analyze_s']:>9.2f} "
                          f"{data['report_s']:>8.2f} {data['rss_mb']:>7.0f} {bare:>7.2f} {total / bare:>7.1f} "
                          f"{total * TARGET_STEPS / steps:>9.0f} {data['cpu_s']:>6.2f}", flush=True)
                    if args.stages:
                        split = [sys.executable, __file__, "--child-stages", str(path)]
                        print("  stages (s): " + subprocess.run(split, env=env, check=True, capture_output=True,
                                                                  text=True).stdout.strip(), flush=True)
                    path.unlink()


if __name__ == "__main__":
    main()
