"""Incremental detector snapshots (issue #10): one hash field per rank, written only for the ranks that changed
since the last commit, each loaded on first use after a restart; the same findings and state as a drain that
never stopped."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.errors import ConfigError
from stability.records import StepRecord
from stability.worker import drain as drain_module
from stability.worker.drain import AT_FIELD, RUN_FIELD, Drainer, SnapshotPolicy
from tests.test_worker import EVERY, RUN, record, snapshot_fields, xadd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _records import RecordFactory


def rich_records(ranks: int, steps: int, modules: int = 3) -> list[list[StepRecord]]:
    """Per step, one load-generator record per rank (per-module signals, NaNs and per-layer jumps injected)."""
    factories = [RecordFactory(run_id=RUN, rank=r, modules=modules, seed=r) for r in range(ranks)]
    out = []
    for step in range(steps):
        inject = {(1, 40): "nan", (2, 70): "layer_grad", (0, 90): "spike", (3, 100): "nan"}
        out.append([f.record(step, 1e9 + step, inject.get((f.rank, step))) for f in factories])
    return out


def key(found: list[Finding]) -> list[tuple[Any, ...]]:
    return [(f.kind, f.rank, f.step, f.severity.value, f.message, tuple(c.cause for c in f.causes)) for f in found]


def comparable(diag: RunDiagnoser) -> tuple[bytes, dict[int, bytes]]:
    """Every rank's part and the run part (without the wall-clock times findings were held at), packed."""
    run, parts = diag.state_parts(changed_only=False)
    run.pop("held_since")
    return msgpack.packb(run), {r: msgpack.packb(p) for r, p in parts.items()}


def test_lazily_loaded_parts_continue_exactly_as_the_full_state() -> None:
    steps = rich_records(ranks=4, steps=120)
    whole = RunDiagnoser()
    found_whole: list[Finding] = []
    for row in steps[:60]:
        for rec in row:
            found_whole += whole.update(rec)
    run, parts = whole.state_parts()
    assert sorted(parts) == [0, 1, 2, 3] and run["all"] == [0, 1, 2, 3]
    saved = {r: msgpack.unpackb(msgpack.packb(p), strict_map_key=False) for r, p in parts.items()}
    assert whole.state_parts()[1] == {}  # nothing changed since

    fetched: list[int] = []

    def fetch(rank: int) -> dict[str, Any] | None:
        fetched.append(rank)
        return saved.get(rank)

    lazy = RunDiagnoser(verdicts=None)
    lazy.load_state_parts(msgpack.unpackb(msgpack.packb(run), strict_map_key=False), fetch)
    found_lazy: list[Finding] = []
    for row in steps[60:]:
        for rec in row:
            found_whole += (w := whole.update(rec))
            found_lazy += (z := lazy.update(rec))
            assert key(w) == key(z)
    found_whole += whole.finish()
    found_lazy += lazy.finish()
    assert key(found_lazy) == key(found_whole[len(found_whole) - len(found_lazy):])
    assert {f.kind for f in found_lazy} >= {"nan"}
    assert sorted(fetched) == [0, 1, 2, 3] and len(fetched) == 4  # each rank read once
    assert comparable(lazy) == comparable(whole)
    assert [i.headline.kind for i in sorted(lazy.incidents, key=lambda i: i.rank)] == \
           [i.headline.kind for i in sorted(whole.incidents, key=lambda i: i.rank)]


def test_only_changed_ranks_are_packed_and_unused_ranks_are_not_loaded() -> None:
    diag = RunDiagnoser()
    for step in range(30):
        for rank in range(3):
            diag.update(record(step, rank))
    run, parts = diag.state_parts()
    assert sorted(parts) == [0, 1, 2]
    diag.update(record(30, 1))
    assert sorted(diag.state_parts()[1]) == [1]

    loaded = RunDiagnoser(verdicts=_Decided())
    loaded.load_state_parts(run, lambda rank: parts[rank])
    loaded.update(record(30, 2))
    assert sorted(loaded._ranks) == [2]  # the other ranks stay in Redis until needed
    assert sorted(loaded.state_parts()[1]) == [2]
    assert loaded.state_parts()[0]["all"] == [0, 1, 2]
    assert len(loaded.incidents) == 0 and sorted(loaded._ranks) == [0, 1, 2]  # visiting every rank loads them


class _Decided:
    def decided(self) -> int:
        return 10**9

    def suspect(self, rank: int, step: int) -> Finding | None:
        return None


class Spy(RunDiagnoser):
    """RunDiagnoser that notes the ranks of each snapshot."""

    packed: ClassVar[list[list[int]]] = []

    def state_parts(self, *, changed_only: bool = True) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        run, parts = super().state_parts(changed_only=changed_only)
        Spy.packed.append(sorted(parts))
        return run, parts


@pytest.fixture(autouse=True)
def _no_kept_contexts() -> Any:
    drain_module._CONTEXTS.clear()
    Spy.packed = []
    yield
    drain_module._CONTEXTS.clear()


def fields(client: Any, run_id: str = RUN) -> set[str]:
    return {k.decode() for k in client.hkeys(keys.state(run_id))} - {AT_FIELD}


def test_a_drain_writes_the_changed_ranks_and_a_restart_reads_ranks_on_use(redis_client: Any) -> None:
    for step in range(20):
        for rank in range(3):
            xadd(redis_client, record(step, rank))
    Drainer(redis_client, RUN, sinks=[], diagnoser=Spy, snapshot=EVERY).run()
    assert fields(redis_client) == {RUN_FIELD, "r0", "r1", "r2"}
    first = redis_client.hgetall(keys.state(RUN))

    for step in range(20, 25):
        xadd(redis_client, record(step, 1))
    Spy.packed = []
    Drainer(redis_client, RUN, sinks=[], diagnoser=Spy, snapshot=EVERY).run()  # continues in memory
    assert Spy.packed and set().union(*map(set, Spy.packed)) == {1}
    now = redis_client.hgetall(keys.state(RUN))
    assert now[b"r0"] == first[b"r0"] and now[b"r2"] == first[b"r2"] and now[b"r1"] != first[b"r1"]

    drain_module._CONTEXTS.clear()  # a restarted worker
    seen: list[Spy] = []

    def factory() -> Spy:
        seen.append(Spy())
        return seen[-1]

    for step in range(25, 30):
        xadd(redis_client, record(step, 2))
    Spy.packed = []
    assert Drainer(redis_client, RUN, sinks=[], diagnoser=factory, snapshot=EVERY).run().processed == 5
    assert sorted(seen[-1]._ranks) == [2] and set().union(*map(set, Spy.packed)) == {2}

    # a held finding of an unsharded run waits for every rank's step, which loads every rank
    drain_module._CONTEXTS.clear()
    xadd(redis_client, record(30, 2, loss=math.nan))
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=factory, snapshot=EVERY).run()
    assert result.findings == [] and sorted(seen[-1]._ranks) == [0, 1, 2]  # held: ranks 0, 1 are behind

    # the same records drained in one go, without restarts: the same snapshot, field for field
    for step in range(31):
        for rank in range(3):
            if step < 20 or (rank == 1 and step < 25) or (rank == 2 and step >= 25):
                rec = record(step, rank, run_id="straight", loss=math.nan) if (rank, step) == (2, 30) else \
                    record(step, rank, run_id="straight")
                xadd(redis_client, rec, run_id="straight")
    Drainer(redis_client, "straight", sinks=[], snapshot=EVERY).run()
    straight = snapshot_fields(redis_client, "straight")
    mine = snapshot_fields(redis_client, RUN)
    assert {k for k in straight} == {k for k in mine}
    for name in (b"r0", b"r1", b"r2"):
        assert straight[name] == mine[name], name


def test_a_snapshot_of_the_former_one_string_format_is_read_and_replaced(redis_client: Any) -> None:
    for step in range(20):
        for rank in range(2):
            xadd(redis_client, record(step, rank))
    old = RunDiagnoser()
    for step in range(10):
        for rank in range(2):
            old.update(record(step, rank))
    redis_client.set(keys.state(RUN), msgpack.packb(old.state_dict(), use_bin_type=True))
    group_at = f"{1_000_000 + 9}-9"  # the old drain had read and acked steps 0-9
    for rank in range(2):
        redis_client.xgroup_create(keys.records(RUN, rank), keys.GROUP, id=group_at)
    Drainer(redis_client, RUN, sinks=[], snapshot=EVERY).run()
    assert redis_client.type(keys.state(RUN)) == b"hash" and fields(redis_client) == {RUN_FIELD, "r0", "r1"}

    for step in range(20):
        for rank in range(2):
            xadd(redis_client, record(step, rank, run_id="fresh"), run_id="fresh")
    Drainer(redis_client, "fresh", sinks=[], snapshot=EVERY).run()
    assert snapshot_fields(redis_client, "fresh") == snapshot_fields(redis_client, RUN)


def pending_total(client: Any, ranks: int = 2, run_id: str = RUN) -> int:
    return sum(int(client.xpending(keys.records(run_id, r), keys.GROUP)["pending"]) for r in range(ranks))


def test_the_commit_cadence_survives_a_drain_moving_to_another_process(redis_client: Any) -> None:
    hourly = SnapshotPolicy(every_s=3600)
    for step in range(10):
        for rank in range(2):
            xadd(redis_client, record(step, rank))
    Drainer(redis_client, RUN, sinks=[], snapshot=EVERY).run()
    assert pending_total(redis_client) == 0 and redis_client.hexists(keys.state(RUN), AT_FIELD)

    for step in range(10, 20):
        xadd(redis_client, record(step, 0))
    Drainer(redis_client, RUN, sinks=[], snapshot=hourly).run()
    assert pending_total(redis_client) == 10  # not due: kept pending

    # the run moves to another process, whose clock would start afresh: the snapshot says it is 2 h old
    redis_client.hset(keys.state(RUN), AT_FIELD, repr(time.time() - 7200))
    drain_module._CONTEXTS.clear()
    xadd(redis_client, record(20, 0))
    result = Drainer(redis_client, RUN, sinks=[], snapshot=hourly).run()
    assert result.processed == 11 and result.committed == 10  # the re-read entries, at once (step 20 came after)


def test_a_caught_up_drain_commits_after_idle_s(redis_client: Any) -> None:
    for step in range(10):
        xadd(redis_client, record(step, 0))
    Drainer(redis_client, RUN, sinks=[], snapshot=SnapshotPolicy(every_s=3600)).run()
    assert pending_total(redis_client, 1) == 10
    xadd(redis_client, record(10, 0))
    result = Drainer(redis_client, RUN, sinks=[], snapshot=SnapshotPolicy(every_s=3600, idle_s=0)).run()
    assert result.committed == 11 and pending_total(redis_client, 1) == 0
    with pytest.raises(ConfigError, match="idle_s"):
        SnapshotPolicy(idle_s=-1)


def test_worker_settings_carry_the_idle_commit() -> None:
    from stability.worker.app import WorkerSettings

    assert WorkerSettings.from_env({}).snapshot_idle_s is None  # as STABILITY_SNAPSHOT_S
    assert WorkerSettings.from_env({"STABILITY_SNAPSHOT_IDLE_S": "0.25"}).snapshot_idle_s == 0.25
    with pytest.raises(ConfigError, match="STABILITY_SNAPSHOT_IDLE_S"):
        WorkerSettings.from_env({"STABILITY_SNAPSHOT_IDLE_S": "-1"})
