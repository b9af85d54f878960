"""Update-ratio jumps: a layer's ``||dw|| / ||w||`` far above its own recent level (an LR spike, a runaway group).

Series: ``update_ratio/<module>`` (and a global ``update_ratio`` if a loop reports one), each judged on the records
that carry it (the capture samples them every ``stats_every`` steps). Per series, in log space:

* baseline = a robust line through the last ``window`` (32) accepted values (``_stats.Baseline``, at least
  ``min_points`` = 8);
* a value ``factor`` (10x) or more over it with a robust z of at least ``z_threshold`` (6) is a jump; jumps are not
  accepted into the baseline, so a run of them stays visible;
* no alarm while the LR warms up or before ``warmup_gate`` (2) times the end of the warm-up (updates grow with the
  LR ramp and Adam's early steps).

One ``update_ratio_jump`` WARNING per record (the largest jump; the message counts the other layers that jumped),
then that series is quiet for ``cooldown`` (20) of its records. The cause is ranked like a loss spike's
(``ranking._gradient_rules``): an LR that jumped with it -> ``lr_too_high``; only attention projections ->
``attention_logit_growth``.

Calibration (evaluation corpus, the cached runs of seeds 0-2, tiny GPT with ``stats_every = 10``): after the
warm-up gate the largest ratio of any clean run's update ratio to its baseline is 3.2x (z < 7); LR spikes give
260-780x, LR ramps ~360x, attention-LR growth 46-90x. Defaults are set for **0 false alarms per 10k steps** on the
clean runs (measured: 0). The real baselines carry no update ratios.

Adam's second moment (``adam_v_ratio``) is not alarmed on: the capture reads ``v`` after the step, so
``sum(g^2) / sum(v) <= 1 / (1 - beta2)`` (20 at beta2 = 0.95) and saturates; on the corpus clean runs reach 18x
their baseline and bad batches 14-18x, so no threshold separates them. It stays a ranking feature
(``ranking._adam_rule``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stability.detectors._stats import Baseline, safe_exp
from stability.detectors.base import Finding, Severity
from stability.detectors.history import LrTracker
from stability.records import StepRecord, split_signal

__all__ = ["UpdateConfig", "UpdateRatioDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateConfig:
    """Settings of :class:`UpdateRatioDetector`."""

    window: int = 32
    min_points: int = 8
    factor: float = 10.0
    z_threshold: float = 6.0
    scale_floor: float = 0.05
    warmup_gate: float = 2.0
    cooldown: int = 20
    max_series: int = 512


class _Series:
    def __init__(self, cfg: UpdateConfig) -> None:
        self.base = Baseline(window=cfg.window, min_points=cfg.min_points, scale_floor=cfg.scale_floor)
        self.quiet = 0


class UpdateRatioDetector:
    """Streaming update-ratio jump detector for one rank (see the module docstring)."""

    name = "update"
    kind = "update_ratio_jump"

    def __init__(self, config: UpdateConfig | None = None) -> None:
        self.config = config or UpdateConfig()
        self._series: dict[str, _Series] = {}
        self._lr = LrTracker()

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        self._lr.update(record.step, record.get("lr"))
        warming = self._lr.in_warmup(record.step, cfg.warmup_gate)
        jumps: list[tuple[float, str, float, float, float]] = []
        for name, value in record.signals.items():
            if split_signal(name)[0] != "update_ratio" or not (value > 0 and math.isfinite(value)):
                continue
            series = self._series.get(name)
            if series is None:
                if len(self._series) >= cfg.max_series:
                    continue
                series = self._series[name] = _Series(cfg)
            y = math.log(value)
            if len(series.base) < cfg.min_points:
                series.base.accept(record.step, y)
                continue
            pred = series.base.predict(record.step)
            ratio, z = safe_exp(y - pred.level), pred.z(y)
            if ratio < cfg.factor or z < cfg.z_threshold:
                series.base.accept(record.step, y)
                series.quiet = max(0, series.quiet - 1)
                continue
            if series.quiet == 0 and not warming:
                jumps.append((ratio, name, value, safe_exp(pred.level), z))
            series.quiet = cfg.cooldown
        if not jumps:
            return []
        ratio, name, value, baseline, z = max(jumps)
        message = f"{name} jumped {ratio:.3g}x over its recent level ({baseline:.3g} -> {value:.3g})"
        if len(jumps) > 1:
            message += f"; {len(jumps) - 1} more layers jumped too"
        return [Finding(kind=self.kind, step=record.step, onset=record.step, severity=Severity.WARNING, signal=name,
                        value=value, message=message, detector=self.name, rank=record.rank, host=record.host,
                        score=ratio, evidence={"ratio": ratio, "z": z, "baseline": baseline,
                                               "layers": float(len(jumps))})]

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"series": {n: {"base": s.base.state_dict(), "quiet": s.quiet} for n, s in self._series.items()},
                "lr": self._lr.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._series = {}
        for name, st in state["series"].items():
            series = self._series[name] = _Series(self.config)
            series.base.load_state_dict(st["base"])
            series.quiet = int(st["quiet"])
        self._lr.load_state_dict(state["lr"])

