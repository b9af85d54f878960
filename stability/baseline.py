"""Compare a run with a baseline run: where do they part, and in which signals first?

``stability postmortem SOURCE --baseline OTHER`` loads both (any supported format), aligns them on step, and for
every signal both log (``loss``, ``grad_norm``, ``lr``, ``loss_scale``, ...; the median over ranks at each step)
computes the **relative difference** ``|a - b| / ((|a| + |b|) / 2)`` at each shared step (a value non-finite in one
run only counts as infinitely different, in both as equal).

* The **noise band** of a signal is read from the early shared steps (the first 10 %, at least 5 and at most
  :attr:`BaselineConfig.early_steps`): median + 5 MAD of the relative difference there, and at least
  :attr:`BaselineConfig.min_band` (two identical runs have no noise; two seeds have a lot).
* A signal **parts** at the first shared step where the difference exceeds its band and stays above it for most of
  the next :attr:`BaselineConfig.persist` shared steps (a one-step blip that falls back is not parting).
* Signals are ranked by how early they part, then by how far (median relative difference after the parting step
  over the band); the earliest is where the runs part.

A re-logged step (a resume) counts with its latest value. Framework-free: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.errors import SourceError
from stability.phases import per_step_median
from stability.records import StepRecord

__all__ = ["BaselineConfig", "compare_runs"]

_SKIP = frozenset({"loss_steps"})
"""Signals that are bookkeeping, not behaviour."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineConfig:
    """Knobs of :func:`compare_runs` (see the module docstring)."""

    early_steps: int = 50
    """Most shared steps the noise band is read from."""
    min_band: float = 1e-3
    """Smallest noise band (relative difference): below it two runs are the same."""
    persist: int = 5
    """Shared steps after a crossing of which more than half must be above the band."""
    max_signals: int = 200
    """Most signals compared (the loss first, then by name)."""


def _latest(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The latest record of each (rank, step) (a resume re-logs steps), in log order otherwise."""
    keys = {(r.rank, r.step) for r in records}
    if len(keys) == len(records):
        return list(records)
    latest: dict[tuple[int, int], StepRecord] = {}
    for record in records:
        latest[(record.rank, record.step)] = record
    return list(latest.values())


def _relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fa, fb = np.isfinite(a), np.isfinite(b)
    scale = (np.abs(a) + np.abs(b)) / 2
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(a - b) / np.where(scale > 0, scale, 1.0), 0.0)
    rel = np.where(fa & fb, rel, np.where(fa == fb, 0.0, np.inf))
    return np.asarray(rel, dtype=np.float64)


def _parting(rel: np.ndarray, band: float, persist: int) -> int | None:
    """Index of the first crossing of ``band`` that most of the next ``persist`` points confirm."""
    above = rel > band
    for i in np.flatnonzero(above).tolist():
        window = above[i:i + persist]
        if window.sum() * 2 > len(window) or (len(window) < persist and i + len(window) == len(rel)
                                              and window.sum() == len(window)):
            return int(i)
    return None


def compare_runs(run: Sequence[StepRecord], baseline: Sequence[StepRecord], *, name: str = "baseline",
                 config: BaselineConfig | None = None) -> dict[str, Any]:
    """Where ``run`` parts from ``baseline`` (plain data for the findings JSON and the reports).

    Returns ``{"baseline", "shared_steps", "first_step", "last_step", "compared", "parts_at", "signals"}``;
    ``signals`` holds one row per compared signal (``signal``, ``parts_at``, ``band``, ``rel_diff``, ``ratio``,
    ``run_value``, ``baseline_value``), earliest parting first, signals that never part last.

    Raises:
        SourceError: the runs share no signal at a common step.
    """
    config = config or BaselineConfig()
    ours, theirs = _latest(run), _latest(baseline)
    names = ({n for r in ours for n in r.signals} & {n for r in theirs for n in r.signals}) - _SKIP
    shared = sorted(names, key=lambda s: (s != "loss", s))[: config.max_signals]
    rows: list[dict[str, Any]] = []
    all_steps: set[int] = set()
    for signal in shared:
        steps_a, values_a = per_step_median(ours, signal)
        steps_b, values_b = per_step_median(theirs, signal)
        common, ia, ib = np.intersect1d(steps_a, steps_b, assume_unique=True, return_indices=True)
        if len(common) < 2:
            continue
        steps = common.tolist()
        all_steps.update(steps)
        a, b = values_a[ia], values_b[ib]
        rel = _relative(a, b)
        early = rel[: max(5, min(config.early_steps, len(rel) // 10))]
        early = early[np.isfinite(early)]
        med = float(np.median(early)) if len(early) else 0.0
        mad = float(np.median(np.abs(early - med))) * 1.4826 if len(early) else 0.0
        band = max(config.min_band, med + 5 * mad)
        at = _parting(rel, band, config.persist)
        row: dict[str, Any] = {"signal": signal, "parts_at": None, "band": round(band, 6), "rel_diff": None,
                               "ratio": None, "run_value": None, "baseline_value": None}
        if at is not None:
            after = rel[at:]
            diff = float(np.median(after))
            row.update(parts_at=steps[at], rel_diff=diff if math.isfinite(diff) else "inf",
                       ratio=round(diff / band, 3) if math.isfinite(diff) else "inf",
                       run_value=_plain(float(a[at])), baseline_value=_plain(float(b[at])))
            if math.isfinite(diff):
                row["rel_diff"] = round(diff, 6)
        rows.append(row)
    if not rows:
        raise SourceError(f"{name}: no signal logged at two or more steps of both runs; cannot compare")
    rows.sort(key=lambda r: (r["parts_at"] is None, r["parts_at"] or 0, -_num(r["ratio"])))
    parts = rows[0]["parts_at"]
    return {"baseline": name, "shared_steps": len(all_steps), "first_step": min(all_steps),
            "last_step": max(all_steps), "compared": [r["signal"] for r in rows], "parts_at": parts,
            "signals": rows}


def _num(value: Any) -> float:
    return math.inf if value == "inf" else float(value or 0.0)


def _plain(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
