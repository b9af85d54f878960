"""Lifecycle of an embedded run (issue 10): whatever ends the training process, its redis-server, supervisor and
local worker go away, after the worker has written findings and report for what reached Redis, and the run's
status says how it ended.

Real processes throughout: a training script with ``import stability.auto`` in a subprocess, killed with
SIGTERM / SIGKILL, or failing with an exception; the processes it started are found through /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from stability import _sigterm, keys, runstate, supervisor
from stability.config import WatchConfig
from stability.embedded import RedisServer
from stability.records import StepRecord
from stability.session import LazySession

pytestmark = pytest.mark.slow

NAN_AT, MARK_AT = 30, 60
SCRIPT = textwrap.dedent("""
    import os, time
    import torch
    import stability.auto  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    steps, nan_at, mark_at = int(os.environ["STEPS"]), int(os.environ["NAN_AT"]), int(os.environ["MARK_AT"])
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        if step == mark_at:
            open(os.environ["MARKER"], "w").write(str(step))
            if os.environ.get("RAISE"):
                raise RuntimeError("boom at step %d" % step)
        time.sleep(float(os.environ.get("SLEEP", "0.02")))
        if os.path.exists(os.environ.get("STOP", "/nonexistent")):
            break
    if os.environ.get("OS_EXIT"):  # scripts that skip a slow teardown end this way (atexit does not run)
        os._exit(int(os.environ["OS_EXIT"]))
""")


def _start(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    child_env.update({"STABILITY_RUN_DIR": str(run_dir), "STABILITY_RUN_ID": "lifecycle-run", "MARKER": str(marker),
                      "STEPS": "100000", "NAN_AT": str(NAN_AT), "MARK_AT": str(MARK_AT), "OMP_NUM_THREADS": "1",
                      "PYTHONPATH": os.pathsep.join(sys.path), **env})
    log = open(tmp_path / "train.log", "wb")
    proc = subprocess.Popen([sys.executable, str(script)], env=child_env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, run_dir, marker


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return out


def _started_processes(proc: subprocess.Popen[bytes], marker: Path) -> dict[int, str]:
    _wait(lambda: marker.exists() or proc.poll() is not None, 240, "the training script to reach the marker step")
    assert proc.poll() is None, "the training script ended early"
    found: dict[int, str] = {}

    def complete() -> bool:
        found.clear()
        found.update(_descendants(proc.pid))
        cmds = " | ".join(found.values())
        return "stability.supervisor" in cmds and "redis-server" in cmds and "stability.worker" in cmds

    _wait(complete, 120, "supervisor, redis-server and worker to be running")
    _wait(lambda: _records_in_redis(marker.parent / "run"), 120, "the training process's session to be open")
    return found


def _records_in_redis(run_dir: Path) -> bool:
    """The training side's session is open: its emitter has written records (the processes exist a little
    earlier; a signal in between finds no session to record the end with, see the note in the SIGTERM test)."""
    try:
        url = (run_dir / "redis" / "url").read_text().strip()
    except OSError:
        return False
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return bool(client.xlen(keys.records("lifecycle-run", 0)))
    except redis.RedisError:
        return False
    finally:
        client.close()


def _findings(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "findings.json").read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_training_leaves_no_process_and_gets_its_report(tmp_path: Path, sig: signal.Signals) -> None:
    proc, run_dir, marker = _start(tmp_path)
    started = _started_processes(proc, marker)
    proc.send_signal(sig)
    assert proc.wait(120) == -sig, "the process must still die of the signal (exit status seen by schedulers)"
    _wait(lambda: not any(_alive(pid) for pid in started), 240,
          f"{sorted(started.values())} to exit after the training process got {sig.name}")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "died"
    assert status["step"] >= MARK_AT
    assert status["reason"] == ("SIGTERM" if sig == signal.SIGTERM else "vanished without a clean close")
    findings = _findings(run_dir)
    assert findings["steps"] >= MARK_AT  # everything that reached Redis was diagnosed
    events = findings["events"]
    assert isinstance(events, list)
    assert any(e["kind"] == "nan" and e["onset"] <= NAN_AT + 1 for e in events), events
    assert (run_dir / "report.html").stat().st_size > 0
    log = (run_dir / "worker.log").read_text()
    assert "is gone; run lifecycle-run died" in log


def test_a_sigterm_while_the_session_opens_still_records_the_reason(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminate path of a session that is not open yet (here a Redis that accepts the connection and never
    answers: a real listening socket) writes ``status.json`` itself: died, with the signal and this process's pid
    (what the supervisor keeps instead of "vanished")."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nothing ever replies
    run_dir = tmp_path / "run"
    config = WatchConfig(run_id="early-term", run_dir=run_dir, redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    sink = LazySession(config)
    try:
        assert sink.put(StepRecord(run_id="early-term", step=0, wall_time=time.time(), signals={"loss": 1.0}))
        sink.terminate("SIGTERM", timeout=0.2)
        assert sink.session is None  # still opening: the early path ran
        status = runstate.read_status_file(run_dir)
        assert status is not None
        assert (status.status, status.reason, status.pid) == (runstate.DIED, "SIGTERM", os.getpid())
        assert status.describe() == "died (SIGTERM)"
    finally:
        silent.close()  # now refused: the session opens (records spool) and records the end itself
    assert sink.wait(60) is not None and sink.session is not None
    status = runstate.read_status_file(run_dir)
    assert status is not None and (status.status, status.reason) == (runstate.DIED, "SIGTERM")


def test_exception_records_died_and_clean_stop(tmp_path: Path) -> None:
    proc, run_dir, _marker = _start(tmp_path, RAISE="1", SLEEP="0")
    assert proc.wait(240) == 1
    assert supervisor.wait_stopped(run_dir, 240)  # the worker finishes the run after the fast exit
    assert "RuntimeError: boom" in (tmp_path / "train.log").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "died"
    assert status["reason"] == f"RuntimeError: boom at step {MARK_AT}"
    assert status["step"] == MARK_AT
    assert any(e["kind"] == "nan" for e in _findings(run_dir)["events"])  # type: ignore[union-attr]
    assert not _descendants(proc.pid)


def test_clean_end_is_finished(tmp_path: Path) -> None:
    proc, run_dir, _marker = _start(tmp_path, STEPS="40", NAN_AT="-1", MARK_AT="-1", SLEEP="0")
    assert proc.wait(240) == 0
    assert supervisor.wait_stopped(run_dir, 240)
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("finished", 39)
    assert _findings(run_dir)["steps"] == 40


@pytest.mark.parametrize(("code", "status"), [(0, "finished"), (3, "died")])
def test_os_exit_closes_the_run_first(tmp_path: Path, code: int, status: str) -> None:
    """``os._exit`` skips atexit: the last step's record was lost and a clean end was recorded as died ("vanished
    without a clean close"). ``import stability.auto`` closes first: every record, finished (or died, with the
    status, for a non-zero one)."""
    proc, run_dir, _marker = _start(tmp_path, STEPS="40", NAN_AT="-1", MARK_AT="-1", SLEEP="0", OS_EXIT=str(code))
    assert proc.wait(240) == code
    assert supervisor.wait_stopped(run_dir, 240)
    state = json.loads((run_dir / "status.json").read_text())
    assert (state["status"], state["step"]) == (status, 39), state
    assert state["reason"] == ("" if code == 0 else f"os._exit({code})")
    assert _findings(run_dir)["steps"] == 40
    assert not _descendants(proc.pid)


def test_exit_waits_for_the_records_not_for_the_worker(tmp_path: Path) -> None:
    """``import stability.auto`` exits once its records are in Redis: with the local worker frozen (SIGSTOP) the
    training process still ends within seconds (before: it waited up to 60 s for the drain), and the worker,
    thawed after the process has gone, still writes the findings of every step; then everything stops."""
    stop = tmp_path / "stop"
    proc, run_dir, marker = _start(tmp_path, STOP=str(stop))
    workers: list[int] = []
    try:
        started = _started_processes(proc, marker)
        workers = [pid for pid, cmd in started.items() if "stability.worker" in cmd]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        stop.touch()
        asked = time.monotonic()
        assert proc.wait(120) == 0
        exit_s = time.monotonic() - asked
        assert exit_s < 30, f"the exit took {exit_s:.1f} s: it waited for the worker"
        assert not (run_dir / "findings.json").exists()  # the frozen worker cannot have finished the run
        status = json.loads((run_dir / "status.json").read_text())
        assert status["status"] == "finished"
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert supervisor.wait_stopped(run_dir, 240)
    _wait(lambda: not any(_alive(pid) for pid in started), 120, "the worker and redis-server to stop")
    findings = _findings(run_dir)
    assert findings["steps"] == status["step"] + 1 and findings["steps"] > MARK_AT
    assert any(e["kind"] == "nan" for e in findings["events"])  # type: ignore[union-attr]
    assert "has exited; run lifecycle-run finished" in (run_dir / "worker.log").read_text()


def test_killed_supervisor_takes_redis_and_worker_with_it(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: the supervisor's children stop when it dies, even by SIGKILL."""
    proc, _run_dir, marker = _start(tmp_path)
    try:
        started = _started_processes(proc, marker)
        supervisor = next(pid for pid, cmd in started.items() if "stability.supervisor" in cmd)
        os.kill(supervisor, signal.SIGKILL)
        _wait(lambda: not any(_alive(pid) for pid in started), 120, "redis-server and worker to follow the supervisor")
        assert proc.poll() is None  # training itself carries on (its emitter spools)
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_handler_only_when_none_is_set() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, lambda *_: None)
        assert not _sigterm.install(lambda reason: None)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert not _sigterm.install(lambda reason: None)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert _sigterm.install(lambda reason: None)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        _sigterm.uninstall()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_trainers_last_word_in_status_json_is_kept_by_the_supervisor(
        redis_server: RedisServer, redis_client: redis.Redis[bytes], tmp_path: Path) -> None:
    """A trainer whose SIGTERM close could not reach Redis in time writes its end to ``status.json`` only; the
    supervisor, seeing it gone, records that reason instead of "vanished" (before: it overwrote it). A status
    another process wrote (a stale file, another pid) does not count."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watched = os.getpid()  # stands for the trainer; the supervisor does not check that it is gone here

    def after_death(run_id: str, pid: int) -> runstate.RunStatus:
        runstate.write_status_file(run_dir, run_id, runstate.RunStatus(status=runstate.DIED, reason="SIGTERM",
                                                                       time=time.time(), host="h", pid=pid))
        supervisor.Supervisor(run_dir=run_dir, run_id=run_id, watch_pid=watched, worker=False, exit_drain_s=1.0,
                              redis_url=redis_server.url)._after_death()
        return runstate.read_status(redis_client, run_id)

    assert after_death("own-word", watched).reason == "SIGTERM"
    assert runstate.read_status_file(run_dir).reason == "SIGTERM"  # type: ignore[union-attr]
    assert after_death("stale-file", watched + 1).reason == "vanished without a clean close"


def test_status_transitions(redis_server: RedisServer, redis_client: redis.Redis[bytes], tmp_path: Path) -> None:
    run = "status-run"
    redis_client.sadd(keys.ranks(run), 0, 1)
    redis_client.xadd(keys.records(run, 0), {"r": b"x"}, id="1000-7")
    redis_client.xadd(keys.records(run, 1), {"r": b"x"}, id="1000-9")
    redis_client.xtrim(keys.records(run, 1), maxlen=0)  # trimmed streams still know their last step
    assert runstate.mark(redis_client, run, runstate.RUNNING).status == "running"
    died = runstate.mark(redis_client, run, runstate.DIED, reason="SIGTERM", run_dir=tmp_path)
    assert (died.status, died.step, died.reason) == ("died", 9, "SIGTERM")
    assert died.describe() == "died at step 9 (SIGTERM)"
    # a later end does not overwrite the first; a restart of the run does
    assert runstate.mark(redis_client, run, runstate.FINISHED).status == "died"
    assert runstate.mark(redis_client, run, runstate.DIED, reason="vanished").reason == "SIGTERM"
    assert runstate.read_status_file(tmp_path) == died
    assert runstate.mark(redis_client, run, runstate.RUNNING).describe() == "running"
    assert runstate.mark(redis_client, run, runstate.FINISHED).describe() == "finished at step 9"
    assert redis_client.hget(keys.meta(run), "status") == b"finished"


def test_crashed_worker_and_redis_are_restarted_under_a_live_trainer(tmp_path: Path) -> None:
    proc, run_dir, marker = _start(tmp_path)
    try:
        started = _started_processes(proc, marker)
        worker = min(pid for pid, cmd in started.items() if "stability.worker" in cmd)  # the worker's main process
        server = next(pid for pid, cmd in started.items() if "redis-server" in cmd)
        os.killpg(worker, signal.SIGKILL)
        os.kill(server, signal.SIGKILL)

        def replaced() -> bool:
            now = _descendants(proc.pid)
            return (any("stability.worker" in c and p not in started for p, c in now.items())
                    and any("redis-server" in c and p not in started for p, c in now.items()))

        _wait(replaced, 120, "a new worker and redis-server")
        later = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == -signal.SIGTERM
        _wait(lambda: not any(_alive(pid) for pid in later), 240, "every process to exit")
        assert _findings(run_dir)["steps"] >= MARK_AT
        log = (run_dir / "worker.log").read_text()
        assert "the worker exited with" in log and "redis-server died; restarting it" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_flush_blocked_by_the_main_threads_lock_still_terminates(tmp_path: Path) -> None:
    """The handler runs on the main thread; a flush waiting for a lock that thread holds must not hang the exit."""
    script = tmp_path / "locked.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading
        from stability import _sigterm

        _sigterm.FLUSH_S = 1.0
        lock = threading.Lock()
        flushed = []
        assert _sigterm.install(lambda reason: (lock.acquire(), flushed.append(reason)))
        with lock:  # the flush cannot get it while the handler runs here
            os.kill(os.getpid(), signal.SIGTERM)
            while True:
                signal.pause()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr


def test_external_redis_run_killed_is_recorded_died_and_ended(
    redis_server: RedisServer, redis_client: redis.Redis[bytes], tmp_path: Path
) -> None:
    """With STABILITY_REDIS_URL the watchdog (supervisor in watch-only mode) is all that is started locally; when the
    trainer vanishes it marks the run died and its ranks ended, so remote workers can finish it."""
    proc, _run_dir, marker = _start(tmp_path, STABILITY_REDIS_URL=redis_server.url)
    try:
        _wait(lambda: marker.exists() or proc.poll() is not None, 240, "the marker step")
        watchdogs: dict[int, str] = {}

        def found() -> bool:
            watchdogs.update({p: c for p, c in _descendants(proc.pid).items() if "stability.supervisor" in c})
            return bool(watchdogs)

        _wait(found, 60, "the watchdog")
        assert all("--external" in cmd and redis_server.url not in cmd for cmd in watchdogs.values())
        assert not any("redis-server" in c or "stability.worker" in c for c in _descendants(proc.pid).values())
        assert runstate.read_status(redis_client, "lifecycle-run").status == runstate.RUNNING
        proc.kill()
        proc.wait(60)
        _wait(lambda: not any(_alive(pid) for pid in watchdogs), 120, "the watchdog to exit")
        status = runstate.read_status(redis_client, "lifecycle-run")
        assert (status.status, status.reason) == ("died", "vanished without a clean close")
        assert status.step is not None and status.step >= MARK_AT
        assert redis_client.hexists(keys.meta("lifecycle-run"), "ended:0")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
