"""The detector contract: findings, cause hints and the ``Detector`` protocol.

Detectors are small, framework-free and streaming: ``update(record)`` is called once per step record of one
rank, in step order, and returns the findings that step produced. Their whole state round-trips through
``state_dict()`` / ``load_state_dict()`` (plain JSON/msgpack-able types), so a worker can die and another can
resume exactly where it stopped. The same detector objects run online in the worker and offline in
``stability postmortem``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from stability.records import StepRecord, split_signal

__all__ = ["CauseHint", "Detector", "Finding", "Severity", "KINDS", "STEP_STATISTICS", "is_skipped_step",
           "without_step_statistics"]

KINDS: tuple[str, ...] = (
    "nan",
    "loss_spike",
    "divergence",
    "grad_explosion",
    "grad_vanishing",
    "loss_scale_collapse",
    "bad_batch",
    "attention_logit_growth",
    "activation_growth",
    "logit_divergence",
    "rank_disagreement",
    "update_ratio_jump",
    "param_jump",
    "adam_v_lag",
    "plateau",
    "lr_off_schedule",
)
"""Finding kinds produced by the built-in detectors."""


class Severity(str, enum.Enum):
    """How bad a finding is. Ordered: ``info < warning < error``."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """0, 1, 2 for info, warning, error."""
        return ("info", "warning", "error").index(self.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class CauseHint:
    """One ranked root-cause hypothesis for a finding."""

    cause: str
    """Id from :data:`stability.detectors.causes.CATALOGUE`."""
    score: float
    """In [0, 1]; hints of one finding are sorted by descending score."""
    evidence: str
    """Human-readable evidence, e.g. ``"grad_norm/h.1.attn rose 40x 3 steps before the loss spike"``."""
    remedy: str = ""
    """What to do about it (defaults to the catalogue's remedy)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One detected anomaly of one rank."""

    kind: str
    """One of :data:`KINDS`."""
    step: int
    """Step at which the detector fired."""
    onset: int
    """First step of the anomaly (<= step)."""
    severity: Severity
    signal: str
    """The signal that triggered it, e.g. ``loss`` or ``grad_norm``."""
    value: float
    """Value of that signal at ``step``."""
    message: str
    detector: str
    rank: int = 0
    host: str = ""
    """Host of ``rank`` when the records carry it (cross-rank findings name the suspect machine)."""
    end: int | None = None
    """Last step of the anomaly when known (a spike that has recovered)."""
    score: float = 0.0
    """Detector statistic (robust z, ratio, ...)."""
    evidence: Mapping[str, float] = field(default_factory=dict)
    """Signal values backing the finding."""
    causes: tuple[CauseHint, ...] = ()
    """Ranked root-cause hints (best first)."""
    rollback_step: int | None = None
    """Last step before the earliest precursor: a safe checkpoint to roll back to."""
    skip_batches: tuple[str, ...] = ()
    """Batch identities to skip on replay, when the records carry them."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["severity"] = self.severity.value
        out["evidence"] = dict(self.evidence)
        out["causes"] = [asdict(c) for c in self.causes]
        out["skip_batches"] = list(self.skip_batches)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        values["severity"] = Severity(values["severity"])
        values["causes"] = tuple(CauseHint(**c) for c in values.get("causes", ()))
        values["skip_batches"] = tuple(values.get("skip_batches", ()))
        values["evidence"] = dict(values.get("evidence", {}))
        return cls(**values)


@runtime_checkable
class Detector(Protocol):
    """A streaming detector over one rank's step records."""

    name: str

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record (in step order) and return the findings it triggers."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The detector's whole state as plain data."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict`."""
        ...


STEP_STATISTICS = frozenset({"grad_norm", "nonfinite_grads", "update_ratio", "adam_v_ratio"})
"""Quantities (global or ``<quantity>/<module>``) computed from a step's gradients or its update."""


BACKOFF = 1.5
"""A loss scale that fell by this factor or more backed off (scalers halve it on an overflow)."""


def is_skipped_step(record: StepRecord, previous_scale: float | None) -> bool:
    """Whether the fp16 loss scaler skipped this step: ``skipped > 0``, the loss scale backed off (fell :data:`BACKOFF`
    x or more) from ``previous_scale`` (the rank's last recorded scale), or a loss scale is recorded and the grad norm
    is not finite (the scaler's overflow check). On such a step the recorded gradients are the scaled ones or inf and no
    update was applied: its gradient statistics describe the overflow, not the training."""
    if record.get("skipped", 0.0) > 0:
        return True
    scale = record.get("loss_scale")
    if not (math.isfinite(scale) and scale > 0):
        return False
    if previous_scale is not None and scale * BACKOFF < previous_scale:
        return True
    grad = record.signals.get("grad_norm")
    return grad is not None and not math.isfinite(grad)


def without_step_statistics(record: StepRecord) -> StepRecord:
    """``record`` without its gradient / update statistics (:data:`STEP_STATISTICS`): what the baselines of the
    detectors may see of a skipped step (the loss, the LR, the loss scale and ``skipped`` stay)."""
    signals = {k: v for k, v in record.signals.items() if split_signal(k)[0] not in STEP_STATISTICS}
    return dataclasses.replace(record, signals=signals)
