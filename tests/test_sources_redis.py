"""Redis as a source (issue 10): ``stability postmortem redis://... --run ID`` (streams + archive) and
``stability runs redis://...``, against real redis-servers, a real worker process and the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from stability import keys, runstate
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord, encode
from stability.transport import Emitter

pytestmark = pytest.mark.slow

RUN, STEPS, NAN_STEP = "redis-src", 200, 150


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, "-m", "stability.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _record(step: int, rank: int = 0, run: str = RUN) -> StepRecord:
    loss = float("nan") if step == NAN_STEP else 3.0 - step / STEPS
    return StepRecord(run_id=run, step=step, rank=rank, wall_time=1e9 + step,
                      signals={"loss": loss, "grad_norm": 1.0 + (step % 7) / 10})


@pytest.fixture
def worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL=redis_server.url, STABILITY_SWEEP_S="0.2", OMP_NUM_THREADS="1")
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stability.worker", "--loglevel", "INFO"], cwd=tmp_path,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_postmortem_from_redis_merges_trimmed_streams_with_the_archive(
    redis_server: RedisServer, redis_client: redis.Redis[bytes], worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    emitter = Emitter(redis_url=redis_server.url, run_id=RUN, spool_dir=run_dir / "spool",
                      meta={"run_dir": str(run_dir)})
    for step in range(STEPS):
        assert emitter.put(_record(step))
    emitter.close(timeout=60)
    _wait(lambda: redis_client.hexists(keys.meta(RUN), "drained"), 240, "the worker to drain and archive the run")
    # bounded Redis: the worker trimmed what it archived; only the archive still has those steps
    stream = keys.records(RUN, 0)
    left = redis_client.xlen(stream)
    assert left < STEPS // 2, left
    # ... and a record that reached Redis after the last archiving is only in the stream
    redis_client.xadd(stream, {"r": encode(_record(STEPS))}, id=f"{10**13}-{STEPS}")
    in_stream = {int(eid.decode().partition("-")[2]) for eid, _ in redis_client.xrange(stream)}
    assert STEPS in in_stream

    out = tmp_path / "out"
    proc = cli("postmortem", redis_server.url, "--run", RUN, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    findings = json.loads((out / f"{RUN}.findings.json").read_text())
    assert findings["steps"] == STEPS + 1  # archive (0..199) + what the stream still holds (..200), each once
    assert any(e["kind"] == "nan" and e["onset"] == NAN_STEP for e in findings["events"])
    assert (out / f"{RUN}.report.html").stat().st_size > 0
    assert f"{RUN}.findings.json" in proc.stdout

    # without the archive only what is left in the stream is there: the archive really was read
    (run_dir / "archive").rename(tmp_path / "moved-archive")
    proc = cli("postmortem", redis_server.url, "-o", str(out))  # the only run: --run may be left out
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / f"{RUN}.findings.json").read_text())["steps"] == len(in_stream)


def test_runs_lists_status_ranks_steps_incidents(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "unix-redis") as server:  # a unix socket URL
        client: redis.Redis[bytes] = redis.Redis.from_url(server.url)
        for run, last in (("run-died", 57), ("run-finished", 20), ("run-live", 5)):
            for rank in (0, 1):
                client.sadd(keys.ranks(run), rank)
                for step in range(last + 1):
                    client.xadd(keys.records(run, rank), {"r": b"-"}, id=f"{int(time.time() * 1000)}-{step}")
            client.hset(keys.meta(run), mapping={"run_dir": f"/runs/{run}", "started": str(time.time())})
            runstate.mark(client, run, runstate.RUNNING)
        runstate.mark(client, "run-died", runstate.DIED, reason="SIGTERM")
        runstate.mark(client, "run-finished", runstate.FINISHED)
        finding = {"kind": "nan", "severity": "error", "rank": 1, "onset": 40, "step": 40, "end": None}
        client.xadd(keys.findings("run-died"), {"f": json.dumps(finding)})
        client.xadd(keys.findings("run-died"), {"f": json.dumps({**finding, "step": 41})})  # same incident
        client.xadd(keys.findings("run-live"), {"f": json.dumps({**finding, "severity": "info"})})
        client.close()

        proc = cli("runs", server.url)
        assert proc.returncode == 0, proc.stderr
        lines = {line.split()[0]: line for line in proc.stdout.splitlines()}
        assert lines["RUN"].split()[:2] == ["RUN", "STATUS"]
        assert "died at step 57 (SIGTERM)" in lines["run-died"]
        assert "1 open, worst error" in lines["run-died"] and "/runs/run-died" in lines["run-died"]
        assert "finished at step 20" in lines["run-finished"]
        assert "0 open, worst info" in lines["run-live"]

        proc = cli("runs", server.url, "--json")
        rows = {row["run_id"]: row for row in map(json.loads, proc.stdout.splitlines())}
        assert (rows["run-died"]["ranks"], rows["run-died"]["last_step"]) == (2, 57)
        assert (rows["run-live"]["status"], rows["run-live"]["incidents"]) == ("running", 0)
        assert rows["run-finished"]["run_dir"] == "/runs/run-finished"


def test_errors_are_one_line_and_never_show_the_password(redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    for args in (("runs", f"redis://:s3cret@127.0.0.1:{port}/0"),
                 ("postmortem", f"redis://admin:s3cret@127.0.0.1:{port}/0", "--run", RUN)):
        proc = cli(*args)
        assert proc.returncode == 2
        assert proc.stderr.startswith("stability: error: cannot reach Redis at redis://")
        assert "s3cret" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1

    redis.Redis.from_url(redis_server.url).hset(keys.meta("other-run"), "run_dir", "/x")
    proc = cli("postmortem", redis_server.url, "--run", RUN)
    assert proc.returncode == 2
    assert f"no run '{RUN}' in Redis at {redis_server.url} (runs there: other-run)" in proc.stderr

    auth_port = free_port()
    binary = redis_server.binary
    server = subprocess.Popen([binary, "--port", str(auth_port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", "right-pw"], stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: _answers(auth_port), 60, "the password-protected redis-server")
        proc = cli("runs", f"redis://:wrong-pw@127.0.0.1:{auth_port}/0")
        assert proc.returncode == 2
        assert "authentication failed" in proc.stderr and "wrong-pw" not in proc.stderr
        proc = cli("runs", f"redis://:right-pw@127.0.0.1:{auth_port}/0")
        assert proc.returncode == 0 and "no runs in Redis at redis://***@127.0.0.1" in proc.stdout
    finally:
        server.kill()
        server.wait()


def _answers(port: int) -> bool:
    try:
        redis.Redis(port=port, socket_timeout=0.5).ping()
    except redis.AuthenticationError:
        return True
    except redis.ResponseError:
        return True
    except redis.RedisError:
        return False
    return True


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@host:6379/0", "redis://***@host:6379/0"),
    ("rediss://admin:s3cret@host:6380/2", "rediss://admin:***@host:6380/2"),
    ("redis//:s3cret@host:6379/0", "<not a URL>"),  # malformed (issue 14 item 5)
    ("unix:///tmp/redis.sock?db=0&password=s3cret", "unix:///tmp/redis.sock?db=0&password=***"),
    ("redis://host:6379/0", "redis://host:6379/0"),
])
def test_redact(url: str, shown: str) -> None:
    from stability.redis_source import redact

    assert redact(url) == shown
