"""``stability postmortem``: analyse a finished (or crashed) run offline with the same detectors as the worker.

Sources:

* any training log people actually have (:func:`load_source`, :mod:`stability.sources`; format sniffed):
  Megatron-LM / Megatron-DeepSpeed / DeepSpeed / HF Trainer / fairseq / nanoGPT stdout, JSON lines, HF
  ``trainer_state.json`` (or an output directory of checkpoints), TensorBoard event directories, W&B offline run
  directories; plus kernel logs (``system_logs``: Xid, ECC, hung tasks, OOM kills, NCCL timeouts) on the same
  timeline. A file not understood gets one line naming the expected formats. Resumes (a step going back, a new
  start-up banner; in a CSV a (rank, step) given again) start a new segment: each is analysed on its own baseline,
  the rollback is on the timeline, re-logged steps are counted once and do not hide what happened before the
  rollback. The log-only findings and causes are in :mod:`stability.sources.analysis`.
* a CSV file (:func:`load_csv`): ``step`` column required; every other numeric column is a signal (``loss``,
  ``grad_norm``, ``grad_norm/h.3.attn``, ...); optional ``rank``, ``run_id``, ``batch`` and ``host`` columns;
  columns with no numeric cell (``episode``, ``note``) are ignored; ``nan``, ``NAN``, ``inf``, ``Infinity`` and
  scientific notation are accepted; an empty cell means absent.
* Averaged losses: Megatron prints the mean ``lm loss`` over its ``log_interval`` and the HF Trainer the mean over
  ``logging_steps``; with ``loss_averaged=True`` (CLI ``--loss-averaged yes``) each record gets a ``loss_steps``
  signal = the log interval, read as the smallest step gap of its rank. The default (``None``, CLI ``auto``)
  assumes it for files with Megatron's log-line fields (``consumed_samples`` and ``skipped_iters`` columns) and
  nowhere else; a ``loss_steps`` column always wins. The detectors read it (``detectors/spike.py``).
* a Redis URL (``redis://``, ``rediss://``, ``unix://``) and a run id (:func:`run_redis`,
  :mod:`stability.redis_source`): the run's streams plus its archive directory, named by the run metadata.
* a run directory (:func:`load_run_dir`): the worker's archive ``archive/`` (Parquet segments and, for a live or
  crashed run, the crash-readable tails; a damaged file is skipped, named in a warning and in the result's
  ``meta["damaged_files"]``) plus any spool files
  ``spool/spool-rank*.bin`` the training process could not send, and the run metadata ``run.json`` the training
  side wrote (host, versions, config) when present.

:func:`analyze` runs :class:`~stability.detectors.engine.RunDiagnoser` over the records and returns a
:class:`PostmortemResult`; :func:`run` does load + analyse + write the JSON / HTML reports. By default
(:func:`default_outputs`) they go next to the source: ``<run dir>/findings.json`` and ``<run dir>/report.html``, or
``<stem>.findings.json`` and ``<stem>.report.html`` beside a CSV file, or into an output directory.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stability.console import display_remedy
from stability.detectors.base import Finding
from stability.detectors.causes import remedy
from stability.detectors.engine import DiagnoserConfig, Incident, RunDiagnoser
from stability.detectors.history import History
from stability.errors import RecordError, SourceError
from stability.phases import Phase, run_phases
from stability.records import StepRecord, decode
from stability.sources import LoadedLog, LogEvent, Segment, SegmentBuilder

if TYPE_CHECKING:
    from stability.report.artifacts import Artifact
    from stability.sources.columnar import ColumnarCsv

__all__ = [
    "PostmortemResult",
    "analyze",
    "default_outputs",
    "load_archive",
    "load_csv",
    "load_csv_groups",
    "load_csv_log",
    "load_run_dir",
    "load_run_meta",
    "run",
    "run_redis",
    "write_outputs",
]

logger = logging.getLogger(__name__)

_META_COLUMNS = ("rank", "run_id", "batch", "host")
_MEGATRON_FIELDS = ("consumed_samples", "skipped_iters")
_ARCHIVE_META = ("run_id", "rank", "step", "wall_time", "host", "batch", "entry_id", "coords")
RUN_META_FILE = "run.json"
"""Run metadata the training side writes into the run directory (see :mod:`stability.session`)."""


def _run_id_from(path: Path) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.:\-]", "-", path.stem).strip("-_.:") or "run"
    return cleaned[:128]


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{path}: cannot read the CSV file ({exc})") from None
    if not rows:
        raise SourceError(f"{path}: the CSV file is empty (no header line)")
    header = [name.strip() for name in rows[0]]
    if len(set(header)) != len(header):
        raise SourceError(f"{path}, line 1: duplicate column names in the header")
    return header, rows[1:]


def _numeric_columns(path: Path, header: list[str], rows: list[list[str]], skip: set[str]) -> list[int]:
    """Indices of signal columns: a column with at least one number; a non-number in one of them is an error."""
    numeric = []
    for col, name in enumerate(header):
        if name in skip or not name:
            continue
        cells = [(line, row[col].strip()) for line, row in enumerate(rows, start=2) if col < len(row)]
        cells = [(line, cell) for line, cell in cells if cell]
        parsed = [(line, cell, _number(cell)) for line, cell in cells]
        if not any(value is not None for _, _, value in parsed):
            continue
        for line, cell, value in parsed:
            if value is None:
                raise SourceError(f"{path}, line {line}, column {name!r}: {cell!r} is not a number")
        numeric.append(col)
    return numeric


def _load_csv_logs(path: str | Path, group_column: str | None = None, *, step_column: str = "step",
                   rename: Mapping[str, str] | None = None, run_id: str | None = None,
                   loss_averaged: bool | None = None) -> dict[str, LoadedLog]:
    """The CSV's records per group, each split into segments (a (rank, step) repeated: a resume)."""
    path = Path(path)
    header, rows = _read_rows(path)
    if step_column not in header:
        raise SourceError(f"{path}, line 1: no {step_column!r} column (columns: {', '.join(header)})")
    index = {name: i for i, name in enumerate(header)}
    if group_column is not None and group_column not in index:
        raise SourceError(f"{path}, line 1: no {group_column!r} column to group by")
    skip = {step_column, *_META_COLUMNS, *([group_column] if group_column else [])}
    signal_cols = [(i, (rename or {}).get(header[i], header[i])) for i in _numeric_columns(path, header, rows, skip)]
    default_run = run_id or _run_id_from(path)
    groups: dict[str, SegmentBuilder] = {}
    for line, row in enumerate(rows, start=2):
        if not any(cell.strip() for cell in row):
            continue
        cells = row + [""] * (len(header) - len(row))
        step = _int_cell(path, line, step_column, cells[index[step_column]])
        rank = _int_cell(path, line, "rank", cells[index["rank"]]) if "rank" in index else 0
        signals = {name: float(cells[i]) for i, name in signal_cols if cells[i].strip()}
        batch = cells[index["batch"]].strip() or None if "batch" in index else None
        rid = cells[index["run_id"]].strip() if "run_id" in index else ""
        host = cells[index["host"]].strip() if "host" in index else ""
        record = StepRecord(run_id=rid or default_run, step=step, rank=rank, signals=signals, batch=batch, host=host)
        key = cells[index[group_column]].strip() if group_column else ""
        if key not in groups:
            groups[key] = SegmentBuilder("table")
        groups[key].add(record)
    if loss_averaged is None:
        loss_averaged = set(_MEGATRON_FIELDS) <= set(header)
        if loss_averaged:
            logger.info("%s: Megatron log fields present: each loss is taken as the mean over the log interval",
                        path)
    out: dict[str, LoadedLog] = {}
    for key, builder in groups.items():
        records, segments = builder.finish()
        out[key] = LoadedLog(format="csv", records=_with_loss_steps(records) if loss_averaged else records,
                             segments=segments)
    return out


def load_csv_groups(path: str | Path, group_column: str | None = None, *, step_column: str = "step",
                    rename: Mapping[str, str] | None = None, run_id: str | None = None,
                    loss_averaged: bool | None = None) -> dict[str, list[StepRecord]]:
    """Like :func:`load_csv`, split by the text of ``group_column`` (e.g. ``episode`` of an excerpt file).

    Without ``group_column`` everything is one group named ``""``.
    """
    logs = _load_csv_logs(path, group_column, step_column=step_column, rename=rename, run_id=run_id,
                          loss_averaged=loss_averaged)
    return {key: log.records for key, log in logs.items()}


def _with_loss_steps(records: list[StepRecord]) -> list[StepRecord]:
    """Add ``loss_steps`` = the log interval (smallest positive step gap of the rank) where it is missing."""
    steps_by_rank: dict[int, list[int]] = {}
    for record in records:
        steps_by_rank.setdefault(record.rank, []).append(record.step)
    interval = {rank: min((b - a for a, b in itertools.pairwise(steps) if b > a), default=1)
                for rank, steps in steps_by_rank.items()}
    return [r if interval[r.rank] <= 1 or "loss_steps" in r.signals
            else replace(r, signals={**r.signals, "loss_steps": float(interval[r.rank])}) for r in records]


def _int_cell(path: Path, line: int, column: str, cell: str) -> int:
    text = cell.strip()
    try:
        value = int(text)
    except ValueError:
        number = _number(text)
        if number is None or not number.is_integer():
            what = "is empty" if not text else f"{text!r} is not an integer"
            raise SourceError(f"{path}, line {line}, column {column!r}: {what}") from None
        value = int(number)
    if value < 0:
        raise SourceError(f"{path}, line {line}, column {column!r}: {value} is negative")
    return value


def load_csv(path: str | Path, *, step_column: str = "step", rename: Mapping[str, str] | None = None,
             run_id: str | None = None, loss_averaged: bool | None = None) -> list[StepRecord]:
    """Read a CSV of per-step signals into records, sorted by step within each rank (segment by segment when a
    (rank, step) repeats: a resume, see :func:`load_csv_log`).

    Args:
        path: the CSV file.
        step_column: the column holding the optimizer step (default ``step``).
        rename: column -> signal name (e.g. ``{"train_loss": "loss"}``).
        run_id: run id of the records when the file has no ``run_id`` column (default: from the file name).
        loss_averaged: each row's loss is the mean since the previous logged step (``True``), a one-step value
            (``False``), or ``None``: assumed for Megatron log fields only (see the module docstring).

    Raises:
        SourceError: unreadable file, no step column, or a cell that is not a number (names file, line, column).
    """
    return load_csv_log(path, step_column=step_column, rename=rename, run_id=run_id,
                        loss_averaged=loss_averaged).records


def load_csv_log(path: str | Path, *, step_column: str = "step", rename: Mapping[str, str] | None = None,
                 run_id: str | None = None, loss_averaged: bool | None = None) -> LoadedLog:
    """:func:`load_csv` with its segments: a row whose (rank, step) the file already holds starts a new segment
    (the run was rolled back and resumed); records come segment by segment, each sorted by (rank, step)."""
    logs = _load_csv_logs(path, None, step_column=step_column, rename=rename, run_id=run_id,
                          loss_averaged=loss_averaged)
    return logs.get("", LoadedLog(format="csv", records=[], segments=[]))


def load_run_dir(path: str | Path, *, damaged: list[str] | None = None) -> list[StepRecord]:
    """Read a run directory: the archive (``archive/``: Parquet segments and live tails, see
    :mod:`stability.worker.archive`) and ``spool/spool-rank*.bin``, de-duplicated by (rank, step).

    A damaged archive file (truncated, not Parquet) does not stop the read: the rest is read, a warning names the
    file and its path is appended to ``damaged`` when given.

    Raises:
        SourceError: not a directory, or no records at all.
    """
    root = Path(path)
    if not root.is_dir():
        raise SourceError(f"{root}: not a run directory")
    records = _archive_records(root / "archive", damaged)
    for file in sorted((root / "spool").glob("spool-rank*.bin")):
        for record in _read_spool(file):
            records.setdefault((record.rank, record.step), record)
    if not records:
        raise SourceError(f"{root}: no records (looked for archive/*.parquet and spool/spool-rank*.bin)")
    return sorted(records.values(), key=lambda r: (r.rank, r.step))


def load_archive(directory: str | Path, *, damaged: list[str] | None = None) -> list[StepRecord]:
    """Read one archive directory (``<run dir>/archive`` or ``$STABILITY_ARCHIVE_DIR/<run>``): closed Parquet
    segments, live tails of a running or crashed run, and files of older layouts.

    Damaged files are skipped with a warning and listed in ``damaged`` (see :func:`load_run_dir`).

    Raises:
        SourceError: no records.
    """
    records = _archive_records(Path(directory), damaged)
    if not records:
        raise SourceError(f"{directory}: no records (looked for *.parquet and tail-*.arrows)")
    return sorted(records.values(), key=lambda r: (r.rank, r.step))


def _archive_records(directory: Path, damaged: list[str] | None = None) -> dict[tuple[int, int], StepRecord]:
    """Records of an archive directory by (rank, step), the first file in name order winning (closed segments
    ``records-*`` sort before live tails ``tail-*``)."""
    from stability.worker.archive import iter_archive_files

    records: dict[tuple[int, int], StepRecord] = {}
    for file in iter_archive_files(directory):
        try:
            rows = list(_read_archive_file(file))
        except SourceError as exc:
            logger.warning("damaged archive file skipped: %s", exc)
            if damaged is not None:
                damaged.append(str(file))
            continue
        for record in rows:
            records.setdefault((record.rank, record.step), record)
    return records


def _read_archive_file(file: Path) -> Iterable[StepRecord]:
    """Rows of one archive file; a live tail that was rolled meanwhile is read from its Parquet segment."""
    if file.suffix == ".parquet":
        return _read_parquet(file)
    from stability.worker.archive import read_tail

    try:
        read = read_tail(file)
    except FileNotFoundError:
        segment = file.with_name(file.name.replace("tail-", "records-", 1)).with_suffix(".parquet")
        return _read_parquet(segment) if segment.exists() else []
    except OSError as exc:
        raise SourceError(f"{file}: cannot read the archive tail ({exc})") from None
    if read.damaged:
        logger.warning("%s: live archive tail ends in a torn frame at offset %d; read the %d frames before it",
                       file, read.valid_bytes, len(read.tables))
    return itertools.chain.from_iterable(_table_records(t, file) for t in read.tables)


def load_run_meta(run_dir: str | Path) -> dict[str, str]:
    """The run metadata in ``<run_dir>/run.json`` (empty when absent or unreadable), values as strings."""
    try:
        data = json.loads((Path(run_dir) / RUN_META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}


def _read_parquet(file: Path) -> Iterable[StepRecord]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow raises several unrelated types
        raise SourceError(f"{file}: cannot read the Parquet archive ({exc})") from None
    return _table_records(table, file)


def _table_records(table: Any, file: Path) -> Iterable[StepRecord]:
    if "step" not in table.column_names:
        raise SourceError(f"{file}: no 'step' column in the Parquet archive")
    columns = table.to_pydict()
    signal_names = [n for n in table.column_names if n not in _ARCHIVE_META]
    fallback = _run_id_from(file.parent.parent)
    out = []
    for i, step in enumerate(columns["step"]):
        if step is None:
            continue

        def meta(name: str, default: Any, i: int = i) -> Any:
            value = columns[name][i] if name in columns else None
            return default if value is None else value

        signals = {n: float(columns[n][i]) for n in signal_names if columns[n][i] is not None}
        out.append(StepRecord(run_id=str(meta("run_id", fallback)), step=int(step), rank=int(meta("rank", 0)),
                              wall_time=float(meta("wall_time", 0.0)), host=str(meta("host", "")),
                              batch=meta("batch", None), signals=signals, coords=_coords(meta("coords", None))))
    return out


def _coords(text: str | None) -> dict[str, int]:
    """An archive row's ``coords`` (compact JSON of name -> int; archives written before it have none)."""
    if not text:
        return {}
    try:
        data = json.loads(text)
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (ValueError, TypeError):
        return {}


def _read_spool(file: Path) -> list[StepRecord]:
    try:
        from stability.transport import read_spool
    except ImportError:  # the transport is optional for an offline post-mortem
        logger.warning("%s: stability.transport.read_spool is not available; spool file skipped", file)
        return []
    out = []
    for entry_id, payload in read_spool(file):
        try:
            out.append(decode(payload))
        except RecordError as exc:
            logger.warning("%s: spool entry %s skipped (%s)", file, entry_id, exc)
    return out


def _jsonable(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class PostmortemResult:
    """Outcome of :func:`analyze`."""

    run_id: str
    steps: int
    """Distinct steps analysed."""
    ranks: tuple[int, ...]
    incidents: tuple[Incident, ...]
    alerts: tuple[Finding, ...] = field(default=())
    """The findings the online worker would have alerted on."""
    meta: Mapping[str, str] = field(default_factory=dict)
    """Run metadata (host, versions, config, W&B link, ...), shown in the report."""
    segments: tuple[Segment, ...] = ()
    """The source's segments (one per process lifetime; a resume starts a new one), when it has several."""
    log_events: tuple[LogEvent, ...] = ()
    """Events the logs state (fp16 overflows, checkpoint loads, system faults), on the timeline."""
    artifacts: tuple[Artifact, ...] = ()
    """Profiler traces and hang stack dumps found in the run directory (:mod:`stability.report.artifacts`)."""
    performance: tuple[str, ...] = ()
    """Step time and memory per rank in words (records with the timing hooks' signals only)."""
    phases: tuple[Phase, ...] = ()
    """The run cut into warm-up / stable / degradation / divergence / restart phases (:mod:`stability.phases`)."""
    baseline: Mapping[str, Any] | None = None
    """Where the run parts from a baseline run, by signal (:mod:`stability.baseline`), when one was given."""

    @property
    def counts(self) -> dict[str, int]:
        """Number of incidents per severity (``error``, ``warning``, ``info``)."""
        out = {"error": 0, "warning": 0, "info": 0}
        for incident in self.incidents:
            out[incident.headline.severity.value] += 1
        return out

    def worst(self) -> str | None:
        """The highest severity among the incidents (None: no incident)."""
        return next((sev for sev in ("error", "warning", "info") if self.counts[sev]), None)

    @property
    def events(self) -> list[dict[str, Any]]:
        """One dict per incident (its headline finding, the earliest onset, the end, all kinds)."""
        return [_event(incident) for incident in self.incidents]

    def to_dict(self, base: Path | None = None) -> dict[str, Any]:
        """The report as plain data (non-finite values as strings); artifact paths relative to ``base`` (the
        directory of the findings file) when given, else absolute."""
        out = {"run_id": self.run_id, "steps": self.steps, "ranks": list(self.ranks), "counts": self.counts,
               "meta": dict(self.meta), "events": self.events}
        if self.phases:
            out["phases"] = [p.to_dict() for p in self.phases]
        if self.baseline is not None:
            out["baseline"] = dict(self.baseline)
        if len(self.segments) > 1:
            out["segments"] = [s.to_dict() for s in self.segments]
        if self.log_events:
            shown = _shown_events(self.log_events)
            out["log_events"] = [e.to_dict() for e in shown]
            if len(shown) < len(self.log_events):
                out["log_events_omitted"] = len(self.log_events) - len(shown)
        if self.performance:
            out["performance"] = list(self.performance)
        if self.artifacts:
            out["artifacts"] = [a.to_dict(base) for a in self.artifacts]
        return out

    def to_json(self, base: Path | None = None) -> str:
        """The report as strict JSON text: ``{"run_id", "steps", "events": [...]}`` (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(base), indent=2, allow_nan=False)


MAX_LOG_EVENTS = 200
"""Log events listed in the findings JSON (the first and last of each kind beyond that are kept)."""


def _shown_events(events: Sequence[LogEvent]) -> list[LogEvent]:
    if len(events) <= MAX_LOG_EVENTS:
        return list(events)
    per_kind: dict[str, list[int]] = {}
    for i, event in enumerate(events):
        per_kind.setdefault(event.kind, []).append(i)
    share = max(2, MAX_LOG_EVENTS // max(1, len(per_kind)))
    keep: set[int] = set()
    for indices in per_kind.values():
        keep.update(indices[: share // 2] + indices[-(share - share // 2):])
    return [events[i] for i in sorted(keep)]


def _event(incident: Incident) -> dict[str, Any]:
    head = incident.headline
    top = head.causes[0].cause if head.causes else "unknown"
    return {
        "kind": head.kind,
        "step": head.step,
        "onset": incident.onset,
        "end": incident.end,
        "severity": head.severity.value,
        "causes": [{"cause": c.cause, "score": c.score, "evidence": c.evidence} for c in head.causes],
        "remedy": display_remedy(head.causes[0].remedy if head.causes else remedy(top), incident.skip_batches),
        "rollback_step": head.rollback_step,
        "skip_batches": incident.skip_batches,
        "rank": incident.rank,
        "host": next((f.host for f in incident.findings if f.host), ""),
        "message": head.message,
        "signal": head.signal,
        "value": _jsonable(head.value),
        "detected_step": incident.first_step,
        "kinds": incident.kinds,
    }


def analyze(records: Sequence[StepRecord], run_id: str, *, config: DiagnoserConfig | None = None,
            meta: Mapping[str, str] | None = None, segments: Sequence[Segment] | None = None,
            events: Sequence[LogEvent] | None = None, progress: bool | None = None,
            run_dir: str | Path | None = None, history: Callable[[], History] | None = None) -> PostmortemResult:
    """Run the detector suite over ``records`` and return the incidents; ``meta`` goes to the report.

    ``run_dir`` (default: ``meta["run_dir"]`` when that directory exists here): where the profiler traces and hang
    stack dumps the report links are looked for (:func:`stability.report.artifacts.find_artifacts`).

    Without ``segments`` the records may come in any order (fed by step, then rank), unless a (rank, step) comes
    twice: then they are taken in the given order and split where a (rank, step) repeats, as a CSV is. With
    segments (a log source, :func:`stability.sources.load_log`) each segment's records are fed in turn (by step,
    then rank): a resume makes a rank's step go back and the detectors re-baseline, so what happened before a
    rollback is analysed too, and steps logged twice are counted once. Segments or ``events`` (a log source) also
    bring the log findings and the causes only logs evidence (:func:`stability.sources.analysis.apply_log_context`).
    ``progress``: a progress bar on stderr (default: when stderr is a terminal and the analysis is long).
    ``history``: makes each rank's detector history (:class:`RunDiagnoser`'s; the columnar path's lazy one).
    """
    if segments is None and len({(r.rank, r.step) for r in records}) < len(records):
        # a (rank, step) given twice: records of a resumed run in log order (e.g. load_csv's), split as a CSV is
        builder = SegmentBuilder("table")
        for record in records:
            builder.add(record)
        records, found = builder.finish()
        segments = found if len(found) > 1 else None
    diagnoser = RunDiagnoser(config, history=history)
    alerts: list[Finding] = []
    chunks = [records[s.start:s.stop] for s in segments] if segments else [records]
    owner: dict[int, int] = {}
    """id(incident) -> index of the segment it was found in."""
    with _progress(len(records), progress) as advance:
        for index, chunk in enumerate(chunks):
            for record in sorted(chunk, key=lambda r: (r.step, r.rank)):
                alerts.extend(diagnoser.update(record))
                advance()
            if index + 1 < len(chunks) and segments and segments[index + 1].first_step < segments[index].last_step:
                # the process ended here and the next one rolled back: flush what the detectors hold (every rank
                # that logs again re-baselines), so each incident is attributed to its own segment
                alerts.extend(diagnoser.finish())
            for incident in diagnoser.incidents:
                owner.setdefault(id(incident), index)
    alerts.extend(diagnoser.finish())
    for incident in diagnoser.incidents:
        owner.setdefault(id(incident), len(chunks) - 1)
    incidents = sorted(diagnoser.incidents, key=lambda i: (i.onset, i.rank))
    log_segments = tuple(segments or ())
    if segments is not None or events:
        from stability.sources.analysis import apply_log_context

        if not log_segments and records:
            steps = [r.step for r in records]
            log_segments = (Segment(index=0, start=0, stop=len(records), first_step=min(steps),
                                    last_step=max(steps)),)
        incidents, _ = apply_log_context(incidents, records, log_segments, list(events or ()), owner=owner)
    from stability.report._data import perf_summary
    from stability.report.artifacts import find_artifacts

    if run_dir is None and (meta or {}).get("run_dir") and Path(str((meta or {})["run_dir"])).is_dir():
        run_dir = str((meta or {})["run_dir"])
    return PostmortemResult(run_id=run_id, steps=len({r.step for r in records}),
                            ranks=tuple(sorted({r.rank for r in records})), incidents=tuple(incidents),
                            alerts=tuple(alerts), meta=dict(meta or {}), segments=log_segments,
                            log_events=tuple(events or ()) + _phase_starts(records), artifacts=find_artifacts(run_dir),
                            performance=tuple(perf_summary(records)), phases=_phases(records, log_segments))


def _phase_starts(records: Sequence[StepRecord]) -> tuple[LogEvent, ...]:
    """The captured ``phase_start`` records (another optimizer took over; the detectors re-baselined there)."""
    return tuple(LogEvent(kind="phase_start", step=r.step, rank=r.rank, host=r.host or "", source="records",
                          message=f"a new training phase at step {r.step}: another optimizer (other parameters) "
                          "took over; the detectors re-baselined")
                 for r in records if r.signals.get("phase_start", 0.0) > 0)


def _phases(records: Sequence[StepRecord], segments: Sequence[Segment]) -> tuple[Phase, ...]:
    """The run's phases; a failure there (ruptures missing, a degenerate series) costs the phases, not the report."""
    try:
        return tuple(run_phases(records, segments))
    except (ImportError, ValueError, ArithmeticError) as exc:
        logger.warning("phases of the run not computed: %s", exc)
        return ()


PROGRESS_MIN_RECORDS = 5_000
"""Records above which :func:`analyze` shows a progress bar (about a second of detector time: ~170 us a record
for a one-rank log, docs/benchmarks.md)."""
READ_STATUS_BYTES = 20 << 20
"""A file above this size shows a "reading" status on a terminal while it is read (a CSV as columns: ~1 s; a text
log: ~1 s per 100k lines)."""
STATUS_MIN_RECORDS = 50_000
"""Records above which the steps around the detectors (screen, report) show a status line on a terminal."""


@contextlib.contextmanager
def status(text: str, enabled: bool = True) -> Iterator[None]:
    """A transient ``rich`` status line (spinner + ``text``) on stderr while the block runs, only when stderr is a
    terminal and ``enabled``."""
    if not (enabled and sys.stderr.isatty()):
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


@contextlib.contextmanager
def _progress(total: int, enabled: bool | None) -> Iterator[Callable[[], None]]:
    """A ``rich`` progress bar on stderr, only when stderr is a terminal (or ``enabled``); yields ``advance()``."""
    if enabled is None:
        enabled = total >= PROGRESS_MIN_RECORDS and sys.stderr.isatty()
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("analysing records", total=total)
        count = 0

        def advance() -> None:
            nonlocal count
            count += 1
            if count % 1000 == 0 or count == total:
                bar.update(task, completed=count)
        yield advance


def default_outputs(source: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Where :func:`run` writes by default: ``(findings JSON, HTML report)``.

    A run directory gets ``findings.json`` and ``report.html`` inside it, a CSV file ``<stem>.findings.json`` and
    ``<stem>.report.html`` beside it; with ``out_dir`` the same names go into that directory instead.
    """
    source = Path(source)
    if source.is_dir():
        base, prefix = source, ""
    else:
        base, prefix = source.parent, f"{source.stem}."
    if out_dir is not None:
        base = Path(out_dir)
    return base / f"{prefix}findings.json", base / f"{prefix}report.html"


def write_outputs(result: PostmortemResult, records: Sequence[StepRecord], *, json_out: str | Path | None = None,
                  html_out: str | Path | None = None) -> None:
    """Write the findings JSON and/or the HTML report (each through a temporary file, then renamed)."""
    if json_out is not None:
        _write_text(Path(json_out), result.to_json(Path(json_out).parent) + "\n")
    if html_out is not None:
        from stability.report import render_html

        _write_text(Path(html_out), render_html(result, records, base=Path(html_out).parent))


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent.stat().st_mode & 0o077 == 0:  # a private run directory keeps its files private (0600)
        from stability._files import write_private_text

        write_private_text(path, text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def run_redis(url: str, run_id: str | None = None, *, out_dir: str | Path | None = None,
              json_out: str | Path | None = None, html_out: str | Path | None = None
              ) -> tuple[PostmortemResult, Path, Path]:
    """Analyse run ``run_id`` (None: the only run there) of the Redis at ``url``: its streams plus its archive,
    de-duplicated by (rank, step). Writes ``<run id>.findings.json`` / ``<run id>.report.html`` into ``out_dir``
    (default: the current directory) unless ``json_out`` / ``html_out`` say otherwise; returns the result and the
    two paths.

    Raises:
        SourceError: unreachable Redis, unknown run, or no records (one line, password redacted).
    """
    from stability import redis_source

    rid, records, meta = redis_source.load_run(url, run_id)
    base = Path(out_dir) if out_dir is not None else Path(".")
    json_path = Path(json_out) if json_out is not None else base / f"{rid}.findings.json"
    html_path = Path(html_out) if html_out is not None else base / f"{rid}.report.html"
    result = analyze(records, rid, meta=meta)
    write_outputs(result, records, json_out=json_path, html_out=html_path)
    return result, json_path, html_path


def run(source: str | Path | Sequence[str | Path], json_out: str | Path | None = None,
        html_out: str | Path | None = None, *,
        run_id: str | None = None, loss_averaged: bool | None = None,
        system_logs: Sequence[str | Path] = (), progress: bool | None = None,
        baseline: str | Path | None = None, exact: bool = False) -> PostmortemResult:
    """Load ``source`` (run directory, Redis URL, CSV file or any log of :func:`load_source`), analyse it and write
    the requested reports.

    Several paths: the per-rank / per-node logs of one run (:func:`load_source`).

    ``run_id`` overrides the run id (default: the records' own, or the file name); for a Redis URL it names the
    run to load (see :func:`run_redis`); ``loss_averaged`` is passed to :func:`load_csv`; ``system_logs``: kernel
    logs (dmesg, journal) of the run's nodes whose events go on the same timeline; ``baseline``: another run (any
    source but Redis) to compare with, step by step (:func:`stability.baseline.compare_runs`).
    A CSV is read as columns and only its global signals and the per-module columns a screen cannot clear are
    replayed through the detectors (:mod:`stability.fast_postmortem`; the same findings); ``exact`` forces one
    record per row with every column (the reference path).

    Raises:
        SourceError: the source cannot be read or holds no records.
    """
    from stability.redis_source import is_redis_url

    if isinstance(source, str) and is_redis_url(source):
        return run_redis(source, run_id, json_out=json_out, html_out=html_out)[0]
    several = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    source = several[0]
    damaged: list[str] = []
    if not source.exists():
        raise SourceError(f"{source}: no such file or directory")
    records, log, table = _load(source, several, run_id=run_id, loss_averaged=loss_averaged, exact=exact,
                                damaged=damaged)
    if system_logs:
        from stability.sources.ranks import add_system_logs

        log = add_system_logs(log or LoadedLog(format="run directory", records=records, segments=[]), system_logs)
    if not records and not (log and log.events) and table is None:
        raise SourceError(f"{source}: no records")
    meta = _meta(source, several, log, damaged)
    rid = run_id or (records[0].run_id if records else _run_id_from(source))
    run_dir = source if _is_run_dir(source) else None
    if table is not None and log is not None:
        from stability.fast_postmortem import analyze_columns

        result, records = analyze_columns(table, rid, meta=meta, events=log.events, progress=progress)
    elif log is not None:
        result = analyze(records, rid, meta=meta, segments=log.segments, events=log.events, progress=progress,
                         run_dir=run_dir)
    else:
        result = analyze(records, rid, meta=meta, progress=progress, run_dir=run_dir)
    if baseline is not None:
        from stability.baseline import compare_runs

        other = Path(baseline)
        base_records = load_run_dir(other) if _is_run_dir(other) else load_source(other).records
        result = replace(result, baseline=compare_runs(records, base_records, name=str(other)))
    with status("writing the findings and the report", len(records) >= STATUS_MIN_RECORDS):
        write_outputs(result, records, json_out=json_out, html_out=html_out)
    return result


def _log_meta(log: LoadedLog) -> dict[str, str]:
    """What a log source adds to the report's metadata: format, start-up context, reading notes, rank hosts."""
    meta = {"format": log.format, **{f"context.{k}": v for k, v in list(log.context.items())[:40]}}
    if log.notes:
        meta["notes"] = "; ".join(log.notes)
    if log.hosts:
        from stability.sources.ranks import describe_hosts

        meta["hosts"] = describe_hosts(log.hosts)
    return meta


def _load(source: Path, several: Sequence[Path], *, run_id: str | None, loss_averaged: bool | None, exact: bool,
          damaged: list[str]) -> tuple[list[StepRecord], LoadedLog | None, ColumnarCsv | None]:
    """The records of ``source`` (none yet for a CSV read as columns), its log and its columns; ``several``: all the
    files given (per-rank logs read as one run)."""
    if len(several) > 1:
        log = load_source(several, run_id=run_id, loss_averaged=loss_averaged)
        return log.records, log, None
    if _is_run_dir(source):
        return load_run_dir(source, damaged=damaged), None, None
    table = None if exact else _read_columns(source, loss_averaged)
    if table is not None:
        return [], LoadedLog(format="csv", records=[], segments=table.segments), table
    size = source.stat().st_size if source.is_file() else 0
    with status(f"reading {source.name} ({size >> 20} MB)", size >= READ_STATUS_BYTES):
        log = load_source(source, run_id=run_id, loss_averaged=loss_averaged)
    return log.records, log, None


def _meta(source: Path, several: Sequence[Path], log: LoadedLog | None, damaged: list[str]) -> dict[str, str]:
    meta = load_run_meta(source) if _is_run_dir(source) else {"source": ", ".join(map(str, several))}
    if log is not None:
        meta.update(_log_meta(log))
    if damaged:
        meta["damaged_files"] = json.dumps(damaged)
    return meta


def _read_columns(path: Path, loss_averaged: bool | None) -> ColumnarCsv | None:
    """A CSV source as columns (:func:`stability.sources.columnar.read_columns`), or None: not a CSV, or one the
    row-by-row reader must take."""
    from stability.sources import sniff
    from stability.sources.columnar import read_columns

    fmt = sniff(path)
    if not (fmt == "csv" or (fmt == "unknown" and path.suffix.lower() == ".csv")):
        return None
    size = path.stat().st_size
    with status(f"reading {path.name} ({size >> 20} MB)", size >= READ_STATUS_BYTES):
        return read_columns(path, loss_averaged=loss_averaged)


def _is_run_dir(path: Path) -> bool:
    """A stability run directory (archive, spool or run.json), as opposed to a TensorBoard / W&B / HF directory."""
    return path.is_dir() and any((path / name).exists() for name in ("archive", "spool", RUN_META_FILE))


def load_source(path: str | Path | Sequence[str | Path], *, run_id: str | None = None,
                loss_averaged: bool | None = None) -> LoadedLog:
    """Read any non-Redis source but a stability run directory: a CSV (:func:`load_csv_log`) or a log
    (:func:`stability.sources.load_log`: training logs, JSON lines, trainer_state.json, TensorBoard, W&B offline,
    a directory of per-rank logs); several paths: the per-rank / per-node / per-task logs of one run
    (:func:`stability.sources.load_logs`).

    Raises:
        SourceError: unreadable, or not a known format (one line naming what was expected).
    """
    from stability.sources import EXPECTED, load_log, load_logs, sniff

    if not isinstance(path, (str, Path)):
        paths = [Path(p) for p in path]
        if len(paths) != 1:
            return _averaged(load_logs(paths, run_id=run_id), loss_averaged)
        path = paths[0]
    path = Path(path)
    fmt = sniff(path)
    if fmt == "csv" or (fmt == "unknown" and path.suffix.lower() == ".csv"):
        return load_csv_log(path, run_id=run_id, loss_averaged=loss_averaged)
    if fmt == "unknown":
        if path.is_dir():
            raise SourceError(f"{path}: not a run directory (no archive/, spool/ or run.json) and no TensorBoard, "
                              f"W&B, HF Trainer files or per-rank training logs; expected {EXPECTED}")
        raise SourceError(f"{path}: format not recognised; expected {EXPECTED}")
    return _averaged(load_log(path, run_id=run_id, fmt=fmt), loss_averaged)


def _averaged(log: LoadedLog, loss_averaged: bool | None) -> LoadedLog:
    averaged = set(log.format.split("+")) & {"megatron", "hf-trainer", "hf-trainer-state", "fairseq"}
    if log.records and (loss_averaged or (loss_averaged is None and averaged)):
        log.records = _with_loss_steps(log.records)
    return log
