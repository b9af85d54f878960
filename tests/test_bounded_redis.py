"""Bounded Redis against real redis-servers: streams trimmed after archive + ack and never past pending data,
detector snapshots at a cadence with the entries since re-read after a crash (exactly once), a drainer killed in
another process, and the embedded server's append-only file rewritten so it stays bounded."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from stability import keys
from stability.embedded import RedisServer, free_port
from stability.errors import ConfigError
from stability.postmortem import load_archive
from stability.worker import drain as drain_module
from stability.worker.drain import Drainer, SnapshotPolicy, owner_key
from stability.worker.sinks import ArchiveSink, RedisFindingsSink, redis_meta
from tests.test_worker import (
    RUN,
    DieAt,
    Recorder,
    findings_in_stream,
    pending,
    record,
    saved_state,
    snapshot_fields,
    xadd,
)

EVERY = SnapshotPolicy(every_s=0)
NEVER = SnapshotPolicy(every_s=1e9, every_records=10**9)


def wait_for(condition: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def archived_run(client: Any, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    client.hset(keys.meta(RUN), "run_dir", str(run_dir))
    return run_dir


def stream_ids(client: Any, rank: int = 0) -> list[str]:
    return [eid.decode() for eid, _ in client.xrange(keys.records(RUN, rank))]


# -- trimming ---------------------------------------------------------------------------------------------------


def test_streams_are_trimmed_after_archive_and_ack(redis_client: Any, tmp_path: Path) -> None:
    run_dir = archived_run(redis_client, tmp_path)
    for step in range(40):
        for rank in (0, 1):
            xadd(redis_client, record(step, rank))
    result = Drainer(redis_client, RUN, sinks=[ArchiveSink(redis_meta(redis_client))], batch=8,
                     diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 80 and result.committed == 80
    assert pending(redis_client, 0) == pending(redis_client, 1) == 0
    # everything below the last acked entry is gone (the last one is kept as the group's position marker)
    assert stream_ids(redis_client, 0) == [f"{1_000_000 + 39}-39"]
    assert stream_ids(redis_client, 1) == [f"{1_000_000 + 39}-39"]
    assert result.trimmed == 78
    # ... and every record is in the archive
    records = load_archive(run_dir / "archive")
    assert sorted((r.rank, r.step) for r in records) == [(rank, s) for rank in (0, 1) for s in range(40)]


def test_nothing_is_trimmed_without_an_archive(redis_client: Any) -> None:
    for step in range(10):
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[RedisFindingsSink(redis_client)], diagnoser=Recorder,
                     snapshot=EVERY).run()
    assert result.committed == 10 and result.trimmed == 0
    assert len(stream_ids(redis_client)) == 10  # Redis holds the only copy: kept
    for step in range(10, 15):
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder,
                     snapshot=SnapshotPolicy(every_s=0, trim_unarchived=True)).run()
    assert result.trimmed == 14 and len(stream_ids(redis_client)) == 1


def test_trim_stops_at_entries_pending_elsewhere_and_at_a_lagging_group(redis_client: Any, tmp_path: Path) -> None:
    archived_run(redis_client, tmp_path)
    stream = keys.records(RUN, 0)
    for step in range(10):
        xadd(redis_client, record(step))
    # another consumer of our group read 0..3 and has not acked (not idle long enough to be claimed)
    redis_client.xgroup_create(stream, keys.GROUP, id="0")
    redis_client.xreadgroup(keys.GROUP, "other-worker", {stream: ">"}, count=4)
    sink = ArchiveSink(redis_meta(redis_client))
    result = Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY, lease_ms=60_000).run()
    assert result.processed == 6 and result.trimmed == 0
    assert len(stream_ids(redis_client)) == 10  # the oldest pending entry (step 0) bounds the trim

    redis_client.xack(stream, keys.GROUP, *[f"{1_000_000 + s}-{s}" for s in range(4)])
    # a second group (e.g. another consumer of the records) has read only up to step 6
    redis_client.xgroup_create(stream, "lagging", id="0")
    redis_client.xreadgroup("lagging", "c", {stream: ">"}, count=7)
    redis_client.xack(stream, "lagging", *[f"{1_000_000 + s}-{s}" for s in range(7)])
    for step in range(10, 12):
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 2
    assert stream_ids(redis_client)[0] == f"{1_000_000 + 6}-6"  # kept from the lagging group's position on

    # entries processed (and archived) but not yet committed stay pending and in the stream until the commit
    redis_client.xgroup_destroy(stream, "lagging")
    for step in range(12, 20):
        xadd(redis_client, record(step))
    assert Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=NEVER).run().processed == 8
    assert pending(redis_client, 0) == 8
    assert stream_ids(redis_client)[-8:] == [f"{1_000_000 + s}-{s}" for s in range(12, 20)]
    result = Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 0 and result.committed == 8  # caught up; the commit is due: ack, then trim
    assert stream_ids(redis_client) == [f"{1_000_000 + 19}-19"] and pending(redis_client, 0) == 0


# -- snapshot cadence and recovery -------------------------------------------------------------------------------


def test_snapshot_cadence_by_records(redis_client: Any) -> None:
    for step in range(25):
        xadd(redis_client, record(step))
    policy = SnapshotPolicy(every_s=1e9, every_records=10)
    result = Drainer(redis_client, RUN, sinks=[], batch=4, diagnoser=Recorder, snapshot=policy).run()
    assert result.processed == 25
    # commits after 12 and 24 entries (batches of 4; due once >= 10): entry 25 stays pending, not yet snapshotted
    assert result.committed == 24 and pending(redis_client, 0) == 1
    assert saved_state(redis_client)["steps"]["0"] == list(range(24))

    for step in range(25, 28):  # the next drain in this process continues in memory; still below 10
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[], batch=4, diagnoser=Recorder, snapshot=policy).run()
    assert result.processed == 3 and result.committed == 0 and pending(redis_client, 0) == 4
    assert saved_state(redis_client)["steps"]["0"] == list(range(24))



@pytest.mark.parametrize(("rank_records", "max_every_s", "committed"), [(1, 120.0, 32), (5, 120.0, 24), (5, 0.0, 32)])
def test_snapshot_cadence_by_entries_per_moved_rank(redis_client: Any, rank_records: int, max_every_s: float,
                                                     committed: int) -> None:
    """``rank_records``: a commit by ``every_records`` also waits for that many entries per rank that moved (4
    ranks x 5 = 20 here: batches of 8 entries commit at 24, not at 16 and 32), at most ``max_every_s``."""
    for step in range(10):
        for rank in range(4):
            xadd(redis_client, record(step, rank))
    policy = SnapshotPolicy(every_s=1e9, every_records=10, rank_records=rank_records, max_every_s=max_every_s)
    result = Drainer(redis_client, RUN, sinks=[], batch=2, diagnoser=Recorder, snapshot=policy).run()
    assert result.processed == 40 and result.committed == committed
    assert sum(pending(redis_client, rank) for rank in range(4)) == 40 - committed
    with pytest.raises(ConfigError, match="rank_records"):
        SnapshotPolicy(rank_records=0)


@pytest.mark.parametrize("max_share", [1.0, 1e-6])
def test_a_long_commit_puts_the_next_timed_one_off(redis_client: Any, max_share: float,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_share``: after a commit that took c seconds, the next timed commit waits c / max_share (here: any
    commit takes far more than 0.1 us, so 1e-6 puts the next one off by > 0.1 s ... up to max_every_s); 1 is off.
    Entries processed since stay pending (acked by a later commit, re-processed from the snapshot after a crash)."""
    monkeypatch.setattr(drain_module, "_RANK_COMMIT_S", [0.0])  # no commit in this process yet: the first is due
    for step in range(40):
        xadd(redis_client, record(step))
    policy = SnapshotPolicy(every_s=1e-9, every_records=10**9, max_share=max_share, max_every_s=3600)
    result = Drainer(redis_client, RUN, sinks=[], batch=8, diagnoser=Recorder, snapshot=policy).run()
    assert result.processed == 40
    if max_share == 1.0:  # a commit after every batch (its interval has always passed)
        assert result.committed == 40 and pending(redis_client, 0) == 0
    else:  # only the first batch's commit: the rest waits for a commit the share allows
        assert result.committed == 8 and pending(redis_client, 0) == 32
        assert saved_state(redis_client)["steps"]["0"] == list(range(8))
    redis_client.hset(keys.meta(RUN), "ended:0", "1")
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=policy).run()
    assert result.status == "drained" and pending(redis_client, 0) == 0  # the end of the run always commits
    assert saved_state(redis_client)["steps"]["0"] == list(range(40))

def test_a_first_commit_expects_what_commits_cost_in_this_process(redis_client: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A context that never committed expects its first commit to cost what the last commit in this process cost
    per rank (else the 16 shards of a 16,384-rank run all packed their first snapshot in the next step's window),
    still at most ``max_every_s`` later; the end of the run commits regardless."""
    monkeypatch.setattr(drain_module, "_RANK_COMMIT_S", [10.0])  # a commit here just took 10 s per rank
    for step in range(40):
        xadd(redis_client, record(step))
    policy = SnapshotPolicy(every_s=1e-9, every_records=10**9, max_every_s=3600)
    result = Drainer(redis_client, RUN, sinks=[], batch=8, diagnoser=Recorder, snapshot=policy).run()
    assert result.processed == 40 and result.committed == 0 and pending(redis_client, 0) == 40
    redis_client.hset(keys.meta(RUN), "ended:0", "1")
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=policy).run()
    assert result.status == "drained" and pending(redis_client, 0) == 0
    assert drain_module._RANK_COMMIT_S[0] < 10.0  # measured again by that commit


def test_snapshot_cadence_by_time_and_at_finish(redis_client: Any) -> None:
    for step in range(6):
        xadd(redis_client, record(step))
    policy = SnapshotPolicy(every_s=0.3, every_records=10**9)
    Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=policy).run()
    if saved_state(redis_client) is None:  # a fast machine: not yet 0.3 s since the drain started
        assert pending(redis_client, 0) == 6
        time.sleep(0.4)
        result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=policy).run()
        assert result.processed == 0 and result.committed == 6  # caught up, but the interval passed: commit
    assert pending(redis_client, 0) == 0 and saved_state(redis_client)["steps"]["0"] == list(range(6))

    xadd(redis_client, record(6))
    redis_client.hset(keys.meta(RUN), "ended:0", "1")
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=NEVER).run()
    assert result.status == "drained" and result.committed == 1  # the end of the run always commits
    assert saved_state(redis_client) == {"steps": {"0": list(range(7))}, "finished": 1}


def test_crash_between_emit_and_ack_loses_and_repeats_nothing(redis_client: Any, tmp_path: Path) -> None:
    run_dir = archived_run(redis_client, tmp_path)
    for step in range(60):
        for rank in (0, 1):
            loss = 9.0 if (rank, step) in ((0, 5), (1, 22), (0, 47)) else 1.0
            xadd(redis_client, record(step, rank, loss=loss))
    policy = SnapshotPolicy(every_s=1e9, every_records=20)

    def sinks(*extra: Any) -> list[Any]:
        return [RedisFindingsSink(redis_client), ArchiveSink(redis_meta(redis_client)), *extra]

    # batches of 4 per rank (8 entries): commits after 24 and 48 entries; dies in the 8th batch (entries 56..63)
    with pytest.raises(RuntimeError, match="died mid-batch"):
        Drainer(redis_client, RUN, sinks=sinks(DieAt(8)), batch=4, diagnoser=Recorder, snapshot=policy).run()
    assert saved_state(redis_client)["steps"]["0"] == list(range(24))
    assert pending(redis_client, 0) + pending(redis_client, 1) == 64 - 48  # processed since the snapshot, + the batch
    # the next drain reloads the snapshot and re-reads exactly the pending entries before the new ones
    # (Recorder asserts each rank's steps strictly increase: a repeat or a gap in order would fail)
    result = Drainer(redis_client, RUN, sinks=sinks(), batch=4, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 120 - 48
    assert saved_state(redis_client)["steps"] == {"0": list(range(60)), "1": list(range(60))}
    assert pending(redis_client, 0) == pending(redis_client, 1) == 0
    assert sorted((f["rank"], f["step"]) for f in findings_in_stream(redis_client)) == [(0, 5), (0, 47), (1, 22)]
    records = load_archive(run_dir / "archive")
    assert sorted((r.rank, r.step) for r in records) == [(rank, s) for rank in (0, 1) for s in range(60)]


def test_a_context_kept_in_memory_is_dropped_when_another_process_drained_meanwhile(redis_client: Any) -> None:
    for step in range(10):
        xadd(redis_client, record(step))
    assert Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=NEVER).run().processed == 10
    mine = drain_module._CONTEXTS.pop(RUN)  # "another process": this one's memory is not visible to it
    assert redis_client.get(owner_key(RUN)) == mine.token.encode()

    for step in range(10, 15):
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=NEVER).run()
    assert result.processed == 15  # recovered: the 10 pending entries again from the (empty) snapshot, + 5 new
    assert redis_client.get(owner_key(RUN)) != mine.token.encode()
    drain_module._CONTEXTS[RUN] = mine  # back in the first process, whose memory is now stale

    for step in range(15, 18):
        xadd(redis_client, record(step))
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 18  # stale memory dropped, everything pending re-read once, in order
    assert saved_state(redis_client)["steps"]["0"] == list(range(18))


_KILLED_WORKER = textwrap.dedent("""
    import sys, time
    import redis
    from stability.worker.drain import Drainer, SnapshotPolicy
    from stability.worker.sinks import ArchiveSink, RedisFindingsSink, redis_meta

    client = redis.Redis.from_url(sys.argv[1])
    flag = sys.argv[2]

    class Hang:
        emits = 0
        def emit(self, run_id, findings, records):
            self.emits += 1
            if self.emits == 5:  # the 5th batch went to the sinks; die before it is acked
                open(flag, "w").close()
                time.sleep(600)
        def close(self, run_id):
            pass

    sinks = [RedisFindingsSink(client), ArchiveSink(redis_meta(client)), Hang()]
    Drainer(client, sys.argv[3], sinks=sinks, batch=10, lease_ms=1000,
            snapshot=SnapshotPolicy(every_s=1e9, every_records=25)).run()
""")


def test_a_killed_worker_process_loses_and_repeats_nothing(redis_server: RedisServer, redis_client: Any,
                                                            tmp_path: Path) -> None:
    def fill(run_id: str) -> None:
        for step in range(80):
            for rank in (0, 1):
                bad = (rank, step) in ((0, 9), (1, 33), (0, 61))
                rec = record(step, rank, run_id=run_id, loss=math.nan if bad else 2.0)
                xadd(redis_client, rec, run_id=run_id)

    fill("clean")
    Drainer(redis_client, "clean", sinks=[RedisFindingsSink(redis_client)], batch=10, snapshot=EVERY).run()

    run_dir = tmp_path / "crashy-run"
    run_dir.mkdir()
    redis_client.hset(keys.meta("crashy"), "run_dir", str(run_dir))
    fill("crashy")
    flag = tmp_path / "emitted"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, redis_server.url, str(flag), "crashy"], env=env)
    try:
        wait_for(lambda: flag.exists() or proc.poll() is not None, what="the worker's 5th batch")
        assert proc.poll() is None, "the worker exited early"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert redis_client.hexists(keys.state("crashy"), "_run")  # committed at 40 entries
    assert int(redis_client.xpending(keys.records("crashy", 0), keys.GROUP)["pending"]) > 0

    wait_for(lambda: not redis_client.exists(keys.lock("crashy")), what="the dead worker's lease to expire")
    archive = ArchiveSink(redis_meta(redis_client))
    result = Drainer(redis_client, "crashy", sinks=[RedisFindingsSink(redis_client), archive], batch=10,
                     snapshot=EVERY, lease_ms=1000).run()
    assert result.status == "idle"
    key = lambda f: (f["rank"], f["kind"], f["step"])  # noqa: E731
    clean, crashy = findings_in_stream(redis_client, "clean"), findings_in_stream(redis_client, "crashy")
    assert any(f["kind"] == "nan" for f in clean)
    assert sorted(map(key, crashy)) == sorted(map(key, clean))
    assert len(set(map(key, crashy))) == len(crashy)
    assert snapshot_fields(redis_client, "crashy") == snapshot_fields(redis_client, "clean")  # byte for byte
    records = load_archive(run_dir / "archive")
    assert sorted((r.rank, r.step) for r in records) == [(rank, s) for rank in (0, 1) for s in range(80)]
    assert len(redis_client.xrange(keys.records("crashy", 0))) == 1  # archived, acked, trimmed


# -- the embedded server's append-only file ------------------------------------------------------------------------


def test_embedded_config_rewrites_the_append_only_file(tmp_path: Path) -> None:
    import redis

    with RedisServer(tmp_path / "redis", port=free_port()) as server:  # the embedded default binary and config
        client = redis.Redis.from_url(server.url)
        config = client.config_get("*aof*")
        assert config["auto-aof-rewrite-percentage"] == "100"
        assert config["aof-use-rdb-preamble"] == "yes"
        assert int(config["auto-aof-rewrite-min-size"]) == 16 * 1024 * 1024
        client.config_set("auto-aof-rewrite-min-size", 1024 * 1024)  # reach the threshold quickly in a test

        def aof_bytes() -> int:
            files = [server.directory / "appendonly.aof", *(server.directory / "appendonlydir").glob("*")]
            return sum(f.stat().st_size for f in files if f.is_file())

        value, written, last = os.urandom(100_000), 0, b""
        for i in range(600):  # 60 MB of SETs of one key: the live data stays 100 KB
            last = value + i.to_bytes(8, "little")
            client.set("state", last)
            written += len(last)
        deadline = time.monotonic() + 120
        while True:
            # wait for the growth rule to settle: no rewrite running or scheduled, and the file at most ~2x its size
            # after the last rewrite (which, on redis 6.2, includes the writes that arrived during that rewrite).
            # The server checks the rule in its cron (10 Hz): right after a rewrite ends the file may still be over
            # the bound for a moment, before the next rewrite starts.
            info = client.info("persistence")
            base, current = int(info["aof_base_size"]), int(info["aof_current_size"])
            idle = not int(info["aof_rewrite_in_progress"]) and not int(info["aof_rewrite_scheduled"])
            if idle and 0 < base and current <= 2 * max(base, 1024 * 1024) + len(last):
                break
            assert time.monotonic() < deadline, f"the append-only file did not settle within 120 s: {info}"
            time.sleep(0.2)
        assert aof_bytes() <= current + len(last)  # the files on disk are what the server accounts for
        assert client.get("state") == last
    with RedisServer(tmp_path / "redis", port=free_port()) as server:  # the rewritten file loads
        assert redis.Redis.from_url(server.url).get("state") == last


def test_worker_settings_carry_the_snapshot_policy() -> None:
    from stability.worker.app import WorkerSettings
    from stability.worker.tasks import _snapshot_policy

    assert (WorkerSettings.from_env({}).snapshot_s, WorkerSettings.from_env({}).snapshot_n) == (5.0, 5000)
    settings = WorkerSettings.from_env({"STABILITY_SNAPSHOT_S": "0.5", "STABILITY_SNAPSHOT_N": "200"})
    assert (settings.snapshot_s, settings.snapshot_n) == (0.5, 200)
    with pytest.raises(ConfigError, match="STABILITY_SNAPSHOT_N"):
        WorkerSettings.from_env({"STABILITY_SNAPSHOT_N": "0"})
    with pytest.raises(ConfigError, match="every_records"):
        SnapshotPolicy(every_records=0)
    assert WorkerSettings.from_env({}).snapshot_share == 0.1
    assert WorkerSettings.from_env({}).snapshot_rank_n == _snapshot_policy().rank_records == 20
    assert WorkerSettings.from_env({"STABILITY_SNAPSHOT_RANK_N": "3"}).snapshot_rank_n == 3
    with pytest.raises(ConfigError, match="STABILITY_SNAPSHOT_RANK_N"):
        WorkerSettings.from_env({"STABILITY_SNAPSHOT_RANK_N": "0"})
    assert WorkerSettings.from_env({"STABILITY_SNAPSHOT_SHARE": "1"}).snapshot_share == 1.0
    with pytest.raises(ConfigError, match="STABILITY_SNAPSHOT_SHARE"):
        WorkerSettings.from_env({"STABILITY_SNAPSHOT_SHARE": "0"})
    with pytest.raises(ConfigError, match="max_share"):
        SnapshotPolicy(max_share=1.5)
