"""O(log w) streaming order statistics of a trailing window: the per-value fast path of the per-module detectors.

The per-module detectors (:mod:`~stability.detectors.update`, :mod:`~stability.detectors.vanish`) used to take a
median (and a Theil-Sen line) over each series' window for every value: 40-200 numpy calls per record, ~100
records/s at 200 signals (issue #14 item 8). :class:`SortedWindow` keeps the same trailing window as
:class:`~stability.detectors._stats.Window` also as a sorted list, so its median, minimum and maximum are O(1) to
read and O(log w) (plus a w-element ``memmove``) to update, bit-identical to ``median(window.y)``.

:func:`level_lower_bound` is a provable lower bound of the robust line's prediction
(:meth:`~stability.detectors._stats.Baseline.predict`): when a value is less than ``factor`` over that bound, it is
less than ``factor`` over the prediction too, so the detector accepts it without fitting the line. Values near or
above the bound take the exact path, so every decision is the one the full fit makes (exact, not an approximation:
the detectors' findings do not change; ``tests/test_rolling.py`` checks it on streams with jumps, trends, steps).
"""

from __future__ import annotations

import bisect
import math
from array import array
from typing import Any

import numpy as np

from stability.detectors._stats import Prediction, pack_window, predict_line, unpack_window

__all__ = ["FastBaseline", "SortedWindow", "level_lower_bound"]

_IRREGULAR = 1
_NONFINITE = 2

_MARGIN = 1e-9
"""Slack (log units) for the floating-point rounding of the exact path (numpy sums in another order)."""


class SortedWindow:
    """The last ``size`` points of a series, in arrival order and with their values sorted (median / min / max in
    O(1), push in O(log w) plus a ``memmove``).

    ``regular`` says whether the window's x values are strictly increasing by at least 1 (the steps of one series)
    and its values are all finite: :func:`level_lower_bound` relies on it, and a caller reads :attr:`median` only
    while it holds.

    Memory (issue #10: a worker holds thousands of ranks' windows): the points are a ring (a list of the values,
    the sorted list sharing their float objects, an ``array('d')`` of x and a ``bytearray`` of flags, overwritten
    in place once full), ~1.9 KB for 32 points instead of ~5.7 KB with three deques.
    """

    __slots__ = ("_flags", "_head", "_irregular", "_last_x", "_nonfinite", "_order", "_sorted", "_xs", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: list[float] = []
        """The values, a ring once full: the oldest at ``_head``."""
        self._xs = array("d")
        self._flags = bytearray()
        """Per point: :data:`_IRREGULAR` (x not at least 1 past the previous one) | :data:`_NONFINITE`."""
        self._head = 0
        self._sorted: list[float] = []
        self._irregular = 0
        self._nonfinite = 0
        self._last_x = -math.inf

    def __len__(self) -> int:
        return len(self._order)

    def push(self, x: float, y: float) -> None:
        """Append one point, dropping the oldest beyond ``size`` (as ``Window.push``)."""
        flag = 0 if x - self._last_x >= 1.0 else _IRREGULAR
        if not math.isfinite(y):
            flag |= _NONFINITE
            self._nonfinite += 1
        if flag & _IRREGULAR:
            self._irregular += 1
        order = self._order
        if len(order) == self.size:
            head = self._head
            old_flag = self._flags[head]
            if old_flag & _NONFINITE:
                self._nonfinite -= 1
            else:
                del self._sorted[bisect.bisect_left(self._sorted, order[head])]
            if old_flag & _IRREGULAR:
                self._irregular -= 1
            order[head] = y
            self._xs[head] = x
            self._flags[head] = flag
            self._head = head + 1 if head + 1 < self.size else 0
        else:
            order.append(y)
            self._xs.append(x)
            self._flags.append(flag)
        if not flag & _NONFINITE:
            bisect.insort(self._sorted, y)
        self._last_x = x

    def clear(self) -> None:
        """Forget every point (as ``Window.clear``)."""
        self._order = []
        self._xs = array("d")
        self._flags = bytearray()
        self._head = 0
        self._sorted = []
        self._irregular = 0
        self._nonfinite = 0
        self._last_x = -math.inf

    def values(self) -> list[float]:
        """The window's y values, oldest first."""
        h = self._head
        return self._order[h:] + self._order[:h] if h else list(self._order)

    def steps(self) -> list[float]:
        """The window's x values, oldest first."""
        h = self._head
        return (self._xs[h:] + self._xs[:h]).tolist() if h else self._xs.tolist()

    @property
    def finite(self) -> bool:
        """Every value in the window is finite (:attr:`median`, :attr:`low`, :attr:`high` are exact)."""
        return self._nonfinite == 0

    @property
    def regular(self) -> bool:
        """:attr:`finite`, and every x in the window is at least 1 past the previous one."""
        return self._irregular == 0 and self._nonfinite == 0

    @property
    def last_x(self) -> float:
        """The newest x pushed."""
        return self._last_x

    @property
    def first_x(self) -> float:
        """The oldest x in the window."""
        return self._xs[self._head]

    @property
    def median(self) -> float:
        """The median of the window's values as ``_stats.median`` computes it (mean of the two middle ones); only
        while :attr:`finite` (a non-finite value is not in the sorted list)."""
        s = self._sorted
        n = len(s)
        return 0.5 * (s[(n - 1) // 2] + s[n // 2])

    @property
    def low(self) -> float:
        """The smallest value (while :attr:`finite`)."""
        return self._sorted[0]

    @property
    def high(self) -> float:
        """The largest value (while :attr:`finite`)."""
        return self._sorted[-1]


def level_lower_bound(window: SortedWindow, x: float) -> float:
    """A lower bound of the robust-line prediction at ``x`` (``Baseline.predict(x).level``) over ``window``'s points,
    or ``-inf`` when none is known (irregular window, fewer than 2 points, or ``x`` not past the window).

    The line's slope is the median of slopes between points ``h = n // 2`` apart, each at least
    ``(low - high) / h`` (x strictly increasing by >= 1, so pairs are >= h apart); the prediction is
    ``median_i(y_i + slope * (x - x_i))`` and every term is at least ``y_i + min(0, slope) * (x - x_first)``, so the
    prediction is at least ``median(y) + min(0, slope_min) * (x - x_first)`` (the median is monotone).
    """
    s = window._sorted
    n = len(window._order)
    if n < 2 or window._irregular or window._nonfinite or not x >= window._last_x:
        return -math.inf
    return (0.5 * (s[(n - 1) // 2] + s[n // 2]) + (s[0] - s[-1]) / (n // 2) * (x - window._xs[window._head])) - _MARGIN


class FastBaseline(SortedWindow):
    """:class:`~stability.detectors._stats.Baseline` without the numpy window: points live in the deques of a
    :class:`SortedWindow` (a push is a few list operations, no numpy scalar stores), :meth:`predict` builds the
    arrays only when a value needs the full fit, and the state has ``Baseline``'s format. Bit-identical to it:
    same float64 values, same ``robust_line`` / ``mad_scale`` calls."""

    __slots__ = ("min_points", "scale_floor")

    def __init__(self, *, window: int, min_points: int, scale_floor: float) -> None:
        super().__init__(window)
        self.min_points = min_points
        self.scale_floor = scale_floor

    def accept(self, x: float, y: float) -> None:
        """Add a point that was not flagged."""
        self.push(float(x), float(y))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's x and y values, oldest first (as ``Window.x`` / ``Window.y``)."""
        return np.array(self.steps(), dtype=np.float64), np.array(self.values(), dtype=np.float64)

    def predict(self, x: float) -> Prediction:
        """``Baseline.predict``: the robust line at ``x`` (call only with at least one point in the window)."""
        xs, ys = self.arrays()
        return predict_line(xs, ys, x, min_points=self.min_points, scale_floor=self.scale_floor)

    def state_dict(self) -> dict[str, Any]:
        """``Window.state_dict``'s (packed) format."""
        return pack_window(self.steps(), self.values())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or ``Baseline.state_dict``) output, packed or the former lists."""
        self.clear()
        xs, ys = unpack_window(state)
        for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
            self.push(x, y)
