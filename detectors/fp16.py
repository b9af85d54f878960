"""Loss-scale collapse and skipped-step bursts (fp16 dynamic loss scaling).

Signals: ``loss_scale`` (the dynamic scale after the step) and ``skipped`` (1 when the optimizer step was skipped
because of an overflow, else 0). Rules, per rank:

* **Start-up calibration** (records starting at step <= ``settle_steps``): until the scale has held (or grown) for
  ``settle_steps`` (50) steps, back-offs find
  the starting scale (GradScaler's 2^16 is a guess; 2^19 -> 2^16 in 37 steps on a healthy fp16 CNN) and are no
  collapse; the collapse rules measure from the settled scale.
* **Collapse** (WARNING): the scale fell >= ``collapse_factor`` (8x) below its maximum over the last ``window``
  (100) steps, or it halved ``halvings`` (5) times in a row without growing in between, however slowly.
* **Floor** (ERROR): the scale is at or below ``floor`` (1.0): gradients underflow, training is no longer fp16-safe.
* **Skipped-step burst** (WARNING): at least ``burst`` (5) skipped steps within ``burst_window`` (20) steps.
* **Then NaN** (ERROR): a non-finite ``loss`` (or ``grad_norm`` on a step that was not skipped) within ``window``
  steps after a collapse or burst.

The onset is the first overflow (skipped step) of the collapse when ``skipped`` is recorded, else the first drop.

Calibration / false-alarm rate: healthy dynamic loss scaling (torch ``GradScaler``: growth every 2000 clean steps,
x0.5 per overflow; DeepSpeed/Megatron: ``loss_scale_window`` 1000, hysteresis 2) halves on isolated overflows and
doubles back after a growth interval, so an 8x fall inside 100 steps needs three overflows in a row, and 5 skips in
20 steps never happens outside an overflow storm. The defaults are set for **0 false alarms per 10k steps** on a
healthy fp16 run; the clean real baselines carry no ``loss_scale`` (bf16/fp32) and raise nothing. The labelled
bigscience excerpts (65536 -> 8192 at tr1-13B step 29050; 1048576 -> 32768 in tr8b-104B) fire.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from stability.detectors._stats import plural
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["LossScaleConfig", "LossScaleDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossScaleConfig:
    """Settings of :class:`LossScaleDetector`."""

    window: int = 100
    collapse_factor: float = 8.0
    halvings: int = 5
    floor: float = 1.0
    burst: int = 5
    burst_window: int = 20
    rearm_steps: int = 200
    """After an alarm, stay quiet until the scale has not fallen for this many steps."""
    settle_steps: int = 50
    """The scaler's start-up calibration: until the scale has held (or grown) for this many steps, its back-offs
    only look for the right starting scale (an init scale of 2^16-2^19 is a guess) and are no collapse; the collapse
    rules measure from the settled scale. The floor, skipped-step bursts and NaN rules apply from the start."""


class LossScaleDetector:
    """Streaming fp16 loss-scale detector for one rank (see the module docstring)."""

    name = "loss_scale"
    kind = "loss_scale_collapse"

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self._scales: deque[tuple[int, float]] = deque(maxlen=self.config.window)
        self._peak: tuple[int, float] | None = None
        """The entry of ``_scales`` that ``max(key=(value, step))`` returns, while known (None: recompute)."""
        self._skips: deque[int] = deque(maxlen=self.config.burst)
        self._halvings = 0.0
        self._fired_at: int | None = None
        """Step of the last collapse/burst alarm (None = armed)."""
        self._at_floor = False
        self._nan_reported = False
        self._last_drop: int | None = None
        self._settled = False
        self._calibrating_since: int | None = None
        """Step of the first scale record, then of each start-up back-off (until settled)."""

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg, step, out = self.config, record.step, []
        if self._fired_at is not None:
            quiet_since = self._last_drop if self._last_drop is not None else self._fired_at
            if step - quiet_since >= cfg.rearm_steps:
                self._fired_at, self._nan_reported, self._halvings = None, False, 0.0
                self._scales.clear()
                self._peak = None
        scale = record.get("loss_scale")
        if math.isfinite(scale) and scale > 0:
            out += self._scale(record, scale)
        if record.get("skipped", 0.0) > 0:
            self._skips.append(step)
            recent = [s for s in self._skips if step - s < cfg.burst_window]
            if len(recent) >= cfg.burst and self._fired_at is None:
                self._fired_at = step
                out.append(self._finding(record, Severity.WARNING, recent[0], "skipped",
                                         f"{len(recent)} optimizer steps skipped (overflow) in the last "
                                         f"{plural(step - recent[0] + 1, 'step')}", {"skipped": float(len(recent))}))
        if self._fired_at is not None and not self._nan_reported and step - self._fired_at <= cfg.window:
            skipped = record.get("skipped", 0.0) > 0  # an overflow the scaler skipped is not a NaN
            for name in ("loss",) if skipped else ("loss", "grad_norm"):
                value = record.signals.get(name)
                if value is not None and not math.isfinite(value):
                    self._nan_reported = True
                    out.append(self._finding(record, Severity.ERROR, self._fired_at, name,
                                             f"{name} became {value} at step {step}, after the loss-scale "
                                             f"collapse at step {self._fired_at}", {"then_nan": 1.0}))
                    break
        return out

    def _scale(self, record: StepRecord, scale: float) -> list[Finding]:
        cfg, step = self.config, record.step
        previous = self._scales[-1][1] if self._scales else None
        self._push(step, scale)
        if previous is not None and scale > previous * (1 + 1e-9):
            self._halvings = 0.0
        elif previous is not None and scale < previous * (1 - 1e-9):
            self._halvings += math.log2(previous / scale)
            self._last_drop = step
        out: list[Finding] = []
        if scale <= cfg.floor and not self._at_floor:
            self._at_floor = True
            self._fired_at = step if self._fired_at is None else self._fired_at
            out.append(self._finding(record, Severity.ERROR, step, "loss_scale",
                                     f"loss scale fell to {scale:.3g}, at or below the floor {cfg.floor:g}: "
                                     "gradients underflow", {"scale": scale}))
            return out
        if scale > cfg.floor:
            self._at_floor = False
        if not self._settle(step, scale, previous):
            return out
        if self._fired_at is not None:
            return out
        if self._peak is None:
            self._peak = max(self._scales, key=lambda p: (p[1], p[0]))
        peak_step, peak = self._peak
        factor = peak / scale
        if factor >= cfg.collapse_factor:
            why = f"fell {factor:.3g}x in {plural(step - peak_step, 'step')} ({peak:.6g} -> {scale:.6g})"
        elif self._halvings >= cfg.halvings - 1e-9:
            why = f"halved {self._halvings:.3g} times in a row without recovering (now {scale:.6g})"
        else:
            return out
        onset = next(s for s, v in self._scales if s > peak_step and v < peak) if factor > 1 else step
        overflows = [s for s in self._skips if onset - cfg.burst_window <= s <= onset]
        onset = min([onset, *overflows])  # the first overflow of the collapse (the scale drops a step later)
        self._fired_at = step
        out.append(self._finding(record, Severity.WARNING, onset, "loss_scale", f"loss scale {why}",
                                 {"factor": factor, "scale": scale, "halvings": self._halvings}))
        return out

    def _push(self, step: int, scale: float) -> None:
        """Append to the window of scales (dropping the points ``window`` steps old), keeping the cached peak."""
        scales, peak_entry = self._scales, self._peak
        while scales and step - scales[0][0] >= self.config.window:
            if scales.popleft() is peak_entry:
                peak_entry = None
        if peak_entry is not None and len(scales) == scales.maxlen and scales[0] is peak_entry:
            peak_entry = None  # the append below drops it
        entry = (step, scale)
        scales.append(entry)
        if peak_entry is not None and (scale, step) > (peak_entry[1], peak_entry[0]):
            peak_entry = entry  # max() keeps the first of equal keys: the cached one, which comes earlier
        self._peak = peak_entry

    def _settle(self, step: int, scale: float, previous: float | None) -> bool:
        """Whether the start-up calibration is over (see ``settle_steps``); when it ends, the collapse rules start
        from the settled scale."""
        if self._settled:
            return True
        grew = previous is not None and scale > previous * (1 + 1e-9)
        if self._calibrating_since is None and step > self.config.settle_steps:
            grew = True  # the records start mid-run (an excerpt, a resume): the scaler settled long ago
        if self._calibrating_since is None or (previous is not None and scale < previous * (1 - 1e-9)):
            self._calibrating_since = step
        if not grew and step - self._calibrating_since < self.config.settle_steps:
            return False
        self._settled = True
        self._halvings = 0.0
        self._scales.clear()
        self._scales.append((step, scale))
        self._peak = None
        return True

    def _finding(self, record: StepRecord, severity: Severity, onset: int, signal: str, message: str,
                 evidence: dict[str, float]) -> Finding:
        value = record.get(signal)
        return Finding(kind=self.kind, step=record.step, onset=min(onset, record.step), severity=severity,
                       signal=signal, value=value, message=message, detector=self.name, rank=record.rank,
                       host=record.host, score=evidence.get("factor", 1.0), evidence=evidence)

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"scales": [list(p) for p in self._scales], "skips": list(self._skips), "halvings": self._halvings,
                "fired_at": self._fired_at, "at_floor": self._at_floor, "nan_reported": self._nan_reported,
                "last_drop": self._last_drop, "settled": self._settled, "calibrating_since": self._calibrating_since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._scales = deque(((int(s), float(v)) for s, v in state["scales"]), maxlen=self.config.window)
        self._peak = None
        self._skips = deque((int(s) for s in state["skips"]), maxlen=self.config.burst)
        self._halvings = float(state["halvings"])
        self._fired_at = state["fired_at"]
        self._at_floor = bool(state["at_floor"])
        self._nan_reported = bool(state["nan_reported"])
        self._last_drop = state["last_drop"]
        self._settled = bool(state.get("settled", True))  # a state from before calibration existed: settled
        self._calibrating_since = state.get("calibrating_since")
