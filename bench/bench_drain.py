"""Drain throughput: records per second through ``Drainer`` against a plain read-and-ack loop on the same streams.

Run: ``python bench/bench_drain.py [--records N] [--signals S]``. A private redis-server (TCP, loopback) is
started in a temporary directory. Printed: records/s of

* ``baseline``  XREADGROUP + XACK in batches of 500 (no decoding, no detectors): the Redis floor;
* ``decode``    the same plus ``records.decode`` of every entry;
* ``detectors`` ``RunDiagnoser.update`` alone on already decoded records (no Redis): the detector cost;
* ``drainer``   ``Drainer`` with the real ``RunDiagnoser``, the findings sink and no archive;
* ``+archive``  the same plus the Parquet ``ArchiveSink``;

and each as a ratio of the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import redis

from stability import keys
from stability.detectors.engine import RunDiagnoser
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord, decode, encode
from stability.worker.drain import Drainer
from stability.worker.sinks import ArchiveSink, RedisFindingsSink, redis_meta


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--signals", type=int, default=100, help="per-layer signals per record")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=free_port()) as server:
        client = redis.Redis.from_url(server.url)
        meta = redis_meta(client)
        cases = {
            "baseline": lambda run: plain_loop(client, run, do_decode=False),
            "decode": lambda run: plain_loop(client, run, do_decode=True),
            "drainer": lambda run: Drainer(client, run, sinks=[RedisFindingsSink(client)], max_seconds=1e9).run(),
            "+archive": lambda run: Drainer(
                client, run, sinks=[RedisFindingsSink(client), ArchiveSink(meta)], max_seconds=1e9
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
