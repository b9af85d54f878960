"""Divergence detector: a sustained upward drift of the log loss (upward Page-Hinkley + a 2x backstop).

* Level ``L`` = median of the last ``level_points`` accepted log losses; on a falling loss it lags above the
  current value, which only makes the test conservative. Scale = 1.4826 * MAD of the residuals of the accepted
  window around a robust line (the noise, not the trend), floored at ``scale_floor``.
* Upward Page-Hinkley on clipped robust residuals (detection.md D2): ``S = max(0, S + min(z, clip) - delta)``;
  fires when ``S >= threshold`` after ``window`` accepted points. Points are not accepted while ``S >= freeze``, so
  the level stays at its pre-incident value during a drift.
* Backstop: the median of the last ``smooth`` log losses sits >= ``backstop_ratio`` (2x) over ``L`` (and >= 2
  robust sigmas of the per-record noise: a loss spanning decades per step, a CNN near 0 loss, doubles its
  median by chance) for more than ``backstop_steps`` consecutive records.

* Averaged records (``loss_steps`` >= ``rise_min_steps``, 4: each loss is the mean of that many steps, as
  Megatron's ``log_interval`` gives): ``rise_records`` (3) consecutive rising records totalling >=
  ``rise_ratio`` (1.5x) are a divergence even before the window has filled (a 5-row excerpt logged every 10
  iterations). Means are quiet: on 4-step means of the clean baselines a 3-record rise reaches 1.34x at most,
  on 10-step means 1.16x; on per-step losses it reaches 1.95x, so per-step records never use this rule.
* Slow rise on a run that was improving (a trend test; issue #8: 0.3-1 %/step under 2-5 % noise is a
  divergence long before it is a spike): over the last ``trend_window`` (64) records of *all* finite log
  losses, the Mann-Kendall statistic is >= ``trend_z`` (3.5) and the robust line's level at the last record
  (``robust_line``, a cheap Theil-Sen) sits >= ``trend_excess`` (10 %) above the *running best* (the lowest
  median of ``trend_smooth`` (16) consecutive records so far; and >= 3 standard errors of such a median on a
  very noisy loss), for ``trend_confirm`` (5) consecutive records.
  The onset is where the fitted line leaves the best level (not before the loss was last at its best). After
  it fires, the best is re-set to the current level (the next alert needs another 10 %). The page-Hinkley
  level (a median of accepted points) follows a slow rise up, this test does not: its reference is the best
  the run reached.
  Calibration: on the seven clean baselines (61k per-step records, and their 10-step means and samples) no
  record has z >= 3.5 with any excess; with z >= 3 the largest excess is 10.3 % (the 1.5B run's spiky phase
  near step 12k), so both thresholds have margin. On synthetic slow rises (noise 2-5 %, rise 0.3-1 %/step,
  4 seeds each) the alert comes 18-43 steps after the rise starts (median ~26), never before it.
* Re-baseline after a divergence: ``rebaseline`` (200) records after firing with the drift still on, the window
  is cleared and refilled from the new level (the run continues at a new regime, e.g. after an LR cut) instead of
  staying frozen on the pre-incident level forever.

Calibration on the clean baselines: with ``delta = 1``, ``clip = 5`` the largest ``S`` over all seven runs
(~61k steps) is about 10, a third of the threshold (``delta = 0.5``, ``clip = 10`` fired 3 times).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._rolling import SortedWindow
from stability.detectors._slopes import SlidingSlopes
from stability.detectors._stats import (
    SCREEN_MARGIN,
    Window,
    line_level,
    log_positive,
    mad_scale,
    median,
    median_of,
    robust_line,
    safe_exp,
    times,
)
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord, adversarial, loss_steps

__all__ = ["SCREENS", "DivergenceConfig", "DivergenceDetector", "mann_kendall_z"]

SCREENS = True
"""Take the exact shortcuts of the module docstring (tests switch them off to compare with the full fits)."""


def mann_kendall_z(y: np.ndarray) -> float:
    """Mann-Kendall trend statistic of ``y`` (no ties correction), as a z score: ~N(0, 1) without a trend,
    positive for a rising series. O(n^2) in numpy (64 points: ~40 us)."""
    n = len(y)
    if n < 3:
        return 0.0
    s = float(np.sum(np.triu(np.sign(y[None, :] - y[:, None]), 1)))
    return (s - math.copysign(1.0, s)) / math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0) if s else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DivergenceConfig:
    """Settings of :class:`DivergenceDetector`."""

    window: int = 96
    level_points: int = 32
    delta: float = 1.0
    clip: float = 5.0
    threshold: float = 30.0
    freeze: float = 10.0
    scale_floor: float = 0.01
    smooth: int = 5
    backstop_ratio: float = 2.0
    backstop_steps: int = 10
    rebaseline: int = 200
    rise_min_steps: float = 4.0
    rise_records: int = 3
    rise_ratio: float = 1.5
    trend_window: int = 64
    trend_smooth: int = 16
    trend_z: float = 3.5
    trend_excess: float = 0.1
    trend_confirm: int = 5


class DivergenceDetector:
    """Streaming divergence detector for one rank (see the module docstring)."""

    name = "divergence"
    kind = "divergence"

    def __init__(self, config: DivergenceConfig | None = None) -> None:
        self.config = config or DivergenceConfig()
        self._window = Window(self.config.window)
        self._recent: deque[float] = deque(maxlen=self.config.smooth)
        self._ph = 0.0
        self._onset: int | None = None
        self._above = 0
        self._fired = False
        self._since_fired = 0
        self._prev: float | None = None
        self._rises = 0
        self._rise_from = (0, 0.0)
        self._trend = Window(self.config.trend_window)
        self._slopes = SlidingSlopes(self.config.window)
        """The window's robust-line slope, kept as the window slides (see the module docstring)."""
        self._trend_slopes = SlidingSlopes(self.config.trend_window)
        self._smooth = SortedWindow(self.config.trend_smooth)
        """The last ``trend_smooth`` finite log losses, sorted: their median (the running best's) in O(1)."""
        self._last = SortedWindow(self.config.level_points)
        """The last ``level_points`` accepted points, sorted: the level ``L`` in O(1)."""
        self._best = math.inf
        self._best_step = 0
        self._trend_run = 0

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record (not a one-side-of-a-game loss: :func:`~stability.records.adversarial`)."""
        y = None if adversarial(record) else log_positive(record.get("loss"))
        if y is None:
            return []
        cfg = self.config
        self._recent.append(y)
        rise = self._rise(record, y)
        trend = self._trend_rule(record, y)
        if len(self._window) < cfg.window:
            self._accept(record.step, y)
            if rise is None or self._fired:
                return []
            self._fired, self._since_fired = True, 0
            onset, base = self._rise_from
            return [self._finding(record, y, rise, onset, ratio=safe_exp(y - base), level=base, z=math.nan,
                                  what="loss")]
        level = self._last.median if SCREENS and self._last.finite else median(self._window.y[-cfg.level_points:])
        smoothed = median_of(list(self._recent))
        z = self._statistic(record.step, y, level, smoothed, need_z=rise is not None)
        if self._ph < cfg.freeze and self._above == 0:
            self._accept(record.step, y)
            self._fired = False
        if self._fired:
            self._cool()
            return []
        onset = self._onset if self._onset is not None else record.step
        if self._ph >= cfg.threshold:
            why = f"Page-Hinkley statistic {self._ph:.1f} >= {cfg.threshold:g} (sustained upward drift)"
        elif self._above > cfg.backstop_steps:
            why = f"smoothed loss >= {cfg.backstop_ratio:g}x its pre-incident level for {self._above} records"
        elif rise is not None:
            why, onset = rise, min(onset, self._rise_from[0])
        elif trend is not None:
            return self._trend_finding(record, y, trend)
        else:
            return []
        self._fired, self._since_fired = True, 0
        return [self._finding(record, y, why, onset, ratio=safe_exp(smoothed - level), level=level, z=z)]

    def _statistic(self, step: int, y: float, level: float, smoothed: float, *, need_z: bool) -> float:
        """Update the Page-Hinkley statistic, its onset and the backstop count for ``y``; return its robust z
        (``nan`` when the screen decided without it and ``need_z`` is false)."""
        cfg = self.config
        if (SCREENS and self._ph == 0.0 and y - level < cfg.scale_floor - SCREEN_MARGIN
                and smoothed - level < math.log(cfg.backstop_ratio) - SCREEN_MARGIN):
            # z < 1 whatever the scale (>= scale_floor): the statistic stays at 0; not 2x up: no backstop count
            self._onset, self._above = None, 0
            return self._z(y, level)[0] if need_z else math.nan
        z, scale = self._z(y, level)
        self._ph = max(0.0, self._ph + min(z, cfg.clip) - cfg.delta)
        if self._ph == 0.0:
            self._onset = None
        elif self._onset is None:
            self._onset = step
        # 2x, and beyond the noise: a loss spanning decades per step (a CNN near 0 loss) doubles its median by chance
        self._above = self._above + 1 if smoothed - level >= max(math.log(cfg.backstop_ratio), 2 * scale) else 0
        return z

    def _z(self, y: float, level: float) -> tuple[float, float]:
        """The robust z of ``y`` over ``level`` and the scale of the window's residuals around its robust line."""
        xs, ys = self._window.x, self._window.y
        slope = self._slopes.slope() if SCREENS else None
        if slope is None:
            level_at_end, slope = robust_line(xs, ys)
        else:
            level_at_end = line_level(xs, ys, slope)
        scale = max(mad_scale(ys - (level_at_end + slope * (xs - xs[-1]))), self.config.scale_floor)
        return (y - level) / scale, scale

    def _accept(self, x: int, y: float) -> None:
        """Add a point to the window (and its sorted views)."""
        self._window.push(x, y)
        self._slopes.push(float(x), y)
        self._last.push(float(x), y)

    def _clear(self) -> None:
        self._window.clear()
        self._slopes.clear()
        self._last.clear()

    def _cool(self) -> None:
        """After a divergence: re-baseline once it has lasted ``rebaseline`` records (a new regime)."""
        self._since_fired += 1
        if self._since_fired >= self.config.rebaseline:
            self._clear()
            self._ph, self._onset, self._above, self._fired, self._since_fired = 0.0, None, 0, False, 0

    def _trend_finding(self, record: StepRecord, y: float, trend: tuple[str, int, float]) -> list[Finding]:
        why, onset, excess = trend
        self._fired, self._since_fired = True, 0
        base, self._best = self._best, self._best + excess  # the next alert needs another trend_excess
        return [self._finding(record, y, why, onset, ratio=safe_exp(excess), level=base, z=math.nan)]

    def _trend_rule(self, record: StepRecord, y: float) -> tuple[str, int, float] | None:
        """Track the running best; ``(reason, onset, excess)`` once a confirmed upward trend sits
        ``trend_excess`` above it, else ``None``."""
        cfg = self.config
        self._trend.push(record.step, y)
        self._trend_slopes.push(float(record.step), y)
        self._smooth.push(float(record.step), y)
        ys = self._trend.y
        if len(ys) >= cfg.trend_smooth:
            smooth = self._smooth.median if SCREENS and self._smooth.finite else median(ys[-cfg.trend_smooth:])
            if smooth < self._best:
                self._best, self._best_step = smooth, record.step
        if len(ys) < cfg.trend_window:
            return None
        known = self._trend_slopes.slope() if SCREENS else None
        if known is not None and known <= 0:
            self._trend_run = 0  # hit needs slope > 0: the level is not needed
            return None
        if known is None:
            level, slope = robust_line(self._trend.x, ys)
        else:
            level, slope = line_level(self._trend.x, ys, known), known
        excess = level - self._best
        hit = slope > 0 and excess >= cfg.trend_excess  # needed >= trend_excess: skip the noise when this fails
        if hit:
            noise = mad_scale(ys - (level + slope * (self._trend.x - self._trend.x[-1])))  # of one record
            needed = max(cfg.trend_excess, 3.0 * 1.2533 * noise / math.sqrt(cfg.trend_smooth))  # 3 se of a median
            hit = excess >= needed and mann_kendall_z(ys) >= cfg.trend_z
        self._trend_run = self._trend_run + 1 if hit else 0
        if self._trend_run < cfg.trend_confirm:
            return None
        z = mann_kendall_z(ys)
        # onset: where the fitted line leaves the best level (a loss that sat flat at its best since long ago
        # started to rise there, not when it was last at its best)
        onset = max(self._best_step, min(record.step, int(record.step - excess / slope)))
        return (f"a rising trend over the last {len(ys)} records (Mann-Kendall z {z:.1f}), the loss's fitted level "
                f"{safe_exp(excess):.3g}x its best {safe_exp(self._best):.4g} (step {self._best_step})",
                onset, excess)

    def _rise(self, record: StepRecord, y: float) -> str | None:
        """Track consecutive rises; the reason text when the averaged-records rule fires, else ``None``."""
        cfg = self.config
        if self._prev is not None and y > self._prev:
            if self._rises == 0:
                self._rise_from = (record.step, self._prev)
            self._rises += 1
        else:
            self._rises = 0
        self._prev = y
        steps = loss_steps(record)
        total = safe_exp(y - self._rise_from[1])
        if steps < cfg.rise_min_steps or self._rises < cfg.rise_records or total < cfg.rise_ratio:
            return None
        return (f"{self._rises} consecutive rising records ({times(total)} since step {self._rise_from[0]}), each a "
                f"mean over {steps:g} steps")

    def _finding(self, record: StepRecord, y: float, why: str, onset: int, *, ratio: float, level: float,
                 z: float, what: str = "smoothed loss") -> Finding:
        evidence = {"ph": self._ph, "ratio": ratio, "baseline": safe_exp(level)}
        if math.isfinite(z):
            evidence["z"] = z
        return Finding(
            kind=self.kind, step=record.step, onset=min(onset, record.step), severity=Severity.ERROR,
            signal="loss", value=safe_exp(y), message=f"loss diverging: {why}; {what} {times(ratio)} the "
            f"pre-incident level {safe_exp(level):.4g}", detector=self.name, rank=record.rank,
            score=self._ph or ratio, evidence=evidence,
        )

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"window": self._window.state_dict(), "recent": list(self._recent), "ph": self._ph,
                "onset": self._onset, "above": self._above, "fired": self._fired,
                "since_fired": self._since_fired, "prev": self._prev, "rises": self._rises,
                "rise_from": list(self._rise_from), "trend": self._trend.state_dict(),
                "best": None if math.isinf(self._best) else self._best, "best_step": self._best_step,
                "trend_run": self._trend_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._window.load_state_dict(state["window"])
        self._slopes.clear()
        self._last.clear()
        for x, y in zip(self._window.x.tolist(), self._window.y.tolist(), strict=True):
            self._slopes.push(x, y)
            self._last.push(x, y)
        self._recent = deque((float(v) for v in state["recent"]), maxlen=self.config.smooth)
        self._ph = float(state["ph"])
        self._onset = None if state["onset"] is None else int(state["onset"])
        self._above = int(state["above"])
        self._fired = bool(state["fired"])
        self._since_fired = int(state.get("since_fired", 0))
        prev = state.get("prev")
        self._prev = None if prev is None else float(prev)
        self._rises = int(state.get("rises", 0))
        step, base = state.get("rise_from", (0, 0.0))
        self._rise_from = (int(step), float(base))
        if "trend" in state:
            self._trend.load_state_dict(state["trend"])
        self._trend_slopes.clear()
        self._smooth.clear()
        for x, y in zip(self._trend.x.tolist(), self._trend.y.tolist(), strict=True):
            self._trend_slopes.push(x, y)
            self._smooth.push(x, y)
        best = state.get("best")
        self._best = math.inf if best is None else float(best)
        self._best_step = int(state.get("best_step", 0))
        self._trend_run = int(state.get("trend_run", 0))

