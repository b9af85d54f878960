"""The compact archive on real files: one live tail per rank readable while the run is live and after its writer
died mid-frame, rolled into Parquet segments by size, re-delivery de-duplicated, the writer changing processes,
and a post-mortem that survives a damaged file and names it."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from stability import postmortem
from stability.records import StepRecord
from stability.worker.archive import ArchiveConfig, read_tail
from stability.worker.sinks import ArchiveSink, Entry, compact

RUN = "arch-run"


def entries(steps: range, rank: int = 0, *, signals: int = 3, nan_at: int | None = None) -> list[Entry]:
    out = []
    for step in steps:
        sig = {f"grad_norm/l{i}": float(step + i) for i in range(signals)}
        sig["loss"] = math.nan if step == nan_at else 2.0 - 0.001 * step
        rec = StepRecord(run_id=RUN, step=step, rank=rank, wall_time=1e9 + step, host=f"h{rank}", signals=sig)
        out.append(Entry(entry_id=f"{1_000_000_000 + step * 1000}-{step}", rank=rank, record=rec))
    return out


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


def sink_for(run_dir: Path, **config: Any) -> ArchiveSink:
    return ArchiveSink(lambda run_id: {"run_dir": str(run_dir)}, config=ArchiveConfig(**config) if config else None)


def steps_read(run_dir: Path) -> list[tuple[int, int]]:
    return [(r.rank, r.step) for r in postmortem.load_archive(run_dir / "archive")]


def test_live_archive_is_one_readable_file_per_rank(run_dir: Path) -> None:
    sink = sink_for(run_dir)
    for start in range(0, 30, 5):  # six batches, two ranks, never closed: the run is live
        sink.emit(RUN, [], entries(range(start, start + 5), 0) + entries(range(start, start + 5), 1))
    assert sink.sync(RUN) is True
    names = sorted(p.name for p in (run_dir / "archive").iterdir())
    assert names == ["tail-0-000000.arrows", "tail-1-000000.arrows"]
    assert steps_read(run_dir) == [(rank, s) for rank in (0, 1) for s in range(30)]
    assert oct((run_dir / "archive" / names[0]).stat().st_mode & 0o777) == "0o600"

    sink.close(RUN)  # end of run: every tail becomes one Parquet file with the same rows
    names = sorted(p.name for p in (run_dir / "archive").iterdir())
    assert names == ["records-0-000000.parquet", "records-1-000000.parquet"]
    table = pq.read_table(run_dir / "archive" / names[0])
    assert table.column("step").to_pylist() == list(range(30))
    assert steps_read(run_dir) == [(rank, s) for rank in (0, 1) for s in range(30)]


def test_a_writer_that_died_mid_frame_leaves_a_readable_tail(run_dir: Path, caplog: Any) -> None:
    sink = sink_for(run_dir)
    sink.emit(RUN, [], entries(range(0, 10)))
    sink.emit(RUN, [], entries(range(10, 20)))
    tail = run_dir / "archive" / "tail-0-000000.arrows"
    good = tail.stat().st_size
    whole = tail.read_bytes()
    frame = whole[good // 2:]  # the second frame, roughly: append half a frame, as a writer killed mid-write
    with open(tail, "ab") as f:
        f.write(frame[: len(frame) // 2])
    with caplog.at_level(logging.WARNING):
        assert steps_read(run_dir) == [(0, s) for s in range(20)]  # a post-mortem of the crashed run reads it as is
    assert "torn frame" in caplog.text and tail.name in caplog.text

    # the next writer (a new process: a fresh sink) cuts the torn frame before appending, so nothing hides behind it
    sink2 = sink_for(run_dir)
    sink2.emit(RUN, [], entries(range(20, 25)))
    read = read_tail(tail)
    assert not read.damaged and read.valid_bytes == read.size
    assert [t.column("step").to_pylist()[0] for t in read.tables] == [0, 10, 20]
    assert steps_read(run_dir) == [(0, s) for s in range(25)]


def test_redelivered_batches_are_not_duplicated(run_dir: Path) -> None:
    sink = sink_for(run_dir)
    batch = entries(range(0, 8))
    sink.emit(RUN, [], batch)
    sink.emit(RUN, [], batch)  # the worker died after emitting, before acking: the batch comes again
    sink.emit(RUN, [], entries(range(8, 12)))
    assert len(read_tail(run_dir / "archive" / "tail-0-000000.arrows").tables) == 3
    assert steps_read(run_dir) == [(0, s) for s in range(12)]
    compact(run_dir / "archive")
    table = pq.read_table(run_dir / "archive" / "records-0-000000.parquet")
    assert table.column("step").to_pylist() == list(range(12))  # de-duplicated by entry id when rolled
    assert table.column("entry_id").to_pylist() == [e.entry_id for e in entries(range(12))]


def test_segments_roll_by_size_and_keep_every_row(run_dir: Path) -> None:
    sink = sink_for(run_dir, roll_bytes=4000)
    for start in range(0, 200, 10):
        sink.emit(RUN, [], entries(range(start, start + 10), signals=20, nan_at=55))
    files = sorted(p.name for p in (run_dir / "archive").iterdir())
    segments = [f for f in files if f.startswith("records-0-")]
    assert len(segments) >= 3 and files[-1].startswith("tail-0-")  # closed segments + the open one
    assert files[-1] == f"tail-0-{len(segments):06d}.arrows"
    for name in segments:  # each closed segment is a complete Parquet file with row groups
        meta = pq.ParquetFile(run_dir / "archive" / name).metadata
        assert meta.num_rows > 0 and meta.num_row_groups >= 1
    records = postmortem.load_archive(run_dir / "archive")
    assert [r.step for r in records] == list(range(200))
    assert math.isnan(records[55].signals["loss"]) and records[56].signals["grad_norm/l19"] == 75.0


def test_segments_roll_by_time(run_dir: Path) -> None:
    sink = sink_for(run_dir, roll_seconds=0.001)
    sink.emit(RUN, [], entries(range(0, 5)))
    tail = run_dir / "archive" / "tail-0-000000.arrows"
    os.utime(tail)  # (the age is the first frame's write time, not the mtime)
    first_ms = read_tail(tail).first_ms
    assert first_ms is not None
    import time

    while int(time.time() * 1000) - first_ms < 2:
        time.sleep(0.001)
    sink.emit(RUN, [], entries(range(5, 10)))
    assert sorted(p.name for p in (run_dir / "archive").iterdir()) == ["records-0-000000.parquet",
                                                                       "tail-0-000001.arrows"]
    assert steps_read(run_dir) == [(0, s) for s in range(10)]


def test_the_writer_may_change_processes(run_dir: Path) -> None:
    first, second = sink_for(run_dir, roll_bytes=3000), sink_for(run_dir, roll_bytes=3000)
    step = 0
    for turn in range(12):  # the run's lease moves between two workers: each has its own stale idea of the tail
        sink = first if turn % 3 else second
        sink.emit(RUN, [], entries(range(step, step + 7), signals=10))
        step += 7
    sink.sync(RUN)
    assert steps_read(run_dir) == [(0, s) for s in range(step)]
    first.close(RUN)
    names = sorted(p.name for p in (run_dir / "archive").iterdir())
    assert all(n.startswith("records-0-") and n.endswith(".parquet") for n in names)
    rows = [s for n in names for s in pq.read_table(run_dir / "archive" / n).column("step").to_pylist()]
    assert rows == list(range(step))  # nothing lost, nothing twice, segments in order


def test_a_crash_between_roll_and_tail_delete_repeats_nothing(run_dir: Path) -> None:
    sink = sink_for(run_dir)
    sink.emit(RUN, [], entries(range(0, 6)))
    tail = run_dir / "archive" / "tail-0-000000.arrows"
    saved = tail.read_bytes()
    compact(run_dir / "archive")
    tail.write_bytes(saved)  # as if the worker died after renaming the Parquet file, before deleting the tail
    assert steps_read(run_dir) == [(0, s) for s in range(6)]
    sink_for(run_dir).emit(RUN, [], entries(range(6, 9)))  # the next writer drops the stale tail, opens segment 1
    assert sorted(p.name for p in (run_dir / "archive").iterdir()) == ["records-0-000000.parquet",
                                                                       "tail-0-000001.arrows"]
    assert steps_read(run_dir) == [(0, s) for s in range(9)]


def test_a_damaged_parquet_file_does_not_abort_the_postmortem(run_dir: Path, caplog: Any) -> None:
    sink = sink_for(run_dir, roll_bytes=2500)
    for start in range(0, 120, 10):
        sink.emit(RUN, [], entries(range(start, start + 10), nan_at=100) + entries(range(start, start + 10), 1))
    sink.close(RUN)
    segments = sorted((run_dir / "archive").glob("records-0-*.parquet"))
    assert len(segments) >= 3
    victim = segments[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # truncated: no footer
    lost = set(pq.read_table(segments[0]).column("step").to_pylist())
    with caplog.at_level(logging.WARNING):
        result = postmortem.run(run_dir)
    assert victim.name in caplog.text and "damaged" in caplog.text
    assert json.loads(result.meta["damaged_files"]) == [str(victim)]
    assert json.loads(result.to_json())["meta"]["damaged_files"] == result.meta["damaged_files"]
    assert result.ranks == (0, 1) and result.steps == 120  # rank 1 complete; rank 0 minus the damaged file
    records = postmortem.load_run_dir(run_dir)
    assert {r.step for r in records if r.rank == 0} >= lost
    assert len([r for r in records if r.rank == 0]) < 120
    assert any("nan" in e["kinds"] and (e["rank"], e["onset"]) == (0, 100) for e in result.events)  # still found

    damaged: list[str] = []
    postmortem.load_archive(run_dir / "archive", damaged=damaged)
    assert damaged == [str(victim)]


def test_older_layouts_are_read_and_folded_into_segments(run_dir: Path) -> None:
    from stability.worker.sinks import archive_table

    archive = run_dir / "archive"
    archive.mkdir()
    for steps in (range(0, 6), range(4, 9)):  # one part per drained batch; a re-delivered batch overlapped
        batch = entries(steps)
        pq.write_table(archive_table(RUN, batch), archive / f"part-0-{batch[0].entry_id}.parquet")
    pq.write_table(archive_table(RUN, entries(range(0, 3), 1)), archive / "records-1.parquet")
    assert steps_read(run_dir) == [(0, s) for s in range(9)] + [(1, s) for s in range(3)]
    sink_for(run_dir).emit(RUN, [], entries(range(9, 12)))
    compact(archive)
    names = sorted(p.name for p in archive.iterdir())
    assert names == ["records-0-000000.parquet", "records-0-000001.parquet", "records-1-000000.parquet"]
    rows = [s for n in names[:2] for s in pq.read_table(archive / n).column("step").to_pylist()]
    assert sorted(rows) == list(range(12)) and len(rows) == 12  # the overlap of the two parts kept once
    assert steps_read(run_dir) == [(0, s) for s in range(12)] + [(1, s) for s in range(3)]


def _table_per_value(run_id: str, batch: list[Entry]) -> Any:
    """The archive table built value by value (the former ``archive_table``): the reference of the column-wise one."""
    import pyarrow as pa

    recs = [e.record for e in batch]
    columns: dict[str, Any] = {
        "run_id": pa.array([run_id] * len(recs), pa.string()),
        "rank": pa.array([e.rank for e in batch], pa.int64()),
        "step": pa.array([r.step for r in recs], pa.int64()),
        "wall_time": pa.array([r.wall_time for r in recs], pa.float64()),
        "host": pa.array([r.host for r in recs], pa.string()),
        "batch": pa.array([r.batch for r in recs], pa.string()),
        "entry_id": pa.array([e.entry_id for e in batch], pa.string()),
        "coords": pa.array([json.dumps(dict(sorted(r.coords.items())), separators=(",", ":")) if r.coords else None
                            for r in recs], pa.string()),
    }
    for name in sorted({name for r in recs for name in r.signals}):
        column = f"signal:{name}" if name in columns else name
        columns[column] = pa.array([r.signals.get(name) for r in recs], pa.float64())
    return pa.table(columns)


def test_column_wise_table_equals_the_per_value_one() -> None:
    from stability.worker.sinks import archive_table

    mixed = entries(range(0, 4), nan_at=2)  # 3 layouts, interleaved: nulls where a record lacks a signal
    for i, entry in enumerate(entries(range(4, 10), signals=5)):
        sig = dict(entry.record.signals)
        if i % 2:
            sig = {"step": -1.0, "lr": math.inf, **sig}  # a signal named like a fixed column, another order
        sig["zeta"] = -0.0
        rec = StepRecord(run_id=RUN, step=entry.record.step, signals=sig, batch="b")
        mixed.append(Entry(entry_id=entry.entry_id, rank=entry.rank, record=rec))
    mixed.insert(1, mixed.pop())
    for batch in (mixed, entries(range(5), nan_at=3), entries(range(2), signals=0)):
        got, want = archive_table(RUN, batch), _table_per_value(RUN, batch)
        assert got.schema == want.schema
        assert repr(got.to_pylist()) == repr(want.to_pylist())  # repr: NaN, -0.0 and NULL (None) told apart


def test_table_from_packed_values_equals_the_one_from_the_signal_dicts() -> None:
    from stability.records import decode_packed, encode
    from stability.worker.sinks import archive_table

    plain = entries(range(0, 3), nan_at=1) + entries(range(3, 6), signals=5) + entries(range(6, 8), signals=0)
    plain.insert(2, plain.pop())
    packed = []
    for entry in plain:
        record, values = decode_packed(encode(entry.record))
        packed.append(Entry(entry_id=entry.entry_id, rank=entry.rank, record=record, packed=values))
    for batch in (packed, packed[:3], packed[:2] + plain[2:4]):  # all packed, one layout, some not packed
        want = _table_per_value(RUN, [Entry(entry_id=e.entry_id, rank=e.rank, record=e.record) for e in batch])
        got = archive_table(RUN, batch)
        assert got.schema == want.schema
        assert repr(got.to_pylist()) == repr(want.to_pylist())


@pytest.mark.parametrize(("ids", "increasing"), [
    (["1-0", "1-1", "2-0", "10-0"], True), (["7-3"], True), ([], True),
    (["1-0", "1-0"], False), (["2-0", "1-5"], False), (["10-0", "9-9"], False), (["1-1", "1-0"], False),
    (["1-0", "x-1"], False), (["1-0", "1"], False), (["1-0", None], False), (["1-0", "-1-2"], False),
])
def test_the_sorted_ids_shortcut_agrees_with_the_row_by_row_order(ids: list[str | None], increasing: bool) -> None:
    import pyarrow as pa

    from stability.worker.archive import _strictly_increasing_ids, table_rows_by_entry

    assert _strictly_increasing_ids(pa.chunked_array([pa.array(ids, pa.string())])) is increasing
    if increasing:  # then the row-by-row de-duplication and sort would keep every row in place
        table = pa.table({"entry_id": pa.array(ids, pa.string()), "step": pa.array(range(len(ids)), pa.int64())})
        assert table_rows_by_entry([table]).column("step").to_pylist() == list(range(len(ids)))


def test_parallel_coordinates_survive_the_archive_live_and_rolled(run_dir: Path) -> None:
    """The post-mortem's cross-rank comparison groups ranks by their coordinates as the worker did: pipeline stages
    (or Hogwild processes) must not be compared as replicas after the archive. Before: the archive kept no
    coordinates, so a post-mortem of a pipeline-parallel run compared the stages' gradient norms."""
    import dataclasses

    def staged(steps: range, rank: int) -> list[Entry]:
        return [dataclasses.replace(e, record=dataclasses.replace(e.record, coords={"pp": rank, "tp": 0}))
                for e in entries(steps, rank)]

    sink = sink_for(run_dir)
    sink.emit(RUN, [], staged(range(0, 5), 0) + staged(range(0, 5), 1) + entries(range(0, 5), 2))
    live = postmortem.load_run_dir(run_dir)  # from the open tails
    sink.close(RUN)
    rolled = postmortem.load_run_dir(run_dir)  # from the Parquet segments
    for records in (live, rolled):
        assert {(r.rank, tuple(sorted(r.coords.items()))) for r in records} == {
            (0, (("pp", 0), ("tp", 0))), (1, (("pp", 1), ("tp", 0))), (2, ())}
