"""Multivariate oddity just before an incident (scikit-learn ``IsolationForest``): a ranking feature only.

:func:`precursor_oddity` looks at the rank's global signals (grad norm, LR, loss scale, ... but not the loss) in the
records before the onset ``t0``: an isolation forest is fit on the ``reference`` records that end ``lead`` records
before ``t0`` (log of the absolute values; columns that are constant there are dropped) and scores the last
``lead`` (5) records before ``t0``. When at least ``min_odd`` (2) of them score below the 5% quantile of the
reference scores, they are returned (by chance, with records like the reference: ~2% of incidents; isolation
scores saturate for far outliers, so "below every reference record" would miss them).

It never raises an alarm. :mod:`~stability.detectors.ranking` uses it where a rule claims "no precursor": a loss
jump with no single-signal precursor is a ``bad_batch`` only if the records before it were not already unusual
in combination. scikit-learn is imported on first use (the worker and post-mortem side only; ~0.05-0.1 s of CPU
per fit for 100 records x 10 signals, measured).

**Storms.** A bad batch that every rank of a data-parallel job sees makes one loss spike per rank at the same
step; a forest per rank would cost ~1,600 CPU-seconds at 16,384 ranks, at the worst moment. Two guards:

* the result is memoised on the exact forest input (the same records -> the same answer, bit for bit: the forest
  is seeded), so ranks whose global signals are all-reduced (grad norm, LR, loss scale: the same on every
  replica) fit one forest between them;
* an :class:`OddityBudget` (one per :class:`~stability.detectors.engine.RunDiagnoser`) allows at most
  ``per_step`` forest fits for the onsets of one step; past it the check is skipped and the returned
  :class:`Oddity` says so (``checked=False``), which the ranking writes into the evidence.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from stability.detectors.history import History
from stability.detectors.steptime import PERF_SIGNALS

__all__ = ["Oddity", "OddityBudget", "precursor_oddity"]

_NOT_FEATURES = frozenset({"loss", "loss_steps"}) | PERF_SIGNALS  # wall-clock jitter is no sign of a bad batch


@dataclass(frozen=True, slots=True)
class Oddity:
    """Records before the onset that the forest isolates faster than any reference record."""

    steps: tuple[int, ...]
    signals: int
    """How many signals the forest saw."""
    checked: bool = True
    """False: the forest was not fit (the :class:`OddityBudget` of the onset's step was spent); ``steps`` is empty."""
    checked_at_step: int = 0
    """How many forests were already fit for onsets at this step when ``checked`` is False."""


class OddityBudget:
    """At most ``per_step`` forest fits for the onsets of one step (memoised answers are free)."""

    __slots__ = ("_fits", "per_step")

    def __init__(self, per_step: int) -> None:
        self.per_step = per_step
        self._fits: dict[int, int] = {}

    def spent(self, step: int) -> int:
        """Forests fit so far for onsets at ``step``."""
        return self._fits.get(step, 0)

    def take(self, step: int) -> bool:
        """Count one fit at ``step``; False (nothing counted) when the step's budget is spent."""
        used = self._fits.get(step, 0)
        if used >= self.per_step:
            return False
        if len(self._fits) >= 256:  # steps long past: keep the newest half
            for old in sorted(self._fits)[:128]:
                del self._fits[old]
        self._fits[step] = used + 1
        return True


_MEMO: OrderedDict[bytes, tuple[tuple[int, ...], int] | None] = OrderedDict()
_MEMO_SIZE = 256


def precursor_oddity(history: History, t0: int, *, reference: int = 64, lead: int = 5, min_reference: int = 32,
                     quantile: float = 0.05, min_odd: int = 2, budget: OddityBudget | None = None) -> Oddity | None:
    """The odd records among the ``lead`` before ``t0``, or ``None`` when there is too little history (fewer than
    ``min_reference`` reference records or fewer than 2 varying signals) or fewer than ``min_odd`` are odd.
    With a ``budget`` whose step ``t0`` is spent (and no memoised answer), an unchecked :class:`Oddity`."""
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
    key = _memo_key(steps[-lead:], ref, recent, quantile, min_odd)
    try:  # (no check-then-read: a worker's threads may share the memo)
        hit = _MEMO[key]
    except KeyError:
        pass
    else:
        return None if hit is None else Oddity(*hit)
    if budget is not None and not budget.take(t0):
        return Oddity((), int(varying.sum()), checked=False, checked_at_step=budget.spent(t0))
    found = _fit(steps[-lead:], ref, recent, quantile, min_odd)
    _MEMO[key] = None if found is None else (found.steps, found.signals)
    while len(_MEMO) > _MEMO_SIZE:  # oldest first
        _MEMO.pop(next(iter(_MEMO)), None)
    return found


def _memo_key(steps: np.ndarray, ref: np.ndarray, recent: np.ndarray, quantile: float, min_odd: int) -> bytes:
    digest = hashlib.blake2b(digest_size=20)
    digest.update(np.asarray(ref.shape, dtype=np.int64).tobytes())
    for part in (steps.astype(np.int64), ref, recent, np.array([quantile, min_odd], dtype=np.float64)):
        digest.update(np.ascontiguousarray(part).tobytes())
    return digest.digest()


def _fit(steps: np.ndarray, ref: np.ndarray, recent: np.ndarray, quantile: float, min_odd: int) -> Oddity | None:
    from sklearn.ensemble import IsolationForest

    forest = IsolationForest(n_estimators=100, random_state=0).fit(ref)
    scores = forest.score_samples(np.concatenate([ref, recent]))  # one pass over the 100 trees (per-row scores)
    floor = float(np.quantile(scores[:len(ref)], quantile))
    odd = [int(s) for s, score in zip(steps, scores[len(ref):], strict=True)
           if math.isfinite(score) and score < floor]
    return Oddity(tuple(odd), ref.shape[1]) if len(odd) >= min_odd else None
