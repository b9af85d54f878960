"""The finding of a candidate-then-confirm detector (loss spike, gradient explosion): one builder for both.

A *candidate* is the plain dict those detectors keep in their state: ``step``, ``y`` (log value), ``level`` (log
baseline), ``ratio``, ``z`` and ``points`` (baseline size).
"""

from __future__ import annotations

from typing import Any

from stability.detectors._stats import safe_exp
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["candidate_finding"]


def candidate_finding(
    detector: Any, signal: str, record: StepRecord, cand: dict[str, Any], severity: Severity, what: str, *,
    end: int | None = None, extra: dict[str, float] | None = None,
) -> Finding:
    """A finding of ``detector`` (its ``name`` and ``kind``) about ``signal`` for the candidate ``cand``."""
    baseline = safe_exp(cand["level"])
    evidence = {"ratio": cand["ratio"], "z": cand["z"], "baseline": baseline, "points": float(cand["points"])}
    evidence.update(extra or {})
    return Finding(
        kind=detector.kind, step=record.step, onset=cand["step"], severity=severity, signal=signal,
        value=safe_exp(cand["y"]), message=f"{signal} {what} (baseline {baseline:.4g})", detector=detector.name,
        rank=record.rank, end=end, score=cand["ratio"], evidence=evidence,
    )
