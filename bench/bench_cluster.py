"""Redis Cluster against one server: emitter throughput and drain throughput through ``redis+cluster://``.

Run: ``python bench/bench_cluster.py`` (needs the system redis-server 7 and redis-cli). Starts, in a temporary
directory, one plain redis-server (the baseline) and three ``cluster-enabled`` nodes joined with
``redis-cli --cluster create --cluster-replicas 0`` (the path docs/deployment.md describes), all on loopback TCP
with the append-only file off, so the two differ only in the client and the cluster protocol. Prints records/s
and the ratio cluster / single for:

* the training-side Emitter: ``put`` N records of 200 signals, ``flush`` (pipelined XADDs, 100 per round trip);
* the Drainer with the real detectors (and the Redis findings sink) over 2 ranks of one run.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stability import keys
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord, encode
from stability.redis_url import connect
from stability.transport import Emitter
from stability.worker.drain import Drainer
from stability.worker.sinks import RedisFindingsSink

N_EMIT = 3000
DRAIN_STEPS = 200
N_SIGNALS = 200
REPEATS = 3
BINARY = "/usr/bin/redis-server"


def record(run_id: str, step: int, rank: int = 0) -> StepRecord:
    """Like bench_drain's records: per-layer gradient norms plus loss, grad_norm and lr."""
    signals = {f"grad_norm/layer.{i}": 1.0 + 0.001 * step for i in range(N_SIGNALS - 3)}
    signals |= {"loss": 3.0 - step / 1000, "grad_norm": 1.0, "lr": 1e-4}
    return StepRecord(run_id=run_id, step=step, rank=rank, wall_time=1e9 + step, host="bench", signals=signals)


def cluster_port() -> int:
    """A free port whose bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port <= 55535:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue


def start_cluster(directory: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    ports = [cluster_port() for _ in range(3)]
    procs = []
    for port in ports:
        data = directory / str(port)
        data.mkdir(parents=True)
        procs.append(subprocess.Popen(
            [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--dir", str(data),
             "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
    for port in ports:
        wait(lambda p=port: subprocess.run(["redis-cli", "-p", str(p), "ping"], capture_output=True).returncode == 0)
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                    "0", "--cluster-yes"], check=True, capture_output=True)  # fmt: skip
    wait(lambda: all(b"cluster_state:ok" in subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"],
                                                            capture_output=True).stdout for p in ports))  # fmt: skip
    return procs, "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:2])


def wait(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out starting the servers")
        time.sleep(0.1)


def emit_rate(url: str, run_id: str, spool: Path) -> float:
    records = [record(run_id, step) for step in range(1, N_EMIT + 1)]
    emitter = Emitter(redis_url=url, run_id=run_id, spool_dir=spool, queue_size=N_EMIT + 1, timeout_s=5.0)
    emitter.put(record(run_id, 0))
    assert emitter.flush(30)  # connected (a cluster client is made on the emitter thread) and registered
    start = time.perf_counter()
    for rec in records:
        emitter.put(rec)
    assert emitter.flush(300)
    elapsed = time.perf_counter() - start
    emitter.close()
    assert emitter.stats.sent == N_EMIT + 1, emitter.stats
    return N_EMIT / elapsed


def drain_rate(client: Any, run_id: str) -> float:
    pipe = client.pipeline(transaction=False)
    for step in range(DRAIN_STEPS):
        for rank in (0, 1):
            pipe.xadd(keys.records(run_id, rank), {"r": encode(record(run_id, step, rank))}, id=f"{step + 1}-{step}")
    pipe.sadd(keys.ranks(run_id), 0, 1)
    pipe.execute()
    start = time.perf_counter()
    result = Drainer(client, run_id, sinks=[RedisFindingsSink(client)], batch=500, max_seconds=600).run()
    elapsed = time.perf_counter() - start
    assert result.processed == 2 * DRAIN_STEPS, result
    return result.processed / elapsed


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    if not (os.access(BINARY, os.X_OK) and shutil.which("redis-cli")):
        raise SystemExit(f"needs {BINARY} and redis-cli")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = RedisServer(root / "single", port=free_port(), binary=BINARY, appendonly=False).start()
        procs, cluster_url = start_cluster(root / "cluster")
        try:
            urls = {"single": single.url, "cluster": cluster_url}
            clients = {name: connect(url) for name, url in urls.items()}
            rates: dict[str, dict[str, list[float]]] = {"emit": {}, "drain": {}}
            for rep in range(REPEATS):
                for name, url in urls.items():
                    run_id = f"bench-{name}-{rep}"
                    rates["emit"].setdefault(name, []).append(emit_rate(url, run_id, root / "spool"))
                    rates["drain"].setdefault(name, []).append(drain_rate(clients[name], f"{run_id}-d"))
            print(f"{N_SIGNALS} signals per record; best of {REPEATS}; loopback TCP, AOF off")
            for what, label in (("emit", f"Emitter put+flush, {N_EMIT} records"),
                                ("drain", f"Drainer, real detectors, 2 ranks x {DRAIN_STEPS} steps")):  # fmt: skip
                base, clu = max(rates[what]["single"]), max(rates[what]["cluster"])
                print(f"{label:48} single {base:8.0f} rec/s   cluster {clu:8.0f} rec/s   ratio {clu / base:5.2f}")
            for client in clients.values():
                client.close()
        finally:
            single.kill()
            for proc in procs:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
