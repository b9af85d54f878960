"""``stability replay RUN_DIR`` (issue 14 item 3): a spool left by a training process that ended while Redis was down
reaches Redis afterwards, in order, once; with no Redis given, the run's embedded Redis and a worker finish the run.
Real redis-servers, a real emitter, the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from stability import keys, runstate
from stability.embedded import RedisServer
from stability.records import StepRecord
from stability.transport import Emitter, parse_id, spool_path
from stability.transport._spool import encode_frames

pytestmark = pytest.mark.slow

RUN, LIVE, STEPS, NAN_STEP = "replay-run", 50, 200, 120


def _record(step: int) -> StepRecord:
    loss = float("nan") if step == NAN_STEP else 3.0 - step / STEPS
    return StepRecord(run_id=RUN, step=step, rank=0, wall_time=1e9 + step, signals={"loss": loss, "grad_norm": 1.0})


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "stability.cli", *args], capture_output=True, text=True, env=env,
                          timeout=400)


def test_replay_after_training_ended_while_redis_was_down(redis_server: RedisServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    emitter = Emitter(redis_url=redis_server.url, run_id=RUN, spool_dir=run_dir / "spool", timeout_s=0.5)
    for step in range(LIVE):
        emitter.put(_record(step))
    assert emitter.flush(60)
    redis_server.stop()  # clean stop: what was sent is kept in its append-only file
    for step in range(LIVE, STEPS):
        emitter.put(_record(step))
    emitter.close(timeout=30)  # training ends before Redis returns
    spool = spool_path(run_dir / "spool", 0)
    assert spool.stat().st_size > 0
    redis_server.start()

    proc = cli("replay", str(run_dir), "--redis", redis_server.url)
    assert proc.returncode == 0, proc.stderr
    assert f"rank 0: {STEPS - LIVE} records replayed, 0 already in Redis" in proc.stdout
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    steps = [parse_id(entry_id)[1] for entry_id, _ in client.xrange(keys.records(RUN, 0))]
    assert steps == list(range(STEPS))  # every record once, in order
    assert not spool.exists()
    assert client.hexists(keys.meta(RUN), "ended:0") and client.sismember(keys.RUNS, RUN)
    assert runstate.read_status(client, RUN).status == runstate.DIED  # nobody recorded a clean end

    proc = cli("replay", str(run_dir), "--redis", redis_server.url)
    assert proc.returncode == 0 and "nothing to replay" in proc.stdout
    client.close()


def test_replay_into_the_embedded_redis_finishes_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RedisServer(run_dir / "redis"):  # the embedded server of the run, as the session had it
        emitter = Emitter(redis_url=f"unix://{run_dir / 'redis' / 'redis.sock'}", run_id=RUN,
                          spool_dir=run_dir / "spool", meta={"run_dir": str(run_dir)})
        for step in range(LIVE):
            emitter.put(_record(step))
        assert emitter.flush(60)
    # Redis gone: the rest is spooled (written here the way the emitter writes it) and training ended
    entries = [(f"{int((1e9 + step) * 1000)}-{step}", _record_bytes(step)) for step in range(LIVE, STEPS)]
    spool = spool_path(run_dir / "spool", 0)
    spool.parent.mkdir(parents=True, exist_ok=True)
    spool.write_bytes(encode_frames(entries))
    emitter.close(timeout=5)
    runstate.write_status_file(run_dir, RUN, runstate.RunStatus(status=runstate.FINISHED))

    proc = cli("replay", str(run_dir))
    assert proc.returncode == 0, proc.stderr + (run_dir / "worker.log").read_text()[-3000:]
    assert "records replayed" in proc.stdout and f"run {RUN} drained" in proc.stdout
    findings = json.loads((run_dir / "findings.json").read_text())
    assert findings["steps"] == STEPS
    assert any(e["kind"] == "nan" and e["onset"] == NAN_STEP for e in findings["events"])
    status = runstate.read_status_file(run_dir)
    assert status is not None and (status.status, status.step) == (runstate.FINISHED, STEPS - 1)
    assert not spool.exists()
    assert "stop requested" in (run_dir / "worker.log").read_text()  # the embedded processes were stopped


def _record_bytes(step: int) -> bytes:
    from stability.records import encode

    return encode(_record(step))


def test_replay_refuses_out_of_order_entries_and_keeps_the_spool(redis_server: RedisServer, tmp_path: Path) -> None:
    """An entry older than the stream's last one cannot be added in order: counted, spool kept, exit 1."""
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    from stability.records import encode

    client.xadd(keys.records(RUN, 0), {"r": encode(_record(5))}, id="2000-5")
    spool = spool_path(tmp_path / "run" / "spool", 0)
    spool.parent.mkdir(parents=True)
    spool.write_bytes(encode_frames([("1000-3", _record_bytes(3)), ("2000-5", _record_bytes(5)),
                                     ("3000-6", _record_bytes(6))]))
    proc = cli("replay", str(tmp_path / "run"), "--redis", redis_server.url)
    assert proc.returncode == 1
    assert "rank 0: 1 records replayed, 1 already in Redis, 1 refused" in proc.stdout
    assert spool.exists()
    client.close()


FROZEN_SCRIPT = """
import os, signal, sys
import torch
import stability.auto  # noqa: F401

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 8), torch.randn(32, 1)
steps, freeze_at = int(os.environ["STEPS"]), int(os.environ["FREEZE_AT"])
for step in range(steps):
    if step == freeze_at:
        stability.auto.handle.flush(60)  # everything so far is in Redis
        os.kill(int(os.environ["FREEZE_PID"]), signal.SIGSTOP)  # Redis hangs for the rest of the run and the exit
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
print("last step done", flush=True)
"""


def test_exit_with_a_hung_redis_spools_every_unsent_record_and_replay_delivers_them(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis freezes (SIGSTOP) near the end of training and stays frozen while the process exits: the exit does
    not wait for it (the process is gone while Redis is still stopped), every record Redis does not have is in the
    run's spool, in order, and ``stability replay`` then delivers them: every step once, in order."""
    steps, freeze_at = 120, 80
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(FROZEN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", STABILITY_REDIS_URL=redis_server.url,
               STABILITY_RUN_ID=RUN, STABILITY_RUN_DIR=str(run_dir), STABILITY_TIMING="0",
               # the round trip in flight at the freeze outlasts the exit's flush bound: close() takes it over
               STABILITY_REDIS_TIMEOUT_S="10", STABILITY_EXIT_FLUSH_S="0.5",
               STEPS=str(steps), FREEZE_AT=str(freeze_at), FREEZE_PID=str(redis_server.pid))
    pid = redis_server.pid
    assert pid is not None
    try:
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        frozen = _stopped(pid)  # the process ended while Redis was still stopped: nothing waited for it
    finally:
        os.kill(pid, signal.SIGCONT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "last step done" in proc.stdout and frozen
    assert "did not take the last" in proc.stderr and "stability replay" in proc.stderr

    from stability import supervisor
    from stability.records import decode
    from stability.transport import read_spool

    assert supervisor.wait_stopped(run_dir, 120)  # the watchdog of an external-Redis run saw a clean exit
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    in_redis = [parse_id(entry_id)[1] for entry_id, _ in client.xrange(keys.records(RUN, 0))]
    spool = spool_path(run_dir / "spool", 0)
    spooled = [decode(payload).step for _entry_id, payload in read_spool(spool)]
    assert spooled == sorted(spooled) and spooled[-1] == steps - 1  # in order, up to the last step
    assert set(in_redis) | set(spooled) == set(range(steps)), (in_redis, spooled)  # nothing lost
    assert in_redis[:freeze_at] == list(range(freeze_at))
    assert runstate.read_status(client, RUN).status == runstate.RUNNING  # the exit did not wait to record it
    local = runstate.read_status_file(run_dir)
    assert local is not None and local.status == runstate.FINISHED  # ... it went to status.json instead

    proc2 = cli("replay", str(run_dir), "--redis", redis_server.url)
    assert proc2.returncode == 0, proc2.stderr
    steps_now = [parse_id(entry_id)[1] for entry_id, _ in client.xrange(keys.records(RUN, 0))]
    assert steps_now == list(range(steps))  # every record once, in order
    assert not spool.exists()
    assert client.hexists(keys.meta(RUN), "ended:0")
    assert runstate.read_status(client, RUN).status == runstate.FINISHED
    client.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"
