"""The run archive on disk: one Parquet file per rank per segment, plus a crash-readable live tail.

Layout of an archive directory (``<run_dir>/archive`` or ``$STABILITY_ARCHIVE_DIR/<run>``)::

    records-<rank>-<seq>.parquet   closed segments: Parquet, row groups of ROW_GROUP_ROWS rows, sorted by entry id
    tail-<rank>-<seq>.arrows       the open segment of a rank: framed Arrow IPC streams, appended per batch
    part-*.parquet, records-<rank>.parquet   older layouts, still read

Why a tail file instead of appending row groups to an open Parquet file: a Parquet file is only readable once its
footer is written on close, so a worker killed mid-segment (or a post-mortem of a live run) would find nothing
readable. The tail is a sequence of self-contained frames ``magic | payload length | write time ms | crc32`` +
an Arrow IPC stream (schema + one record batch, LZ4-compressed; zstd in tails written before, read the same). Each
frame is written with one ``writev`` call on an ``O_APPEND`` descriptor; a reader keeps every frame whose length
and CRC check out and stops at a torn one, so a writer that died mid-frame costs at most that frame (whose entries
were never acknowledged, so the next drain writes them again). Each frame carries its own schema, so batches with
different signal sets need no rewrite.

A segment is *rolled* (closed) when its tail passes ``roll_bytes`` or ``roll_seconds`` after its first frame, and
at the end of the run: the tail's frames are read, de-duplicated by ``entry_id`` (a batch re-delivered after a
worker died between writing and acking appears twice), sorted by entry id, written to a temporary Parquet file that
is renamed to ``records-<rank>-<seq>.parquet``, and only then is the tail deleted. A crash between the rename and
the delete leaves both; the next writer sees the Parquet file and deletes the stale tail, and readers de-duplicate.

Nothing about the open segment is kept only in memory: a writer re-reads the directory whenever the tail it knows
changed size or vanished (another worker process took the run's lease and wrote or rolled meanwhile) and truncates
a torn frame before appending, so the writer may change processes (or hosts sharing the directory) at any time.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stability.errors import ConfigError

__all__ = [
    "SEGMENT_RE",
    "TAIL_RE",
    "ArchiveConfig",
    "ArchiveWriter",
    "TailRead",
    "finalize_directory",
    "iter_archive_files",
    "read_tail",
    "roll_tail",
    "table_rows_by_entry",
    "write_parquet_atomically",
]

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sQQI")
"""Frame header: magic, payload length, write time (unix ms), crc32 of the payload."""
MAGIC = b"STA1"
ROW_GROUP_ROWS = 8192
"""Rows per Parquet row group of a closed segment."""
TAIL_RE = re.compile(r"^tail-(\d+)-(\d+)\.arrows$")
SEGMENT_RE = re.compile(r"^records-(\d+)-(\d+)\.parquet$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchiveConfig:
    """When an open segment is closed into a Parquet file."""

    roll_bytes: int = 64 * 1024 * 1024
    """Close the segment once its tail file is this large."""
    roll_seconds: float = 600.0
    """Close the segment this long after its first frame was written."""

    def __post_init__(self) -> None:
        if self.roll_bytes < 1:
            raise ConfigError(f"roll_bytes must be >= 1, got {self.roll_bytes}")
        if self.roll_seconds <= 0:
            raise ConfigError(f"roll_seconds must be > 0, got {self.roll_seconds}")


@dataclass(slots=True, kw_only=True)
class TailRead:
    """What :func:`read_tail` found in one tail file."""

    tables: list[Any] = field(default_factory=list)
    """One ``pyarrow.Table`` per good frame, in write order."""
    valid_bytes: int = 0
    """Length of the readable prefix (the rest is a torn or damaged frame)."""
    size: int = 0
    """File size when read."""
    first_ms: int | None = None
    """Write time of the first frame."""

    @property
    def damaged(self) -> bool:
        """True when bytes past the last good frame were found."""
        return self.valid_bytes != self.size


def _frame(table: Any) -> tuple[bytes, Any]:
    """The frame of ``table``: its header and its payload (a ``pyarrow.Buffer``, written without a copy).

    LZ4, not zstd: float signal columns hardly compress (zstd saved ~12 % of the bytes of 206-signal records, LZ4
    ~3 %) and zstd cost ~3x LZ4's CPU per record; the tail is rewritten as Parquet when it is rolled anyway.
    """
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_ipc_options()) as writer:
        writer.write_table(table)
    payload = sink.getvalue()
    return _FRAME.pack(MAGIC, payload.size, int(time.time() * 1000), zlib.crc32(payload)), payload


@functools.cache
def _ipc_options() -> Any:
    import pyarrow as pa

    return pa.ipc.IpcWriteOptions(compression="lz4")


def read_tail(path: Path) -> TailRead:
    """Read the good frames of a tail file (a torn or corrupt frame ends the read; see the module docstring).

    Raises:
        OSError: the file cannot be read (e.g. it was rolled away meanwhile: ``FileNotFoundError``).
    """
    import pyarrow as pa

    data = path.read_bytes()
    view = memoryview(data)  # frames are read in place: no copy of any payload
    out = TailRead(size=len(data))
    offset = 0
    while offset + _FRAME.size <= len(data):
        magic, length, written_ms, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        if magic != MAGIC or end > len(data):
            break
        payload = view[offset + _FRAME.size:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        except (pa.ArrowException, OSError, ValueError):
            break
        out.tables.append(table)
        if out.first_ms is None:
            out.first_ms = int(written_ms)
        offset = end
    out.valid_bytes = offset
    return out


def table_rows_by_entry(tables: Sequence[Any]) -> Any:
    """Concatenate archive tables (schemas merged), keep the last row per ``entry_id`` (else per (rank, step)),
    sorted by entry id."""
    import pyarrow as pa

    if not tables:
        return None
    table = pa.concat_tables(list(tables), promote_options="default")
    if "entry_id" in table.column_names and _strictly_increasing_ids(table.column("entry_id")):
        return table  # the common case (no re-delivered batch), found without a Python object per row
    if "entry_id" in table.column_names:
        keys = [(e, None) for e in table.column("entry_id").to_pylist()]
    else:
        keys = list(zip(table.column("rank").to_pylist(), table.column("step").to_pylist(), strict=True))
    last: dict[Any, int] = {}
    for i, key in enumerate(keys):
        last[key] = i
    order = sorted(last.values(), key=lambda i: _sort_key(keys[i]))
    if len(order) == table.num_rows and order == list(range(table.num_rows)):
        return table
    return table.take(pa.array(order, pa.int64()))


def _strictly_increasing_ids(ids: Any) -> bool:
    """Whether the stream ids ``"<ms>-<seq>"`` of ``ids`` (a pyarrow string column) increase strictly (so they are
    unique and sorted); False when one is null or not of that form."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if ids.null_count or len(ids) < 2:
        return not ids.null_count
    try:
        parts = pc.split_pattern(ids, "-", max_splits=1)
        if not pc.all(pc.equal(pc.list_value_length(parts), 2)).as_py():
            return False
        ms = pc.cast(pc.list_element(parts, 0), pa.uint64()).to_numpy()
        seq = pc.cast(pc.list_element(parts, 1), pa.uint64()).to_numpy()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    later = (ms[1:] > ms[:-1]) | ((ms[1:] == ms[:-1]) & (seq[1:] > seq[:-1]))
    return bool(np.all(later))


def _sort_key(key: Any) -> tuple[int, int]:
    first, second = key
    if second is None and isinstance(first, str):
        ms, _, seq = first.partition("-")
        try:
            return int(ms), int(seq or 0)
        except ValueError:
            return 0, 0
    return int(first or 0), int(second or 0)


def write_parquet_atomically(table: Any, path: Path) -> None:
    """Write a Parquet file under a temporary name (mode 0600), fsync it and rename it into place.

    Dictionary encoding for the string columns only: tried on a float signal column it is wasted work that ends in
    a larger file (206-signal records: 15 -> 5 us per record to write, 1,980 -> 1,650 bytes per record).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    strings = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet.tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, use_dictionary=strings)
        _fsync(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _segment_path(directory: Path, rank: int, seq: int) -> Path:
    return directory / f"records-{rank}-{seq:06d}.parquet"


def _tail_path(directory: Path, rank: int, seq: int) -> Path:
    return directory / f"tail-{rank}-{seq:06d}.arrows"


def _scan(directory: Path) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """``(tails, segments)``: sequence numbers per rank present in ``directory``."""
    tails: dict[int, list[int]] = {}
    segments: dict[int, list[int]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return tails, segments
    for name in names:
        if m := TAIL_RE.match(name):
            tails.setdefault(int(m[1]), []).append(int(m[2]))
        elif m := SEGMENT_RE.match(name):
            segments.setdefault(int(m[1]), []).append(int(m[2]))
    return tails, segments


def roll_tail(directory: Path, rank: int, seq: int) -> Path | None:
    """Close segment ``seq`` of ``rank``: tail -> ``records-<rank>-<seq>.parquet`` (see the module docstring).

    Returns the Parquet path, or None when the tail held no readable frame (it is deleted).
    """
    tail, target = _tail_path(directory, rank, seq), _segment_path(directory, rank, seq)
    if target.exists():  # rolled before, the tail's delete was lost to a crash
        tail.unlink(missing_ok=True)
        return target
    try:
        read = read_tail(tail)
    except FileNotFoundError:
        return None
    if read.damaged:
        logger.warning("%s: dropped %d bytes of a torn frame at offset %d", tail, read.size - read.valid_bytes,
                       read.valid_bytes)
    table = table_rows_by_entry(read.tables)
    if table is None:
        tail.unlink(missing_ok=True)
        return None
    write_parquet_atomically(table, target)
    tail.unlink(missing_ok=True)
    logger.debug("rolled %s (%d rows) into %s", tail.name, table.num_rows, target.name)
    return target


def finalize_directory(directory: Path) -> list[Path]:
    """Roll every open tail of ``directory`` into its Parquet segment (end of a run); returns the new files."""
    tails, _ = _scan(directory)
    out = []
    for rank, seqs in sorted(tails.items()):
        for seq in sorted(seqs):
            path = roll_tail(directory, rank, seq)
            if path is not None:
                out.append(path)
    return out


@dataclass(slots=True)
class _Open:
    seq: int
    size: int
    first_ms: int | None


class ArchiveWriter:
    """Appends archive tables of one run directory to per-rank segments (see the module docstring).

    Keeps only a hint per rank (open segment, its size); the directory is the truth, re-read when the hint does
    not match the file.
    """

    def __init__(self, directory: Path, config: ArchiveConfig | None = None) -> None:
        self.directory = directory
        self.config = config or ArchiveConfig()
        self._open: dict[int, _Open] = {}
        self._dirty: set[Path] = set()

    def append(self, rank: int, table: Any) -> Path:
        """Append ``table`` (rows of ``rank``) to the rank's open segment, rolling it first when due."""
        self.directory.mkdir(parents=True, exist_ok=True)
        header, payload = _frame(table)
        size = len(header) + payload.size
        state = self._current(rank)
        now_ms = int(time.time() * 1000)
        too_old = state.first_ms is not None and now_ms - state.first_ms >= self.config.roll_seconds * 1000
        if state.size and (state.size + size > self.config.roll_bytes or too_old):
            self._roll(rank, state.seq)
            state = _Open(seq=state.seq + 1, size=0, first_ms=None)
        path = _tail_path(self.directory, rank, state.seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            written = os.writev(fd, [header, payload])
            if written != size:  # a short write (disk full): the reader stops at this torn frame; the next append
                raise OSError(f"{path}: wrote {written} of {size} bytes")  # truncates it (see _current)
        finally:
            os.close(fd)
        self._dirty.add(path)
        self._open[rank] = _Open(seq=state.seq, size=state.size + size, first_ms=state.first_ms or now_ms)
        return path

    def sync(self) -> None:
        """fsync every tail written since the last sync (the drainer acks the entries only after this)."""
        for path in sorted(self._dirty):
            try:
                _fsync(path)
            except FileNotFoundError:  # rolled meanwhile: the Parquet file was fsynced when written
                pass
        if self._dirty:
            _fsync_dir(self.directory)
        self._dirty.clear()

    def finalize(self) -> list[Path]:
        """Roll every open segment (end of the run)."""
        self.sync()
        self._open.clear()
        return finalize_directory(self.directory)

    def _roll(self, rank: int, seq: int) -> None:
        self._dirty.discard(_tail_path(self.directory, rank, seq))
        roll_tail(self.directory, rank, seq)
        self._open.pop(rank, None)

    def _current(self, rank: int) -> _Open:
        """The rank's open segment, re-read from the directory unless our hint still matches the tail file."""
        hint = self._open.get(rank)
        if hint is not None:
            try:
                if os.stat(_tail_path(self.directory, rank, hint.seq)).st_size == hint.size:
                    return hint
            except FileNotFoundError:
                pass
        tails, segments = _scan(self.directory)
        done = segments.get(rank, [])
        open_seqs = sorted(tails.get(rank, []))
        for seq in open_seqs[:-1]:  # several open tails: an earlier writer crashed mid-roll; close the older ones
            roll_tail(self.directory, rank, seq)
        if open_seqs and open_seqs[-1] not in done:
            seq = open_seqs[-1]
            path = _tail_path(self.directory, rank, seq)
            read = read_tail(path)
            if read.damaged:  # a writer died mid-frame: cut the torn frame, or later frames land behind it
                logger.warning("%s: truncating a torn frame at offset %d (%d bytes)", path, read.valid_bytes,
                               read.size - read.valid_bytes)
                with open(path, "r+b") as f:
                    f.truncate(read.valid_bytes)
            state = _Open(seq=seq, size=read.valid_bytes, first_ms=read.first_ms)
        else:
            if open_seqs:
                _tail_path(self.directory, rank, open_seqs[-1]).unlink(missing_ok=True)
            seq = max(done + open_seqs, default=-1) + 1
            state = _Open(seq=seq, size=0, first_ms=None)
        self._open[rank] = state
        return state


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def iter_archive_files(directory: Path) -> Iterator[Path]:
    """Parquet files and tails of an archive directory, in name order."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(".parquet") or TAIL_RE.match(name):
            yield directory / name
