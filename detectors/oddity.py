"""Multivariate oddity just before an incident (scikit-learn ``IsolationForest``): a ranking feature only.

:func:`precursor_oddity` looks at the rank's global signals (grad norm, LR, loss scale, ... but not the loss) in the
records before the onset ``t0``: an isolation forest is fit on the ``reference`` records that end ``lead`` records
before ``t0`` (log of the absolute values; columns that are constant there are dropped) and scores the last
``lead`` (5) records before ``t0``. When at least ``min_odd`` (2) of them score below the 5% quantile of the
reference scores, they are returned (by chance, with records like the reference: ~2% of incidents; isolation
scores saturate for far outliers, so "below every reference record" would miss them).

It never raises an alarm. :mod:`~stability.detectors.ranking` uses it where a rule claims "no precursor": a loss
jump with no single-signal precursor is a ``bad_batch`` only if the records before it were not already unusual
in combination. scikit-learn is imported on first use (the worker and post-mortem side only; ~0.05 s per call
for 100 records x 10 signals, measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stability.detectors.history import History
from stability.detectors.steptime import PERF_SIGNALS

__all__ = ["Oddity", "precursor_oddity"]

_NOT_FEATURES = frozenset({"loss", "loss_steps"}) | PERF_SIGNALS  # wall-clock jitter is no sign of a bad batch


@dataclass(frozen=True, slots=True)
class Oddity:
    """Records before the onset that the forest isolates faster than any reference record."""

    steps: tuple[int, ...]
    signals: int
    """How many signals the forest saw."""


def precursor_oddity(history: History, t0: int, *, reference: int = 64, lead: int = 5, min_reference: int = 32,
                     quantile: float = 0.05, min_odd: int = 2) -> Oddity | None:
    """The odd records among the ``lead`` before ``t0``, or ``None`` when there is too little history (fewer than
    ``min_reference`` reference records or fewer than 2 varying signals) or fewer than ``min_odd`` are odd."""
    ring = history.globals
    steps = ring.ordered()
    names = [n for n in ring.series if n not in _NOT_FEATURES]
    if not names:
        return None
    data = np.stack([ring.ordered(n).astype(np.float64) for n in names], axis=1)
    before = steps < t0
    steps, data = steps[before][-(reference + lead):], data[before][-(reference + lead):]
    keep = np.all(np.isfinite(data), axis=1)
    steps, data = steps[keep], np.log(np.abs(data[keep]) + 1e-30)
    if len(steps) < min_reference + lead:
        return None
    ref, recent = data[:-lead], data[-lead:]
    varying = ref.std(axis=0) > 1e-9  # log space: constant columns (a flat LR) have rounding-level spread
    if varying.sum() < 2:
        return None
    ref, recent = ref[:, varying], recent[:, varying]
    from sklearn.ensemble import IsolationForest

    forest = IsolationForest(n_estimators=100, random_state=0).fit(ref)
    scores = forest.score_samples(np.concatenate([ref, recent]))  # one pass over the 100 trees (per-row scores)
    floor = float(np.quantile(scores[:len(ref)], quantile))
    odd = [int(s) for s, score in zip(steps[-lead:], scores[len(ref):], strict=True)
           if math.isfinite(score) and score < floor]
    return Oddity(tuple(odd), int(varying.sum())) if len(odd) >= min_odd else None
