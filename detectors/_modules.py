"""Vectorised bookkeeping of the per-module detectors: one record's signal layout parsed once, and the trailing
windows of all a detector's series in one ``[series x window]`` ring.

A run repeats the same signal names on every record, so :func:`layout` parses a record's names once (a
:class:`Schema`: each name's quantity and module, the positions of each quantity) and hands back the same object
for every record with that name list; a detector keys its own plan (which positions it reads, which of its rows
they are) on that object. :class:`Rings` holds the windows of every series of a detector as rows of two float64
matrices (x and y) with a write position and a fill count per row, so one record's values are judged and pushed
by a few numpy operations over all the detector's series instead of a Python loop per value (issue #14 item 8).

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

from stability.detectors._stats import MAD_TO_SIGMA
from stability.records import StepRecord, split_signal

__all__ = ["Rings", "Schema", "layout", "line_predict", "log_list", "row_median"]


class Schema:
    """The parsed name list of a record: each name's quantity and module, in record order."""

    __slots__ = ("by_quantity", "modules", "names", "quantities")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        parts = [split_signal(n) for n in names]
        self.quantities = [q for q, _ in parts]
        self.modules = [m for _, m in parts]
        self.by_quantity: dict[str, list[int]] = {}
        """quantity -> positions of its series (global and per module) in record order."""
        for i, q in enumerate(self.quantities):
            self.by_quantity.setdefault(q, []).append(i)


_SCHEMAS: dict[tuple[str, ...], Schema] = {}
_MAX_SCHEMAS = 256
_last: list[Any] = [None, None, None, None]
"""[record, its signals mapping, Schema, values array] of the latest record (several detectors read one record)."""


def layout(record: StepRecord) -> tuple[Schema, np.ndarray]:
    """``record``'s :class:`Schema` and its values as a float64 array in the same order (cached for the latest
    record: every per-module detector of a rank reads the same record)."""
    signals = record.signals
    if _last[0] is record and _last[1] is signals:
        return _last[2], _last[3]
    names = tuple(signals)
    schema = _SCHEMAS.get(names)
    if schema is None:
        if len(_SCHEMAS) >= _MAX_SCHEMAS:
            _SCHEMAS.clear()
        schema = _SCHEMAS[names] = Schema(names)
    values = np.fromiter(signals.values(), dtype=np.float64, count=len(names))
    _last[:] = [record, signals, schema, values]
    return schema, values


def log_list(values: np.ndarray) -> np.ndarray:
    """``math.log`` of each (positive, finite) value: the per-value code's exact logs (see the module docstring)."""
    return np.array(list(map(math.log, values.tolist())), dtype=np.float64)


def row_median(a: np.ndarray) -> np.ndarray:
    """The median of each row of a 2-d array, exactly as ``_stats.median`` computes it for one row (the mean of
    the two middle order statistics)."""
    n = a.shape[1]
    lo, hi = (n - 1) // 2, n // 2
    if lo == hi:
        mid = np.partition(a, lo, axis=1)[:, lo]
        return 0.5 * (mid + mid)
    part = np.partition(a, (lo, hi), axis=1)
    return 0.5 * (part[:, lo] + part[:, hi])


class Rings:
    """Trailing windows of ``size`` (x, y) points for a growing set of series (rows), oldest first on read."""

    __slots__ = ("count", "head", "rows", "size", "x", "y")

    def __init__(self, size: int) -> None:
        self.size = size
        self.rows = 0
        self.x = np.zeros((0, size))
        self.y = np.zeros((0, size))
        self.head = np.zeros(0, dtype=np.int64)
        """Position of each row's oldest point."""
        self.count = np.zeros(0, dtype=np.int64)
        """Points in each row's window."""

    def add_row(self) -> int:
        """A new empty row; its index."""
        if self.rows == len(self.head):
            cap = max(8, 2 * self.rows)
            self.x = np.resize(self.x, (cap, self.size))
            self.y = np.resize(self.y, (cap, self.size))
            self.head = np.resize(self.head, cap)
            self.count = np.resize(self.count, cap)
        row = self.rows
        self.head[row] = 0
        self.count[row] = 0
        self.rows += 1
        return row

    def push(self, rows: np.ndarray, x: float | np.ndarray, y: np.ndarray) -> None:
        """Append one point to each of ``rows`` (distinct), dropping the oldest beyond ``size``."""
        if len(rows) == 0:
            return
        head, count = self.head[rows], self.count[rows]
        full = count == self.size
        pos = head + count
        pos[pos >= self.size] -= self.size
        self.x[rows, pos] = x
        self.y[rows, pos] = y
        self.head[rows] = np.where(full, np.where(head + 1 == self.size, 0, head + 1), head)
        self.count[rows] = np.where(full, count, count + 1)

    def clear(self, row: int) -> None:
        """Forget every point of ``row``."""
        self.head[row] = 0
        self.count[row] = 0

    def ordered(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The x and y windows of ``rows`` (each holding ``n`` points), oldest first: two ``[rows x n]`` arrays."""
        idx = self.head[rows, None] + np.arange(n)
        idx[idx >= self.size] -= self.size
        return self.x[rows[:, None], idx], self.y[rows[:, None], idx]

    def row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """One row's x and y windows, oldest first (contiguous 1-d arrays)."""
        n = int(self.count[row])
        idx = (int(self.head[row]) + np.arange(n)) % self.size
        return self.x[row, idx], self.y[row, idx]

    def load_row(self, row: int, xs: list[Any], ys: list[Any]) -> None:
        """Fill ``row`` with a saved window (the last ``size`` points of it)."""
        self.clear(row)
        keep = list(zip(xs, ys, strict=True))[-self.size:]
        for i, (x, y) in enumerate(keep):
            self.x[row, i] = float(x)
            self.y[row, i] = float(y)
        self.count[row] = len(keep)

    def row_state(self, row: int) -> dict[str, Any]:
        """``_stats.Window.state_dict``'s format for one row (x as integers when they all are)."""
        xs, ys = self.row(row)
        return {"x": xs.astype(np.int64).tolist() if np.all(xs == np.round(xs)) else xs.tolist(), "y": ys.tolist()}


def line_predict(xs: np.ndarray, ys: np.ndarray, x: float, scale_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~stability.detectors._stats.predict_line` for each row of ``[rows x n]`` windows (``n >= 2``, at
    least ``min_points``): the robust line's level at ``x`` and the residual scale, per row, bit-identical to the
    one-row function (same order statistics, same elementwise operations)."""
    half = xs.shape[1] // 2
    dx = xs[:, half : 2 * half] - xs[:, :half]
    slope = row_median((ys[:, half : 2 * half] - ys[:, :half]) / dx)
    last = xs[:, -1]
    level = row_median(ys - slope[:, None] * (xs - last[:, None]))
    residuals = ys - (level[:, None] + slope[:, None] * (xs - last[:, None]))
    scale = np.maximum(MAD_TO_SIGMA * row_median(np.abs(residuals - row_median(residuals)[:, None])), scale_floor)
    return level + slope * (x - last), scale
