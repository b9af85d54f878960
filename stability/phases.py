"""Change-point segmentation of a whole run into phases: warm-up, stable, degradation, divergence, restart.

Each segment of a run (one process lifetime, :class:`~stability.sources.Segment`) is cut separately; a segment after
the first opens with a zero-length ``restart`` phase. Within a segment:

1. The per-step loss is the median over ranks. The **divergence tail** comes first: from the first non-finite loss
   after which at least half of the logged losses are non-finite, to the end of the segment, when the last loss is
   non-finite or there are at least 3 (a single NaN that the run recovers from is an incident, not a phase).
2. The finite part is read as ``y = log(loss)`` (the loss itself when it is not positive), reduced to at most
   :attr:`PhaseConfig.max_points` bin medians, smoothed by a running median (not for short excerpts), and cut
   with PELT (``ruptures``, least-squares cost: level shifts of the smoothed log-loss) with a BIC-like penalty
   scaled by the noise of the bins (MAD of their differences); a trend comes out as a staircase of small steps that
   labelling merges back.
3. Labels, in this order:

   * **warm-up** (from the segment's start only): until the LR stops rising (it reaches 95 % of its peak, when
     the LR climbs at least 2x from the start; the peak of its 9-point running median, so an LR spike of up to 4
     points is no end of the warm-up), and / or until the first steep loss drop is 80 % done, when the
     loss falls by at least :attr:`PhaseConfig.warmup_drop` (log units) with that 80 % reached in the first half
     of the segment;
   * **divergence**: a piece whose level is at least ``max(divergence_rise, 6 noise)`` above the best (lowest)
     level so far, or the non-finite tail;
   * **degradation**: a piece at least ``max(degradation_rise, 3 noise)`` above the best level so far (the loss
     trending up without blowing up);
   * **stable**: anything else (a loss falling or flat);

   adjacent pieces with one label are merged. A divergence the run recovers from is followed by a ``stable``
   phase (the loss came back).

The result feeds the post-mortem's timeline (text, ``findings.json`` ``phases``, the HTML report). Framework-free:
numpy and ruptures only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.records import StepRecord
from stability.sources import Segment

__all__ = ["PHASE_LABELS", "Phase", "PhaseConfig", "per_step_median", "run_phases", "segment_phases"]

PHASE_LABELS = ("warm-up", "stable", "degradation", "divergence", "restart")
"""Phase labels, see the module docstring."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseConfig:
    """Knobs of :func:`run_phases` (see the module docstring for the rules)."""

    signal: str = "loss"
    max_points: int = 400
    """Bins the finite loss is reduced to before PELT (keeps a 1M-step run cheap)."""
    smooth: int = 5
    """Running-median window over the bins."""
    min_size: int = 5
    """Fewest bins between two change points."""
    penalty: float = 3.0
    """PELT penalty, times ``noise**2 * log(bins)``."""
    warmup_drop: float = 0.35
    """Loss drop (log units, about -30 %) that makes the start of a segment a warm-up."""
    degradation_rise: float = 0.05
    """Rise (log units, about +5 %) above the best level so far that is degradation."""
    divergence_rise: float = 0.4
    """Rise (log units, about +50 %) above the best level so far that is divergence."""
    min_steps: int = 8
    """Segments with fewer finite losses get one phase (``stable``, or ``divergence`` for a non-finite tail)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One labelled stretch of a segment."""

    label: str
    """One of :data:`PHASE_LABELS`."""
    first_step: int
    last_step: int
    segment: int
    """Index of the segment it belongs to."""
    loss_start: float | None = None
    """Median loss over the phase's first bins (None: none finite)."""
    loss_end: float | None = None
    evidence: str = ""

    def to_dict(self) -> dict[str, object]:
        """Plain data for the findings JSON."""
        return {"label": self.label, "first_step": self.first_step, "last_step": self.last_step,
                "segment": self.segment, "loss_start": self.loss_start, "loss_end": self.loss_end,
                "evidence": self.evidence}


def run_phases(records: Sequence[StepRecord], segments: Sequence[Segment] = (), *,
               config: PhaseConfig | None = None) -> list[Phase]:
    """The phases of every segment of a run, in segment order (records without segments: one segment)."""
    config = config or PhaseConfig()
    if not segments:
        if not records:
            return []
        steps = [r.step for r in records]
        segments = (Segment(index=0, start=0, stop=len(records), first_step=min(steps), last_step=max(steps)),)
    out: list[Phase] = []
    for seg in segments:
        if seg.index > 0:
            out.append(Phase(label="restart", first_step=seg.first_step, last_step=seg.first_step, segment=seg.index,
                             evidence=f"resumed at step {seg.first_step} after step {seg.resumed_after} "
                                      f"({seg.reason})"))
        out.extend(segment_phases(records[seg.start:seg.stop], segment=seg.index, config=config))
    return out


def per_step_median(records: Sequence[StepRecord], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps (sorted) and the median over ranks of signal ``name`` at each (NaN where a rank logged non-finite).

    Vectorised: sorted by (step, value), each step's median is the mean of its middle one or two values."""
    pairs = [(r.step, v) for r in records if (v := r.signals.get(name)) is not None]
    if not pairs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    steps = np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs))
    values = np.fromiter((p[1] for p in pairs), dtype=np.float64, count=len(pairs))
    order = np.lexsort((values, steps))
    steps, values = steps[order], values[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    if len(starts) == len(steps):
        return steps, np.where(np.isfinite(values), values, np.nan)
    counts = np.diff(np.r_[starts, len(steps)])
    median = (values[starts + (counts - 1) // 2] + values[starts + counts // 2]) / 2
    bad = np.maximum.reduceat((~np.isfinite(values)).astype(np.int8), starts) > 0
    return steps[starts], np.where(bad, np.nan, median)


def _bins(steps: np.ndarray, y: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most ``limit`` bins: (first step, last step, median y) of each."""
    edges = np.linspace(0, len(y), min(limit, len(y)) + 1).astype(np.int64)
    first = steps[edges[:-1]]
    last = steps[edges[1:] - 1]
    med = np.array([np.median(y[a:b]) for a, b in itertools.pairwise(edges.tolist())])
    return first, last, med


def _running_median(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y.copy()
    half = window // 2
    padded = np.pad(y, half, mode="edge")
    return np.asarray(np.median(np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1), axis=1))


def _noise(y: np.ndarray) -> float:
    """Robust noise of a series: MAD of its first differences over sqrt(2) (a trend does not count)."""
    if len(y) < 3:
        return 0.0
    return float(1.4826 * np.median(np.abs(np.diff(y))) / math.sqrt(2))


def _loss(value: float, positive: bool) -> float:
    return round(math.exp(value) if positive else value, 6)


def segment_phases(records: Sequence[StepRecord], *, segment: int = 0,
                   config: PhaseConfig | None = None) -> list[Phase]:
    """The phases of one segment's records (see the module docstring)."""
    config = config or PhaseConfig()
    steps, loss = per_step_median(records, config.signal)
    if len(steps) == 0:
        return []
    bad = ~np.isfinite(loss)
    tail = len(loss)
    if bad.any():
        # first non-finite index from which at least half of what follows is non-finite
        later_bad = np.cumsum(bad[::-1])[::-1]
        remaining = np.arange(len(loss), 0, -1)
        ok = bad & (later_bad * 2 >= remaining)
        if ok.any() and (bad[-1] or int(bad.sum()) >= 3):  # one Inf the run shrugs off is no divergence
            tail = int(np.argmax(ok))
    finite = np.isfinite(loss[:tail])
    head_steps, head = steps[:tail][finite], loss[:tail][finite]
    phases: list[Phase] = []
    if len(head) < config.min_steps:
        if len(head):
            phases.append(Phase(label="stable", first_step=int(head_steps[0]), last_step=int(steps[tail - 1]),
                                segment=segment, loss_start=round(float(head[0]), 6),
                                loss_end=round(float(head[-1]), 6), evidence="too few steps to cut"))
    else:
        phases.extend(_finite_phases(records, head_steps, head, segment, config))
    if tail < len(loss):
        phases.append(Phase(label="divergence", first_step=int(steps[tail]), last_step=int(steps[-1]),
                            segment=segment, loss_start=None, loss_end=None,
                            evidence=f"loss non-finite from step {int(steps[tail])} "
                                     f"({int(bad[tail:].sum())} of {len(loss) - tail} logged losses)"))
    return _merged(phases)


def _warmup_end(records: Sequence[StepRecord], steps: np.ndarray, first: np.ndarray, last: np.ndarray,
                smooth: np.ndarray, config: PhaseConfig) -> tuple[int, str]:
    """Number of bins of the warm-up (0: none) and why."""
    n = len(smooth)
    ends: list[tuple[int, str]] = []
    lr_steps, lr = per_step_median(records, "lr")
    lr_ok = np.isfinite(lr)
    lr_steps, lr = lr_steps[lr_ok], lr[lr_ok]
    if len(lr) >= 3 and lr.max() > 0:
        level = _running_median(lr, 9)  # an LR spike of a few steps (a fault) is no peak of the schedule
        peak = float(level.max())
        if lr[0] * 2 <= peak:
            reach = int(lr_steps[int(np.argmax(level >= 0.95 * peak))])
            if reach < int(steps[-1]):
                ends.append((int(np.searchsorted(last, reach)) + 1,
                             f"LR rises {lr[0]:.3g} -> {peak:.3g} until step {reach}"))
    drop = float(smooth[0] - smooth.min())
    if drop >= config.warmup_drop:
        done = int(np.argmax(smooth[0] - smooth >= 0.8 * drop))
        if done <= n // 2:
            ends.append((done + 1, f"first steep loss drop ({math.exp(drop):.3g}x) 80 % done at step "
                                   f"{int(last[done])}"))
    if not ends:
        return 0, ""
    count = min(n, max(e for e, _ in ends))
    return count, "; ".join(why for _, why in ends)


def _finite_phases(records: Sequence[StepRecord], steps: np.ndarray, loss: np.ndarray, segment: int,
                   config: PhaseConfig) -> list[Phase]:
    import ruptures

    positive = bool((loss > 0).all())
    y = np.log(loss) if positive else loss
    first, last, binned = _bins(steps, y, config.max_points)
    # a short excerpt is not smoothed: a running median would move its few change points
    smooth = _running_median(binned, config.smooth if len(binned) >= 20 * config.smooth else 1)
    noise = _noise(binned)
    n = len(smooth)
    warm, warm_why = _warmup_end(records, steps, first, last, smooth, config)
    pieces: list[tuple[int, int]] = [(0, warm)] if warm else []
    if warm < n:
        rest = smooth[warm:]
        min_size = max(2, min(config.min_size, len(rest) // 4))
        if len(rest) >= 2 * min_size:
            pen = config.penalty * max(noise, 1e-6) ** 2 * math.log(len(rest))
            cost = _cumsum_l2()
            cuts = ruptures.Pelt(custom_cost=cost, min_size=min_size, jump=1).fit(rest).predict(pen=pen)
        else:
            cuts = [len(rest)]
        start = warm
        for cut in cuts:
            pieces.append((start, warm + cut))
            start = warm + cut
    out: list[Phase] = []
    best = math.inf
    for index, (a, b) in enumerate(pieces):
        level = float(np.median(smooth[a:b]))
        head, tail_ = float(np.median(smooth[a:min(b, a + 3)])), float(np.median(smooth[max(a, b - 3):b]))
        rise = level - best
        if index == 0 and warm:
            label, why = "warm-up", warm_why
        elif rise >= max(config.divergence_rise, 6 * noise):
            label, why = "divergence", f"loss level {_ratio(rise, positive)} the best so far"
        elif rise >= max(config.degradation_rise, 3 * noise):
            label, why = "degradation", f"loss level {_ratio(rise, positive)} the best so far"
        else:
            label, why = "stable", ""
        best = min(best, level if not (index == 0 and warm) else tail_)
        out.append(Phase(label=label, first_step=int(first[a]), last_step=int(last[b - 1]), segment=segment,
                         loss_start=_loss(head, positive), loss_end=_loss(tail_, positive), evidence=why))
    return out


def _cumsum_l2() -> Any:
    """ruptures' least-squares cost (``CostL2``: the segment's variance times its length) from running sums: O(1) a
    segment instead of a ``var`` over it (PELT asks for tens of thousands; the same change points, 10x faster).
    Built on first use: importing ruptures takes seconds."""
    from ruptures.base import BaseCost

    class CumsumL2(BaseCost):  # type: ignore[misc]  # ruptures is untyped
        model = "l2-cumsum"
        min_size = 1

        def __init__(self) -> None:
            self._sum = np.zeros(1)
            self._sq = np.zeros(1)
            self.signal = np.zeros((0, 1))  # ruptures reads signal.shape

        def fit(self, signal: np.ndarray) -> CumsumL2:
            values = np.asarray(signal, dtype=np.float64).reshape(-1)
            self.signal = values.reshape(-1, 1)
            self._sum = np.r_[0.0, np.cumsum(values)]
            self._sq = np.r_[0.0, np.cumsum(values * values)]
            return self

        def error(self, start: int, end: int) -> float:
            total = self._sum[end] - self._sum[start]
            return max(0.0, float(self._sq[end] - self._sq[start] - total * total / (end - start)))

    return CumsumL2()


def _ratio(rise: float, positive: bool) -> str:
    return f"{math.exp(rise):.2f}x" if positive else f"+{rise:.3g} over"


def _merged(phases: list[Phase]) -> list[Phase]:
    """Adjacent phases with one label joined (the staircase of a trend back into one phase)."""
    out: list[Phase] = []
    for phase in phases:
        if out and out[-1].label == phase.label and out[-1].segment == phase.segment:
            prev = out[-1]
            out[-1] = Phase(label=prev.label, first_step=prev.first_step, last_step=phase.last_step,
                            segment=prev.segment, loss_start=prev.loss_start, loss_end=phase.loss_end,
                            evidence=prev.evidence or phase.evidence)
        else:
            out.append(phase)
    return out
