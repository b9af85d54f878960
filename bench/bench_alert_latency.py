"""Alert latency: a step record handed to the transport -> its alert line printed in the training terminal.

Run: ``OMP_NUM_THREADS=1 python bench/bench_alert_latency.py [--incidents N] [--step-ms MS]``. The real path of
``import stability.auto``: a :class:`~stability.session.Session` with the embedded redis-server and the local
Celery worker process (sweep every 0.5 s, the session's default), records put on its emitter at one step every
``--step-ms`` ms, and a :class:`~stability.console.ConsoleReporter` printing to /dev/null (rate limit off). Every
120th step carries a NaN loss (the NaN detector decides on that very record, so the latency is pure transport +
worker + reader time); the clock starts when the record is ``put`` on the emitter and stops when its line has been
printed. Printed: p50, p90, p99 and max over the incidents, and how many were under the 1 s target.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from stability.config import WatchConfig
from stability.console import ConsoleReporter
from stability.records import StepRecord
from stability.session import Session

PERIOD = 120
"""Steps between injected NaN losses (the NaN detector treats closer ones as one incident)."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--incidents", type=int, default=40, help="NaN incidents to time (default 40)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="milliseconds between steps (default 10)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = WatchConfig(run_id="bench-latency", run_dir=Path(tmp) / "run", quiet=True)
        session = Session.open(config)
        put_at: dict[int, float] = {}
        latencies: list[float] = []
        got = threading.Condition()

        def printed(finding: dict[str, Any], at: float) -> None:
            with got:
                if finding["kind"] == "nan" and finding["step"] in put_at:
                    latencies.append(at - put_at[finding["step"]])
                got.notify_all()

        with open(os.devnull, "w") as devnull:
            reporter = ConsoleReporter(session.redis_url, config.run_id, session.run_dir, "bench", stream=devnull,
                                       on_line=printed, burst=10**6).start()
            try:
                steps = PERIOD * (args.incidents + 1)
                for step in range(steps):
                    nan = step % PERIOD == PERIOD - 1
                    loss = float("nan") if nan else 2.0 + rng.gauss(0, 0.02)
                    record = StepRecord(run_id=config.run_id, step=step, wall_time=time.time(),
                                        signals={"loss": loss, "grad_norm": 1.0 + rng.gauss(0, 0.05), "lr": 1e-3})
                    if nan:
                        put_at[step] = time.monotonic()
                    session.emitter.put(record)
                    time.sleep(args.step_ms / 1000)
                with got:
                    got.wait_for(lambda: len(latencies) >= args.incidents, timeout=60)
            finally:
                reporter.stop(final=False)
                session.close()
    ms = [1000 * x for x in latencies]
    under = sum(x <= 1000 for x in ms)
    print(f"{len(ms)} incidents, one step every {args.step_ms:g} ms, NaN every {PERIOD} steps")
    print(f"record put -> alert line printed: p50 {percentile(ms, 50):.0f} ms, p90 {percentile(ms, 90):.0f} ms, "
          f"p99 {percentile(ms, 99):.0f} ms, max {max(ms):.0f} ms; {under}/{len(ms)} within 1 s")


if __name__ == "__main__":
    main()
