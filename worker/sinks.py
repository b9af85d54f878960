"""Where findings (and the records behind them) go: the ``Sink`` protocol and the built-in sinks.

A sink receives, per processed batch of one run, the findings the detectors produced and the stream entries
that were read (:class:`Entry`: stream id + decoded record). A batch may be delivered twice: a worker that dies
after emitting but before acking leaves the entries pending, and the next drain re-processes them from the same
detector state, producing the same findings. Every sink is therefore idempotent:

* :class:`ConsoleSink` logs (a repeated log line is harmless);
* :class:`RedisFindingsSink` adds a finding to the findings stream only once per ``(rank, kind, step)``;
* :class:`ArchiveSink` appends each batch to the rank's live archive segment; a re-processed batch is appended
  again and de-duplicated by entry id when the segment is closed and by every reader;
* :class:`~stability.worker.wandb_sink.WandbSink` keeps its own ``(rank, kind, step)`` set;
* :class:`ReportSink` acts only when the run is closed: it rewrites ``findings.json`` and ``report.html`` from the
  whole archive (a repeated close writes the same files again).

A sink may also have ``sync(run_id) -> bool``: the drainer calls it before it acknowledges (and may trim) the
entries of a commit; it makes what was emitted durable and returns True if the run's records are archived by it
(:class:`ArchiveSink`), which is what allows the drainer to trim them from Redis.
"""

from __future__ import annotations

import json
import logging
import os
import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import redis

from stability import keys
from stability.detectors.base import Finding, Severity
from stability.records import PackedSignals, StepRecord
from stability.worker import archive
from stability.worker.archive import ArchiveConfig, ArchiveWriter

__all__ = [
    "ArchiveSink",
    "ConsoleSink",
    "Entry",
    "MetaLookup",
    "RedisFindingsSink",
    "ReportSink",
    "Sink",
    "finding_key",
    "redis_meta",
]

logger = logging.getLogger(__name__)

MetaLookup = Callable[[str], Mapping[str, str]]
"""``run_id -> metadata hash`` (``run_dir``, ``wandb_project``, ...), as strings."""

ARCHIVE_COLUMNS: tuple[str, ...] = ("run_id", "rank", "step", "wall_time", "host", "batch", "entry_id", "coords")
"""Fixed columns of an archive part; one float64 column per signal follows. ``coords``: the record's parallel
coordinates as compact JSON (``{"pp":1,"tp":0}``; null when it has none): the post-mortem's cross-rank comparison
groups the ranks by them, as the worker did (pipeline stages and Hogwild processes are not replicas)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One decoded stream entry."""

    entry_id: str
    """Stream id, ``"<wall ms>-<step>"``."""
    rank: int
    """Rank of the stream the entry was read from."""
    record: StepRecord
    packed: PackedSignals | None = field(default=None, compare=False, repr=False)
    """The record's signals as decoded (names, float64 bytes) when the drainer has them: the archive writes them
    column-wise without reading ``record.signals`` value by value."""


@runtime_checkable
class Sink(Protocol):
    """Receives the findings and records of each processed batch; must tolerate re-delivery of a batch."""

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Handle one processed batch of ``run_id`` (``records`` may be empty, e.g. at the end of the run)."""
        ...

    def close(self, run_id: str) -> None:
        """The run is fully drained: release what is held for it."""
        ...


def finding_key(finding: Finding) -> str:
    """The dedupe key of a finding: ``"<rank>:<kind>:<step>"``; a revision of an alerted diagnosis
    (``evidence["revised"]``) adds what it says (``":revised:<first cause>:<severity>"``), so it reaches the stream
    once, after the alert it corrects."""
    key = f"{finding.rank}:{finding.kind}:{finding.step}"
    if finding.evidence.get("revised"):
        key += f":revised:{finding.causes[0].cause if finding.causes else '-'}:{finding.severity.value}"
    return key


def redis_meta(client: redis.Redis[bytes]) -> MetaLookup:
    """A :data:`MetaLookup` reading ``keys.meta(run_id)`` from Redis."""

    def lookup(run_id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = client.hgetall(keys.meta(run_id))  # type: ignore[assignment]
        return {_text(k): _text(v) for k, v in raw.items()}

    return lookup


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class ConsoleSink:
    """Logs every finding (``logging``: warning/error findings at WARNING/ERROR, others at INFO)."""

    _LEVELS: ClassVar[dict[Severity, int]] = {
        Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.ERROR: logging.ERROR,
    }  # fmt: skip

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Log each finding with its top cause."""
        for f in findings:
            cause = f" (likely {f.causes[0].cause}: {f.causes[0].evidence})" if f.causes else ""
            where = f"rank {f.rank}" + (f" on {f.host}" if f.host else "")
            logger.log(
                self._LEVELS.get(f.severity, logging.INFO),
                "[%s %s] %s at step %d: %s%s",
                run_id, where, f.kind, f.step, f.message, cause,
            )  # fmt: skip

    def close(self, run_id: str) -> None:
        """Nothing to release."""


_ADD_ONCE = """
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'f', ARGV[i + 1])
    added = added + 1
  end
end
return added
"""


def findings_seen_key(run_id: str) -> str:
    """Set of dedupe keys of the findings already in ``keys.findings(run_id)`` (same hash slot)."""
    return keys.findings_seen(run_id)


class RedisFindingsSink:
    """Appends findings to the stream ``keys.findings(run_id)`` as JSON (field ``f``), once per (rank, kind, step).

    The check and the XADD run in one Lua script, so a re-processed batch never adds a finding twice.
    """

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self._client = client
        self._script = client.register_script(_ADD_ONCE)

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Add the findings not yet in the stream."""
        if not findings:
            return
        args: list[str] = []
        for f in findings:
            args += [finding_key(f), json.dumps(f.to_dict())]
        added = self._script(keys=[keys.findings(run_id), findings_seen_key(run_id)], args=args)
        if added != len(findings):
            logger.debug(
                "%s: %d of %d findings were already in the stream", run_id, len(findings) - added, len(findings)
            )

    def close(self, run_id: str) -> None:
        """Nothing to release (the dedupe set stays, so a late re-delivery is still ignored)."""


class ArchiveSink:
    """Writes every processed record to the run's archive: per rank, Parquet segments plus a live tail.

    ``<dir>`` is ``<run_dir>/archive`` when the run's ``run_dir`` (from its metadata) exists on this machine, else
    ``$STABILITY_ARCHIVE_DIR/<run_id>`` when that variable is set (or ``archive_dir`` is given); otherwise the run
    is not archived (logged once). Each batch is appended per rank to ``tail-<rank>-<seq>.arrows`` (framed Arrow
    IPC, readable after a crash), rolled into ``records-<rank>-<seq>.parquet`` by size/time and at the end of the
    run (:mod:`stability.worker.archive` explains the layout and why). Columns: :data:`ARCHIVE_COLUMNS` plus one
    float64 column per signal name, NULL where a record lacks the signal, NaN/Inf kept. A signal whose name
    clashes with a fixed column is stored as ``signal:<name>``. A re-delivered batch is appended again and
    de-duplicated by ``entry_id`` when its segment is rolled (and by readers before that).

    :meth:`sync` fsyncs what was appended; the drainer calls it before acknowledging (and trimming) the entries,
    so Redis drops a record only once it is on disk.
    """

    def __init__(self, meta: MetaLookup, *, archive_dir: str | Path | None = None,
                 config: ArchiveConfig | None = None) -> None:
        self._meta = meta
        base = archive_dir if archive_dir is not None else os.environ.get("STABILITY_ARCHIVE_DIR") or None
        self._base = Path(base) if base is not None else None
        self._config = config or ArchiveConfig()
        self._dirs: dict[str, Path | None] = {}
        self._writers: dict[str, ArchiveWriter] = {}

    def directory(self, run_id: str) -> Path | None:
        """Directory of ``run_id``'s archive (None: not archived); resolved once per run."""
        if run_id not in self._dirs:
            self._dirs[run_id] = self._resolve(run_id)
        return self._dirs[run_id]

    def _resolve(self, run_id: str) -> Path | None:
        directory = archive_directory(self._meta(run_id), self._base, run_id)
        if directory is None:
            logger.info("%s: not archived (run_dir %r not on this host, STABILITY_ARCHIVE_DIR unset)", run_id,
                        self._meta(run_id).get("run_dir"))
        return directory

    def _writer(self, run_id: str, directory: Path) -> ArchiveWriter:
        writer = self._writers.get(run_id)
        if writer is None or writer.directory != directory:
            writer = self._writers[run_id] = ArchiveWriter(directory, self._config)
        return writer

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Append this batch's records to each rank's open segment."""
        directory = self.directory(run_id) if records else None
        if directory is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        by_rank: dict[int, list[Entry]] = {}
        for entry in records:
            by_rank.setdefault(entry.rank, []).append(entry)
        writer = self._writer(run_id, directory)
        for rank, entries in sorted(by_rank.items()):
            writer.append(rank, archive_table(run_id, entries))

    def sync(self, run_id: str) -> bool:
        """Make what :meth:`emit` wrote for ``run_id`` durable; True if the run's records are archived here."""
        directory = self.directory(run_id)
        if directory is None:
            return False
        writer = self._writers.get(run_id)
        if writer is not None:
            writer.sync()
        return True

    def close(self, run_id: str) -> None:
        """At the end of the run: roll every open segment into Parquet (see :func:`compact`), forget the run."""
        directory = self._dirs.pop(run_id, None) or self._resolve(run_id)
        writer = self._writers.pop(run_id, None)
        if writer is not None:
            writer.sync()
        if directory is not None and directory.is_dir():
            compact(directory)


def archive_directory(meta: Mapping[str, str], base: Path | None, run_id: str) -> Path | None:
    """Where a run's archive parts go: ``<run_dir>/archive`` when the run directory is on this host, else
    ``<base>/<run_id>`` (``STABILITY_ARCHIVE_DIR``), else None."""
    run_dir = meta.get("run_dir")
    if run_dir and Path(run_dir).is_dir():
        return Path(run_dir) / "archive"
    if base is not None:
        return base / run_id
    return None


class ReportSink:
    """At the end of a run writes ``findings.json`` and ``report.html`` next to its archive.

    The output directory is the run directory when the archive is ``<run_dir>/archive``, else the archive directory
    itself (``$STABILITY_ARCHIVE_DIR/<run_id>``). The files come from :func:`stability.postmortem.run` over the
    compacted archive, so they are exactly what ``stability postmortem <run dir>`` prints; put this sink after
    :class:`ArchiveSink`, whose ``close`` compacts the parts. The report's path is stored in the run's metadata
    (field ``report``) for the training side's summary line. A failure is logged, never raised (the run is still
    marked drained).
    """

    def __init__(self, meta: MetaLookup, client: redis.Redis[bytes] | None = None, *,
                 archive_dir: str | Path | None = None) -> None:
        self._meta = meta
        self._client = client
        base = archive_dir if archive_dir is not None else os.environ.get("STABILITY_ARCHIVE_DIR") or None
        self._base = Path(base) if base is not None else None

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Nothing to do per batch."""

    def close(self, run_id: str) -> None:
        """Write the run's findings and report (see the class docstring)."""
        try:
            self._write(run_id)
        except Exception:
            logger.exception("%s: could not write the findings and report", run_id)

    def _write(self, run_id: str) -> None:
        from stability import postmortem

        meta = dict(self._meta(run_id))
        directory = archive_directory(meta, self._base, run_id)
        if meta.get("run_dir") and Path(meta["run_dir"]).is_dir():
            meta = {**postmortem.load_run_meta(meta["run_dir"]), **meta}
        if directory is None or not any(directory.glob("*.parquet")):
            logger.info("%s: no archive on this host; no report written", run_id)
            return
        run_dir = meta.get("run_dir")
        out = Path(run_dir) if run_dir and directory == Path(run_dir) / "archive" else directory
        damaged: list[str] = []
        records = postmortem.load_archive(directory, damaged=damaged)
        if damaged:
            meta["damaged_files"] = json.dumps(damaged)
        result = postmortem.analyze(records, run_id, meta=meta)
        json_path, html_path = out / "findings.json", out / "report.html"
        postmortem.write_outputs(result, records, json_out=json_path, html_out=html_path)
        logger.info("%s: findings -> %s, report -> %s", run_id, json_path, html_path)
        if self._client is not None:
            self._client.hset(keys.meta(run_id), mapping={"report": str(html_path), "findings": str(json_path)})


_LEGACY_RE = re.compile(r"^(?:part-(\d+)-.+|records-(\d+))\.parquet$")


def compact(directory: Path) -> None:
    """Close every open segment of ``directory`` into its Parquet file, and fold parts of the older one-file-per-batch
    layout (``part-<rank>-*.parquet``, ``records-<rank>.parquet``) into a new segment per rank.

    Crash-safe: every file is written under a temporary name and renamed before its sources are deleted, and
    readers de-duplicate, so a crash between the two steps loses and repeats nothing.
    """
    import pyarrow.parquet as pq

    archive.finalize_directory(directory)
    legacy: dict[int, list[Path]] = {}
    for path in directory.glob("*.parquet"):
        if m := _LEGACY_RE.match(path.name):
            legacy.setdefault(int(m[1] or m[2]), []).append(path)
    for rank, parts in sorted(legacy.items()):
        table = archive.table_rows_by_entry([pq.read_table(p) for p in parts])
        seqs = [int(m[2]) for p in directory.iterdir() if (m := archive.SEGMENT_RE.match(p.name)) and int(m[1]) == rank]
        target = directory / f"records-{rank}-{max(seqs, default=-1) + 1:06d}.parquet"
        archive.write_parquet_atomically(table, target)
        for part in parts:
            part.unlink(missing_ok=True)
        logger.info("compacted %d archive parts of rank %d into %s", len(parts), rank, target)


def _coords_json(coords: Mapping[str, int]) -> str | None:
    return json.dumps(dict(coords), sort_keys=True, separators=(",", ":")) if coords else None


def archive_table(run_id: str, entries: Sequence[Entry]) -> Any:
    """The ``pyarrow.Table`` of ``entries`` (see :class:`ArchiveSink` for the columns).

    Built column-wise: the records are grouped by signal layout (the names in order; a run repeats a few), each
    group's values go into one float64 matrix (the packed values as decoded when the drainer passed them, else one
    pass over the signal dicts), and each signal column is a row of its transpose (a record without the signal is
    NULL there); no dict lookup per value and name (~15x faster at 206 signals, ``bench/bench_drain.py --stages``).
    """
    import numpy as np
    import pyarrow as pa

    recs = [e.record for e in entries]
    columns: dict[str, Any] = {
        "run_id": pa.array([run_id] * len(recs), pa.string()),
        "rank": pa.array([e.rank for e in entries], pa.int64()),
        "step": pa.array([r.step for r in recs], pa.int64()),
        "wall_time": pa.array([r.wall_time for r in recs], pa.float64()),
        "host": pa.array([r.host for r in recs], pa.string()),
        "batch": pa.array([r.batch for r in recs], pa.string()),
        "entry_id": pa.array([e.entry_id for e in entries], pa.string()),
        "coords": pa.array([_coords_json(r.coords) for r in recs], pa.string()),
    }
    blocks = _signal_blocks(entries)
    for name in sorted({name for _, index, _ in blocks for name in index}):
        column = f"signal:{name}" if name in columns else name
        if len(blocks) == 1:
            _, index, by_signal = blocks[0]
            columns[column] = pa.array(by_signal[index[name]], pa.float64())
            continue
        values = np.zeros(len(recs), np.float64)
        present = np.zeros(len(recs), np.bool_)
        for rows_at, index, by_signal in blocks:
            j = index.get(name)
            if j is not None:
                values[rows_at] = by_signal[j]
                present[rows_at] = True
        columns[column] = pa.array(values, pa.float64(), mask=~present)
    return pa.table(columns)


def _signal_blocks(entries: Sequence[Entry]) -> list[tuple[Any, dict[str, int], Any]]:
    """Per signal layout of ``entries``: its rows, name -> row of its matrix, and the matrix (one row per signal,
    one column per entry). From the entries' packed values when every entry has them (no per-value work), else
    from their signal dicts."""
    import numpy as np

    packs = [e.packed for e in entries]
    packed = [p for p in packs if p is not None]
    use_packed = len(packed) == len(entries)
    groups: dict[Any, tuple[tuple[str, ...], list[int]]] = {}
    for i, entry in enumerate(entries):
        if use_packed:
            names = packed[i][0]
            key: Any = id(names)  # one tuple object per layout (records.decode_packed)
        else:
            names = key = tuple(entry.record.signals)
        groups.setdefault(key, (names, []))[1].append(i)
    blocks = []
    for names, rows in groups.values():
        if use_packed:
            flat = np.frombuffer(b"".join(packed[i][1] for i in rows), "<f8")
        else:
            values = chain.from_iterable(entries[i].record.signals.values() for i in rows)
            flat = np.frombuffer(array("d", values), np.float64)
        by_signal = np.ascontiguousarray(flat.reshape(len(rows), len(names)).T, dtype=np.float64)
        blocks.append((np.array(rows, np.int64), {name: j for j, name in enumerate(names)}, by_signal))
    return blocks
