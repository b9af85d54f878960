"""The worker sweep's check for runs whose ranks ALL went quiet while the run is still running (issue 12): one
``hang`` finding per silence episode, through the findings path, none for a finished run or one still writing.

Real redis-server (private instance), real record streams with ``<wall ms>-<step>`` ids written at a regular pace in
the past, the real runstate and findings sink; the check is called with an explicit wall time (no sleeping).
"""

from __future__ import annotations

import json
import time

import pytest

from stability import keys, runstate
from stability.errors import ConfigError
from stability.records import StepRecord, encode
from stability.testing import saving_checkpoint
from stability.worker.quiet import QuietCheck, QuietConfig
from stability.worker.sinks import RedisFindingsSink

NOW = float(int(time.time()))


def _write(client, run_id: str, rank: int, steps: range, start: float, every: float, **extra: float) -> None:
    """Records of ``rank`` at a regular pace: step s written at ``start + s * every`` (wall seconds)."""
    for step in steps:
        wall = start + step * every
        record = StepRecord(run_id=run_id, step=step, rank=rank, host=f"h{rank}", wall_time=wall,
                            signals={"loss": 1.0, "step_time": every, **extra})
        client.xadd(keys.records(run_id, rank), {"r": encode(record)}, id=f"{int(wall * 1000)}-{step}")
    client.sadd(keys.ranks(run_id), rank)


def _hangs(client, run_id: str) -> list[dict]:
    found = [json.loads(fields[b"f"]) for _id, fields in client.xrange(keys.findings(run_id))]
    assert all(f["kind"] == "hang" for f in found)
    return found


@pytest.fixture
def check() -> QuietCheck:
    return QuietCheck(QuietConfig(floor_s=5.0, every_s=0.0))


def test_all_ranks_silent_while_running_is_one_hang(redis_client, check: QuietCheck) -> None:
    sinks = [RedisFindingsSink(redis_client)]
    runs = {"quiet": "running", "done": "finished", "busy": "running"}
    for run_id, status in runs.items():
        _write(redis_client, run_id, 0, range(40), NOW - 100, 1.0)  # rank 0: steps 0-39, last at NOW - 61
        _write(redis_client, run_id, 1, range(31), NOW - 100, 1.0)  # rank 1 stopped first, after step 30
        runstate.mark(redis_client, run_id, runstate.RUNNING)
        if status == "finished":
            runstate.mark(redis_client, run_id, runstate.FINISHED)
    _write(redis_client, "busy", 0, range(40, 100), NOW - 100, 1.0)  # keeps writing: last at NOW - 1
    redis_client.xtrim(keys.records("quiet", 0), maxlen=1)  # a drained stream keeps its last entry only

    assert check.sweep(redis_client, list(runs), sinks, now=NOW - 61 + 4) == 0  # within the floor
    assert check.sweep(redis_client, list(runs), sinks, now=NOW) == 1
    (hang,) = _hangs(redis_client, "quiet")
    assert (hang["rank"], hang["host"], hang["step"], hang["severity"]) == (1, "h1", 31, "error")
    assert hang["evidence"]["last_step"] == 30 and hang["evidence"]["silent_s"] == pytest.approx(61.0, abs=0.01)
    assert hang["evidence"]["usual_s"] == pytest.approx(1.0) and hang["evidence"]["ranks"] == 2
    assert "rank 1 on h1 stopped first, after step 30" in hang["message"]
    assert "rank 0 step 39, rank 1 step 30" in hang["message"] and hang["causes"][0]["cause"] == "hang"
    assert _hangs(redis_client, "done") == [] and _hangs(redis_client, "busy") == []

    # the same silence: reported once, however often the sweep runs ("busy" is left out: it would be quiet by then)
    assert check.sweep(redis_client, ["quiet", "done"], sinks, now=NOW + 30) == 0
    assert check.sweep(redis_client, ["quiet", "done"], sinks, now=NOW + 600) == 0
    assert len(_hangs(redis_client, "quiet")) == 1

    # both ranks come back and stop again: a new episode, a new finding
    _write(redis_client, "quiet", 0, range(40, 43), NOW - 100, 1.0)
    _write(redis_client, "quiet", 1, range(31, 42), NOW - 100, 1.0)
    assert check.sweep(redis_client, ["quiet"], sinks, now=NOW + 600) == 1
    assert [(h["rank"], h["step"]) for h in _hangs(redis_client, "quiet")] == [(1, 31), (1, 42)]


def test_the_limit_is_twice_the_usual_step_time_above_the_floor(redis_client, check: QuietCheck) -> None:
    sinks = [RedisFindingsSink(redis_client)]
    _write(redis_client, "slow", 0, range(10), NOW - 100, 10.0)  # 10 s steps; last at NOW - 10
    runstate.mark(redis_client, "slow", runstate.RUNNING)
    assert check.sweep(redis_client, ["slow"], sinks, now=NOW + 9) == 0  # 19 s < 2 x 10 s
    assert check.sweep(redis_client, ["slow"], sinks, now=NOW + 11) == 1
    (hang,) = _hangs(redis_client, "slow")
    assert hang["evidence"]["limit_s"] == pytest.approx(20.0) and hang["step"] == 10


def test_a_stall_the_watchdog_reported_is_not_reported_again(redis_client, check: QuietCheck) -> None:
    _write(redis_client, "dog", 0, range(20), NOW - 100, 1.0)
    _write(redis_client, "dog", 0, range(20, 21), NOW - 100, 1.0, hang_s=12.0)  # the watchdog's record
    runstate.mark(redis_client, "dog", runstate.RUNNING)
    assert check.sweep(redis_client, ["dog"], [RedisFindingsSink(redis_client)], now=NOW) == 0
    assert _hangs(redis_client, "dog") == []


def test_a_paused_job_whose_processes_live_is_no_hang_until_the_busy_limit(tmp_path, redis_server, redis_client,
                                                                            check: QuietCheck) -> None:
    """The training side's real heartbeat: while no step ends for 10 s the watchdog's poll writes ``keys.alive``
    saying what the training thread does (here inside ``torch.save``); the quiet check leaves the run alone up to
    ``busy_s``, then reports the hang with what the heartbeat said. No heartbeat written while steps end."""
    import torch

    from stability.hooks.timing import PAUSE_S, Performance, TimingConfig

    run_id = "ckpt"
    perf = Performance(run_id, tmp_path, redis_server.url, emit=lambda step, signals: None, rank=lambda: 2,
                       config=TimingConfig(watchdog=False))
    cpu = torch.device("cpu")
    try:
        for step in range(5):
            perf.end_step(step, cpu, {})
        assert perf.timing.last_end is not None
        perf._poll(perf.timing.last_end + 1.0)
        assert redis_client.get(keys.alive(run_id)) is None  # steps end: nothing written
        with saving_checkpoint() as saver:
            perf.timing.thread = saver  # the "training thread" is inside torch.save
            perf._poll(perf.timing.last_end + PAUSE_S + 1)
    finally:
        perf.close()
    beat = json.loads(redis_client.get(keys.alive(run_id)))
    assert (beat["rank"], beat["step"]) == (2, 4) and beat["state"].startswith("saving a checkpoint"), beat
    assert 0 < redis_client.pttl(keys.alive(run_id)) <= 3 * PAUSE_S * 1000

    now = time.time()
    _write(redis_client, run_id, 2, range(5), now - 65, 1.0)  # last record 61 s ago: past the 5 s floor
    runstate.mark(redis_client, run_id, runstate.RUNNING)
    sinks = [RedisFindingsSink(redis_client)]
    assert check.sweep(redis_client, [run_id], sinks, now=now) == 0  # the processes live: not a hang yet
    busy = QuietCheck(QuietConfig(floor_s=5.0, every_s=0.0, busy_s=60.0))
    assert busy.sweep(redis_client, [run_id], sinks, now=now + 20) == 1  # 81 s > busy_s: reported after all
    (hang,) = _hangs(redis_client, run_id)
    assert "the processes still live (rank 2: saving a checkpoint" in hang["message"]
    # a heartbeat older than 30 s by its own clock is no sign of life: the floor applies again
    redis_client.set(keys.alive("stale"), json.dumps({"rank": 0, "step": 4, "state": "no step", "t": now - 40}))
    _write(redis_client, "stale", 0, range(5), now - 65, 1.0)
    runstate.mark(redis_client, "stale", runstate.RUNNING)
    assert check.sweep(redis_client, ["stale"], sinks, now=now) == 1


def test_quiet_check_settings() -> None:
    assert QuietConfig.from_env({}).floor_s == 30.0
    assert QuietConfig.from_env({"STABILITY_QUIET_S": "0.5"}) == QuietConfig(floor_s=0.5, every_s=0.125)
    with pytest.raises(ConfigError, match="STABILITY_QUIET_S must be a number"):
        QuietConfig.from_env({"STABILITY_QUIET_S": "soon"})
    with pytest.raises(ConfigError, match="must be >= 0"):
        QuietConfig.from_env({"STABILITY_QUIET_S": "-1"})
    assert QuietConfig.from_env({"STABILITY_QUIET_BUSY_S": "1800"}).busy_s == 1800.0
    with pytest.raises(ConfigError, match="STABILITY_QUIET_BUSY_S must be a number"):
        QuietConfig.from_env({"STABILITY_QUIET_BUSY_S": "long"})
    assert QuietCheck(QuietConfig(floor_s=0.0)).sweep(None, ["r"], []) == 0  # off: touches nothing


def test_the_worker_sweep_runs_the_check(redis_client, monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker.tasks.sweep`` (what the lease-holding Sweeper calls) publishes the hang; the drain triggers are
    replaced (they need a Celery broker; the drain is not what is tested here)."""
    from stability.worker import tasks

    monkeypatch.setenv("STABILITY_QUIET_S", "5")
    monkeypatch.setattr(tasks, "client", lambda: redis_client)
    monkeypatch.setattr(tasks, "_trigger", lambda marker, task, *args: 1)
    tasks.quiet_check.cache_clear()
    try:
        now = time.time()
        _write(redis_client, "live", 0, range(30), now - 100, 1.0)  # last record 71 s ago
        redis_client.sadd(keys.RUNS, "live")
        runstate.mark(redis_client, "live", runstate.RUNNING)
        assert tasks.sweep() == 1  # one drain trigger
        (hang,) = _hangs(redis_client, "live")
        assert (hang["rank"], hang["step"]) == (0, 30) and hang["evidence"]["limit_s"] == 5.0
        assert json.loads(redis_client.get(keys.advice("live")))["kind"] == "hang"  # the advice sink got it too
    finally:
        tasks.quiet_check.cache_clear()
