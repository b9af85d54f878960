"""The per-value implementation of the vanishing-gradient rules (:mod:`~stability.detectors.vanish`).

:class:`~stability.detectors.vanish.GradVanishingDetector` runs this one for records with few gradient series (a
Python loop over a handful of values costs less than the numpy calls of the vectorised rules) and the vectorised
one for many; both keep the same state format, so the detector switches between them through
``state_dict`` / ``load_state_dict`` without changing a decision (``tests/test_vectorised.py`` runs every stream
through each).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from stability.detectors._rolling import FastBaseline
from stability.detectors._stats import median, safe_exp
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord, split_signal

if TYPE_CHECKING:
    from stability.detectors.vanish import VanishConfig

import numpy as np

__all__ = ["ScalarVanishing", "one_per_rule"]

_TINY = 1e-30


class _Series:
    """Reference window and alarm state of one series."""

    def __init__(self, window: int) -> None:
        self.win = FastBaseline(window=window, min_points=0, scale_floor=0.0)
        """The reference window, also sorted: its median in O(1) (bit-identical to ``median(win.y)``)."""
        self.low = 0
        self.low_onset: int | None = None
        self.fired = False

    def state_dict(self) -> dict[str, Any]:
        return {"win": self.win.state_dict(), "low": self.low, "low_onset": self.low_onset, "fired": self.fired}

    def push(self, x: float, y: float) -> None:
        self.win.accept(x, y)

    def clear(self) -> None:
        self.win.clear()

    def median(self) -> float:
        """The median of the window (O(1) from the sorted values; numpy when a value is not finite)."""
        return self.win.median if self.win.finite else median(self.win.arrays()[1])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.win.load_state_dict(state["win"])
        self.low, self.low_onset, self.fired = int(state["low"]), state["low_onset"], bool(state["fired"])


class ScalarVanishing:
    """The per-value implementation of :class:`~stability.detectors.vanish.GradVanishingDetector` (a Python loop
    over a record's series: the faster one for records with few of them)."""

    name = "vanish"
    kind = "grad_vanishing"

    def __init__(self, config: VanishConfig) -> None:
        self.config = config
        self._series: dict[str, _Series] = {}
        self._lr_peak = 0.0

    def _get(self, name: str) -> _Series | None:
        series = self._series.get(name)
        if series is None and len(self._series) < self.config.max_series:
            series = self._series[name] = _Series(self.config.window)
        return series

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        lr = record.get("lr")
        if math.isfinite(lr) and lr > self._lr_peak:
            self._lr_peak = lr
        layer_logs: dict[str, float] = {}
        out: list[Finding] = []
        for name in sorted(record.signals):
            quantity, module = split_signal(name)
            value = record.signals[name]
            if not math.isfinite(value) or value < 0:
                continue
            if value == 0.0 and module is not None:
                continue  # exactly no gradient: the module was unused this step (an MoE expert without tokens)
            if quantity == "grad_norm":
                y = math.log(max(value, _TINY))
                if module is not None:
                    layer_logs[name] = y
                out += self._history_rule(record, name, y)
            elif quantity == "update_ratio" and module is not None:
                lr_ok = not math.isfinite(lr) or self._lr_peak <= 0 or lr >= cfg.lr_floor * self._lr_peak
                low = value < cfg.min_update_ratio and lr_ok
                out += self._persist(record, name + "#frozen", low, value,
                                     f"{name} = {value:.3g} < {cfg.min_update_ratio:g}: the layer no longer moves",
                                     {"ratio": value})
        out = one_per_rule(out)
        if len(layer_logs) >= cfg.min_layers:
            middle = median(np.fromiter(layer_logs.values(), dtype=np.float64))
            for name, y in layer_logs.items():
                below = safe_exp(middle - y)
                out += self._persist(record, name + "#layers", below >= cfg.layer_factor, safe_exp(y),
                                     f"{name} is {below:.3g}x below the median layer ({safe_exp(middle):.3g})",
                                     {"factor": below})
        return one_per_rule(out)

    def _history_rule(self, record: StepRecord, name: str, y: float) -> list[Finding]:
        cfg = self.config
        series = self._get(name)
        if series is None:
            return []
        if len(series.win) < cfg.min_points:
            series.push(record.step, y)
            return []
        ref = series.median()
        if y > ref - math.log(cfg.factor):
            series.low, series.low_onset, series.fired = 0, None, False
            series.push(record.step, y)
            return []
        series.low += 1
        if series.low_onset is None:
            series.low_onset = record.step
        if series.low >= cfg.rebaseline:
            series.clear()
            series.push(record.step, y)
            series.low, series.low_onset = 0, None
            return []
        if series.low < cfg.persist or series.fired:
            return []
        series.fired = True
        factor = safe_exp(ref - y)
        where = "the global gradient norm" if "/" not in name else f"layer {split_signal(name)[1]}"
        return [self._finding(record, name, series.low_onset, safe_exp(y),
                              f"{name} collapsed {factor:.3g}x below its recent median {safe_exp(ref):.3g} for "
                              f"{series.low} records ({where})", {"factor": factor, "baseline": safe_exp(ref)})]

    def _persist(self, record: StepRecord, key: str, low: bool, value: float, what: str,
                 evidence: dict[str, float]) -> list[Finding]:
        series = self._get(key)
        if series is None:
            return []
        if not low:
            series.low, series.low_onset, series.fired = 0, None, False
            return []
        series.low += 1
        if series.low_onset is None:
            series.low_onset = record.step
        if series.low < self.config.persist or series.fired:
            return []
        series.fired = True
        signal = key.split("#", 1)[0]
        return [self._finding(record, signal, series.low_onset, value, f"{what} for {series.low} records",
                              evidence)]

    def _finding(self, record: StepRecord, signal: str, onset: int, value: float, message: str,
                 evidence: dict[str, float]) -> Finding:
        return Finding(kind=self.kind, step=record.step, onset=onset, severity=Severity.WARNING, signal=signal,
                       value=value, message=message, detector=self.name, rank=record.rank, host=record.host,
                       score=evidence.get("factor", 1.0), evidence=evidence)

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"series": {k: v.state_dict() for k, v in self._series.items()}, "lr_peak": self._lr_peak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._series = {}
        for name, series_state in state["series"].items():
            series = self._series[name] = _Series(self.config.window)
            series.load_state_dict(series_state)
        self._lr_peak = float(state["lr_peak"])


def one_per_rule(found: list[Finding]) -> list[Finding]:
    """At most one finding per quantity and record (the most extreme layer, naming how many more): no storm."""
    best: dict[str, tuple[Finding, int]] = {}
    for finding in found:
        key = split_signal(finding.signal)[0] + ("/" if "/" in finding.signal else "")
        kept = best.get(key)
        if kept is None:
            best[key] = (finding, 1)
        else:
            extreme = finding if finding.score > kept[0].score or (
                finding.score == kept[0].score and finding.value < kept[0].value) else kept[0]
            best[key] = (extreme, kept[1] + 1)
    return [f if n == 1 else dataclasses.replace(f, message=f"{f.message} ({n - 1} more layers too)")
            for f, n in best.values()]
