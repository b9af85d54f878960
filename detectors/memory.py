"""Memory growth toward a limit, with the projected step of exhaustion (signals of :mod:`stability.hooks.timing`).

Per rank, two series: host ``host_rss`` against ``host_mem_limit`` and, on CUDA, ``mem_allocated`` against
``mem_limit``. After ``warmup`` (20) records (allocators and caches fill up first), the last ``window`` (64)
points are fitted (every ``every`` (8) records) with a least-squares line over the step. It is a leak when the
fit explains the points (R^2 >= ``min_r2``, 0.8: steady growth, not one allocation) and the memory grew by
``min_growth`` (64 MiB) and by ``min_rel_growth`` (5 %) over the window. Then ``memory_leak`` WARNING, with
``projected_step`` = the step at which the line reaches the limit (when the limit is recorded); ERROR when that
step is within ``horizon_steps`` (2000). One finding per series, and again when the projection comes within the
horizon later (an escalation).

Silent on records without these signals (every corpus recorded before the timing hooks).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["MemoryConfig", "MemoryDetector"]

SERIES = (("host_rss", "host_mem_limit", "host memory (RSS)"), ("mem_allocated", "mem_limit", "device memory"))
_MIB = 1024.0 * 1024.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """Settings of :class:`MemoryDetector`."""

    warmup: int = 20
    window: int = 64
    min_r2: float = 0.8
    min_growth: float = 64 * _MIB
    min_rel_growth: float = 0.05
    horizon_steps: int = 2000
    every: int = 8
    """Fit every this many records (a fit costs ~50 us)."""


class MemoryDetector:
    """Streaming memory-growth detector of one rank (see the module docstring)."""

    name = "memory"

    def __init__(self, config: MemoryConfig | None = None) -> None:
        self.config = config or MemoryConfig()
        self._points: dict[str, deque[tuple[int, float]]] = {}
        self._seen: dict[str, int] = {}
        self._alerted: dict[str, int] = {}
        """series -> severity rank alerted."""

    def update(self, record: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        for signal, limit_name, what in SERIES:
            value = record.signals.get(signal)
            if value is None or not math.isfinite(value) or value <= 0:
                continue
            seen = self._seen[signal] = self._seen.get(signal, 0) + 1
            if seen <= self.config.warmup:
                continue
            points = self._points.setdefault(signal, deque(maxlen=self.config.window))
            points.append((record.step, value))
            if len(points) == self.config.window and seen % self.config.every == 0:
                finding = self._judge(record, signal, record.signals.get(limit_name, math.nan), what)
                if finding is not None:
                    out.append(finding)
        return out

    def _judge(self, record: StepRecord, signal: str, limit: float, what: str) -> Finding | None:
        cfg = self.config
        points = self._points[signal]
        x = np.array([p[0] for p in points], dtype=float)
        y = np.array([p[1] for p in points], dtype=float)
        if x[-1] <= x[0]:
            return None
        slope, intercept = np.polyfit(x, y, 1)
        fitted = slope * x + intercept
        total = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - float(np.sum((y - fitted) ** 2)) / total if total > 0 else 0.0
        growth = float(slope * (x[-1] - x[0]))
        if slope <= 0 or r2 < cfg.min_r2 or growth < cfg.min_growth or growth < cfg.min_rel_growth * y[0]:
            return None
        now = float(fitted[-1])
        projected = (x[-1] + (limit - now) / slope) if math.isfinite(limit) and limit > now else math.nan
        soon = math.isfinite(projected) and projected - record.step <= cfg.horizon_steps
        severity = Severity.ERROR if soon else Severity.WARNING
        if self._alerted.get(signal, -1) >= severity.rank:
            return None
        self._alerted[signal] = severity.rank
        per_step = slope / _MIB
        tail = (f"; at this rate it reaches the limit ({limit / 2**30:.3g} GiB) at step {projected:.0f}"
                if math.isfinite(projected) else "")
        return Finding(
            kind="memory_leak", step=record.step, onset=int(x[0]), severity=severity, signal=signal, value=y[-1],
            score=r2, detector=self.name, rank=record.rank, host=record.host,
            evidence={"bytes_per_step": float(slope), "growth": growth, "r2": r2, "limit": limit,
                      "projected_step": projected},
            message=f"{what} grew steadily by {growth / _MIB:.0f} MiB over steps {int(x[0])}-{int(x[-1])} "
                    f"({per_step:.3g} MiB/step, R^2 {r2:.2f}), now {y[-1] / 2**30:.3g} GiB{tail}")

    def state_dict(self) -> dict[str, Any]:
        return {"points": {k: [list(p) for p in v] for k, v in self._points.items()}, "seen": dict(self._seen),
                "alerted": dict(self._alerted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._points = {k: deque(((int(s), float(v)) for s, v in pts), maxlen=self.config.window)
                        for k, pts in state["points"].items()}
        self._seen = {k: int(v) for k, v in state["seen"].items()}
        self._alerted = {k: int(v) for k, v in state["alerted"].items()}
