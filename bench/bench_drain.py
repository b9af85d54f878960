"""Drain throughput: records per second through ``Drainer`` against a plain read-and-ack loop on the same streams.

Run: ``python bench/bench_drain.py [--records N] [--signals S]``. A private redis-server (TCP, loopback) is
started in a temporary directory. Printed: records/s of

* ``baseline``  XREADGROUP + XACK in batches of 500 (no decoding, no detectors): the Redis floor;
* ``decode``    the same plus ``records.decode`` of every entry;
* ``detectors`` ``RunDiagnoser.update`` alone on already decoded records (no Redis): the detector cost;
* ``drainer``   ``Drainer`` with the real ``RunDiagnoser``, the findings sink and no archive;
* ``+archive``  the same plus the Parquet ``ArchiveSink``;

and each as a ratio of the baseline, measured in the same run.

``python bench/bench_drain.py --stages [--runs 4 --ranks 2 --steps 1500] [--no-detectors]`` instead profiles one
in-process backlog drain of ``bench/_records.py`` records (206 signals, as ``bench/loadgen.py`` writes them) with the
worker's sinks (console, findings, archive, advice, report) and prints the CPU time per record of each stage:
reading (``XREADGROUP`` + reply parsing), decoding, the detectors, the archive (table, frame, write), commits and
the rest of the loop. ``--no-detectors`` uses the worker's benchmark-only no-op diagnoser.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from stability import keys
from stability.detectors.engine import RunDiagnoser
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord, decode, encode
from stability.worker import archive as archive_module
from stability.worker import sinks as sinks_module
from stability.worker.drain import Drainer, SnapshotPolicy
from stability.worker.sinks import ArchiveSink, RedisFindingsSink, archive_table, redis_meta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RecordFactory
from _timing import tally_calls


def fill(client: redis.Redis, run_id: str, n: int, signals: int) -> None:
    pipe = client.pipeline(transaction=False)
    for step in range(n):
        sig = {f"grad_norm/layer.{i}": 1.0 + 0.001 * step for i in range(signals)}
        sig |= {"loss": 3.0 - step / n, "grad_norm": 1.0, "lr": 1e-4}
        rec = StepRecord(run_id=run_id, step=step, wall_time=1e9 + step, signals=sig)
        pipe.xadd(keys.records(run_id, 0), {"r": encode(rec)}, id=f"{1_000_000 + step}-{step}")
        if step % 500 == 499:
            pipe.execute()
    pipe.execute()
    client.sadd(keys.ranks(run_id), 0)


def plain_loop(client: redis.Redis, run_id: str, do_decode: bool) -> None:
    stream = keys.records(run_id, 0)
    client.xgroup_create(stream, keys.GROUP, id="0")
    while True:
        reply = client.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=500)
        if not reply:
            return
        entries = reply[0][1]
        if do_decode:
            for _, fields in entries:
                decode(fields[b"r"])
        client.xack(stream, keys.GROUP, *[eid for eid, _ in entries])


def detectors_only(client: redis.Redis, run_id: str) -> float:
    """Seconds of RunDiagnoser.update over the run's records, decoded beforehand."""
    records = [decode(fields[b"r"]) for _, fields in client.xrange(keys.records(run_id, 0))]
    diag = RunDiagnoser()
    start = time.perf_counter()
    for rec in records:
        diag.update(rec)
    return time.perf_counter() - start


_STAGES = (
    ("read: XREADGROUP + reply parsing", Drainer, "_read"),
    ("decode (records.decode_packed, Entry)", Drainer, "_decode"),
    ("detectors (RunDiagnoser.update)", None, "update"),
    ("archive: table (sinks.archive_table)", sinks_module, "archive_table"),
    ("archive: Arrow IPC frame", archive_module, "_frame"),
    ("archive: whole emit (+ write)", ArchiveSink, "emit"),
    ("commit (fsync, snapshot, ack, trim)", Drainer, "_commit"),
    ("whole drain", Drainer, "_drain"),
)


def stages(args: argparse.Namespace) -> None:
    """CPU per record of each stage of an in-process backlog drain (see the module docstring)."""
    import loadgen  # bench/loadgen.py: the same records and run registration

    from stability.worker.advice import AdviceSink
    from stability.worker.sinks import ConsoleSink, ReportSink
    from stability.worker.tasks import NullDiagnoser

    spent: dict[str, float] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        tally_calls(owner, name, spent, label, time.process_time)

    class Timed(RunDiagnoser):
        pass

    diagnoser: Any = NullDiagnoser if args.no_detectors else Timed
    for label, owner, name in _STAGES:
        timed(diagnoser if owner is None else owner, name, label)
    gen = loadgen.parse(["--runs", str(args.runs), "--ranks", str(args.ranks), "--steps", str(args.steps)])
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=free_port()) as server:
        client = redis.Redis.from_url(server.url)
        runs = loadgen.run_ids(gen)
        loadgen.register(client, runs, gen.ranks, Path(tmp), True)
        loadgen.fill_backlog(client, runs, gen)
        meta = redis_meta(client)
        sinks = [ConsoleSink(), RedisFindingsSink(client), ArchiveSink(meta), AdviceSink(client),
                 ReportSink(meta, client)]
        archive_table("warm-up", [])  # imports (pyarrow) before the clock starts
        if not args.no_detectors:
            from stability.detectors import oddity  # noqa: F401  (the first finding's ranking imports scikit-learn)
        start, n = time.process_time(), 0
        for run in runs:
            while True:
                result = Drainer(client, run, sinks=sinks, max_seconds=1e9, diagnoser=diagnoser).run()
                n += result.processed
                if result.status != "timeout":
                    break
        total = time.process_time() - start
        client.close()
    print(f"{n:,} records x {RecordFactory(run_id='x', rank=0).signal_count} signals, {args.runs} runs x "
          f"{args.ranks} ranks, archive on, detectors {'OFF' if args.no_detectors else 'on'}: "
          f"{n / total:,.0f} records per CPU-second ({1e6 * total / n:.0f} us/record)")
    for label, _, _ in _STAGES:
        print(f"  {label:40s} {1e6 * spent.get(label, 0.0) / n:7.1f} us/record")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--signals", type=int, default=100, help="per-layer signals per record")
    parser.add_argument("--stages", action="store_true", help="profile the stages of an in-process drain instead")
    parser.add_argument("--runs", type=int, default=4, help="--stages: runs (default 4)")
    parser.add_argument("--ranks", type=int, default=2, help="--stages: ranks per run (default 2)")
    parser.add_argument("--steps", type=int, default=1500, help="--stages: records per rank (default 1500)")
    parser.add_argument("--no-detectors", action="store_true", help="--stages: the no-op diagnoser")
    args = parser.parse_args()
    if args.stages:
        stages(args)
        return
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=free_port()) as server:
        client = redis.Redis.from_url(server.url)
        meta = redis_meta(client)
        cases = {
            "baseline": lambda run: plain_loop(client, run, do_decode=False),
            "decode": lambda run: plain_loop(client, run, do_decode=True),
            # idle_s=0: commit (ack) once caught up, as a drain that ends does
            "drainer": lambda run: Drainer(client, run, sinks=[RedisFindingsSink(client)], max_seconds=1e9,
                                           snapshot=SnapshotPolicy(idle_s=0.0)).run(),
            "+archive": lambda run: Drainer(
                client, run, sinks=[RedisFindingsSink(client), ArchiveSink(meta)], max_seconds=1e9,
                snapshot=SnapshotPolicy(idle_s=0.0),
            ).run(),
        }
        rates = {}
        fill(client, "bench-detectors", args.records, args.signals)
        detector_rate = args.records / detectors_only(client, "bench-detectors")
        for name, drain in cases.items():
            run = f"bench-{name.strip('+')}"
            fill(client, run, args.records, args.signals)
            client.hset(keys.meta(run), "run_dir", tmp)
            start = time.perf_counter()
            drain(run)
            rates[name] = args.records / (time.perf_counter() - start)
            if name == "decode":
                rates["detectors"] = detector_rate
            pending = client.xpending(keys.records(run, 0), keys.GROUP)["pending"]
            assert pending == 0, f"{name}: {pending} entries left pending"
        print(f"{args.records} records x {args.signals + 3} signals, redis {client.info('server')['redis_version']}")
        for name, rate in rates.items():
            print(f"{name:>9}: {rate:10,.0f} records/s  ({rate / rates['baseline']:.3f}x baseline)")
        client.close()


if __name__ == "__main__":
    main()
