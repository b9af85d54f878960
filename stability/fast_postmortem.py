"""The post-mortem of a big CSV without a Python dict of every signal per row: screen, then exact replay.

The exact path (:func:`stability.postmortem.analyze` over one ``StepRecord`` per row with every column) spends
most of its time on per-module columns that are quiet. Here the CSV arrives as columns
(:mod:`stability.sources.columnar`) and:

1. **Screen** (:func:`quiet_columns`): a ``grad_norm/<module>`` column is left out of the replay when numpy proves,
   over the whole column, that no detector reading it can act on it: every value finite and positive; the
   per-layer jump rule (``LAYER_GRAD``, 20x over a robust line through the last 32 values) cannot fire, because
   ``y - min(W) + (max(W) - min(W)) * 2.25 * gap_max / gap_min < log 20`` for each value ``y`` (log) and its
   trailing window ``W`` (the line's prediction is at least ``min(W)`` minus the steepest falling slope between
   points ``n // 2`` apart times the distance from the window's first point, ``n <= 32``,
   ``n / (n // 2) <= 2.25`` for ``n >= 8``); the vanishing history rule cannot fire (``y > max(W64) - log 100``);
   and on no row do the layers differ by 1e4x (the vanishing layers rule, for any subset of them). Windows skip
   the steps the fp16 scaler skipped (the detectors do not see their gradients) and restart where a resume
   re-baselines the detectors. By induction every value is accepted into the baselines, so the detectors that
   do see the other columns keep exactly the state they would have had.
2. **Exact replay**: the same :class:`~stability.detectors.engine.RunDiagnoser` runs over one light record per row
   (global signals plus the columns the screen kept). Root-cause ranking reads per-module history at a finding:
   :class:`ColumnHistory` gives it those columns' values from the arrays, lazily, exactly as the engine's
   ``History`` would have held them (the last ``module_history_steps`` records, float32, gradients absent on
   skipped steps).

Findings equal the exact path's (``tests/test_postmortem_fast.py`` compares the findings JSON on the real runs,
the test data and synthetic faults). The report gets the light records, with every column on the records near an
incident (heat maps) and on each segment's first record (the signal list).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from stability.detectors.base import BACKOFF, STEP_STATISTICS
from stability.detectors.engine import DiagnoserConfig
from stability.detectors.history import TRACKED_QUANTITIES, History
from stability.detectors.update import LAYER_GRAD
from stability.detectors.vanish import VanishConfig
from stability.records import StepRecord, split_signal
from stability.sources._model import LogEvent
from stability.sources.columnar import ColumnarCsv

if TYPE_CHECKING:
    from stability.postmortem import PostmortemResult

__all__ = ["ColumnHistory", "analyze_columns", "quiet_columns", "skipped_rows"]

JUMP_LOG = math.log(LAYER_GRAD.factor)
"""The per-layer gradient jump the screen must exclude (the screen holds only for the default settings, which
:func:`_config_matches` checks; the constants are read from them)."""
JUMP_WINDOW, JUMP_MIN = LAYER_GRAD.window, LAYER_GRAD.min_points
VANISH_LOG = math.log(VanishConfig().factor)
VANISH_WINDOW, VANISH_MIN = VanishConfig().window, VanishConfig().min_points
LAYERS_LOG = math.log(VanishConfig().layer_factor)
_MARGIN = 1e-6
REPORT_SPAN = 128
"""Steps around an incident's onset whose records keep every column for the report."""


def _config_matches(config: DiagnoserConfig) -> bool:
    """The screen's constants are the default detector settings (another config: no screen)."""
    default = DiagnoserConfig()
    return config.layer_grad == default.layer_grad and config.vanish == default.vanish


def _chunks(steps: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges between resumes (a step going back: the engine starts fresh detectors)."""
    cuts = [0, *(np.flatnonzero(np.diff(steps) < 0) + 1).tolist(), len(steps)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _column(table: ColumnarCsv, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Values and presence of ``name`` (NaN / False when the file has no such column)."""
    if name not in table.names:
        return np.full(len(table), np.nan), np.zeros(len(table), dtype=bool)
    i = table.names.index(name)
    mask = table.present[i]
    return table.values[i], np.ones(len(table), dtype=bool) if mask is None else mask


def skipped_rows(table: ColumnarCsv) -> np.ndarray:
    """Rows the engine takes for steps the fp16 scaler skipped (:func:`~stability.detectors.base.is_skipped_step`
    with the rank's last recorded scale, which a resume forgets)."""
    skipped, has_skipped = _column(table, "skipped")
    scale, _ = _column(table, "loss_scale")
    grad, has_grad = _column(table, "grad_norm")
    out: np.ndarray = has_skipped & (np.nan_to_num(skipped, nan=0.0) > 0)
    valid = np.isfinite(scale) & (scale > 0)
    for a, b in _chunks(table.steps):
        idx = np.where(valid[a:b], np.arange(b - a), -1)
        last = np.maximum.accumulate(idx)
        prev_idx = np.concatenate([[-1], last[:-1]])
        prev = np.where(prev_idx >= 0, scale[a:b][np.maximum(prev_idx, 0)], np.nan)
        backoff = (prev_idx >= 0) & (scale[a:b] * BACKOFF < prev)
        overflow = has_grad[a:b] & ~np.isfinite(grad[a:b])
        out[a:b] |= valid[a:b] & (backoff | overflow)
    return out


def _window(values: np.ndarray, size: int, reduce: Callable[[np.ndarray, np.ndarray], np.ndarray],
            fill: float) -> np.ndarray:
    """``reduce`` over the ``size`` values before each position (``fill`` where there are none), in log2(size)
    vectorised passes."""
    padded = np.concatenate([np.full(size, fill), values])
    span, acc = 1, padded
    while span * 2 <= size:
        acc = reduce(acc[:-span], acc[span:])
        span *= 2
    n = len(values)
    # acc[i] covers padded[i : i + span]; the window before position k is padded[k : k + size]
    out: np.ndarray = reduce(acc[:n], acc[size - span: size - span + n])
    return out


def _column_quiet(y: np.ndarray, x: np.ndarray) -> bool:
    """No jump and no collapse in one series of log values ``y`` at steps ``x`` (one detector lifetime)."""
    if len(y) <= JUMP_MIN:
        return True
    gaps = np.diff(x)
    if gaps.min() < 1:
        return False
    spread = 2.25 * float(gaps.max()) / float(gaps.min())
    low = _window(y, JUMP_WINDOW, np.minimum, np.inf)[JUMP_MIN:]
    high = _window(y, JUMP_WINDOW, np.maximum, -np.inf)[JUMP_MIN:]
    if not (y[JUMP_MIN:] - low + (high - low) * spread < JUMP_LOG - _MARGIN).all():
        return False
    top = _window(y, VANISH_WINDOW, np.maximum, -np.inf)[VANISH_MIN:]
    return bool((y[VANISH_MIN:] > top - VANISH_LOG + _MARGIN).all())


def quiet_columns(table: ColumnarCsv, skipped: np.ndarray, config: DiagnoserConfig) -> set[str]:
    """Names of the ``grad_norm/<module>`` columns the replay may leave out (see the module docstring)."""
    names = [n for n in table.names if split_signal(n)[1] is not None]
    grads = [table.names.index(n) for n in names if split_signal(n)[0] == "grad_norm"]
    if not grads or not _config_matches(config) or 2 * len(names) + len(table.names) >= config.max_series:
        return set()  # (the detectors' per-rank series limits must not be reached on either path)
    seen = ~skipped
    hi = np.full(len(table), -np.inf)
    lo = np.full(len(table), np.inf)
    chunks = _chunks(table.steps)
    quiet: list[str] = []
    finite = 0
    for i in grads:
        values, mask = table.values[i], table.present[i]
        given = values if mask is None else values[mask]
        if not (np.isfinite(given).all() and (given > 0).all()):
            continue
        finite += 1
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.log(np.where(np.isnan(values), 1.0, values))
        on = seen if mask is None else seen & mask
        hi = np.where(on, np.maximum(hi, y), hi)
        lo = np.where(on, np.minimum(lo, y), lo)
        # the column's own rules now, while its logs are at hand (one column's logs in memory at a time)
        if all(_column_quiet(*_seen_part(y, table.steps, on, a, b)) for a, b in chunks):
            quiet.append(table.names[i])
    if finite < len(grads):  # a zero / non-finite layer: the layers rule is not proven for every subset
        for i in grads:
            values, mask = table.values[i], table.present[i]
            given = values if mask is None else values[mask]
            if np.isfinite(given).all() and (given > 0).all():
                continue
            on = seen & np.isfinite(values) & (values > 0) & (True if mask is None else mask)
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.log(np.where(on, values, 1.0))
            hi, lo = np.where(on, np.maximum(hi, y), hi), np.where(on, np.minimum(lo, y), lo)
    rows = np.isfinite(hi) & np.isfinite(lo)
    if (hi[rows] - lo[rows] >= LAYERS_LOG - _MARGIN).any():
        return set()
    return set(quiet)


def _seen_part(y: np.ndarray, steps: np.ndarray, on: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The log values and steps (float) of rows ``a:b`` the detectors see (no copy of ``y`` when they see all)."""
    part = on[a:b]
    if part.all():
        return y[a:b], steps[a:b].astype(np.float64)
    return y[a:b][part], steps[a:b][part].astype(np.float64)


class _Feed:
    """Shared by the histories of one replay: the records in feed order and how many were pushed."""

    def __init__(self, records: Sequence[StepRecord], table: ColumnarCsv, tracked: list[int],
                 kept: list[int] | None = None) -> None:
        self.records = records
        self.row = 0
        self.skipped = bytearray(len(records))
        self.table = table
        glob = [i for i in (kept or []) if "/" not in table.names[i]]
        self.glob_names = [table.names[i] for i in glob]
        """The global signals every record carries (their names in record order), when no cell of them is absent:
        a pushed record's global values are then a row of :attr:`glob_values` (``None``: read the record)."""
        dense = bool(glob) and all(table.present[i] is None for i in glob)
        self.glob_values = np.stack([table.values[i] for i in glob], axis=1) if dense else None
        self.tracked = tracked
        """Indices of the columns the engine's history would keep (``TRACKED_QUANTITIES`` per module)."""
        stats = [i for i in tracked if split_signal(table.names[i])[0] in STEP_STATISTICS]
        self.any_stat = self._any(stats)
        self.any_other = self._any([i for i in tracked if i not in stats])
        self.is_stat = {i: i in stats for i in tracked}

    def _any(self, columns: list[int]) -> np.ndarray:
        out = np.zeros(len(self.table), dtype=bool)
        for i in columns:
            mask = self.table.present[i]
            if mask is None:
                return np.ones(len(self.table), dtype=bool)
            out |= mask
        return out


class ColumnRing:
    """What ``History.modules`` (a :class:`~stability.detectors.history.Ring`) would hold, read from the columns:
    the rows pushed since this history started, the last ``size`` of them on demand."""

    def __init__(self, feed: _Feed, size: int, max_series: int) -> None:
        self.feed, self.size, self.max_series = feed, size, max_series
        self.rows: list[int] = []
        self._series: tuple[int, dict[str, None]] = (-1, {})

    def note(self, row: int, skipped: bool) -> None:
        """Row ``row`` was pushed to the history (only rows with a tracked module value count)."""
        if self.feed.any_other[row] or (self.feed.any_stat[row] and not skipped):
            self.rows.append(row)

    def _present(self, i: int, rows: np.ndarray) -> np.ndarray:
        mask = self.feed.table.present[i]
        on = np.ones(len(rows), dtype=bool) if mask is None else mask[rows]
        if self.feed.is_stat[i]:
            on &= np.frombuffer(self.feed.skipped, dtype=np.uint8)[rows] == 0
        return on

    @property
    def series(self) -> dict[str, None]:
        """Series names in order of their first pushed value (as ``Ring.series``' keys)."""
        if self._series[0] != len(self.rows):
            rows = np.asarray(self.rows, dtype=np.int64)
            first = []
            for i in self.feed.tracked:
                hits = np.flatnonzero(self._present(i, rows))
                if len(hits):
                    first.append((int(hits[0]), self.feed.tracked.index(i), self.feed.table.names[i]))
            self._series = (len(self.rows), {name: None for *_, name in sorted(first)[: self.max_series]})
        return self._series[1]

    def ordered(self, name: str | None = None) -> np.ndarray:
        """Steps (``name=None``) or the series ``name`` over the last ``size`` pushed rows, oldest first."""
        rows = np.asarray(self.rows[-self.size:], dtype=np.int64)
        table = self.feed.table
        if name is None:
            return table.steps[rows]
        i = table.names.index(name)
        return np.where(self._present(i, rows), table.values[i][rows], np.nan).astype(np.float32)


class ColumnHistory(History):
    """The engine's :class:`History` with its per-module ring read lazily from the columns (see the module
    docstring); global signals, the LR tracker and the first step as ``History.push`` keeps them."""

    def __init__(self, feed: _Feed, *, steps: int, module_steps: int, max_series: int) -> None:
        super().__init__(steps=steps, module_steps=module_steps, max_series=max_series)
        self.feed = feed
        self.modules = ColumnRing(feed, module_steps, max_series)  # type: ignore[assignment]

    def push(self, record: StepRecord) -> None:
        """Add one record (the next of the feed, or its copy without gradient statistics on a skipped step)."""
        feed = self.feed
        row = feed.row
        feed.row += 1
        skipped = record.signals is not feed.records[row].signals
        feed.skipped[row] = skipped
        if self.first_step is None:
            self.first_step = record.step
        if feed.glob_values is not None and not skipped:  # the record's global signals, from the columns
            self.globals.push_layout(record.step, feed.glob_names, feed.glob_values[row])
        else:
            self.globals.push(record.step, {k: v for k, v in record.signals.items() if "/" not in k})
        self.modules.note(row, skipped)  # type: ignore[attr-defined]
        self.lr.update(record.step, record.get("lr"))


_NO_COORDS: Mapping[str, int] = MappingProxyType({})
"""The coordinates of every light record (a CSV has none): one read-only empty mapping, not a dict a row."""


def _rows(table: ColumnarCsv, columns: list[int], run_id: str) -> list[StepRecord]:
    """One record per row with ``columns`` (absent cells left out)."""
    names = [table.names[i] for i in columns]
    lists: list[list[Any]] = [table.values[i].tolist() for i in columns]
    for i, col in zip(columns, lists, strict=True):
        mask = table.present[i]
        if mask is not None:
            for absent in np.flatnonzero(~mask).tolist():
                col[absent] = None
    sparse = any(table.present[i] is not None for i in columns)
    steps = table.steps.tolist()
    rows: Iterator[tuple[Any, ...]] = zip(*lists, strict=True) if lists else iter([()] * len(steps))
    if sparse:
        return [StepRecord(run_id=run_id, step=step, coords=_NO_COORDS,
                           signals={n: v for n, v in zip(names, row, strict=True) if v is not None})
                for step, row in zip(steps, rows, strict=True)]
    return [StepRecord(run_id=run_id, step=step, signals=dict(zip(names, row, strict=True)), coords=_NO_COORDS)
            for step, row in zip(steps, rows, strict=True)]


def analyze_columns(table: ColumnarCsv, run_id: str, *, config: DiagnoserConfig | None = None,
                    meta: dict[str, str] | None = None, events: Sequence[LogEvent] = (),
                    progress: bool | None = None, run_dir: str | Path | None = None
                    ) -> tuple[PostmortemResult, list[StepRecord]]:
    """:func:`stability.postmortem.analyze` of a columnar CSV (see the module docstring); returns the result and
    the records for the report."""
    from stability.postmortem import STATUS_MIN_RECORDS, analyze, status

    config = config or DiagnoserConfig()
    with status("screening the per-layer columns", progress is not False and len(table) >= STATUS_MIN_RECORDS):
        skipped = skipped_rows(table)
        quiet = quiet_columns(table, skipped, config)
        kept = [i for i, n in enumerate(table.names) if n not in quiet]
        records = _rows(table, kept, run_id)
    factory = None
    if quiet:
        tracked = [i for i, n in enumerate(table.names)
                   if (q := split_signal(n))[1] is not None and q[0] in TRACKED_QUANTITIES]
        feed = _Feed(records, table, tracked, kept)

        def factory() -> History:
            return ColumnHistory(feed, steps=config.history_steps, module_steps=config.module_history_steps,
                                 max_series=config.max_series)
    result = analyze(records, run_id, config=config, meta=meta, segments=table.segments, events=events,
                     progress=progress, run_dir=run_dir, history=factory)
    if quiet:
        _widen(records, table, [i.onset for i in result.incidents], run_id)
    return result, records


def _widen(records: list[StepRecord], table: ColumnarCsv, onsets: list[int], run_id: str) -> None:
    """Every column on the records within :data:`REPORT_SPAN` steps of an incident and on each segment's first."""
    rows = {seg.start for seg in table.segments}
    if onsets:
        near = np.zeros(len(table), dtype=bool)
        for onset in onsets:
            near |= np.abs(table.steps - onset) <= REPORT_SPAN
        rows.update(np.flatnonzero(near).tolist())
    order = np.asarray(sorted(rows), dtype=np.int64)
    if not len(order):
        return
    # the selected rows of every column at once, then one dict a row
    values = [v[order].tolist() for v in table.values]
    given = [None if m is None else m[order].tolist() for m in table.present]
    for k, row in enumerate(order.tolist()):
        signals = {name: column[k] for name, column, mask in zip(table.names, values, given, strict=True)
                   if mask is None or mask[k]}
        records[row] = StepRecord(run_id=run_id, step=int(table.steps[row]), signals=signals)
