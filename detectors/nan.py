"""NaN / Inf detector: a non-finite loss, gradient norm or per-module statistic is an error at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["NanConfig", "NanDetector"]

_CHECKED_GLOBALS = ("loss", "grad_norm", "logit_z", "batch_loss_max")


@dataclass(frozen=True, slots=True, kw_only=True)
class NanConfig:
    """Settings of :class:`NanDetector`."""

    rearm_steps: int = 20
    """Report once per incident: re-arm after this many consecutive finite records."""


class NanDetector:
    """Fires ``nan`` (ERROR, delay 0) on the first non-finite signal of an incident.

    Checked: ``loss``, ``grad_norm``, ``logit_z``, ``batch_loss_max``, every per-module signal (``<q>/<module>``)
    and ``nonfinite_grads > 0``. The evidence names the first non-finite per-module signal when there is one (it
    names the module), else the first global one.
    """

    name = "nan"

    def __init__(self, config: NanConfig | None = None) -> None:
        self.config = config or NanConfig()
        self._armed = True
        self._finite_run = 0

    def update(self, record: StepRecord) -> list[Finding]:
        """Check one record."""
        culprit = _first_nonfinite(record)
        if culprit is None:
            self._finite_run += 1
            if self._finite_run >= self.config.rearm_steps:
                self._armed = True
            return []
        self._finite_run = 0
        if not self._armed:
            return []
        self._armed = False
        name, value = culprit
        loss = record.get("loss")
        message = f"{name} is {value} at step {record.step}"
        if name != "loss" and not math.isfinite(loss):
            message += f" (loss {loss})"
        return [
            Finding(
                kind="nan",
                step=record.step,
                onset=record.step,
                severity=Severity.ERROR,
                signal=name,
                value=value,
                message=message,
                detector=self.name,
                rank=record.rank,
                end=None,
                score=1.0,
                evidence={name: value, "loss": loss},
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"armed": self._armed, "finite_run": self._finite_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._armed = bool(state["armed"])
        self._finite_run = int(state["finite_run"])


def _first_nonfinite(record: StepRecord) -> tuple[str, float] | None:
    """The first non-finite checked signal, preferring a per-module one."""
    first_global: tuple[str, float] | None = None
    for name, value in record.signals.items():
        if math.isfinite(value):
            if name == "nonfinite_grads" and value > 0 and first_global is None:
                first_global = (name, value)
            continue
        if "/" in name:
            return name, value
        if name in _CHECKED_GLOBALS and first_global is None:
            first_global = (name, value)
    return first_global
