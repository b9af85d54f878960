"""Gradient-explosion detector on the global ``grad_norm`` (log space).

* **Candidate**: robust z >= ``z_threshold`` (6) and ``grad_norm / baseline >= ratio_threshold`` (5x); with fewer
  than ``min_points`` points the ratio alone against the median of at least 2 points. Non-positive grad norms
  are treated as absent (some Megatron builds print ``0.000`` when the norm is not computed).
* **Huge** (``ratio >= error_ratio``, 50x) with the loss of the same record already up (>= ``loss_ratio``, 1.5x
  its recent median): ERROR at once. A huge norm with a normal loss waits for the next record like any candidate.
* **Confirmation** at the next record: still ``>= confirm_ratio`` (2.5x) over the frozen baseline, or the loss is
  spiking *now* -> ``grad_explosion`` WARNING (ERROR if the loss is >= ``loss_ratio`` over its recent median at
  either record, or the norm was huge). Otherwise the jump reverted at once: the grad norm is back and so is the
  loss, whatever both did on the one step (a bad batch: loss 2.3x with the norm 31x, or a 280x norm with the loss
  unchanged), and the finding is INFO with ``evidence["reverted"]`` (ranked ``bad_batch``); the clean llm.c run has
  such a 7.5x blip at step 9025 whose next value is 1.26x. A jump is a one-step event only if it reverts: one that
  stays up is an error or a warning as above. A next value no higher than the one accepted just before the jump is
  back too, however far over the frozen baseline both are: in a series that climbed under the candidate ratio (a
  net leaving its plateau at chance, grad norm 0.25 -> 1.0 in seven steps with no alarm), the baseline (the median
  of fewer than ``min_points`` points) lags, and "still 3.5x over it" only says where the series already was.
* **Screen** (exact, issue #11): a value less than ``ratio_threshold`` over
  :func:`~stability.detectors._rolling.level_lower_bound` (a bound of the line's prediction, and of the median in
  the few-points regime, from the window's sorted values) cannot be a candidate, so it is accepted without the fit;
  only values near or over the bound take :meth:`~stability.detectors._rolling.FastBaseline.predict`.
* ``evidence["onset_loss_ratio"]``: the loss of the onset record over its recent median (``loss_ratio`` is the
  larger of it and the confirming record's). With the loss up on the very record the norm jumped, and nothing
  moving before, the ranking reads the jump as a loss spike without precursor (``ranking._data_rules``).
* Per-layer ``grad_norm/<module>`` is not judged here: :data:`~stability.detectors.update.LAYER_GRAD` (a layer
  20x over its own level) alarms on it, and the ranking uses it (which layer moved first).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from stability.detectors._candidate import candidate_finding
from stability.detectors._rolling import FastBaseline, level_lower_bound
from stability.detectors._stats import SCREEN_MARGIN, Prediction, log_positive, safe_exp, times
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["GradConfig", "GradExplosionDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GradConfig:
    """Settings of :class:`GradExplosionDetector`."""

    window: int = 96
    min_points: int = 32
    few_min_points: int = 2
    z_threshold: float = 6.0
    ratio_threshold: float = 5.0
    confirm_ratio: float = 2.5
    error_ratio: float = 50.0
    loss_ratio: float = 1.5
    loss_window: int = 16
    recover_ratio: float = 2.0
    scale_floor: float = 1e-2
    max_active: int = 200


class GradExplosionDetector:
    """Streaming gradient-explosion detector for one rank (see the module docstring)."""

    name = "grad"
    kind = "grad_explosion"

    def __init__(self, config: GradConfig | None = None) -> None:
        self.config = config or GradConfig()
        cfg = self.config
        self._base = FastBaseline(window=cfg.window, min_points=cfg.min_points, scale_floor=cfg.scale_floor)
        self._losses: deque[float] = deque(maxlen=cfg.loss_window)
        self._pending: dict[str, Any] | None = None
        self._active: dict[str, Any] | None = None
        self._quiet = math.log(cfg.ratio_threshold) - SCREEN_MARGIN
        """A value less than this (log) over :func:`level_lower_bound` cannot be a candidate (no fit needed)."""

    def _loss_ratio(self, record: StepRecord) -> float:
        loss = log_positive(record.get("loss"))
        if loss is None or len(self._losses) < 2:
            return 1.0
        ordered = sorted(self._losses)
        ratio = safe_exp(loss - ordered[len(ordered) // 2])
        return ratio

    def _candidate(self, y: float, pred: Prediction) -> bool:
        ratio = safe_exp(y - pred.level)
        if pred.points < self.config.min_points:
            return ratio >= self.config.ratio_threshold
        return ratio >= self.config.ratio_threshold and pred.z(y) >= self.config.z_threshold

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        y = log_positive(record.get("grad_norm"))
        loss_ratio = self._loss_ratio(record)
        loss = log_positive(record.get("loss"))
        if loss is not None and loss_ratio < self.config.loss_ratio:
            self._losses.append(loss)
        if y is None:
            return []
        if self._active is not None:
            return self._track(record, y)
        if self._pending is not None:
            cand, self._pending = self._pending, None
            ratio_now = safe_exp(y - cand["level"])
            spiking_now = loss_ratio >= self.config.loss_ratio
            before = cand.get("before")
            back = before is not None and y <= before  # no higher than the value just before the jump
            if (ratio_now >= self.config.confirm_ratio and not back) or spiking_now:
                loss_spiking = spiking_now or cand["loss_ratio"] >= self.config.loss_ratio
                huge = cand["ratio"] >= self.config.error_ratio
                severity = Severity.ERROR if loss_spiking or huge else Severity.WARNING
                self._active = {**cand, "last": record.step, "records": 0}
                return [self._finding(record, cand, severity,
                                      f"rose {times(cand['ratio'])} over its baseline at step {cand['step']} and is "
                                      f"{times(ratio_now)} at step {record.step}",
                                      extra={"confirm_ratio": ratio_now, "loss_ratio": max(cand["loss_ratio"],
                                                                                         loss_ratio),
                                             "onset_loss_ratio": cand["loss_ratio"]})]
            self._base.accept(record.step, y)
            what = f"one-step jump of {times(cand['ratio'])} at step {cand['step']}"
            if cand["loss_ratio"] >= self.config.loss_ratio:
                what += f" (the loss {times(cand['loss_ratio'])} on that step)"
            return [self._finding(record, cand, Severity.INFO,
                                  f"{what}, back to {times(ratio_now)} at step {record.step} with the loss back too: "
                                  "it reverted at once", end=cand["step"],
                                  extra={"reverted": 1.0, "loss_ratio": cand["loss_ratio"]})]
        if len(self._base) < self.config.few_min_points:
            self._base.accept(record.step, y)
            return []
        if y - level_lower_bound(self._base, record.step) < self._quiet:
            self._base.accept(record.step, y)  # under ratio_threshold over the line, whatever its fit: no candidate
            return []
        pred = self._base.predict(record.step)
        if not self._candidate(y, pred):
            self._base.accept(record.step, y)
            return []
        ratio = safe_exp(y - pred.level)
        cand = {"step": record.step, "y": y, "level": pred.level, "ratio": ratio, "z": pred.z(y),
                "points": pred.points, "loss_ratio": loss_ratio, "rank": record.rank,
                "before": self._base.values()[-1]}
        if ratio >= self.config.error_ratio and loss_ratio >= self.config.loss_ratio:
            self._active = {**cand, "last": record.step, "records": 0}
            return [self._finding(record, cand, Severity.ERROR, f"rose {times(ratio)} over its baseline",
                                  extra={"loss_ratio": loss_ratio, "onset_loss_ratio": loss_ratio})]
        self._pending = cand
        return []

    def _track(self, record: StepRecord, y: float) -> list[Finding]:
        active = self._active
        assert active is not None
        if safe_exp(y - active["level"]) < self.config.recover_ratio:
            self._active = None
            self._base.accept(record.step, y)
            return [self._finding(record, active, Severity.INFO,
                                  f"back under {self.config.recover_ratio:g}x at step {record.step}",
                                  end=active["last"], extra={"closes": 1.0})]
        active["last"] = record.step
        active["records"] += 1
        if active["records"] > self.config.max_active:
            self._active = None
            self._base.clear()
            self._base.accept(record.step, y)
        return []

    def _finding(self, record: StepRecord, cand: dict[str, Any], severity: Severity, what: str, *,
                 end: int | None = None, extra: dict[str, float] | None = None) -> Finding:
        return candidate_finding(self, "grad_norm", record, cand, severity, what, end=end, extra=extra)

    def finish(self) -> list[Finding]:
        """A huge (``>= error_ratio``) candidate that the end of the records left unconfirmed is reported as the
        ERROR it would be if it did not revert (``evidence["unconfirmed"]``); a smaller one alone is not."""
        cand, self._pending = self._pending, None
        if cand is None or cand["ratio"] < self.config.error_ratio:
            return []
        baseline = safe_exp(cand["level"])
        return [Finding(kind=self.kind, step=cand["step"], onset=cand["step"], severity=Severity.ERROR,
                        signal="grad_norm", value=safe_exp(cand["y"]),
                        message=f"grad_norm rose {times(cand['ratio'])} over its baseline {baseline:.4g} at step "
                        f"{cand['step']}; the records end before it could be confirmed", detector=self.name,
                        rank=cand.get("rank", 0), score=cand["ratio"],
                        evidence={"ratio": cand["ratio"], "z": cand["z"], "baseline": baseline,
                                  "loss_ratio": cand["loss_ratio"], "onset_loss_ratio": cand["loss_ratio"],
                                  "unconfirmed": 1.0})]

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"base": self._base.state_dict(), "losses": list(self._losses), "pending": self._pending,
                "active": None if self._active is None else dict(self._active)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._base.load_state_dict(state["base"])
        self._losses = deque((float(v) for v in state["losses"]), maxlen=self.config.loss_window)
        self._pending = None if state["pending"] is None else dict(state["pending"])
        self._active = None if state["active"] is None else dict(state["active"])
