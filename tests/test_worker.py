"""The Drainer against a real redis-server (conftest fixtures): order, atomic state + ack, malformed entries,
crash and re-processing, the lease, end of run, and the Parquet archive read back with pyarrow."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stability import keys
from stability.detectors.base import Finding, Severity
from stability.postmortem import load_archive
from stability.records import MAX_RECORD_BYTES, StepRecord, encode
from stability.worker.archive import read_tail
from stability.worker.drain import CONSUMER, Drainer, SnapshotPolicy
from stability.worker.sinks import ArchiveSink, ConsoleSink, Entry, RedisFindingsSink, compact, redis_meta

RUN = "run-test"
EVERY = SnapshotPolicy(every_s=0)
"""Commit after every batch (the state-per-batch behaviour these tests were written for)."""


# -- helpers --------------------------------------------------------------------------------------------------


def record(step: int, rank: int = 0, run_id: str = RUN, **signals: float) -> StepRecord:
    sig = {"loss": 2.0 - 0.01 * step, "grad_norm": 1.0} | signals
    return StepRecord(run_id=run_id, step=step, rank=rank, wall_time=1000.0 + step, host=f"h{rank}", signals=sig)


def entry_id(step: int) -> str:
    return f"{1_000_000 + step}-{step}"


def xadd(client: Any, rec: StepRecord, fields: dict[str, bytes] | None = None, run_id: str = RUN) -> str:
    """Write like the emitter: explicit "<wall ms>-<step>" ids, rank set, active-run set."""
    eid = entry_id(rec.step)
    client.xadd(keys.records(run_id, rec.rank), fields if fields is not None else {"r": encode(rec)}, id=eid)
    client.sadd(keys.ranks(run_id), rec.rank)
    client.sadd(keys.RUNS, run_id)
    return eid


def pending(client: Any, rank: int, run_id: str = RUN) -> int:
    return int(client.xpending(keys.records(run_id, rank), keys.GROUP)["pending"])


def findings_in_stream(client: Any, run_id: str = RUN) -> list[dict[str, Any]]:
    return [json.loads(f[b"f"]) for _, f in client.xrange(keys.findings(run_id))]


class Recorder:
    """A real diagnoser that checks per-rank order and emits a warning for every step with loss > 5."""

    def __init__(self) -> None:
        self.steps: dict[str, list[int]] = {}
        self.finished = 0

    def update(self, rec: StepRecord) -> list[Finding]:
        steps = self.steps.setdefault(str(rec.rank), [])
        assert not steps or rec.step > steps[-1], f"rank {rec.rank}: step {rec.step} after {steps[-1]}"
        steps.append(rec.step)
        if rec.get("loss") > 5:
            return [_finding("loss_spike", rec.step, rec.rank)]
        return []

    def finish(self) -> list[Finding]:
        self.finished += 1
        return [_finding("divergence", max(max(s) for s in self.steps.values()), 0)]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "finished": self.finished}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = {k: list(v) for k, v in state["steps"].items()}
        self.finished = state["finished"]


def _finding(kind: str, step: int, rank: int) -> Finding:
    return Finding(kind=kind, step=step, onset=step, severity=Severity.WARNING, signal="loss", value=9.0,
                   message=f"{kind} at {step}", detector="recorder", rank=rank)  # fmt: skip


class ListSink:
    """Keeps what it is given; raises on the first ``fail_times`` emits (a worker dying mid-batch)."""

    def __init__(self, fail_times: int = 0) -> None:
        self.fail_times = fail_times
        self.emits: list[tuple[list[Finding], list[Entry]]] = []
        self.closed: list[str] = []

    def emit(self, run_id: str, findings: Any, records: Any) -> None:
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("worker died mid-batch")
        self.emits.append((list(findings), list(records)))

    def close(self, run_id: str) -> None:
        self.closed.append(run_id)


class DieAt(ListSink):
    """Raises on its ``n``-th emit."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def emit(self, run_id: str, findings: Any, records: Any) -> None:
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("worker died mid-batch")


def snapshot_fields(client: Any, run_id: str) -> dict[bytes, bytes]:
    """A per-rank snapshot hash without its commit time (``drain.AT_FIELD``)."""
    fields: dict[bytes, bytes] = client.hgetall(keys.state(run_id))
    fields.pop(b"_at", None)
    return fields


def saved_state(client: Any, run_id: str = RUN) -> dict[str, Any] | None:
    raw = client.get(keys.state(run_id))
    return None if raw is None else msgpack.unpackb(raw, raw=False, strict_map_key=False)


# -- tests ----------------------------------------------------------------------------------------------------


def test_two_ranks_in_order_state_saved_and_acked(redis_client: Any) -> None:
    for step in range(30):
        for rank in (0, 1):
            xadd(redis_client, record(step, rank, loss=9.0 if step == 17 and rank == 1 else 1.0))
    sink = ListSink()
    result = Drainer(redis_client, RUN, sinks=[sink], batch=7, diagnoser=Recorder, snapshot=EVERY).run()

    assert result.status == "idle" and result.processed == 60 and result.rejected == 0
    assert [(f.kind, f.rank, f.step) for f in result.findings] == [("loss_spike", 1, 17)]
    assert saved_state(redis_client) == {"steps": {"0": list(range(30)), "1": list(range(30))}, "finished": 0}
    assert pending(redis_client, 0) == pending(redis_client, 1) == 0
    order = [(e.record.step, e.rank) for _, entries in sink.emits for e in entries]
    assert order == sorted(order) and len(order) == 60  # ranks merged in stream-id order
    assert max(len(entries) for _, entries in sink.emits) <= 14  # 7 per rank per batch
    assert all(e.entry_id == entry_id(e.record.step) for _, entries in sink.emits for e in entries)

    for step in range(30, 35):  # a later drain continues from the saved state
        xadd(redis_client, record(step, 0))
    result = Drainer(redis_client, RUN, sinks=[sink], batch=7, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 5
    assert saved_state(redis_client)["steps"]["0"] == list(range(35))


def test_malformed_entries_are_rejected_counted_and_acked(redis_client: Any) -> None:
    good = record(0)
    bad_version = msgpack.unpackb(encode(record(3)), raw=False) | {"v": 99}
    oversized = b"\x00" * (MAX_RECORD_BYTES + 1)
    xadd(redis_client, good)
    xadd(redis_client, record(1), {"r": b"\xc1garbage\xff"})
    xadd(redis_client, record(2), {"x": encode(record(2))})
    xadd(redis_client, record(3), {"r": msgpack.packb(bad_version, use_bin_type=True)})
    xadd(redis_client, record(4), {"r": oversized})
    xadd(redis_client, record(5), {"r": encode(record(5, run_id="other-run"))})
    xadd(redis_client, record(6))

    diag = Recorder()
    result = Drainer(redis_client, RUN, sinks=[], diagnoser=lambda: diag, snapshot=EVERY).run()

    assert result.processed == 7 and result.rejected == 5
    assert diag.steps == {"0": [0, 6]}
    assert pending(redis_client, 0) == 0
    assert redis_client.hget(keys.meta(RUN), "errors") == b"5"
    errors = {f[b"entry"].decode(): f[b"reason"].decode() for _, f in redis_client.xrange(keys.errors(RUN))}
    assert sorted(errors) == [entry_id(s) for s in range(1, 6)]
    assert "msgpack" in errors[entry_id(1)]
    assert "no field 'r'" in errors[entry_id(2)]
    assert "version 99" in errors[entry_id(3)]
    assert f"{MAX_RECORD_BYTES}-byte limit" in errors[entry_id(4)]
    assert "other-run" in errors[entry_id(5)]


def test_crash_before_ack_reprocesses_from_old_state_without_duplicates(redis_client: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    redis_client.hset(keys.meta(RUN), "run_dir", str(run_dir))
    for step in range(12):
        xadd(redis_client, record(step, 0, loss=9.0 if step in (3, 8) else 1.0))
        xadd(redis_client, record(step, 1, loss=9.0 if step == 5 else 1.0))
    Drainer(redis_client, RUN, sinks=[], batch=100, diagnoser=Recorder, snapshot=EVERY).run()  # batch 0..11 committed
    state_before = saved_state(redis_client)
    for step in range(12, 20):
        xadd(redis_client, record(step, 0, loss=9.0 if step == 15 else 1.0))

    def sinks(fail: int) -> list[Any]:
        meta = redis_meta(redis_client)
        return [RedisFindingsSink(redis_client), ArchiveSink(meta), ListSink(fail_times=fail)]

    with pytest.raises(RuntimeError, match="died mid-batch"):  # findings + archive written, then the "crash"
        Drainer(redis_client, RUN, sinks=sinks(fail=1), batch=100, diagnoser=Recorder, snapshot=EVERY).run()
    assert pending(redis_client, 0) == 8  # nothing acked
    assert saved_state(redis_client) == state_before  # nothing saved
    assert [f["step"] for f in findings_in_stream(redis_client)] == [15]

    result = Drainer(redis_client, RUN, sinks=sinks(fail=0), batch=100, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 8 and pending(redis_client, 0) == 0
    assert saved_state(redis_client)["steps"]["0"] == list(range(20))  # continued, not doubled
    assert [f["step"] for f in findings_in_stream(redis_client)] == [15]  # no duplicate
    # the re-processed batch was appended to the live tail again; readers and the roll de-duplicate by entry id
    tail = read_tail(run_dir / "archive" / "tail-0-000000.arrows")
    assert [t.column("step").to_pylist() for t in tail.tables] == [list(range(12, 20))] * 2
    assert [r.step for r in load_archive(run_dir / "archive")] == list(range(12, 20))
    compact(run_dir / "archive")
    rows = pq.read_table(run_dir / "archive" / "records-0-000000.parquet").column("step").to_pylist()
    assert rows == list(range(12, 20))
    assert sorted(p.name for p in (run_dir / "archive").iterdir()) == ["records-0-000000.parquet"]


def test_real_diagnoser_crash_gives_the_same_findings_as_a_clean_run(redis_client: Any) -> None:
    def fill(run_id: str) -> None:
        for step in range(40):
            for rank in (0, 1):
                bad = (rank, step) in ((0, 9), (0, 25), (1, 30))
                xadd(redis_client, record(step, rank, run_id=run_id, loss=math.nan if bad else 2.0), run_id=run_id)

    fill("clean")
    Drainer(redis_client, "clean", sinks=[RedisFindingsSink(redis_client)], batch=10, snapshot=EVERY).run()
    fill("crashy")
    for fail_at in (1, 3):  # die after the findings of the 1st, then of the 3rd batch went out
        with pytest.raises(RuntimeError):
            Drainer(redis_client, "crashy", sinks=[RedisFindingsSink(redis_client), DieAt(fail_at)], batch=10,
                    snapshot=EVERY).run()
    Drainer(redis_client, "crashy", sinks=[RedisFindingsSink(redis_client)], batch=10, snapshot=EVERY).run()

    clean, crashy = findings_in_stream(redis_client, "clean"), findings_in_stream(redis_client, "crashy")
    assert any(f["kind"] == "nan" and f["step"] == 9 and f["rank"] == 0 for f in clean)
    key = lambda f: (f["rank"], f["kind"], f["step"])  # noqa: E731
    assert sorted(map(key, crashy)) == sorted(map(key, clean))
    assert max(Counter(map(key, crashy)).values()) == 1
    # byte-for-byte (the state may hold NaN evidence, and nan != nan in a dict comparison)
    assert snapshot_fields(redis_client, "crashy") == snapshot_fields(redis_client, "clean")


def test_lease_excludes_a_concurrent_drainer(redis_client: Any) -> None:
    for step in range(5):
        xadd(redis_client, record(step))
    redis_client.set(keys.lock(RUN), "crashed-holder", px=400)  # a holder that died without releasing
    assert Drainer(redis_client, RUN, sinks=[], lease_ms=400, snapshot=EVERY).run().status == "busy"
    assert not redis_client.exists(keys.state(RUN))

    seen: list[str] = []

    class Concurrent(ListSink):
        def emit(self, run_id: str, findings: Any, records: Any) -> None:  # another trigger while we hold it
            seen.append(Drainer(redis_client, RUN, sinks=[], lease_ms=400, snapshot=EVERY).run().status)

    time.sleep(0.5)  # the dead holder's lease expires
    result = Drainer(redis_client, RUN, sinks=[Concurrent()], lease_ms=400, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 5 and seen == ["busy"]
    assert not redis_client.exists(keys.lock(RUN))  # released


def test_a_batch_slower_than_the_lease_keeps_it(redis_client: Any) -> None:
    """The process's lease keeper thread renews the lease of a batch that runs for several lease times (a slow sink):
    the drain commits, and meanwhile another drainer finds the run busy."""
    for step in range(5):
        xadd(redis_client, record(step))
    seen: list[str] = []

    class Slow(ListSink):
        def emit(self, run_id: str, findings: Any, records: Any) -> None:
            deadline = time.monotonic() + 1.2  # four lease times
            while time.monotonic() < deadline:
                seen.append(Drainer(redis_client, RUN, sinks=[], lease_ms=300, snapshot=EVERY).run().status)
                time.sleep(0.1)

    result = Drainer(redis_client, RUN, sinks=[Slow()], lease_ms=300, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.status == "idle" and result.committed == 5
    assert set(seen) == {"busy"} and len(seen) >= 10
    assert pending(redis_client, 0) == 0


def test_lost_lease_commits_nothing(redis_client: Any) -> None:
    for step in range(5):
        xadd(redis_client, record(step))

    class StealLease(ListSink):
        def emit(self, run_id: str, findings: Any, records: Any) -> None:  # we stalled past our lease
            redis_client.set(keys.lock(RUN), "someone-else", px=10_000)

    result = Drainer(redis_client, RUN, sinks=[StealLease()], diagnoser=Recorder, snapshot=EVERY).run()
    assert result.status == "lease_lost"
    assert pending(redis_client, 0) == 5 and not redis_client.exists(keys.state(RUN))
    assert redis_client.get(keys.lock(RUN)) == b"someone-else"  # not released by the loser


def test_abandoned_entries_of_another_consumer_are_claimed(redis_client: Any) -> None:
    for step in range(6):
        xadd(redis_client, record(step))
    stream = keys.records(RUN, 0)
    redis_client.xgroup_create(stream, keys.GROUP, id="0")
    redis_client.xreadgroup(keys.GROUP, "old-worker", {stream: ">"}, count=4)  # read, never acked
    time.sleep(0.25)
    result = Drainer(redis_client, RUN, sinks=[], lease_ms=200, diagnoser=Recorder, snapshot=EVERY).run()
    assert result.processed == 6
    assert pending(redis_client, 0) == 0
    assert saved_state(redis_client)["steps"]["0"] == list(range(6))
    consumers = {c["name"]: c["pending"] for c in redis_client.xinfo_consumers(stream, keys.GROUP)}
    assert consumers == {b"old-worker": 0, CONSUMER.encode(): 0}


def test_end_of_run_finishes_once_and_marks_drained(redis_client: Any) -> None:
    for step in range(4):
        xadd(redis_client, record(step, 0))
        xadd(redis_client, record(step, 1))
    redis_client.hset(keys.meta(RUN), "ended:0", "1")
    sink = ListSink()
    status = Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY).run().status
    assert status == "idle"  # rank 1 still on
    assert not redis_client.hexists(keys.meta(RUN), "drained") and sink.closed == []

    redis_client.hset(keys.meta(RUN), "ended:1", "1")
    result = Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY).run()
    assert result.status == "drained"
    assert [(f.kind, f.step) for f in result.findings] == [("divergence", 3)]
    assert sink.emits[-1][0] == result.findings and sink.emits[-1][1] == []
    assert sink.closed == [RUN]
    assert saved_state(redis_client)["finished"] == 1
    assert float(redis_client.hget(keys.meta(RUN), "drained")) == pytest.approx(time.time(), abs=60)
    assert not redis_client.sismember(keys.RUNS, RUN)

    redis_client.sadd(keys.RUNS, RUN)  # a stale trigger for a drained run does nothing
    assert Drainer(redis_client, RUN, sinks=[sink], diagnoser=Recorder, snapshot=EVERY).run().status == "drained"
    assert sink.closed == [RUN] and not redis_client.sismember(keys.RUNS, RUN)


def test_archive_parts_read_back_equal_the_records(redis_client: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    redis_client.hset(keys.meta(RUN), "run_dir", str(run_dir))
    written = []
    for step in range(10):
        for rank in (0, 1):
            signals: dict[str, float] = {"loss": 1.0 / (step + 1), "grad_norm/h.0.attn": float(step)}
            if step == 4:
                signals = {"loss": math.nan, "grad_norm": math.inf}  # NaN/Inf kept, other signals NULL
            if rank == 1 and step % 3 == 0:
                signals["step"] = 7.0  # clashes with a fixed column
            rec = StepRecord(run_id=RUN, step=step, rank=rank, wall_time=100.5 + step, host=f"node{rank}",
                             batch=None if step % 2 else f"shard-{step}", signals=signals)  # fmt: skip
            written.append((xadd(redis_client, rec), rec))
    Drainer(redis_client, RUN, sinks=[ArchiveSink(redis_meta(redis_client))], batch=4, snapshot=EVERY).run()

    tails = sorted((run_dir / "archive").glob("tail-*.arrows"))
    assert [p.name for p in tails] == ["tail-0-000000.arrows", "tail-1-000000.arrows"]  # one live file per rank
    frames = [read_tail(p).tables for p in tails]
    assert [len(f) for f in frames] == [3, 3]  # 3 batches appended per rank
    table = pa.concat_tables([t for f in frames for t in f], promote_options="default")
    rows = sorted(table.to_pylist(), key=lambda r: (r["rank"], r["step"]))
    assert len(rows) == 20
    for row, (eid, rec) in zip(rows, sorted(written, key=lambda w: (w[1].rank, w[1].step)), strict=True):
        assert (row["run_id"], row["rank"], row["step"], row["entry_id"]) == (RUN, rec.rank, rec.step, eid)
        assert (row["wall_time"], row["host"], row["batch"]) == (rec.wall_time, rec.host, rec.batch)
        for name in ("loss", "grad_norm", "grad_norm/h.0.attn", "step"):
            column = "signal:step" if name == "step" else name
            want = rec.signals.get(name)
            got = row.get(column)
            if want is None:
                assert got is None, (name, row)
            elif math.isnan(want):
                assert got is not None and math.isnan(got)
            else:
                assert got == want
    assert table.schema.field("loss").type == pa.float64()

    # at the end of the run the parts are compacted into one file per rank with the same rows, in step order
    ArchiveSink(redis_meta(redis_client)).close(RUN)
    files = sorted(p.name for p in (run_dir / "archive").iterdir())
    assert files == ["records-0-000000.parquet", "records-1-000000.parquet"]
    merged = pa.concat_tables([pq.read_table(run_dir / "archive" / f) for f in files], promote_options="default")
    assert merged.num_rows == 20 and merged.column("step").to_pylist() == list(range(10)) * 2
    def same(row: dict[str, Any]) -> str:  # NaN-aware row comparison
        return repr(sorted(row.items()))

    merged_rows = sorted(merged.to_pylist(), key=lambda r: (r["rank"], r["step"]))
    assert [same(r) for r in merged_rows] == [same(r) for r in rows]


def test_archive_location(tmp_path: Path) -> None:
    meta = {"elsewhere": {"run_dir": "/not/on/this/host"}, "local": {"run_dir": str(tmp_path)}}
    assert ArchiveSink(meta.__getitem__).directory("elsewhere") is None
    assert ArchiveSink(meta.__getitem__).directory("local") == tmp_path / "archive"
    fallback = ArchiveSink(meta.__getitem__, archive_dir=tmp_path / "arch")
    assert fallback.directory("elsewhere") == tmp_path / "arch" / "elsewhere"


def test_console_sink_names_rank_host_and_top_cause(caplog: pytest.LogCaptureFixture) -> None:
    from stability.detectors.base import CauseHint

    finding = Finding(kind="rank_disagreement", step=12, onset=12, severity=Severity.ERROR, signal="grad_norm",
                      value=9.0, message="rank 3 grad_norm 9x the others", detector="crossrank", rank=3,
                      host="node7", causes=(CauseHint(cause="hardware_fault", score=0.9, evidence="only rank 3"),))
    with caplog.at_level("INFO", logger="stability.worker.sinks"):
        ConsoleSink().emit(RUN, [finding], [])
    assert caplog.records[-1].levelname == "ERROR"
    assert "[run-test rank 3 on node7] rank_disagreement at step 12" in caplog.text
    assert "likely hardware_fault: only rank 3" in caplog.text
