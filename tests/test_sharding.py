"""Sharded runs (issue #10): one run's ranks drained as shards plus a cross-rank stage give the findings of the
unsharded drain; exactly once across a killed worker; old runs still drain; any worker takes over the sweep when the
sweeping worker dies (issue #14 item 4). Real redis-server; real worker processes where the behaviour is theirs."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from stability import keys
from stability.records import StepRecord, encode
from stability.worker import crossrank_stage, drain
from stability.worker.crossrank_stage import CrossRankStage
from stability.worker.drain import Drainer, SnapshotPolicy
from stability.worker.shards import ShardDrainer, decide_shard_size
from stability.worker.sinks import RedisFindingsSink

RANKS = 8
STEPS = 80
FAULTY = 5
"""Its post-reduce grad norm leaves the others' from FAULT_STEP on (a bad GPU)."""
FAULT_STEP = 40
NAN_RANK, NAN_STEP = 2, 60


def record(run: str, rank: int, step: int) -> StepRecord:
    loss = 3.0 - 0.01 * step + 0.002 * math.sin(rank + step)
    if (rank, step) == (NAN_RANK, NAN_STEP):
        loss = math.nan
    grad = 1.0 + 0.05 * math.sin(step / 3)
    if rank == FAULTY and step >= FAULT_STEP:
        grad *= 2.5
    return StepRecord(run_id=run, step=step, rank=rank, wall_time=1e9 + step, host=f"node-{rank // 2}",
                      signals={"loss": loss, "grad_norm": grad, "lr": 1e-3})


def write_run(client: Any, run: str, steps: range, *, end: bool = False) -> None:
    client.sadd(keys.ranks(run), *range(RANKS))
    pipe = client.pipeline(transaction=False)
    for step in steps:
        for rank in range(RANKS):
            pipe.xadd(keys.records(run, rank), {"r": encode(record(run, rank, step))}, id=f"{1_000_000 + step}-{step}")
    pipe.execute()
    if end:
        client.hset(keys.meta(run), mapping={f"ended:{r}": "1" for r in range(RANKS)})
    client.sadd(keys.RUNS, run)


def findings(client: Any, run: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"f"]) for _, f in client.xrange(keys.findings(run))]


def alerted(client: Any, run: str) -> set[tuple[int, str, int, str]]:
    return {(f["rank"], f["kind"], f["step"], f["severity"]) for f in findings(client, run)}


def drain_sharded(client: Any, run: str, size: int, order: list[int | str], *, batch: int = 16) -> int:
    """Drain a sharded run in-process, shards and cross-rank stage in ``order`` each round; return the rounds."""
    sinks = [RedisFindingsSink(client)]
    policy = SnapshotPolicy(every_s=0.0)
    for rounds in range(1, 500):
        for unit in order:
            if unit == "x":
                CrossRankStage(client, run, size, sinks=sinks, snapshot=policy, read_count=3).run()
            else:
                assert isinstance(unit, int)
                ShardDrainer(client, run, unit, size, sinks=sinks, batch=batch, snapshot=policy).run()
        if client.hexists(keys.meta(run), "drained"):
            return rounds
    raise AssertionError("the sharded run was not drained")


@pytest.fixture
def fresh_process_state() -> Iterator[None]:
    """Each drain starts from Redis, as a new worker would (no in-memory continuation from another test)."""
    drain._CONTEXTS.clear()
    crossrank_stage._STATES.clear()
    yield
    drain._CONTEXTS.clear()
    crossrank_stage._STATES.clear()


def test_sharded_drain_finds_what_the_unsharded_drain_finds(redis_client: Any, fresh_process_state: None) -> None:
    write_run(redis_client, "flat", range(STEPS), end=True)
    while Drainer(redis_client, "flat", sinks=[RedisFindingsSink(redis_client)], batch=16).run().status != "drained":
        pass
    expected = alerted(redis_client, "flat")
    assert (FAULTY, "rank_disagreement", FAULT_STEP, "error") in expected
    assert (NAN_RANK, "nan", NAN_STEP, "error") in expected

    write_run(redis_client, "sharded", range(STEPS), end=True)
    redis_client.hset(keys.meta("sharded"), "shard_size", "2")  # 4 shards of 2 ranks
    # uneven progress: shard 3 and the cross-rank stage first, shard 0 last; small batches
    drain_sharded(redis_client, "sharded", 2, [3, "x", 1, 2, "x", 0])
    assert alerted(redis_client, "sharded") == expected
    by_kind = {(f["rank"], f["kind"]): f for f in findings(redis_client, "sharded")}
    disagreement = by_kind[(FAULTY, "rank_disagreement")]
    assert f"rank {FAULTY} (host node-{FAULTY // 2})" in disagreement["message"]
    assert disagreement["host"] == f"node-{FAULTY // 2}"
    assert disagreement["causes"][0]["cause"] == "hardware_fault"
    nan_flat = next(f for f in findings(redis_client, "flat") if f["kind"] == "nan")
    assert by_kind[(NAN_RANK, "nan")]["causes"][0]["cause"] == nan_flat["causes"][0]["cause"]
    # everything acked, summaries consumed and trimmed, every shard done
    for rank in range(RANKS):
        assert redis_client.xpending(keys.records("sharded", rank), keys.GROUP)["pending"] == 0
    meta = redis_client.hgetall(keys.meta("sharded"))
    assert {k for k in meta if k.startswith(b"shard_done:")} == {b"shard_done:%d" % s for s in range(4)}
    assert not redis_client.sismember(keys.RUNS, "sharded")
    assert sum(redis_client.xlen(keys.summaries("sharded", s)) for s in range(4)) <= 4


def test_held_finding_carries_the_cross_rank_verdict(redis_client: Any, fresh_process_state: None) -> None:
    """The NaN rank's own finding waits for the cross-rank stage and is ranked with its verdict (the NaN on one rank
    only also names hardware_fault, as in the unsharded drain), though its shard is drained far ahead of the other."""
    write_run(redis_client, "held", range(STEPS), end=True)
    redis_client.hset(keys.meta("held"), "shard_size", "4")
    drain_sharded(redis_client, "held", 4, [0, 0, 0, "x", 1, "x"], batch=500)
    nan = next(f for f in findings(redis_client, "held") if f["kind"] == "nan")
    assert (nan["rank"], nan["step"]) == (NAN_RANK, NAN_STEP)
    assert [c["cause"] for c in nan["causes"]] == ["numerical_nan", "hardware_fault"]


def test_shard_size_is_fixed_once_and_never_for_a_run_already_drained(redis_client: Any) -> None:
    write_run(redis_client, "new", range(2))
    assert decide_shard_size(redis_client, "new", 0) == 0  # a worker without sharding writes nothing
    assert not redis_client.hexists(keys.meta("new"), "shard_size")
    assert decide_shard_size(redis_client, "new", 4) == 4
    assert decide_shard_size(redis_client, "new", 2) == 4  # never changed for the run
    write_run(redis_client, "old", range(2))
    redis_client.set(keys.state("old"), b"x")  # an unsharded drain committed a snapshot
    assert decide_shard_size(redis_client, "old", 4) == 0
    # the unsharded drainer refuses a sharded run (a drain task queued before the decision)
    status = Drainer(redis_client, "new", sinks=[RedisFindingsSink(redis_client)]).run().status
    assert status == "sharded"


def test_exactly_once_when_a_shard_drain_dies_mid_run(redis_client: Any, fresh_process_state: None) -> None:
    """A shard drain that processed and summarized entries but never committed (its process died): the next drain
    re-processes them from the snapshot and writes no summary twice."""
    write_run(redis_client, "crash", range(STEPS // 2))
    redis_client.hset(keys.meta("crash"), "shard_size", "4")
    sinks = [RedisFindingsSink(redis_client)]
    slow = SnapshotPolicy(every_s=3600, every_records=10**6)
    dying = ShardDrainer(redis_client, "crash", 1, 4, sinks=sinks, batch=8, snapshot=slow, lease_ms=200)
    assert dying.run().processed == 4 * STEPS // 2
    assert redis_client.xpending(keys.records("crash", 4), keys.GROUP)["pending"] == STEPS // 2  # never acked
    drain._CONTEXTS.clear()  # the process is gone
    time.sleep(0.25)  # its lease expires
    write_run(redis_client, "crash", range(STEPS // 2, STEPS), end=True)
    for _ in range(3):  # both shards to their end (they then wait for the cross-rank stage)
        for shard in (0, 1):
            ShardDrainer(redis_client, "crash", shard, 4, sinks=sinks, batch=8).run()
    summarized = Counter()
    for shard in (0, 1):
        for _, fields in redis_client.xrange(keys.summaries("crash", shard)):
            summarized.update((item[0], item[1]) for item in msgpack.unpackb(fields[b"s"]))
    assert sorted(summarized) == [(r, s) for r in range(RANKS) for s in range(STEPS)]
    assert max(summarized.values()) == 1, "a re-processed entry was summarized twice"
    drain_sharded(redis_client, "crash", 4, [0, 1, "x"])
    assert (FAULTY, "rank_disagreement", FAULT_STEP, "error") in alerted(redis_client, "crash")
    assert (NAN_RANK, "nan", NAN_STEP, "error") in alerted(redis_client, "crash")
    keys_seen = Counter((f["rank"], f["kind"], f["step"]) for f in findings(redis_client, "crash"))
    assert max(keys_seen.values()) == 1
