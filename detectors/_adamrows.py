"""The vectorised own-baseline bank of :class:`~stability.detectors.update.AdamLagDetector` (records with many
series).

Per series the detector keeps its last ``own_window`` values that raised no alarm and a decaying peak of them.
On the common record (every module's ratio finite and under the lowest threshold, ``min(lag, sparse_lag)``, no
module in its cooldown) nothing is judged and every value is appended: :class:`AdamRows` does that for all the
record's series at once (one ring per matrix row, a per-row push count, the peaks as one float64 array:
``where(v > p * decay, v, p * decay)`` is Python's ``max(p * decay, v)``), instead of a Python loop of ring appends
and dict updates (issue #14 item 8). Any other record goes through :meth:`AdamRows.judge_each`, the per-value loop
of the detector on the same rows.

The state is the per-value bank's (``own``: each ring oldest first as float64 bytes; ``peak``: floats, same keys
and order), so the detector moves between the two when a layout crosses :data:`~._modules.VECTOR_MIN` series.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from stability.detectors._modules import Schema, layout
from stability.detectors._stats import pack_floats, unpack_floats
from stability.records import StepRecord

__all__ = ["AdamRows"]


class AdamRows:
    """Own-baseline rings and peaks of an Adam-lag detector's series as matrix rows (see the module docstring)."""

    def __init__(self, size: int, max_series: int, decay: float) -> None:
        self.size = size
        self.max_series = max_series
        self.decay = decay
        """The peak's factor per record (``0.5 ** (1 / peak_half_life)``)."""
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._own = np.zeros((0, size))
        self._pushes = np.zeros(0, dtype=np.int64)
        """Values appended to each row (its ring's next slot is ``pushes % size``); stale while :attr:`_common`
        is set."""
        self._common: int | None = 0
        """The push count of every row when they are all equal (the common case: one column store), else None."""
        self._peak = np.zeros(0)
        self._plans: dict[Schema, np.ndarray] = {}
        """Layout whose every series has a row -> their positions in row order."""

    def _sync(self) -> None:
        """Write :attr:`_common` back to every row's push count (before a per-row read or change)."""
        if self._common is not None:
            self._pushes[: len(self._names)] = self._common

    def _settle(self) -> None:
        """Set :attr:`_common` again if every row has the same push count."""
        pushes = self._pushes[: len(self._names)]
        self._common = int(pushes[0]) if len(pushes) and bool((pushes == pushes[0]).all()) else None

    def _add(self, name: str) -> int:
        self._sync()
        row = len(self._names)
        if row == len(self._peak):
            cap = row + max(8, row // 4)
            self._own = np.resize(self._own, (cap, self.size))
            self._pushes = np.resize(self._pushes, cap)
            self._peak = np.resize(self._peak, cap)
        self._index[name] = row
        self._names.append(name)
        self._pushes[row] = 0
        self._peak[row] = 0.0
        self._plans.clear()
        self._common = None  # (the caller settles it)
        return row

    def own(self, name: str) -> np.ndarray | None:
        """``name``'s ring (slot order, a copy), or None when it has none."""
        row = self._index.get(name)
        if row is None:
            return None
        self._sync()
        return self._own[row, : min(int(self._pushes[row]), self.size)].copy()

    def peak(self, name: str) -> float:
        """``name``'s peak (0 when it has none)."""
        row = self._index.get(name)
        return 0.0 if row is None else float(self._peak[row])

    def append_all(self, record: StepRecord, names: list[str], least: float) -> bool:
        """Append every value of ``names`` when each series has a row, all of them have a value in this record
        and every value is finite and under ``least`` (True); else change nothing (False)."""
        schema, values = layout(record)
        pos = self._plans.get(schema)
        if pos is None:
            rows = [self._index.get(n, -1) for n in names]
            if min(rows, default=-1) < 0:
                return False
            where = {n: i for i, n in enumerate(schema.names)}
            order = np.argsort(np.array(rows, dtype=np.int64), kind="stable")
            if len(self._plans) >= 64:
                self._plans.clear()
            pos = self._plans[schema] = np.array([where[n] for n in names], dtype=np.int64)[order]
        if len(pos) != len(self._names):
            return False
        v = values[pos]
        listed = v.tolist()
        if not (max(listed) < least and math.isfinite(sum(listed))):  # (a NaN or an infinity makes the sum one)
            return False
        n = len(self._names)
        if self._common is not None:
            self._own[:n, self._common % self.size] = v
            self._common += 1
        else:
            pushes = self._pushes[:n]
            self._own[np.arange(n), pushes % self.size] = v
            pushes += 1
        peak = self._peak[:n] * self.decay
        self._peak[:n] = np.where(v > peak, v, peak)  # (Python's max(peak, v): v only when larger)
        return True

    def judge_each(self, record: StepRecord, names: list[str], quiet: dict[str, int], cooldown: int,
                   least: float, threshold: Callable[[str], float]) -> list[tuple[float, str]]:
        """The detector's per-value loop on these rows (see ``AdamLagDetector.update``): the lags."""
        self._sync()
        self._common = None  # (per-row counts below; settled at the end)
        lags = []
        signals = record.signals
        for name in names:  # (the record's, in its order)
            value = signals[name]
            if not math.isfinite(value):
                continue
            q = quiet.get(name, 0)
            limit = threshold(name) if value >= least else math.inf
            if value >= limit and q == 0:
                lags.append((value, name))
            if value >= limit or q:
                quiet[name] = cooldown if value >= limit else q - 1
            if value < limit:
                row = self._index.get(name)
                if row is None:
                    if len(self._names) >= self.max_series:
                        continue
                    row = self._add(name)
                self._own[row, int(self._pushes[row]) % self.size] = value
                self._pushes[row] += 1
                self._peak[row] = max(float(self._peak[row]) * self.decay, value)
        self._settle()
        return lags

    def state(self) -> tuple[dict[str, bytes], dict[str, float]]:
        """The per-value bank's ``own`` and ``peak`` states."""
        self._sync()
        own = {}
        for row, name in enumerate(self._names):
            n = int(self._pushes[row])
            ring = self._own[row, : min(n, self.size)]
            own[name] = pack_floats(np.roll(ring, -(n % self.size)) if n > self.size else ring)
        return own, dict(zip(self._names, self._peak[: len(self._names)].tolist(), strict=True))

    def load(self, own: dict[str, Any], peak: dict[str, Any]) -> None:
        """Restore :meth:`state` (or the per-value bank's) output (``peak`` has the keys of ``own``)."""
        for name, packed in own.items():
            row = self._add(str(name))
            values = unpack_floats(packed)
            n = len(values)
            kept = np.arange(max(0, n - self.size), n)
            self._own[row, kept % self.size] = values[kept]
            self._pushes[row] = n
            self._peak[row] = float(peak[name])
        self._settle()
