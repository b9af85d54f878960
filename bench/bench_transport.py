"""Emitter costs: ``put`` latency with Redis up and with Redis hung (SIGSTOP), and throughput to a local Redis.

Run: ``python bench/bench_transport.py``. Starts its own private redis-server (``stability.embedded.RedisServer``,
unix socket, append-only file) in a temporary directory. Baselines measured in the same run: a bare
``queue.Queue.put_nowait`` of an already encoded record (latency) and redis-py pipelined XADDs of pre-encoded
records, 100 per round trip (throughput).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis

from stability import keys
from stability.embedded import RedisServer
from stability.records import StepRecord, encode
from stability.transport import Emitter

N_LATENCY = 3000
PACE_S = 0.0005
"""Pause between puts in the latency runs (a fast training loop, ~1-2 kHz), so the emitter thread keeps up."""
N_THROUGHPUT = 10_000
REPEATS = 3
N_SIGNALS = 200


def make_record(step: int, run_id: str = "bench") -> StepRecord:
    signals = {f"grad_norm/model.layers.{i}.mlp": 0.01 * (i + step) for i in range(N_SIGNALS - 1)}
    signals["loss"] = 2.0
    return StepRecord(run_id=run_id, step=step, wall_time=time.time(), host="bench", signals=signals)


def timed_calls(call: Callable[[int], object], n: int, pace_s: float) -> np.ndarray:
    """Durations (µs) of ``call(i)`` for i in range(n), sleeping ``pace_s`` between calls."""
    durations = np.empty(n)
    for i in range(n):
        start = time.perf_counter_ns()
        call(i)
        durations[i] = (time.perf_counter_ns() - start) / 1000
        if pace_s:
            time.sleep(pace_s)
    return durations


def describe(name: str, us: np.ndarray, base: np.ndarray) -> str:
    med, p99 = np.percentile(us, [50, 99])
    bmed, bp99 = np.percentile(base, [50, 99])
    return (
        f"{name:44} median {med:8.1f} µs ({med / bmed:6.1f}x)   p99 {p99:8.1f} µs ({p99 / bp99:6.1f}x)"
        f"   max {us.max():9.1f} µs"
    )


def latency(server: RedisServer, spool_dir: Path) -> None:
    records = [make_record(i) for i in range(N_LATENCY)]
    payload = encode(records[0])
    bare: queue.Queue[bytes] = queue.Queue()
    base = timed_calls(lambda i: bare.put_nowait(payload), N_LATENCY, PACE_S)
    encode_only = timed_calls(lambda i: encode(records[i]), N_LATENCY, PACE_S)

    with Emitter(redis_url=server.url, run_id="lat-up", spool_dir=spool_dir) as up:
        up.flush()
        put_up = timed_calls(lambda i: up.put(records[i]), N_LATENCY, PACE_S)
        up.flush()
        up_stats = up.stats

    down = Emitter(redis_url=server.url, run_id="lat-down", spool_dir=spool_dir)
    down.put(make_record(0, "lat-down"))
    down.flush()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        put_down = timed_calls(lambda i: down.put(records[i]), N_LATENCY, PACE_S)
        down.flush(30)
        spooled = down.stats.spooled
    finally:
        os.kill(server.pid, signal.SIGCONT)
    down.close(30)
    with redis.Redis.from_url(server.url) as client:
        landed = client.xlen(keys.records("lat-down", 0))

    print(f"put() latency, one record of {N_SIGNALS} signals, {N_LATENCY} calls, {PACE_S * 1e6:.0f} µs apart;")
    print("ratio = vs. bare queue.put_nowait of an encoded record")
    print(describe("bare queue.put_nowait (baseline)", base, base))
    print(describe("records.encode alone", encode_only, base))
    print(describe("Emitter.put, Redis up", put_up, base))
    print(describe("Emitter.put, Redis hung (SIGSTOP)", put_down, base))
    print(f"  Redis up: {up_stats}")
    print(f"  Redis hung: {spooled} records spooled; after SIGCONT + close {landed} of {N_LATENCY + 1} in the stream")


def raw_pipeline_rate(url: str, payloads: list[bytes], stream: str) -> float:
    """Baseline: redis-py pipelined XADDs of pre-encoded records, 100 per round trip."""
    base_ts = int(time.time() * 1000)
    with redis.Redis.from_url(url) as client:
        start = time.perf_counter()
        for first in range(0, len(payloads), 100):
            pipe = client.pipeline(transaction=False)
            for i in range(first, min(first + 100, len(payloads))):
                pipe.xadd(stream, {"r": payloads[i]}, id=f"{base_ts}-{i + 1}")
            pipe.execute()
        return len(payloads) / (time.perf_counter() - start)


def emitter_rate(url: str, records: list[StepRecord], run_id: str, spool_dir: Path) -> tuple[float, str]:
    """Emitter: put every record (encode included) as fast as possible, then flush."""
    emitter = Emitter(redis_url=url, run_id=run_id, spool_dir=spool_dir, queue_size=len(records))
    emitter.flush()
    start = time.perf_counter()
    for record in records:
        emitter.put(record)
    emitter.flush(120)
    rate = len(records) / (time.perf_counter() - start)
    emitter.close()
    return rate, str(emitter.stats)


def throughput(server: RedisServer, spool_dir: Path) -> None:
    records = [make_record(i, "tput") for i in range(N_THROUGHPUT)]
    payloads = [encode(record) for record in records]
    raw, ours, stats = [], [], ""
    for attempt in range(REPEATS):
        raw.append(raw_pipeline_rate(server.url, payloads, f"bench:raw:{attempt}"))
        rate, stats = emitter_rate(server.url, records, f"tput-{attempt}", spool_dir)
        ours.append(rate)
    print(f"throughput, {N_THROUGHPUT} records of {N_SIGNALS} signals ({len(payloads[0])} B), local redis-server,")
    print(f"best of {REPEATS} (all runs in parentheses):")
    print(f"  redis-py pipelined XADD of pre-encoded records (baseline): {max(raw):9.0f} records/s  {_runs(raw)}")
    print(
        f"  Emitter put + flush (encode included):                    {max(ours):9.0f} records/s  {_runs(ours)}"
        f" = {max(ours) / max(raw):.2f}x"
    )
    print(f"  last emitter: {stats}")


def _runs(rates: list[float]) -> str:
    return "(" + ", ".join(f"{r:.0f}" for r in rates) + ")"


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="  [log] %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        with RedisServer(Path(tmp) / "redis") as server:
            latency(server, Path(tmp) / "spool")
            print()
            throughput(server, Path(tmp) / "spool")


if __name__ == "__main__":
    main()
