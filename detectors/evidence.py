"""Evidence primitives for root-cause ranking: when and how far a signal moved before an onset, and whether it
leads the loss.

Everything reads a rank's :class:`~stability.detectors.history.History` (ring buffers of recent records):

* :func:`find_move` - the first step a signal crossed a fold change from its reference median;
* :func:`robust_move` - the same by robust z of its own log noise (smaller jumps, far outside the noise);
* :func:`lr_rise` - a post-warm-up LR increase (jump or ramp);
* :func:`lead_lag` - cross-correlation of step changes against the loss, both ways;
* :func:`granger_p` - a Granger test (statsmodels, imported lazily) used only to break ties.

The rules that turn these into ranked causes live in :mod:`~stability.detectors.ranking`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stability.detectors._stats import mad_scale, median, plural, safe_exp
from stability.detectors.history import History, Ring

__all__ = ["Move", "describe", "earliest", "find_move", "granger_p", "lead_lag", "lr_rise", "modules",
           "robust_move"]


@dataclass(frozen=True, slots=True)
class Move:
    """A signal leaving its reference level before an onset."""

    signal: str
    step: int
    """First step at which it crossed the factor."""
    factor: float
    """Value / reference median at that step."""
    peak: float
    """Largest (rise) or smallest (fall) factor in the precursor window."""
    lead: int
    """``onset - step``."""


_MIN_REF = 3
"""Fewer reference values than this (a per-module statistic sampled every ``stats_every`` steps, of which the
history's last 96 records hold 3-4): one old value is no level to move from (0.40 -> 1.25 on an MoE expert whose
values ranged 0.005-1.75 is not a 3x rise)."""


def find_move(ring: Ring, name: str, onset: int, *, factor: float, lead_steps: int, lead_records: int = 3,
              rise: bool = True, ref_points: int = 64) -> Move | None:
    """The first step in the window before ``onset`` where ``name`` moved ``factor``-fold from its reference.

    The window is the last ``lead_records`` records before ``onset`` or the last ``lead_steps`` steps, whichever
    reaches further back, plus ``onset`` itself. The reference is the median of up to ``ref_points`` positive
    values before the window (the first value of the history when nothing precedes the window); a crossing must
    also lie outside every reference value (above their maximum for a rise, below their minimum for a fall). A
    signal that is exactly 0 on most records up to ``onset`` (intermittent) has no move.
    """
    if name not in ring.series:
        return None
    steps, values = ring.ordered(), ring.ordered(name).astype(np.float64)
    finite = (steps <= onset) & np.isfinite(values)
    if 2 * int(np.count_nonzero(values[finite] == 0)) > int(np.count_nonzero(finite)):
        return None  # intermittent (an MoE expert routed no tokens on most steps): its values have no level
    keep = finite & (values > 0)
    steps, values = steps[keep], values[keep]
    if len(steps) < 2:
        return None
    before = np.flatnonzero(steps < onset)
    start = onset - lead_steps
    if len(before) > lead_records:
        start = min(start, int(steps[before[-lead_records]]))
    ref = values[steps < start][-ref_points:]
    scan = steps >= start
    if len(before) <= lead_records or len(ref) == 0:  # too little before the window: the first value is the reference
        ref, scan = values[:1], np.arange(len(steps)) >= 1
    elif len(ref) < _MIN_REF:  # a sampled signal (every 25 steps) with 1-2 values left in the history: no reference
        return None
    level = float(np.median(ref))
    ratios = values[scan] / level
    # beyond the reference's own range too: a heavy-tailed signal (a small CNN's gradient norm, p90 at 3.7x its
    # median) crosses 3x its median by chance; a move is a value the reference never reached
    outside = values[scan] > ref.max() if rise else values[scan] < ref.min()
    hit = (ratios >= factor if rise else ratios <= 1.0 / factor) & outside
    if not hit.any():
        return None
    first = int(np.argmax(hit))
    step = int(steps[scan][first])
    peak = float(ratios.max() if rise else ratios.min())
    return Move(name, step, float(ratios[first]), peak, onset - step)


def robust_move(ring: Ring, name: str, onset: int, *, z_threshold: float = 6.0, factor: float = 2.0,
                lead_steps: int = 8, ref_points: int = 64) -> Move | None:
    """The first step in ``[onset - lead_steps, onset]`` where log ``name`` sits >= ``z_threshold`` robust sigmas
    (MAD of the reference window, floored at 0.01) and >= ``factor`` above the reference median (update-ratio
    anomalies: a smaller jump than :func:`find_move` needs, but far outside the layer's own noise)."""
    if name not in ring.series:
        return None
    steps, values = ring.ordered(), ring.ordered(name).astype(np.float64)
    keep = (steps <= onset) & np.isfinite(values) & (values > 0)
    steps, logs = steps[keep], np.log(values[keep])
    ref = logs[steps < onset - lead_steps][-ref_points:]
    if len(ref) < 8:
        return None
    center = median(ref)
    scale = max(mad_scale(ref), 0.01)
    scan = steps >= onset - lead_steps
    excess = logs[scan] - center
    hit = (excess >= z_threshold * scale) & (excess >= math.log(factor))
    if not hit.any():
        return None
    first = int(np.argmax(hit))
    step = int(steps[scan][first])
    return Move(name, step, safe_exp(float(excess[first])), safe_exp(float(excess.max())), onset - step)


def modules(ring: Ring, quantity: str) -> list[str]:
    """Names of the per-module series of ``quantity`` (``grad_norm/...``)."""
    return [name for name in ring.series if name.startswith(quantity + "/")]


def earliest(moves: list[Move]) -> Move | None:
    """The move that happened first (the larger one on ties)."""
    moves = [m for m in moves if m is not None]
    return min(moves, key=lambda m: (m.step, -m.peak)) if moves else None


def describe(move: Move, event: str) -> str:
    """``"grad_norm/h.3 rose 40x 3 steps before the loss spike (step 497)"``."""
    when = f"{plural(move.lead, 'step')} before {event}" if move.lead > 0 else f"at {event}"
    verb = "rose" if move.peak >= 1 else "fell"
    size = move.peak if move.peak >= 1 else 1.0 / move.peak
    return f"{move.signal} {verb} {size:.3g}x {when} (step {move.step})"


def granger_p(history: History, signal: str, t0: int, *, span: int = 64, maxlag: int = 2) -> float | None:
    """Smallest ssr F-test p-value over lags 1..``maxlag`` that step changes of log ``signal`` Granger-cause those
    of log loss, on the records in ``[t0 - span, t0 + maxlag]``; None when unavailable (too few points, constant
    series, statsmodels missing)."""
    ring = history.modules if "/" in signal else history.globals
    if signal not in ring.series or "loss" not in history.globals.series:
        return None
    loss = dict(zip(history.globals.ordered().tolist(), history.globals.ordered("loss").tolist(), strict=True))
    rows = [(loss.get(s, math.nan), v) for s, v in zip(ring.ordered().tolist(), ring.ordered(signal).tolist(),
                                                        strict=True) if t0 - span <= s <= t0 + maxlag]
    data = np.array([r for r in rows if r[0] > 0 and r[1] > 0 and math.isfinite(r[0]) and math.isfinite(r[1])])
    if len(data) < 5 * maxlag + 10:
        return None
    changes = np.diff(np.log(data), axis=0)
    if np.any(changes.std(axis=0) == 0):
        return None
    try:
        from statsmodels.tsa.stattools import grangercausalitytests
    except ImportError:  # optional: the tie stays a tie
        return None
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = grangercausalitytests(changes, maxlag=maxlag)
    except Exception:  # singular design matrices and the like: no verdict
        return None
    return float(min(result[lag][0]["ssr_ftest"][1] for lag in result))


def lr_rise(history: History, t0: int, *, lookback: int = 100, factor: float = 1.5) -> Move | None:
    """A post-warm-up LR increase of at least ``factor`` within ``lookback`` steps before ``t0`` (jump or ramp).

    The reference is the smallest LR in the window after the warm-up; ``Move.step`` is the first step above it.
    """
    lr = history.lr
    if lr.rising or "lr" not in history.globals.series:
        return None
    steps, values = history.globals.ordered(), history.globals.ordered("lr").astype(np.float64)
    start = t0 - lookback if lr.warmup_end is None else max(t0 - lookback, lr.warmup_end)
    keep = (steps <= t0) & (steps >= start) & np.isfinite(values) & (values > 0)
    steps, values = steps[keep], values[keep]
    if len(values) < 2:
        return None
    floor = float(values[:-1].min())
    low = int(np.flatnonzero(values[:-1] <= floor * (1 + 1e-6))[-1])  # the last step at the low level
    ratio = float(values[-1] / values[low])
    if ratio < factor:
        return None
    moved = int(steps[low + 1])
    return Move("lr", moved, ratio, ratio, t0 - moved)


def lead_lag(history: History, signal: str, t0: int, *, span: int = 48, max_lag: int = 6) -> tuple[int, float] | None:
    """Cross-correlation of the step changes of log ``signal`` and log loss around ``t0``, both ways.

    Returns ``(lag, ccf)`` at the peak of ``|ccf|`` over lags ``-max_lag..max_lag``: ``lag > 0`` means the
    signal leads the loss by ``lag`` records. ``None`` when either series is too short.
    """
    ring = history.modules if "/" in signal else history.globals
    if signal not in ring.series or "loss" not in history.globals.series:
        return None
    loss = dict(zip(history.globals.ordered().tolist(), history.globals.ordered("loss").tolist(), strict=True))
    pairs = [(s, v, loss.get(s, math.nan)) for s, v in zip(ring.ordered().tolist(), ring.ordered(signal).tolist(),
                                                             strict=True) if t0 - span <= s <= t0 + max_lag]
    rows = np.array([(v, w) for _, v, w in pairs if v > 0 and w > 0 and math.isfinite(v) and math.isfinite(w)])
    if len(rows) < 4 * max_lag:
        return None
    dx, dy = np.diff(np.log(rows[:, 0])), np.diff(np.log(rows[:, 1]))
    best: tuple[int, float] | None = None
    for lag in range(-max_lag, max_lag + 1):
        a, b = (dx[: len(dx) - lag], dy[lag:]) if lag >= 0 else (dx[-lag:], dy[: len(dy) + lag])
        if a.std() == 0 or b.std() == 0:
            continue
        ccf = float(np.corrcoef(a, b)[0, 1])
        if best is None or abs(ccf) > abs(best[1]) + 1e-12:
            best = (lag, ccf)
    return best
