"""Sharded runs (issue #10): one run's ranks drained as shards plus a cross-rank stage give the findings of the
unsharded drain; exactly once across a killed worker; old runs still drain; any worker takes over the sweep when the
sweeping worker dies (issue #14 item 4). Real redis-server; real worker processes where the behaviour is theirs."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from stability import keys
from stability.detectors.engine import DiagnoserConfig
from stability.embedded import RedisServer
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
HOLD = DiagnoserConfig(verdict_wait_s=600.0)
"""Held findings wait for the cross-rank verdict however slow the machine (the default waits 1 s, then alerts
provisionally: see the provisional test)."""


def record(run: str, rank: int, step: int) -> StepRecord:
    loss = 3.0 - 0.01 * step + 0.002 * math.sin(rank + step)
    if (rank, step) == (NAN_RANK, NAN_STEP):
        loss = math.nan
    grad = 1.0 + 0.05 * math.sin(step / 3)
    if rank == FAULTY and step >= FAULT_STEP:
        grad *= 2.5
    return StepRecord(run_id=run, step=step, rank=rank, wall_time=1e9 + step, host=f"node-{rank // 2}",
                      signals={"loss": loss, "grad_norm": grad, "lr": 1e-3})


def write_run(client: Any, run: str, steps: range, *, end: bool = False, active: bool = True) -> None:
    client.sadd(keys.ranks(run), *range(RANKS))
    pipe = client.pipeline(transaction=False)
    for step in steps:
        for rank in range(RANKS):
            pipe.xadd(keys.records(run, rank), {"r": encode(record(run, rank, step))}, id=f"{1_000_000 + step}-{step}")
    pipe.execute()
    if end:
        client.hset(keys.meta(run), mapping={f"ended:{r}": "1" for r in range(RANKS)})
    if active:
        client.sadd(keys.RUNS, run)


def findings(client: Any, run: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"f"]) for _, f in client.xrange(keys.findings(run))]


def alerted(client: Any, run: str) -> set[tuple[int, str, int, str]]:
    return {(f["rank"], f["kind"], f["step"], f["severity"]) for f in findings(client, run)}


def drain_sharded(client: Any, run: str, size: int, order: list[int | str], *, batch: int = 16,
                  config: DiagnoserConfig | None = HOLD) -> int:
    """Drain a sharded run in-process, shards and cross-rank stage in ``order`` each round; return the rounds."""
    sinks = [RedisFindingsSink(client)]
    policy = SnapshotPolicy(every_s=0.0)
    for rounds in range(1, 500):
        for unit in order:
            if unit == "x":
                CrossRankStage(client, run, size, sinks=sinks, snapshot=policy, read_count=3).run()
            else:
                assert isinstance(unit, int)
                ShardDrainer(client, run, unit, size, sinks=sinks, batch=batch, snapshot=policy, config=config).run()
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


def test_the_stage_hands_a_held_shard_over_when_it_decides_the_step(redis_client: Any,
                                                                   fresh_process_state: None) -> None:
    """A shard holding a finding marks the step (``held`` in its summary watermark); the cross-rank stage calls
    ``on_release`` with that shard as soon as it decides the step, and the shard's next drain releases the finding,
    ranked with the verdict, and clears the mark."""
    write_run(redis_client, "rel", range(STEPS))
    redis_client.hset(keys.meta("rel"), "shard_size", "4")
    sinks = [RedisFindingsSink(redis_client)]
    released: list[int] = []
    leased: list[int] = []
    nan_shard = ShardDrainer(redis_client, "rel", 0, 4, sinks=sinks, on_lease=lambda: leased.append(0), config=HOLD)
    before = time.time()
    nan_shard.run()
    held = redis_client.hget(keys.summary_pos("rel", 0), "held")
    assert held is not None and int(held) <= NAN_STEP and leased == [0]
    due = redis_client.zscore(keys.DUE, keys.urgent_member("rel", 0))  # when the sweeper drains it to release
    assert due is not None and before + HOLD.verdict_wait_s <= due <= time.time() + HOLD.verdict_wait_s
    assert "nan" not in {f["kind"] for f in findings(redis_client, "rel")}
    CrossRankStage(redis_client, "rel", 4, sinks=sinks, on_release=released.extend).run()
    assert released == []  # shard 1 has not summarized its ranks: nothing decided yet
    ShardDrainer(redis_client, "rel", 1, 4, sinks=sinks, config=HOLD).run()
    CrossRankStage(redis_client, "rel", 4, sinks=sinks, on_release=released.extend).run()
    assert 0 in released
    nan_shard.run()
    nan = next(f for f in findings(redis_client, "rel") if f["kind"] == "nan")
    assert (nan["rank"], nan["step"]) == (NAN_RANK, NAN_STEP)
    assert [c["cause"] for c in nan["causes"]] == ["numerical_nan", "hardware_fault"]
    assert redis_client.hget(keys.summary_pos("rel", 0), "held") is None


URGENT_PROBE = """
import json, time
from kombu import Connection
from stability import keys
from stability.transport import push_urgent
from stability.worker import tasks
from stability.worker.app import app

client, run = tasks.client(), "hurry"
client.hset(keys.meta(run), "shard_size", "4")
client.sadd(keys.RUNS, run)
client.sadd(keys.ranks(run), *range(16))
normal = tasks.sweep()  # the 4 shards and the cross-rank stage, queued in shard order
with client.pipeline(transaction=False) as pipe:
    push_urgent(pipe, run, 13)  # rank 13 (shard 3) wrote a NaN
    pipe.execute()
client.zadd(keys.DUE, {keys.urgent_member(run, 2): time.time() - 1})  # shard 2 holds a finding now due
client.zadd(keys.DUE, {keys.urgent_member(run, 1): time.time() + 600})  # shard 1's is not due yet
sweeper = tasks.Sweeper(1.0)
sweeper.holding = True
sent = sweeper.serve_urgent(5.0)
with client.pipeline(transaction=False) as pipe:
    push_urgent(pipe, run, 14)  # another NaN in shard 3 before its urgent drain started: no second task
    pipe.execute()
again = sweeper.serve_urgent(5.0)
order = []
with Connection(app.conf.broker_url) as conn:
    queue = conn.SimpleQueue("celery")
    for _ in range(normal + sent):
        message = queue.get(timeout=10)
        order.append([message.headers["task"], message.payload[0], message.payload[1].get("urgent", False)])
        message.ack()
print(json.dumps({"normal": normal, "sent": sent, "again": again, "order": order,
                  "left": [m.decode() for m in client.zrange(keys.DUE, 0, -1)]}))
"""


def test_urgent_drains_are_read_before_the_drains_queued_earlier(redis_server: RedisServer) -> None:
    """A rank that wrote a non-finite record (``keys.URGENT``) and a shard whose held finding is due
    (``keys.DUE``) get their drains queued by the sweeping worker at once, and a real kombu consumer on the real
    Redis broker reads them before the five drains the sweep had queued (priority 0 against the default 6); a
    second NaN of a shard whose urgent drain is still queued sends nothing more; the shard not yet due stays in
    ``keys.DUE``. In a fresh process: the Celery app reads its broker from the
    environment."""
    env = {**os.environ, "STABILITY_REDIS_URL": redis_server.url, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", URGENT_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["normal"], out["sent"], out["again"]) == (5, 2, 0)
    assert out["order"][:2] == [["stability.drain_shard", ["hurry", 2, 4], True],
                                ["stability.drain_shard", ["hurry", 3, 4], True]]
    assert out["order"][2:] == [  # then the sweep's, in their order
        *(["stability.drain_shard", ["hurry", shard, 4], False] for shard in range(4)),
        ["stability.crossrank", ["hurry", 4], False]]
    assert out["left"] == ["hurry\n1"]


def test_a_finding_whose_verdict_is_late_is_alerted_at_once_and_revised_by_the_verdict(
        redis_client: Any, fresh_process_state: None) -> None:
    """With no time to wait for the cross-rank verdict (``verdict_wait_s=0``; by default 1 s, for a 16k-rank step
    the workers read for seconds), a shard alerts its ranks' findings at once, ranked with their own evidence, and
    keeps their steps marked (``held``). Once the cross-rank stage decided the steps, the shard's next drain ranks
    the incidents again with the verdicts: the faulty rank's gradient explosion, first alerted as a warm-up problem,
    is alerted again (``evidence["revised"]``) as ``hardware_fault``, once, through the real findings sink; the NaN
    keeps its first cause (the verdict only adds ``hardware_fault`` behind it, so no second alert)."""
    import dataclasses

    run, now, every = "late", DiagnoserConfig(verdict_wait_s=0.0), SnapshotPolicy(every_s=0.0)
    redis_client.sadd(keys.ranks(run), *range(RANKS))
    for step in range(STEPS):
        for rank in range(RANKS):
            rec = record(run, rank, step)
            if rank == FAULTY and step >= FAULT_STEP:  # 50x the others' norm: the rank's own detector fires too
                rec = dataclasses.replace(rec, signals={**rec.signals, "grad_norm": rec.signals["grad_norm"] * 20})
            redis_client.xadd(keys.records(run, rank), {"r": encode(rec)}, id=f"{1_000_000 + step}-{step}")
    redis_client.hset(keys.meta(run), "shard_size", "4")
    sinks = [RedisFindingsSink(redis_client)]
    for shard in (0, 1):
        ShardDrainer(redis_client, run, shard, 4, sinks=sinks, config=now, snapshot=every).run()
    first = {f["kind"]: f for f in findings(redis_client, run)}
    assert set(first) == {"nan", "grad_explosion"}  # alerted before any verdict exists
    explosion = first["grad_explosion"]
    assert explosion["rank"] == FAULTY and FAULT_STEP <= explosion["step"] <= FAULT_STEP + 2
    assert "hardware_fault" not in {c["cause"] for c in explosion["causes"]}
    assert [c["cause"] for c in first["nan"]["causes"]] == ["numerical_nan"]
    marks = [redis_client.hget(keys.summary_pos(run, s), "held") for s in (0, 1)]
    assert marks == [str(NAN_STEP).encode(), str(explosion["step"]).encode()]
    drain._CONTEXTS.clear()  # the next drains start from the shards' snapshots (provisional steps included)
    CrossRankStage(redis_client, run, 4, sinks=sinks).run()
    for _ in range(2):  # the second pass re-delivers nothing new: the revision is in the stream once
        for shard in (0, 1):
            ShardDrainer(redis_client, run, shard, 4, sinks=sinks, config=now, snapshot=every).run()
    revisions = [f for f in findings(redis_client, run) if f["evidence"].get("revised")]
    assert [(f["rank"], f["kind"], f["step"]) for f in revisions] == [(FAULTY, "grad_explosion", explosion["step"])]
    assert revisions[0]["causes"][0]["cause"] == "hardware_fault"
    assert [redis_client.hget(keys.summary_pos(run, s), "held") for s in (0, 1)] == [None, None]


def test_the_shards_timed_commits_are_spread_over_the_period() -> None:
    """All shards of a job start together; with the same commit clock their timed commits (put off up to 120 s)
    fell on the same step, eight ~0.3 s commits back to back per worker, and the next NaN alert waited for them.
    A shard's first drain starts its clock ``commit_phase`` earlier: any number of shards spread evenly."""
    from stability.worker.shards import commit_phase

    for count in (2, 16, 64):
        phases = sorted(commit_phase(shard, 120.0) for shard in range(count))
        assert all(0.0 <= p < 120.0 for p in phases)
        gaps = [b - a for a, b in itertools.pairwise([*phases, phases[0] + 120.0])]
        assert min(gaps) >= 120.0 / count / 4 and max(gaps) <= 120.0 / count * 4  # none together, no long hole


def test_cross_rank_stage_killed_before_its_commit_repeats_nothing(redis_client: Any,
                                                                  fresh_process_state: None) -> None:
    """The stage fed summaries and published verdicts but never committed (its process died): the next stage
    re-reads the same summaries from its snapshot; the findings are those of the unsharded drain, each once."""
    write_run(redis_client, "xcrash", range(STEPS))
    redis_client.hset(keys.meta("xcrash"), "shard_size", "4")
    sinks = [RedisFindingsSink(redis_client)]
    for shard in (0, 1):
        ShardDrainer(redis_client, "xcrash", shard, 4, sinks=sinks, batch=500).run()
    slow = SnapshotPolicy(every_s=3600, every_records=10**6)
    dying = CrossRankStage(redis_client, "xcrash", 4, sinks=sinks, snapshot=slow, lease_ms=300)
    assert dying.run().processed == RANKS * STEPS
    assert redis_client.get(keys.shard_state("xcrash", "x")) is None  # never committed
    assert (FAULTY, "rank_disagreement", FAULT_STEP, "error") in alerted(redis_client, "xcrash")
    crossrank_stage._STATES.clear()  # the process is gone
    time.sleep(0.35)  # its lease expires
    redis_client.hset(keys.meta("xcrash"), mapping={f"ended:{r}": "1" for r in range(RANKS)})
    drain_sharded(redis_client, "xcrash", 4, ["x", 0, 1])
    assert alerted(redis_client, "xcrash") == expected_alerts("xcrash")
    seen = Counter((f["rank"], f["kind"], f["step"]) for f in findings(redis_client, "xcrash"))
    assert max(seen.values()) == 1


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    """The 3-node Redis Cluster of tests/test_cluster.py."""
    import test_cluster

    binary = test_cluster._binary()
    if binary is None:
        pytest.skip("no system redis-server (7.x) to run cluster nodes")
    nodes = test_cluster.Cluster(tmp_path / "cluster", binary)
    try:
        yield nodes.start()
    finally:
        nodes.stop()


def test_sharded_drain_over_a_three_node_cluster(cluster: Any, fresh_process_state: None) -> None:
    """Every key of a sharded run (shards, summaries, watermarks, verdicts, cross-rank stage) is in the run's slot:
    the shard and cross-rank transactions and scripts run on a Redis Cluster, with the unsharded drain's findings."""
    from stability.redis_url import connect

    client = connect(cluster.url, socket_timeout=5)
    write_run(client, "clustered", range(STEPS), end=True)
    client.hset(keys.meta("clustered"), "shard_size", "4")
    drain_sharded(client, "clustered", 4, [1, "x", 0])
    assert alerted(client, "clustered") == expected_alerts("clustered")
    client.close()


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


# ------------------------------------------------------------------------------------------ real worker processes
@pytest.fixture
def workers(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL=redis_server.url, STABILITY_SWEEP_S="0.2", STABILITY_LEASE_MS="1500",
               STABILITY_BATCH="10", STABILITY_DRAIN_S="2", STABILITY_SHARD_SIZE="2", WANDB_MODE="disabled",
               STABILITY_SNAPSHOT_S="10",  # processed entries stay pending: the kill lands before their ack
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def start(name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "stability.worker", "-n", f"{name}@%h"], cwd=tmp_path,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_for(what: str, check: Callable[[], Any], timeout: float, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    pytest.fail(f"timed out waiting for {what}\n{tails}")


def expected_alerts(run: str) -> set[tuple[int, str, int, str]]:
    from stability.detectors.engine import RunDiagnoser

    diag = RunDiagnoser()
    out = [f for step in range(STEPS) for rank in range(RANKS) for f in diag.update(record(run, rank, step))]
    out += diag.finish()
    return {(f.rank, f.kind, f.step, f.severity.value) for f in out}


def test_two_workers_drain_a_sharded_run_and_survive_the_sweeping_worker_dying(
    redis_client: Any, workers: Callable[[str], subprocess.Popen[bytes]], tmp_path: Path, fresh_process_state: None
) -> None:
    """8 ranks in 4 shards drained by 2 real workers; the worker holding the sweep lease is killed (process group)
    while entries are processed but not acked; the other takes over the sweep, finishes the sharded run with the
    unsharded drain's findings, every record archived once, and drains an old unsharded run added afterwards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir = tmp_path / "big"
    run_dir.mkdir()
    redis_client.hset(keys.meta("big"), mapping={"run_dir": str(run_dir), "started": str(time.time())})
    write_run(redis_client, "big", range(STEPS // 2))
    procs = {name: workers(name) for name in ("a", "b")}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    holder = wait_for("a worker to take the sweep lease", lambda: next(
        (n for n in procs if b"took the sweep lease" in (tmp_path / f"{n}.log").read_bytes()), None), 120, logs)
    wait_for("the run to be sharded", lambda: redis_client.hget(keys.meta("big"), "shard_size") == b"2", 60, logs)

    def pending() -> int:
        try:
            return sum(redis_client.xpending(keys.records("big", r), keys.GROUP)["pending"] for r in range(RANKS))
        except redis.ResponseError:  # no consumer group yet
            return 0

    wait_for("entries processed, not acked", lambda: pending() > 0, 60, logs)
    os.killpg(procs[holder].pid, signal.SIGKILL)  # the worker and everything it started: a machine going down
    procs[holder].wait(10)
    write_run(redis_client, "big", range(STEPS // 2, STEPS), end=True)
    # an old run: drained by an unsharded worker before the upgrade (it has an unsharded snapshot)
    write_run(redis_client, "old", range(STEPS // 2), active=False)
    Drainer(redis_client, "old", sinks=[RedisFindingsSink(redis_client)], snapshot=SnapshotPolicy(every_s=0)).run()
    assert redis_client.exists(keys.state("old"))
    write_run(redis_client, "old", range(STEPS // 2, STEPS), end=True)

    survivor = next(n for n in procs if n != holder)
    wait_for("both runs drained", lambda: all(redis_client.hexists(keys.meta(r), "drained") for r in ("big", "old")),
             180, logs)
    assert procs[survivor].poll() is None
    assert b"took the sweep lease" in (tmp_path / f"{survivor}.log").read_bytes()
    assert redis_client.hget(keys.meta("old"), "shard_size") == b"0"
    expected = expected_alerts("big")
    assert alerted(redis_client, "big") == expected
    assert (FAULTY, "rank_disagreement", FAULT_STEP, "error") in expected
    assert (NAN_RANK, "nan", NAN_STEP, "error") in alerted(redis_client, "old")
    seen = Counter((f["rank"], f["kind"], f["step"]) for f in findings(redis_client, "big"))
    assert max(seen.values()) == 1
    parts = sorted((run_dir / "archive").glob("*.parquet"))
    table = pa.concat_tables(pq.read_table(p, columns=["rank", "step"]) for p in parts)
    rows = Counter(zip(table.column("rank").to_pylist(), table.column("step").to_pylist(), strict=True))
    assert sorted(rows) == [(r, s) for r in range(RANKS) for s in range(STEPS)]
    assert max(rows.values()) == 1, "a record was archived twice"
    assert (run_dir / "report.html").exists()


def test_a_shard_drain_that_caught_up_routes_the_next_trigger_to_its_worker(
    redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard affinity (worker.tasks): the queue of the worker that last caught up with a shard gets its next trigger;
    after a drain that ran out of time (or once the affinity expired) the shared queue does."""
    from stability.worker import tasks

    sent: list[tuple[tuple[Any, ...], str | None]] = []

    class Task:
        def delay(self, *args: Any) -> None:
            sent.append((args, None))

        def apply_async(self, args: tuple[Any, ...], queue: str) -> None:
            sent.append((tuple(args), queue))

    monkeypatch.setattr(tasks, "client", lambda: redis_client)
    monkeypatch.setattr(tasks, "_OWN_QUEUE", ["stability.worker.w9@host"])
    key = keys.shard_affinity("big", 3)

    def trigger() -> None:
        redis_client.delete(keys.shard_trigger("big", 3))
        tasks._trigger(keys.shard_trigger("big", 3), Task(), "big", 3, 16, affinity=key)

    trigger()
    tasks._affine("big", 3, "idle")
    assert 0 < redis_client.pttl(key) <= tasks.AFFINITY_MS
    trigger()
    tasks._affine("big", 3, "busy")  # another worker held the lease: nothing changes
    trigger()
    tasks._affine("big", 3, "timeout")
    trigger()
    tasks._affine("big", 3, "leased")  # a drain took the shard's lease here: triggers sent meanwhile come here too
    trigger()
    assert sent == [(("big", 3, 16), None), (("big", 3, 16), "stability.worker.w9@host"),
                    (("big", 3, 16), "stability.worker.w9@host"), (("big", 3, 16), None),
                    (("big", 3, 16), "stability.worker.w9@host")]
    assert "{big}" in key  # the shard lease's hash slot
