"""Shared math of the streaming detectors: a trailing window and a robust local-linear baseline.

Everything works on one series (log loss, log grad norm). The baseline of the next point is a robust line
through the trailing window of *accepted* points (points a detector flagged are never added, so one spike does
not inflate the scale and hide the next). The line is Theil-Sen restricted to pairs half a window apart (median
of those slopes, then median intercept): O(w) per step and robust to a few outliers. The scale is 1.4826 * MAD
of the window's residuals, floored. The MAD is one line of numpy: ``statsmodels.robust.scale.mad`` computes the
same value but costs ~1.8 s of import time and is slower per call (measured), and these detectors are imported by
``stability.detectors``.

With fewer than ``min_points`` points the baseline is the window median and the scale is unknown (``nan``): the
detectors then gate on the ratio alone (see ``spike.py``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SCREEN_MARGIN", "Baseline", "Prediction", "Window", "log_positive", "mad_scale", "median", "median_of",
           "pack_floats", "pack_window", "line_level", "plural", "predict_level", "predict_line", "robust_line",
           "safe_exp", "times", "unpack_floats", "unpack_window"]

_I8 = np.dtype("<i8")
_EXACT_INT = 2.0**53
"""Integers below this in magnitude are exact in float64 (window x values: steps)."""

SCREEN_MARGIN = 1e-9
"""Slack (log units) between a detector's screen bound and its threshold (beyond the bound's own): a screen decides
only values clearly on the quiet side; the others take the exact fit."""

MAD_TO_SIGMA = 1.4826
"""Consistency constant: 1.4826 * MAD estimates sigma for Gaussian data."""


_SORT_MAX = 24
"""Up to this many values a Python sort beats ``np.partition``'s call overhead (measured)."""


def median(values: np.ndarray) -> float:
    """``np.median`` of a non-empty 1-d float array without its per-call overhead (~4x faster on short windows).

    Bit-identical to ``np.median``: both take the middle value (or the mean ``0.5 * (a + b)`` of the middle two) of
    the same multiset, and equal floats have equal bits except 0.0 and -0.0, so a zero result (and any NaN, which a
    Python sort does not order) takes the ``np.partition`` path.
    """
    return _median(values, scratch=False)


def median_of(items: list[float]) -> float:
    """``median(np.array(items))`` of a short non-empty list of floats without building the array (the same
    float: the same Python sort path; long lists, NaN and a zero result go through :func:`median`)."""
    n = len(items)
    if n <= _SORT_MAX:
        total = sum(items)
        if total == total:
            ordered = sorted(items)
            mid = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
            if mid != 0.0:
                return mid
    return median(np.array(items, dtype=np.float64))


def line_level(x: np.ndarray, y: np.ndarray, slope: float) -> float:
    """``robust_line(x, y)[0]`` given its slope (at least 2 points): the median of ``y - slope * (x - x[-1])``."""
    return _median(y - slope * (x - x[-1]), scratch=True)


def _median(values: np.ndarray, *, scratch: bool) -> float:
    """:func:`median`; ``scratch``: ``values`` is a temporary the call may reorder (no copy)."""
    n = len(values)
    lo, hi = (n - 1) // 2, n // 2
    if n <= _SORT_MAX:
        items: list[float] = values.tolist()
        total = sum(items)
        if total == total:  # no NaN in the values
            items.sort()
            mid = 0.5 * (items[lo] + items[hi])
            if mid != 0.0:
                return mid
    part = values if scratch else values.copy()
    part.partition((lo, hi) if lo != hi else lo)
    low: float = part.item(lo)
    high: float = part.item(hi)
    return 0.5 * (low + high)


def mad_scale(values: np.ndarray) -> float:
    """1.4826 times the median absolute deviation of ``values`` (a robust standard deviation)."""
    return MAD_TO_SIGMA * _median(np.abs(values - median(values)), scratch=True)


def _mad_scale_scratch(values: np.ndarray) -> float:
    """:func:`mad_scale` of a temporary it may reorder (the median of a permutation is the same)."""
    return MAD_TO_SIGMA * _median(np.abs(values - _median(values, scratch=True)), scratch=True)


def robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Robust line through ``(x, y)``: returns ``(level at x[-1], slope)``.

    The slope is the median of the slopes between points half a window apart (a cheap Theil-Sen); the level is
    the median of ``y - slope * (x - x[-1])``.
    """
    if len(y) // 2 == 0:
        return float(y[-1]), 0.0
    return _line(x, y, x - x[-1])


def _line(x: np.ndarray, y: np.ndarray, to_end: np.ndarray) -> tuple[float, float]:
    """:func:`robust_line` of at least 2 points, given ``to_end = x - x[-1]``."""
    half = len(y) // 2
    dx = x[half : 2 * half] - x[:half]
    slope = _median((y[half : 2 * half] - y[:half]) / dx, scratch=True)
    level = _median(y - slope * to_end, scratch=True)
    return level, slope


class Window:
    """The last ``size`` (x, y) pairs, kept contiguous so numpy sees plain slices (amortised O(1) append)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._x = np.empty(2 * size)
        self._y = np.empty(2 * size)
        self._n = 0

    def __len__(self) -> int:
        return min(self._n, self.size)

    def push(self, x: float, y: float) -> None:
        """Append one pair, dropping the oldest beyond ``size``."""
        if self._n == 2 * self.size:
            self._x[: self.size - 1] = self._x[self.size + 1 :]
            self._y[: self.size - 1] = self._y[self.size + 1 :]
            self._n = self.size - 1
        self._x[self._n] = x
        self._y[self._n] = y
        self._n += 1

    @property
    def x(self) -> np.ndarray:
        """The x values, oldest first."""
        return self._x[max(0, self._n - self.size) : self._n]

    @property
    def y(self) -> np.ndarray:
        """The y values, oldest first."""
        return self._y[max(0, self._n - self.size) : self._n]

    def clear(self) -> None:
        """Forget every point."""
        self._n = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state in the packed format of :func:`pack_window`."""
        return pack_window(self.x, self.y)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (packed, or the former lists of ``x`` and ``y``)."""
        self.clear()
        xs, ys = unpack_window(state)
        for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
            self.push(x, y)


def pack_floats(values: np.ndarray | Sequence[float]) -> bytes:
    """float64 values as little-endian bytes: exact, 8 bytes a value, and one ``bin`` object for msgpack (a list of
    Python floats costs 9 bytes a value and a Python object each to pack and unpack)."""
    return np.asarray(values, dtype="<f8").tobytes()


def unpack_floats(data: bytes | Sequence[float]) -> np.ndarray:
    """The float64 array of :func:`pack_floats` output (or of a former plain list of floats)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype="<f8").astype(np.float64)
    return np.array([float(v) for v in data], dtype=np.float64)


def pack_window(xs: np.ndarray | Sequence[float], ys: np.ndarray | Sequence[float]) -> dict[str, Any]:
    """Compact state of a window of ``(x, y)`` points: ``y`` as float64 bytes; ``x`` (steps) as zlib-compressed
    int64 differences when they are integers (a run of consecutive steps packs to a few bytes), else float64
    bytes. Exact: :func:`unpack_window` gives back the same float64 values."""
    x = np.asarray(xs, dtype=np.float64)
    out: dict[str, Any] = {"yb": pack_floats(ys)}
    # few numpy calls: a snapshot packs ~170 windows per rank at 200 signals (min/max are NaN-propagating, so a NaN
    # or an infinity fails the bound; the bound makes the int64 cast exact for every integer-valued x)
    if len(x) and -_EXACT_INT < x.min() and x.max() < _EXACT_INT:
        steps = x.astype(_I8)
        if (steps == x).all():
            steps[1:] -= steps[:-1].copy()
            out["xd"] = zlib.compress(steps.tobytes(), 1)
            return out
    out["xb"] = pack_floats(x)
    return out


def unpack_window(state: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` float64 arrays of a window state: :func:`pack_window` output or the former format (plain lists
    ``{"x": [...], "y": [...]}``, as states saved before the packed format hold)."""
    if "yb" in state:
        ys = unpack_floats(state["yb"])
        if "xd" in state:
            xs = np.cumsum(np.frombuffer(zlib.decompress(state["xd"]), dtype="<i8")).astype(np.float64)
        else:
            xs = unpack_floats(state["xb"])
    else:
        xs = np.array([float(v) for v in state["x"]], dtype=np.float64)
        ys = np.array([float(v) for v in state["y"]], dtype=np.float64)
    if len(xs) != len(ys):
        raise ValueError(f"window state has {len(xs)} x values and {len(ys)} y values")
    return xs, ys


@dataclass(frozen=True, slots=True)
class Prediction:
    """Baseline prediction for one point."""

    level: float
    """Predicted value (log space)."""
    scale: float
    """Robust sigma of the residuals; ``nan`` in the few-points regime."""
    points: int
    """How many points the baseline was built from."""

    def z(self, y: float) -> float:
        """Robust z of ``y`` (``nan`` when the scale is unknown)."""
        return (y - self.level) / self.scale if self.scale == self.scale else math.nan


def predict_line(xs: np.ndarray, ys: np.ndarray, x: float, *, min_points: int, scale_floor: float) -> Prediction:
    """The robust line through ``(xs, ys)`` evaluated at ``x`` with its residual scale; with fewer than
    ``min_points`` points the median and an unknown (``nan``) scale."""
    if len(ys) < min_points:
        return Prediction(median(ys), math.nan, len(ys))
    if len(ys) // 2 == 0:
        level, slope = robust_line(xs, ys)
        residuals = ys - (level + slope * (xs - xs[-1]))
    else:
        to_end = xs - xs[-1]
        level, slope = _line(xs, ys, to_end)
        residuals = ys - (level + slope * to_end)
    scale = max(_mad_scale_scratch(residuals), scale_floor)
    return Prediction(level + slope * (x - xs[-1]), scale, len(ys))


def predict_level(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """``predict_line(xs, ys, x, ...).level`` with at least ``min_points`` points (the robust line's prediction, the
    same float by the same operations) without the residual scale."""
    if len(ys) // 2 == 0:
        level, slope = robust_line(xs, ys)
        return level + slope * (x - xs[-1])  # type: ignore[no-any-return]
    level, slope = _line(xs, ys, xs - xs[-1])
    return level + slope * (x - xs[-1])  # type: ignore[no-any-return]


class Baseline:
    """Robust local-linear baseline over a trailing window of accepted points (see the module docstring)."""

    def __init__(self, *, window: int, min_points: int, scale_floor: float) -> None:
        self.window = Window(window)
        self.min_points = min_points
        self.scale_floor = scale_floor

    def __len__(self) -> int:
        return len(self.window)

    def predict(self, x: float) -> Prediction:
        """The baseline at ``x`` (call only when at least one point is in the window)."""
        return predict_line(self.window.x, self.window.y, x, min_points=self.min_points,
                            scale_floor=self.scale_floor)

    def accept(self, x: float, y: float) -> None:
        """Add a point that was not flagged."""
        self.window.push(x, y)

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return self.window.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.window.load_state_dict(state)


_MAX_EXP = 709.78
"""``math.exp`` overflows above this (float64 max is ~1.8e308)."""


def safe_exp(x: float) -> float:
    """``math.exp`` that saturates at the float range instead of raising: a ratio of two logged values
    (``exp(log a - log b)``) can exceed it for hostile or broken input (1e300 after 1e-300)."""
    return math.exp(min(x, _MAX_EXP))


def log_positive(value: float) -> float | None:
    """``log(value)`` for a finite positive value, else ``None`` (absent, zero, negative or non-finite)."""
    if value > 0 and math.isfinite(value):
        return math.log(value)
    return None


def plural(n: int, word: str) -> str:
    """``"1 step"``, ``"3 steps"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def times(ratio: float) -> str:
    """A ratio for people: ``2.35x``, ``31.2x``, ``280x``, ``3.2e10x`` (never ``32128570082.64x``)."""
    if not math.isfinite(ratio):
        return f"{ratio}"
    if abs(ratio) < 999.5:
        return f"{ratio:.3g}x"
    mantissa, exponent = f"{ratio:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}x"
