"""Vectorised bookkeeping of the per-module detectors: one record's signal layout parsed once, and the trailing
windows of all a detector's series in one ``[series x window]`` ring.

A run repeats the same signal names on every record, so :func:`schema_of` parses a record's names once (a
:class:`Schema`: each name's quantity and module, the positions and names of each quantity) and hands back the
same object for every record with that name list; a detector keys its own plan (which positions it reads, which
of its rows they are) on that object, and a per-value detector loops over :meth:`Schema.series` instead of every
signal. :class:`Rings` holds the windows of every series of a detector as rows of two float64 matrices (x and y),
aligned on their newest point, with a fill count per row, so one record's values are judged and pushed by a few
numpy operations over all the detector's series instead of a Python loop per value (issue #14 item 8). Below
:data:`VECTOR_MIN` series the numpy calls cost more than the loop: the detectors then keep their per-value code.

Exactness: the detectors built on this compute the same float64 values as the per-value code they replace
(medians as the same order statistics, the same elementwise ``+ - * /``); logs and exps are taken with
:mod:`math` per value, as before (numpy's vectorised ``log``/``exp`` may differ in the last bit), and decisions
at a threshold are made on scalars (``tests/test_vectorised.py`` replays record streams against the reference
findings of the per-value code).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stability.detectors._stats import pack_window, unpack_window
from stability.records import StepRecord, split_signal

__all__ = ["VECTOR_MIN", "Rings", "Schema", "SizeSwitch", "layout", "log_list", "row_median", "schema_of"]

VECTOR_MIN = 10
"""Series of a record from which a detector takes its vectorised path (fewer: the per-value loop is cheaper;
measured crossover 9-11 series for the vanishing and growth rules)."""


class Schema:
    """The parsed name list of a record: each name's quantity and module, in record order."""

    __slots__ = ("_series", "by_quantity", "modules", "names", "quantities")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        parts = [split_signal(n) for n in names]
        self.quantities = [q for q, _ in parts]
        self.modules = [m for _, m in parts]
        self.by_quantity: dict[str, list[int]] = {}
        """quantity -> positions of its series (global and per module) in record order."""
        for i, q in enumerate(self.quantities):
            self.by_quantity.setdefault(q, []).append(i)
        self._series: dict[tuple[str, bool], list[str]] = {}

    def series(self, quantity: str, modules_only: bool = False) -> list[str]:
        """The names of ``quantity``'s series (only ``<quantity>/<module>`` ones with ``modules_only``), in record
        order: what a per-value detector loops over instead of every signal of the record."""
        key = (quantity, modules_only)
        names = self._series.get(key)
        if names is None:
            names = self._series[key] = [self.names[i] for i in self.by_quantity.get(quantity, ())
                                         if not (modules_only and self.modules[i] is None)]
        return names


_SCHEMAS: dict[tuple[str, ...], Schema] = {}
_MAX_SCHEMAS = 256
_last: list[Any] = [None, None, None, None]
"""[record, its signals mapping, Schema, values array] of the latest record (several detectors read one record)."""


def schema_of(record: StepRecord) -> Schema:
    """``record``'s :class:`Schema` (cached for the latest record: every per-module detector of a rank reads the
    same record)."""
    signals = record.signals
    if _last[0] is record and _last[1] is signals:
        schema: Schema = _last[2]
        return schema
    names = tuple(signals)
    schema = _SCHEMAS.get(names)  # type: ignore[assignment]
    if schema is None:
        if len(_SCHEMAS) >= _MAX_SCHEMAS:
            _SCHEMAS.clear()
        schema = _SCHEMAS[names] = Schema(names)
    _last[:] = [record, signals, schema, None]
    return schema


def layout(record: StepRecord) -> tuple[Schema, np.ndarray]:
    """``record``'s :class:`Schema` and its values as a float64 array in the same order (cached as above)."""
    schema = schema_of(record)
    values = _last[3]
    if values is None:
        signals = record.signals
        values = _last[3] = np.fromiter(signals.values(), dtype=np.float64, count=len(signals))
    return schema, values


def log_list(values: np.ndarray) -> np.ndarray:
    """``math.log`` of each (positive, finite) value: the per-value code's exact logs (see the module docstring)."""
    return np.array(list(map(math.log, values.tolist())), dtype=np.float64)


def row_median(a: np.ndarray) -> np.ndarray:
    """The median of each row of a 2-d array, exactly as ``_stats.median`` computes it for one row (the mean of
    the two middle order statistics)."""
    n = a.shape[1]
    part = np.sort(a, axis=1)  # (faster than np.partition along an axis for these sizes; the same order statistics)
    out: np.ndarray = 0.5 * (part[:, (n - 1) // 2] + part[:, n // 2])
    return out


class Rings:
    """Trailing windows of ``size`` (x, y) points for a growing set of series (rows), aligned on their newest point.

    Every row's window ends at the same column (``end``): the last ``n`` points of all rows are one basic slice
    of the matrices (:meth:`slab`, a view: no gather), and pushing a value to every row is one column store. A
    row that gets no value on a push moves its window one column right (a copy of that row only), so the
    alignment holds; when the buffer's ``size // 4`` spare columns are used up the windows move back to its start.

    Memory (issue #10: a worker holds thousands of ranks): ``size + max(8, size // 4)`` columns (not ``3 * size``)
    and rows grown by a quarter (not doubled), ~2.4x less than before for the same windows; a move back costs
    ``rows x size`` copies every ``size // 4`` pushes, a few per row and push.
    """

    __slots__ = ("cols", "count", "end", "rows", "size", "x", "y")

    def __init__(self, size: int) -> None:
        self.size = size
        self.cols = size + max(8, size // 4)
        self.rows = 0
        self.x = np.zeros((0, self.cols))
        self.y = np.zeros((0, self.cols))
        self.end = size
        """Column after every row's newest point."""
        self.count = np.zeros(0, dtype=np.int64)
        """Points in each row's window."""

    def add_row(self) -> int:
        """A new empty row; its index."""
        if self.rows == len(self.count):
            cap = self.rows + max(8, self.rows // 4)
            self.x = np.resize(self.x, (cap, self.cols))
            self.y = np.resize(self.y, (cap, self.cols))
            self.count = np.resize(self.count, cap)
        row = self.rows
        self.count[row] = 0
        self.rows += 1
        return row

    def push(self, rows: np.ndarray, x: float | np.ndarray, y: np.ndarray) -> None:
        """Append one point to each of ``rows`` (distinct, ascending), dropping the oldest beyond ``size``."""
        n_rows, size = self.rows, self.size
        if len(rows) == 0:
            return
        if len(rows) == n_rows:  # every row (rows are distinct): one column
            self.push_all(x, y)
            return
        end = self._room()
        idle = np.ones(n_rows, dtype=bool)
        idle[rows] = False
        others = np.flatnonzero(idle)
        self.x[others, end - size + 1 : end + 1] = self.x[others, end - size : end]
        self.y[others, end - size + 1 : end + 1] = self.y[others, end - size : end]
        self.x[rows, end] = x
        self.y[rows, end] = y
        self.count[rows] += self.count[rows] < size
        self.end = end + 1

    def push_all(self, x: float | np.ndarray, y: np.ndarray, *, full: bool = False) -> None:
        """:meth:`push` to every row (``y`` in row order); ``full``: every row already holds ``size`` points."""
        end = self._room()
        n_rows = self.rows
        self.x[:n_rows, end] = x
        self.y[:n_rows, end] = y
        if not full:
            count = self.count[:n_rows]
            count += count < self.size
        self.end = end + 1

    def _room(self) -> int:
        """The column of the next push (the windows moved back to the buffer's start when it is used up)."""
        end, size, n_rows = self.end, self.size, self.rows
        if end == self.cols:
            self.x[:n_rows, :size] = self.x[:n_rows, end - size : end]
            self.y[:n_rows, :size] = self.y[:n_rows, end - size : end]
            end = size
        return end

    def clear(self, row: int) -> None:
        """Forget every point of ``row``."""
        self.count[row] = 0

    def slab(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The last ``n`` columns of every row (views, ``[rows x n]``): the window of each row holding ``n``."""
        return self.x[: self.rows, self.end - n : self.end], self.y[: self.rows, self.end - n : self.end]

    def row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """One row's x and y windows, oldest first (contiguous 1-d copies)."""
        start = self.end - int(self.count[row])
        return self.x[row, start : self.end].copy(), self.y[row, start : self.end].copy()

    def load_row(self, row: int, state: dict[str, Any]) -> None:
        """Fill ``row`` with a saved window (:meth:`row_state`, or the former ``{"x": [...], "y": [...]}``; the
        last ``size`` points of it)."""
        xs, ys = unpack_window(state)
        xs, ys = xs[-self.size :], ys[-self.size :]
        start = self.end - len(ys)
        self.x[row, start : self.end] = xs
        self.y[row, start : self.end] = ys
        self.count[row] = len(ys)

    def row_state(self, row: int) -> dict[str, Any]:
        """One row's window in the packed format of :func:`~._stats.pack_window`."""
        return pack_window(*self.row(row))


class SizeSwitch:
    """Base of a detector with a vectorised and a per-value implementation that share one state format.

    Each record's layout (:class:`Schema`) picks one (:meth:`_wide`, cached per layout; None: no series, either
    will do); when a layout crosses the size, the state moves to the other implementation, which changes no
    decision. Subclasses set ``name`` and implement :meth:`_make` and :meth:`_wide`.
    """

    name = ""

    def __init__(self) -> None:
        self._is_wide = False
        self._impl: Any = self._make(False)
        self._wide_by: dict[Schema, bool | None] = {}

    def _make(self, wide: bool) -> Any:
        """A fresh implementation: vectorised when ``wide``, else per-value."""
        raise NotImplementedError

    def _wide(self, schema: Schema) -> bool | None:
        """Whether records of this layout go to the vectorised implementation (None: either)."""
        raise NotImplementedError

    def update(self, record: StepRecord) -> list[Any]:
        """Consume one record."""
        schema = schema_of(record)
        if schema not in self._wide_by:
            if len(self._wide_by) >= 64:
                self._wide_by.clear()
            self._wide_by[schema] = self._wide(schema)
        wide = self._wide_by[schema]
        if wide is not None and wide != self._is_wide:
            impl = self._make(wide)
            impl.load_state_dict(self._impl.state_dict())
            self._impl, self._is_wide = impl, wide
        found: list[Any] = self._impl.update(record)
        return found

    def finish(self) -> list[Any]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (one format for both implementations)."""
        state: dict[str, Any] = self._impl.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._impl.load_state_dict(state)
