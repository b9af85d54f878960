"""Root-cause ranking: structural rules over a rank's recent history (root-causes.md section 3, triage order).

For a finding with onset ``t0`` the rules look for precursors in the records just before it:

* NaN -> ``numerical_nan``; ``fp16_loss_scale`` first if the loss scale collapsed (>= 4x) before it.
* loss scale collapsing first -> ``fp16_loss_scale``.
* a one-step jump that reverted, or a spike with no precursor -> ``bad_batch``.
* global / per-layer grad norm or update ratio rising >= 3x in the ``lead`` steps before -> ``lr_too_high``
  (strong when the LR itself jumped in the last 100 steps).
* inside the LR warm-up ramp, or within 3x its length -> ``warmup_too_short``.
* a layer's ``adam_v_ratio`` jumping 1-8 steps before -> ``adam_second_moment``.
* ``attn_logit_max`` growth -> ``attention_logit_growth``; ``logit_z`` drift -> ``output_logit_divergence``.
* per-layer grad norms collapsing (>= 10x down) -> ``vanishing_gradients``.
* a level shift without precursor -> ``data_shift``; nothing matched -> ``unknown``.

Each finding also gets ``rollback_step`` (the last recorded step before the earliest precursor) and
``skip_batches`` (batch ids of the anomalous steps, when the records carry them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stability.detectors.base import CauseHint, Finding
from stability.detectors.causes import remedy
from stability.detectors.history import History, Ring

__all__ = ["Move", "Ranking", "find_move", "rank_causes"]

MAX_SKIP_BATCHES = 64


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


@dataclass(frozen=True, slots=True)
class Ranking:
    """The ranked causes of one finding, with rollback and skip advice."""

    causes: tuple[CauseHint, ...]
    rollback_step: int | None
    skip_batches: tuple[str, ...]


def find_move(ring: Ring, name: str, onset: int, *, factor: float, lead_steps: int, lead_records: int = 3,
              rise: bool = True, ref_points: int = 64) -> Move | None:
    """The first step in the window before ``onset`` where ``name`` moved ``factor``-fold from its reference.

    The window is the last ``lead_records`` records before ``onset`` or the last ``lead_steps`` steps, whichever
    reaches further back, plus ``onset`` itself. The reference is the median of up to ``ref_points`` positive
    values before the window (the first value of the history when nothing precedes the window).
    """
    if name not in ring.series:
        return None
    steps, values = ring.ordered(), ring.ordered(name).astype(np.float64)
    keep = (steps <= onset) & np.isfinite(values) & (values > 0)
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
    ratios = values[scan] / float(np.median(ref))
    hit = ratios >= factor if rise else ratios <= 1.0 / factor
    if not hit.any():
        return None
    first = int(np.argmax(hit))
    step = int(steps[scan][first])
    peak = float(ratios.max() if rise else ratios.min())
    return Move(name, step, float(ratios[first]), peak, onset - step)


def _modules(ring: Ring, quantity: str) -> list[str]:
    return [name for name in ring.series if name.startswith(quantity + "/")]


def _earliest(moves: list[Move]) -> Move | None:
    moves = [m for m in moves if m is not None]
    return min(moves, key=lambda m: (m.step, -m.peak)) if moves else None


def _fmt(move: Move, event: str) -> str:
    when = f"{move.lead} steps before {event}" if move.lead > 0 else f"at {event}"
    verb = "rose" if move.peak >= 1 else "fell"
    size = move.peak if move.peak >= 1 else 1.0 / move.peak
    return f"{move.signal} {verb} {size:.3g}x {when} (step {move.step})"


def _event_name(finding: Finding) -> str:
    return {"nan": "the NaN", "loss_spike": "the loss spike", "divergence": "the divergence",
            "grad_explosion": "the grad-norm explosion"}.get(finding.kind, f"the {finding.kind}")


class _Hints:
    def __init__(self) -> None:
        self.best: dict[str, tuple[float, str]] = {}

    def add(self, cause: str, score: float, evidence: str) -> None:
        if cause not in self.best or score > self.best[cause][0]:
            self.best[cause] = (score, evidence)

    def ranked(self) -> tuple[CauseHint, ...]:
        if not self.best or max(s for s, _ in self.best.values()) < 0.3:
            self.add("unknown", 0.2, "no structural rule matched; inspect per-layer signals around the onset")
        ordered = sorted(self.best.items(), key=lambda kv: -kv[1][0])
        return tuple(CauseHint(cause=c, score=round(s, 3), evidence=e, remedy=remedy(c)) for c, (s, e) in ordered)


def rank_causes(finding: Finding, history: History) -> Ranking:
    """Rank catalogue causes for ``finding`` from the rank's ``history`` (which includes the finding's step)."""
    t0, event = finding.onset, _event_name(finding)
    hints = _Hints()
    precursors: list[Move] = []
    scale = find_move(history.globals, "loss_scale", t0, factor=4.0, lead_steps=50, lead_records=5, rise=False)
    if scale is not None and scale.lead > 0:
        precursors.append(scale)
    if finding.kind == "nan":
        what = f"{finding.signal} became {finding.value} at step {finding.step}"
        if scale is not None and scale.lead > 0:
            hints.add("fp16_loss_scale", 0.95, f"{_fmt(scale, event)}; then {what}")
            hints.add("numerical_nan", 0.7, what)
        else:
            hints.add("numerical_nan", 0.95, f"{what}; no loss-scale collapse before it")
    else:
        if scale is not None:
            hints.add("fp16_loss_scale", 0.85 if scale.lead > 0 else 0.5, _fmt(scale, event))
        precursors += _gradient_rules(finding, history, hints, event)
        _slow_rules(finding, history, hints, event)
        _data_rules(finding, hints, precursors)
    rollback = _rollback(history, min([t0] + [m.step for m in precursors]))
    return Ranking(hints.ranked(), rollback, _skip_batches(finding, history))


def _gradient_rules(finding: Finding, history: History, hints: _Hints, event: str) -> list[Move]:
    t0, glob, mods = finding.onset, history.globals, history.modules
    found: list[Move] = []

    names = ["update_ratio", *_modules(mods, "grad_norm"), *_modules(mods, "update_ratio")]
    if finding.kind != "grad_explosion":
        names.insert(0, "grad_norm")
    moves = [find_move(glob if "/" not in n else mods, n, t0, factor=3.0, lead_steps=8) for n in names]
    rises = [m for m in moves if m is not None and m.lead > 0]
    lr = history.lr
    jumped = lr.last_jump is not None and t0 - 100 <= lr.last_jump <= t0
    first = _earliest(rises)
    if jumped:
        assert lr.last_jump is not None
        lead = t0 - lr.last_jump
        text = f"lr raised {lr.jump_factor:.3g}x at step {lr.last_jump}, {lead} steps before {event}"
        if first is not None:
            text += f"; {_fmt(first, event)}"
        hints.add("lr_too_high", 0.9, text)
        found.append(Move("lr", lr.last_jump, lr.jump_factor, lr.jump_factor, lead))
    elif first is not None:
        hints.add("lr_too_high", 0.65, f"{_fmt(first, event)}; lr unchanged")
    if first is not None:
        found.append(first)
    adam = _earliest([m for m in (find_move(mods, n, t0, factor=3.0, lead_steps=8) for n in
                                  _modules(mods, "adam_v_ratio")) if m is not None and 1 <= m.lead <= 8])
    if adam is not None:
        hints.add("adam_second_moment", 0.85, _fmt(adam, event))
        found.append(adam)
    falls = [m for m in (find_move(mods, n, t0, factor=10.0, lead_steps=50, rise=False) for n in
                         _modules(mods, "grad_norm")) if m is not None]
    if falls:
        hints.add("vanishing_gradients", 0.6, _fmt(min(falls, key=lambda m: m.peak), event))
    if lr.rising:
        hints.add("warmup_too_short", 0.7, f"{event} at step {t0} while the LR is still warming up")
    elif lr.warmup_end is not None and t0 <= 3 * lr.warmup_end:
        hints.add("warmup_too_short", 0.55, f"{event} at step {t0}, within 3x the warm-up (LR peaked at step "
                                            f"{lr.warmup_end})")
    return found


def _growth(ring: Ring, name: str, t0: int) -> tuple[float, float] | None:
    """(first, last) finite values of ``name`` up to ``t0`` when at least 8 exist."""
    if name not in ring.series:
        return None
    steps, values = ring.ordered(), ring.ordered(name).astype(np.float64)
    keep = (steps <= t0) & np.isfinite(values)
    values = values[keep]
    return (float(values[0]), float(values[-1])) if len(values) >= 8 else None


def _slow_rules(finding: Finding, history: History, hints: _Hints, event: str) -> None:
    t0, mods, glob = finding.onset, history.modules, history.globals
    best: tuple[float, str] | None = None
    for name in _modules(mods, "attn_logit_max"):
        pair = _growth(mods, name, t0)
        if pair and pair[0] > 0 and pair[1] / pair[0] >= 1.5 and (best is None or pair[1] / pair[0] > best[0]):
            best = (pair[1] / pair[0], f"{name} grew {pair[1] / pair[0]:.3g}x ({pair[0]:.3g} -> {pair[1]:.3g}) "
                                       f"over the recorded window before {event}")
    if best is not None:
        hints.add("attention_logit_growth", 0.6, best[1])
    for name, ring in [("logit_z", glob)] + [(n, mods) for n in _modules(mods, "logit_z")]:
        pair = _growth(ring, name, t0)
        if pair and abs(pair[1] - pair[0]) >= 2.0 and abs(pair[1]) >= 3.0:
            score = 0.7 if finding.kind == "divergence" else 0.55
            hints.add("output_logit_divergence", score, f"{name} drifted from {pair[0]:.3g} to {pair[1]:.3g} "
                                                        f"before {event}")


def _data_rules(finding: Finding, hints: _Hints, precursors: list[Move]) -> None:
    if finding.evidence.get("reverted"):
        hints.add("bad_batch", 0.9, f"one-step jump at step {finding.onset} with no lasting effect: it reverted "
                                    "at the next step, not an instability of the run")
        return
    if precursors:
        return
    if finding.kind == "loss_spike":
        ratio = finding.evidence.get("ratio", math.nan)
        hints.add("bad_batch", 0.6, f"loss jumped {ratio:.3g}x at step {finding.onset} with no precursor in "
                                    "gradients, update ratios, LR or loss scale")
        hints.add("data_shift", 0.35, "the loss stayed elevated after the jump without a gradient precursor")
    elif finding.kind == "divergence":
        hints.add("data_shift", 0.5, "the loss level rose and stayed up without a gradient precursor")


def _rollback(history: History, earliest: int) -> int | None:
    steps = history.globals.ordered()
    before = steps[steps < earliest]
    return int(before[-1]) if len(before) else None


def _skip_batches(finding: Finding, history: History) -> tuple[str, ...]:
    last = finding.end if finding.end is not None else finding.step
    if finding.kind == "divergence":
        last = finding.onset
    steps = sorted(s for s in history.batches if finding.onset <= s <= last)
    return tuple(history.batches[s] for s in steps[:MAX_SKIP_BATCHES])
