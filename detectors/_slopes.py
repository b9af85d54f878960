"""The Theil-Sen slope of a full sliding window, kept sorted: the robust line's slope in O(log w) per point.

:func:`~stability.detectors._stats.robust_line` takes the median of the slopes between points half a window apart
(``h = n // 2``: pairs ``(i, i + h)``, ``i < h``). When a full window slides by one point, one pair leaves (the
oldest point and the one ``h`` after it) and one comes in (the point ``h`` before the newest and the newest); every
other pair stays. :class:`SlidingSlopes` keeps those slopes as a sorted list, so the median is read in O(1) and a
slide costs two bisections (the global detectors fit a line over a full window on every record: issue #11).

Bit-identical to the numpy fit: each slope is the same IEEE division (``(y2 - y1) / (x2 - x1)``), and the median of
a multiset is the same float whatever the order it was built in (equal floats have equal bits, but for the sign of
zero: a window with a ``-0.0`` y is declined, so a zero slope is ``+0.0`` unless a difference under ~1e-308
underflows, and the line fitted with a zero slope of either sign is the same). The window must have strictly
increasing finite x (steps) and finite y; otherwise :meth:`SlidingSlopes.slope` is ``None`` and the caller fits in
numpy as before.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

__all__ = ["SlidingSlopes"]


class SlidingSlopes:
    """The sorted pair slopes of the last ``size`` points pushed (see the module docstring)."""

    __slots__ = ("_bad", "_flags", "_last_x", "_sorted", "_xs", "_ys", "half", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.half = size // 2
        self._xs: deque[float] = deque()
        self._ys: deque[float] = deque()
        self._flags: deque[bool] = deque()
        """Per point: its y is not finite or is -0.0, or its x is not finite or not past the previous point's."""
        self._bad = 0
        """How many flags in the window are set (then no slopes are kept)."""
        self._last_x = -math.inf
        self._sorted: list[float] | None = None
        """The pair slopes, sorted; ``None`` while the window is not full or has a flagged point."""

    def push(self, x: float, y: float) -> None:
        """Append one point, dropping the oldest beyond ``size`` (as ``Window.push``)."""
        xs, ys, flags, h = self._xs, self._ys, self._flags, self.half
        flag = not (self._last_x < x < math.inf and -math.inf < y < math.inf) or (
            y == 0.0 and math.copysign(1.0, y) < 0)
        self._last_x = x
        slopes = self._sorted
        if len(xs) == self.size:
            if slopes is not None and not flag:
                del slopes[bisect.bisect_left(slopes, (ys[h] - ys[0]) / (xs[h] - xs[0]))]
            xs.popleft()
            ys.popleft()
            self._bad -= flags.popleft()
        xs.append(x)
        ys.append(y)
        flags.append(flag)
        self._bad += flag
        if self._bad or len(xs) < self.size or h == 0:
            self._sorted = None
        elif slopes is not None:
            bisect.insort(slopes, (ys[2 * h - 1] - ys[h - 1]) / (xs[2 * h - 1] - xs[h - 1]))
        else:
            px, py = list(xs), list(ys)
            self._sorted = sorted([(py[i + h] - py[i]) / (px[i + h] - px[i]) for i in range(h)])

    def clear(self) -> None:
        """Forget every point (as ``Window.clear``)."""
        self._xs.clear()
        self._ys.clear()
        self._flags.clear()
        self._bad = 0
        self._last_x = -math.inf
        self._sorted = None

    def slope(self) -> float | None:
        """``robust_line``'s slope of the full window (the median pair slope), or ``None`` (not full, or a flagged
        point in it)."""
        s = self._sorted
        if s is None:
            return None
        n = len(s)
        return 0.5 * (s[(n - 1) // 2] + s[n // 2])
