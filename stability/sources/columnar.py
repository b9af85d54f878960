"""Columnar reading of a big CSV (issue #11): numpy columns per file instead of one ``StepRecord`` dict per row.

:func:`read_columns` streams the file with ``pyarrow.csv`` (column types from the first MB; a numeric column becomes one
float64 array, empty cells a presence mask) and groups the rows into segments with the ``table`` policy of
:class:`~stability.sources.SegmentBuilder` (a step the current segment already holds starts a new one; each
segment sorted by step). It handles the common case only and returns ``None`` for anything else, which then takes
the row-by-row reader (:func:`stability.postmortem.load_csv_log`) with its exact error messages: ``rank``,
``run_id``, ``batch`` or ``host`` columns, a header with blank or repeated names, a row of the wrong width, a cell
in a numeric column that is no number, a step that is empty, negative or not an integer. Values are those of
Python's ``float(cell)`` (pyarrow parses decimal text correctly rounded; cells of a column pyarrow reads as text
go through ``float`` itself).
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stability.sources._model import Segment

__all__ = ["ColumnarCsv", "read_columns"]

META_COLUMNS = ("rank", "run_id", "batch", "host")
_BLOCK = 1 << 20


@dataclass(slots=True, kw_only=True)
class ColumnarCsv:
    """A CSV's signals as columns, rows in analysis order (segment by segment, each sorted by step)."""

    names: list[str]
    """Signal names, in column order."""
    values: list[np.ndarray]
    """float64 per signal (NaN where absent: see :attr:`present`)."""
    present: list[np.ndarray | None]
    """Per signal: where a cell was given (None: everywhere)."""
    steps: np.ndarray
    segments: list[Segment]
    header: list[str]
    """Every column name of the file (stripped)."""

    def __len__(self) -> int:
        return len(self.steps)


class _Fallback(Exception):
    """Not the common case: the row-by-row reader handles (or reports) it."""


def _header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8") as handle:
        first = next(csv.reader(handle), None)
    if not first:
        raise _Fallback
    names = [n.strip() for n in first]
    if len(set(names)) != len(names) or not all(names) or names != first or set(names) & set(META_COLUMNS):
        raise _Fallback
    return names


def _text_column(chunks: list[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """A column pyarrow read as text: None when no cell is a number (ignored, as the row reader does), its
    ``float`` values and presence when every non-blank cell is one; otherwise the row reader must report it."""
    cells = [c for chunk in chunks for c in chunk.to_pylist()]
    values = np.full(len(cells), np.nan)
    present = np.zeros(len(cells), dtype=bool)
    numbers = failures = 0
    parsed: dict[str, float | None] = {}
    for i, cell in enumerate(cells):
        if cell is None or not cell.strip():
            continue
        if cell not in parsed:
            try:
                parsed[cell] = float(cell)
            except ValueError:
                parsed[cell] = None
        value = parsed[cell]
        if value is None:
            failures += 1
        else:
            numbers += 1
            values[i], present[i] = value, True
    if not numbers:
        return None
    if failures:
        raise _Fallback
    return values, present


def _numeric(path: Path) -> set[str]:
    """Columns pyarrow reads as numbers in the first MB (cheap; the text of the others is checked later)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with path.open("rb") as handle:
        head = handle.read(_BLOCK)
    if len(head) == _BLOCK:
        head = head[: head.rfind(b"\n") + 1]
    inferred = pacsv.read_csv(io.BytesIO(head)).schema
    return {f.name for f in inferred if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)}


def _stream(path: Path, header: list[str], numeric: set[str]
            ) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, list[Any]]]:
    """Rows read, then per column: float64 values and presence (numeric columns), arrow chunks (text columns)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    types = {name: pa.float64() if name in numeric else pa.string() for name in header}
    convert = pacsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True,
                                   quoted_strings_can_be_null=True)
    rows = _line_count(path)  # at least the rows (a quoted newline only makes fewer): one array per column
    values = {name: np.empty(rows) for name in header if name in numeric}
    present: dict[str, np.ndarray] = {}
    texts: dict[str, list[Any]] = {name: [] for name in header if name not in numeric}
    done = 0
    with pacsv.open_csv(path, convert_options=convert) as reader:  # batch by batch: no whole-file table
        if reader.schema.names != header:  # (pyarrow drops a byte-order mark that csv keeps)
            raise _Fallback
        for batch in reader:
            n = batch.num_rows
            if done + n > rows:
                raise _Fallback
            for name, column in zip(batch.schema.names, batch.columns, strict=True):
                if name in texts:
                    texts[name].append(column)
                    continue
                values[name][done:done + n] = column.to_numpy(zero_copy_only=False)
                if column.null_count:
                    if name not in present:
                        present[name] = np.ones(rows, dtype=bool)
                    present[name][done:done + n] = column.is_valid().to_numpy(zero_copy_only=False)
            done += n
    pa.default_memory_pool().release_unused()
    return done, values, present, texts


def _read(path: Path) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray | None]]]:
    header = _header(path)
    done, values, present, texts = _stream(path, header, _numeric(path))
    columns: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    for name in header:
        if name in texts:
            text = _text_column(texts.pop(name))
            if text is not None:
                columns[name] = text
        elif name not in present:
            columns[name] = (values[name][:done], None)
        elif present[name][:done].any():
            columns[name] = (values[name][:done], present[name][:done])
    return header, columns


def _line_count(path: Path) -> int:
    count = 0
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            count += block.count(b"\n")
    return count + 1


def _segments(steps: np.ndarray) -> tuple[np.ndarray, list[Segment]]:
    """Row order (segment by segment, each by step) and the segments: a step already in the current segment
    starts a new one (``SegmentBuilder('table')`` for one rank)."""
    bounds = [0]
    seen: set[int] = set()
    for i, step in enumerate(steps.tolist()):
        if step in seen:
            bounds.append(i)
            seen = set()
        seen.add(step)
    bounds.append(len(steps))
    order: list[np.ndarray] = []
    segments: list[Segment] = []
    last: int | None = None
    for start, stop in itertools.pairwise(bounds):
        part = start + np.argsort(steps[start:stop], kind="stable")
        first, end = int(steps[part[0]]), int(steps[part[-1]])
        rows = sum(len(o) for o in order)
        segments.append(Segment(index=len(segments), start=rows, stop=rows + len(part), first_step=first,
                                last_step=end, reason="step went back" if segments else "start",
                                resumed_after=last))
        order.append(part)
        last = end
    return (np.concatenate(order) if order else np.zeros(0, dtype=np.int64)), segments


def _loss_steps(table: ColumnarCsv) -> None:
    """``loss_steps`` = the smallest positive step gap where the row has none (``postmortem._with_loss_steps``)."""
    gaps = np.diff(table.steps)
    gaps = gaps[gaps > 0]
    interval = int(gaps.min()) if len(gaps) else 1
    if interval <= 1:
        return
    if "loss_steps" not in table.names:
        table.names.append("loss_steps")
        table.values.append(np.full(len(table), float(interval)))
        table.present.append(None)
        return
    i = table.names.index("loss_steps")
    mask = table.present[i]
    if mask is not None:
        table.values[i] = np.where(mask, table.values[i], float(interval))
        table.present[i] = None


def read_columns(path: str | Path, *, step_column: str = "step", rename: Mapping[str, str] | None = None,
                 loss_averaged: bool | None = None) -> ColumnarCsv | None:
    """The CSV as columns, or None when the row-by-row reader must take it (see the module docstring).

    ``loss_averaged``: as :func:`stability.postmortem.load_csv_log` (None: for Megatron log fields only)."""
    path = Path(path)
    try:
        header, columns = _read(path)
    except (_Fallback, OSError, UnicodeDecodeError, ValueError, ImportError, csv.Error):
        return None  # (pyarrow's ArrowInvalid is a ValueError)
    if step_column not in columns or columns[step_column][1] is not None:
        return None
    raw_steps = columns.pop(step_column)[0]
    if not len(raw_steps) or not np.isfinite(raw_steps).all() or (raw_steps < 0).any() \
            or (raw_steps != np.floor(raw_steps)).any() or raw_steps.max() >= 2**53:
        return None
    order, segments = _segments(raw_steps.astype(np.int64))
    identity = bool((order == np.arange(len(order))).all())
    names, values, present = [], [], []
    for name in header:
        if name in columns:
            col, mask = columns.pop(name)
            names.append((rename or {}).get(name, name))
            values.append(col if identity else col[order])
            present.append(None if mask is None or mask.all() else mask if identity else mask[order])
    if len(set(names)) != len(names):
        return None
    steps = raw_steps.astype(np.int64)
    table = ColumnarCsv(names=names, values=values, present=present, steps=steps if identity else steps[order],
                        segments=segments, header=header)
    if loss_averaged is None:
        loss_averaged = {"consumed_samples", "skipped_iters"} <= set(header)
    if loss_averaged:
        _loss_steps(table)
    return table
