"""Plateau: no improvement of the log loss over a long window outside the warm-up (detection.md D5).

Every ``every`` (50) records, once ``window`` (1000) finite losses are held, the detector compares the median
log loss of the first and last quarter of the window. The improvement ``d = median(first) - median(last)`` is a
relative improvement of the loss (log space). Its standard error comes from the MAD of the log losses around
their quarter medians (``se = 1.2533 * sigma * sqrt(2 / quarter)``). A **plateau** is declared when the upper
bound ``d + 2 se`` is below the needed improvement: ``min_improvement`` (0.5% of the loss over the window,
detection.md D5), capped by what a slow power law ``L ~ t^-0.02`` would still gain over the window at this step
(late in a run a healthy loss improves by well under 0.5% per 1000 steps: llm.c 124M gains ~0.3% per 1000 steps
at step 10k). Gates: the LR warm-up is over and the LR (when recorded) is above
``lr_floor`` (10%) of its peak (a decayed LR legitimately flattens the loss).

The evidence carries ``lr_ratio``, the LR now over its lowest value in the window: a loss that stalls while the
LR *rose* (an LR leaving its schedule stalls the loss before it diverges) is not starved of LR, and the ranking
then names ``lr_too_high``, never ``lr_too_low``.

A plateau is INFO; it becomes a WARNING (once) when it lasts ``warn_windows`` (3) windows. It re-arms when the
loss improves again by ``min_improvement`` with the same confidence.

Calibration: the seven clean baselines (~61k steps, all improving until their LR decays) give no WARNING (0 per
10k steps, the default is set for that) and INFO plateaus only where the rank-0 train loss is flat within 0.5%
over 1000 steps (measured in the report accompanying this change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._stats import Window, log_positive, mad_scale, median, safe_exp
from stability.detectors.base import Finding, Severity
from stability.detectors.history import LrTracker
from stability.records import StepRecord, adversarial

__all__ = ["PlateauConfig", "PlateauDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlateauConfig:
    """Settings of :class:`PlateauDetector`."""

    window: int = 1000
    every: int = 50
    min_improvement: float = 0.005
    power_rate: float = 0.02
    """A loss following a power law ``L ~ t^-b`` improves by ``b * span / t`` (log) over a window of ``span``
    steps at step ``t``; slower than ``b = power_rate`` counts as no improvement (caps ``min_improvement``)."""
    confidence: float = 2.0
    lr_floor: float = 0.1
    warn_windows: int = 3


class PlateauDetector:
    """Streaming plateau detector for one rank (see the module docstring)."""

    name = "plateau"
    kind = "plateau"

    def __init__(self, config: PlateauConfig | None = None) -> None:
        self.config = config or PlateauConfig()
        self._win = Window(self.config.window)
        self._lrs = Window(self.config.window)
        """log LR of the window's records (NaN where absent)."""
        self._lr = LrTracker()
        self._count = 0
        self._onset: int | None = None
        """Onset of the current plateau (None = armed)."""
        self._warned = False

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        lr = record.get("lr")
        self._lr.update(record.step, lr)
        y = None if adversarial(record) else log_positive(record.get("loss"))  # one side of a game: no plateau
        if y is None:
            return []
        self._win.push(record.step, y)
        self._lrs.push(record.step, math.log(lr) if lr > 0 and math.isfinite(lr) else math.nan)
        self._count += 1
        if len(self._win) < cfg.window or self._count % cfg.every:
            return []
        if self._lr.rising or (self._lr.warmup_end is not None and self._win.x[0] < self._lr.warmup_end):
            return []
        if math.isfinite(lr) and self._lr.peak > 0 and lr < cfg.lr_floor * self._lr.peak:
            return []
        ys = self._win.y
        quarter = len(ys) // 4
        first, last = ys[:quarter], ys[-quarter:]
        m_first, m_last = median(first), median(last)
        sigma = mad_scale(np.concatenate([first - m_first, last - m_last]))
        se = 1.2533 * sigma * math.sqrt(2.0 / quarter)
        gain = m_first - m_last
        span = int(self._win.x[-1] - self._win.x[0])
        needed = min(cfg.min_improvement, cfg.power_rate * span / max(float(self._win.x[-1]), 1.0))
        if gain - cfg.confidence * se >= needed:
            self._onset, self._warned = None, False
            return []
        if gain + cfg.confidence * se >= needed:
            return []
        evidence = {"improvement": gain, "se": se, "window": float(len(ys)), "needed": needed}
        what = (f"loss improved {100 * gain:.2g}% (+-{200 * se:.1g}%) over the last {span} steps "
                f"({safe_exp(m_first):.4g} -> {safe_exp(m_last):.4g})")
        logs = self._lrs.y[np.isfinite(self._lrs.y)]
        if len(logs) and math.isfinite(self._lrs.y[-1]):
            evidence["lr_ratio"] = safe_exp(float(self._lrs.y[-1] - logs.min()))
            if evidence["lr_ratio"] >= 1.2:
                what += f", while the lr rose {evidence['lr_ratio']:.3g}x"
        if self._onset is None:
            self._onset = int(self._win.x[0])
            return [self._finding(record, Severity.INFO, f"plateau: {what}", evidence)]
        if not self._warned and record.step - self._onset >= cfg.warn_windows * span:
            self._warned = True
            return [self._finding(record, Severity.WARNING,
                                  f"plateau for {record.step - self._onset} steps: {what}", evidence)]
        return []

    def _finding(self, record: StepRecord, severity: Severity, message: str, evidence: dict[str, float]) -> Finding:
        assert self._onset is not None
        return Finding(kind=self.kind, step=record.step, onset=self._onset, severity=severity, signal="loss",
                       value=record.get("loss"), message=message, detector=self.name, rank=record.rank,
                       host=record.host, score=evidence["improvement"], evidence=evidence)

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"win": self._win.state_dict(), "lrs": self._lrs.state_dict(), "lr": self._lr.state_dict(),
                "count": self._count,
                "onset": self._onset, "warned": self._warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._win.load_state_dict(state["win"])
        if "lrs" in state:
            self._lrs.load_state_dict(state["lrs"])
        self._lr.load_state_dict(state["lr"])
        self._count = int(state["count"])
        self._onset = state["onset"]
        self._warned = bool(state["warned"])
