"""Root-cause ranking: structural rules over a rank's recent history (root-causes.md section 3, triage order).

Structure and evidence first, statistics only to confirm or break ties (the measurements - when and how far a
signal moved, lead-lag, Granger - are in :mod:`~stability.detectors.evidence`). For a finding with onset ``t0``:

* Findings that name their cause (:data:`KIND_CAUSE`): ``loss_scale_collapse`` -> ``fp16_loss_scale``,
  ``rank_disagreement`` -> ``hardware_fault``, ``attention_logit_growth`` -> ``attention_logit_growth``,
  ``logit_divergence`` -> ``output_logit_divergence``, ``grad_vanishing`` -> ``vanishing_gradients``,
  ``activation_growth`` -> ``lr_too_high`` (weak), ``plateau`` -> ``lr_too_low``. The same findings earlier in the
  incident (up to 100 steps before ``t0``, or up to 10 steps after it, weaker) are precursors of a loss event;
  a growth finding counts as a precursor only if its series grew (>= 1.5x, using points before ``t0`` only)
  before the onset, and is a symptom of the LR (-0.2, ``lr_too_high`` named) when the LR jumped before its
  onset, or after its fitted onset while the series had not grown before the jump (an LR change is an
  intervention: it precedes everything it causes).
* NaN -> ``numerical_nan``; ``fp16_loss_scale`` first if the loss scale collapsed (>= 4x) before it;
  ``lr_too_high`` first if the LR jumped >= 3x above any level its schedule had at most 3 steps before it.
* loss scale collapsing first -> ``fp16_loss_scale``.
* a one-step jump that reverted (also a huge jump alerted at once that the next record shows reverted: the
  engine ranks the incident's headline again), or a spike with no precursor -> ``bad_batch`` (weaker when an
  IsolationForest over the global signals isolates the records just before the onset: :mod:`~.oddity`);
  with no LR logged, a spike whose loss and gradient norm keep compounding from the onset on (:func:`_runaway`)
  is a runaway update -> ``lr_too_high`` (0.65) above ``bad_batch`` (0.45). A gradient explosion whose loss jumped
  >= 1.5x on its onset record is that loss spike seen first on the gradient (:func:`_loss_jumped_with`).
* global / per-layer grad norm or update ratio rising >= 3x in the ``lead`` steps before (or a per-layer update
  ratio >= 2x and >= 6 robust sigmas of its own log noise) -> ``lr_too_high``; strong when the LR itself jumped or
  rose >= 1.5x (ramp) after the warm-up within 100 steps ("lr rose 23x over the 60 steps before the onset").
* inside the LR warm-up ramp, or within 3x its length, or in the first 100 steps of a run with no (or a
  <= 10-step) warm-up -> ``warmup_too_short``; weakly (0.3) when the records start mid-run less than 100 steps
  before the onset (an excerpt: the schedule before it is unknown).
* an ``update_ratio_jump`` with the logged LR unchanged: only attention projections -> ``attention_logit_growth``,
  else ``lr_too_high`` (weak).
* a layer's ``adam_v_ratio`` jumping 1-8 steps before -> ``adam_second_moment`` (weak when a gradient or
  update-ratio precursor moved earlier: the earliest deviating signal wins); an ``adam_v_lag`` finding names it
  for itself (0.7) and goes through the gradient rules too (an LR jump with it wins).
* LR unchanged and the update ratios that rose first are only attention projections (a strict minority of the
  layers; an LR too high moves every layer at once) -> ``attention_logit_growth``.
* ``attn_logit_max`` growth (fitted up to the onset, not past it) -> ``attention_logit_growth``; ``logit_z``
  drift -> ``output_logit_divergence``.
* per-layer grad norms collapsing (>= 10x down) -> ``vanishing_gradients``.
* a level shift without precursor -> ``data_shift``; nothing matched -> ``unknown``.

Confirmation: the first gradient precursor's lead over the loss is checked by cross-correlating step changes of
both (:func:`lead_lag`, both directions): +0.05 when it leads, -0.1 when it lags. When the two best causes are
within :data:`TIE`, a Granger test (statsmodels, imported lazily, :func:`granger_p`) breaks the tie. The max-z
"most deviating signal" is not a rule of its own (it is what the magnitude rules measure); the IsolationForest
oddity only tempers the "no precursor" claim of ``bad_batch``.

Each finding also gets ``rollback_step`` (the last recorded step before the earliest precursor) and
``skip_batches`` (batch ids of the anomalous steps, when the records carry them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stability.detectors._stats import plural
from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy
from stability.detectors.evidence import (
    Move,
    describe,
    earliest,
    find_move,
    granger_p,
    lead_lag,
    lr_rise,
    modules,
    robust_move,
)
from stability.detectors.history import History, Ring
from stability.detectors.nan import FORWARD_QUANTITIES
from stability.detectors.oddity import OddityBudget, precursor_oddity
from stability.detectors.steptime import PERF_KINDS, perf_causes

__all__ = ["KIND_CAUSE", "Boundary", "Move", "Ranking", "SystemFact", "context_causes", "find_move", "granger_p",
           "lead_lag", "lr_rise", "merge_causes", "rank_causes", "robust_move"]

MAX_SKIP_BATCHES = 64


@dataclass(frozen=True, slots=True)
class Ranking:
    """The ranked causes of one finding, with rollback and skip advice."""

    causes: tuple[CauseHint, ...]
    rollback_step: int | None
    skip_batches: tuple[str, ...]


def _event_name(finding: Finding) -> str:
    return {"nan": "the NaN", "loss_spike": "the loss spike", "divergence": "the divergence",
            "grad_explosion": "the grad-norm explosion", "loss_scale_collapse": "the loss-scale collapse",
            "grad_vanishing": "the gradient collapse", "rank_disagreement": "the disagreement",
            "attention_logit_growth": "the attention-logit growth", "activation_growth": "the activation growth",
            "logit_divergence": "the logit drift", "plateau": "the plateau",
            "lr_off_schedule": "the LR fall" if finding.evidence.get("fell") else "the LR rise",
            }.get(finding.kind, f"the {finding.kind}")


class _Hints:
    def __init__(self) -> None:
        self.best: dict[str, tuple[float, str]] = {}
        self.signals: dict[str, str] = {}
        """cause -> the signal its best evidence rests on (for the Granger tie-break)."""

    def add(self, cause: str, score: float, evidence: str, signal: str | None = None) -> None:
        if cause not in self.best or score > self.best[cause][0]:
            self.best[cause] = (score, evidence)
            if signal is not None:
                self.signals[cause] = signal
            else:
                self.signals.pop(cause, None)

    def tie_break(self, history: History, t0: int) -> None:
        """Granger tie-break of the top two causes when their scores are within ``TIE``: the one whose signal
        better predicts the loss changes gets +0.01 (statsmodels, imported only here)."""
        ordered = sorted(self.best.items(), key=lambda kv: -kv[1][0])
        if len(ordered) < 2 or ordered[0][1][0] - ordered[1][1][0] > TIE:
            return
        tied = [c for c, _ in ordered[:2] if c in self.signals]
        if len(tied) < 2 or self.signals[tied[0]] == self.signals[tied[1]]:
            return
        pvalues = {c: granger_p(history, self.signals[c], t0) for c in tied}
        scored = [(p, c) for c, p in pvalues.items() if p is not None]
        if not scored:
            return
        p, winner = min(scored)
        if p < 0.05:
            score, evidence = self.best[winner]
            self.best[winner] = (score + 0.01, f"{evidence}; Granger tie-break: {self.signals[winner]} predicts the "
                                                f"loss (p={p:.2g})")

    def ranked(self) -> tuple[CauseHint, ...]:
        if not self.best or max(s for s, _ in self.best.values()) < 0.3:
            self.add("unknown", 0.2, "no structural rule matched; inspect per-layer signals around the onset")
        ordered = sorted(self.best.items(), key=lambda kv: -kv[1][0])
        return tuple(CauseHint(cause=c, score=round(s, 3), evidence=e, remedy=remedy(c)) for c, (s, e) in ordered)


TIE = 0.02
"""Top causes closer than this are tied (Granger tie-break)."""


KIND_CAUSE = {
    "loss_scale_collapse": ("fp16_loss_scale", 0.95),
    "rank_disagreement": ("hardware_fault", 0.97),
    "attention_logit_growth": ("attention_logit_growth", 0.9),
    "logit_divergence": ("output_logit_divergence", 0.9),
    "grad_vanishing": ("vanishing_gradients", 0.9),
    "activation_growth": ("lr_too_high", 0.55),
    "plateau": ("lr_too_low", 0.6),
    "lr_off_schedule": ("lr_too_high", 0.88),  # below the gradient rules' 0.9-0.92, whose evidence says more
}
"""Finding kinds that name their cause structurally, with the score of that cause."""

LR_ROSE = 1.2
"""A plateau while the LR rose this much over its window is no sign of an LR too low (its evidence ``lr_ratio``)."""


def _kind_cause(finding: Finding) -> tuple[str, float] | None:
    """The cause a finding names by its kind; a plateau names ``lr_too_high`` when the LR rose over its window (a
    loss that stalls while the LR climbs is not starved of LR)."""
    if finding.kind == "plateau" and finding.evidence.get("lr_ratio", 1.0) >= LR_ROSE:
        return ("lr_too_high", 0.6)
    if finding.kind == "lr_off_schedule" and finding.evidence.get("fell"):
        return ("lr_too_low", 0.85)  # the LR fell off its schedule: the run stalls
    return KIND_CAUSE.get(finding.kind)

PRECURSOR_WINDOW = 100
"""Earlier findings of the rank within this many steps before the onset count as precursors."""

FOLLOW_WINDOW = 10
"""Structural findings of the same incident starting up to this many steps after the onset still count (weaker)."""


def rank_causes(finding: Finding, history: History, recent: Sequence[Finding] = (), *,
                oddity: OddityBudget | None = None) -> Ranking:
    """Rank catalogue causes for ``finding`` from the rank's ``history`` (which includes the finding's step).

    ``recent`` are earlier findings of the same rank (the open incident): a loss-scale collapse, a rank
    disagreement, a logit/activation growth or a gradient collapse shortly before the onset names its cause first.
    Structure and evidence rules come first; the lead-lag of the first precursor against the loss (cross-correlation
    both ways) confirms or weakens it. ``oddity`` caps the IsolationForest fits per onset step (a bad batch that
    every rank saw; see :mod:`~stability.detectors.oddity`); None: no cap.
    """
    if finding.kind in PERF_KINDS:  # performance findings name their cause; nothing to roll back or skip
        return Ranking(perf_causes(finding), None, ())
    t0, event = finding.onset, _event_name(finding)
    hints = _Hints()
    precursors: list[Move] = []
    scale = find_move(history.globals, "loss_scale", t0, factor=4.0, lead_steps=50, lead_records=5, rise=False)
    if scale is not None and scale.lead > 0:
        precursors.append(scale)
    structural = _kind_cause(finding)
    if structural is not None:
        hints.add(structural[0], structural[1] - _symptom_of_lr(finding, history, hints), finding.message)
    if finding.kind == "rank_disagreement" and finding.signal == "loss" and not math.isfinite(finding.value):
        hints.add("bad_batch", 0.6, f"a non-finite loss on rank {finding.rank} only, at step {finding.onset}: a batch "
                  "with NaN/Inf inputs on that rank does the same (if that batch reproduces it on another device, it "
                  "is the data)")
    if finding.kind == "adam_v_lag":  # its own cause, but not a precursor cause of later findings (_adam_rule is)
        hints.add("adam_second_moment", 0.7, finding.message, finding.signal)
    precursors += _recent_hints(finding, history, hints, recent, event)
    if finding.kind == "nan":
        _nan_rule(finding, history, hints, scale, event)
    elif finding.kind in ("loss_spike", "divergence", "grad_explosion", "activation_growth",
                          "attention_logit_growth", "update_ratio_jump", "adam_v_lag"):
        if scale is not None:
            hints.add("fp16_loss_scale", 0.85 if scale.lead > 0 else 0.5, describe(scale, event), "loss_scale")
        precursors += _gradient_rules(finding, history, hints, event)
        _slow_rules(finding, history, hints, event)
        _overflow_rules(finding, history, hints, event)
        _data_rules(finding, history, hints, precursors, recent, oddity)
    elif finding.kind == "param_jump":
        _param_jump_rules(finding, history, hints, recent)
    hints.tie_break(history, t0)
    rollback = _rollback(history, min([t0] + [m.step for m in precursors]))
    return Ranking(hints.ranked(), rollback, _skip_batches(finding, history))


NAN_AFTER_LR = 3
"""A NaN at most this many steps after the LR jumped (>= :data:`NAN_LR_FACTOR`, above any peak seen: not a
scheduled restart) is blamed on the LR: the update made with it overflowed (root-causes.md triage: just after a
schedule change). A NaN in the data comes with no LR move."""
NAN_LR_FACTOR = 3.0


def _lr_raised_just_before(history: History, t0: int) -> str | None:
    """The evidence when the LR jumped out of the schedule it followed right before a NaN at ``t0``, else None."""
    lr = history.lr
    jump = lr.last_jump
    if jump is None or not t0 - NAN_AFTER_LR <= jump <= t0 or lr.jump_factor < NAN_LR_FACTOR or lr.last is None:
        return None
    if lr.last <= lr.peak * lr.config.peak_tol:  # back to a level the schedule had (a warm restart)
        return None
    return f"lr raised {lr.jump_factor:.3g}x at step {jump}, {plural(t0 - jump, 'step')} before the NaN"


def _recent_hints(finding: Finding, history: History, hints: _Hints, recent: Sequence[Finding],
                  event: str) -> list[Move]:
    """Hints from the incident's other structural findings; the precursors among them (those before the onset
    whose series, for a growth, grew before it too)."""
    t0, precursors = finding.onset, []
    for earlier in recent:
        if earlier.kind == "param_jump" and earlier.causes and finding.kind != "param_jump":
            _weights_jumped_after(finding, earlier, hints, event)
            continue
        cause = _kind_cause(earlier)
        if cause is None or earlier is finding or earlier.kind == finding.kind:
            continue
        lead = t0 - earlier.onset
        ongoing = earlier.kind == "lr_off_schedule" and history.lr.off_since == earlier.onset  # the LR is still up
        if ongoing and earlier.onset <= finding.step:
            lead = max(lead, 1)  # the LR left its schedule before this alert and still is off: a precursor
        elif not -FOLLOW_WINDOW <= lead <= PRECURSOR_WINDOW:
            continue
        if lead > 0 and earlier.kind in GROWTH and not _grew_before(history, earlier.signal, t0):
            when, penalty = f"but {earlier.signal} did not grow before {event} (a consequence)", 0.4
        elif lead > 0:
            when, penalty = f"{plural(lead, 'step')} before {event}", 0.0
            precursors.append(Move(earlier.signal, earlier.onset, earlier.score, earlier.score, lead))
        elif lead == 0:
            when, penalty = f"with {event}", 0.05
        else:
            when, penalty = f"{plural(-lead, 'step')} after the onset of {event}", 0.15
        penalty += _symptom_of_lr(earlier, history, hints)
        hints.add(cause[0], cause[1] - penalty, f"{earlier.message} ({when})", earlier.signal)
    return precursors


GROWTH = frozenset({"attention_logit_growth", "activation_growth", "logit_divergence"})

PARAM_SAMPLES = 100
"""A weight jump (``param_jump``) seen at a sampled step up to this many steps after an event's onset may have
happened at the onset (weights are sampled every ``stats_every`` steps, 50 by default)."""


PRECEDING_JUMP_BONUS = 0.05
"""A weight jump sampled before an event of its incident explains the event a little more surely than the jump's
own first cause explains the jump: the order is known, and the event (the gradient of a layer holding a 1e4 weight)
is its consequence. Run-level priors such as "no warm-up" (0.8) must not outrank it."""


def _weights_jumped_after(finding: Finding, jump: Finding, hints: _Hints, event: str) -> None:
    """A module's weights found jumped at the next sampled step after ``event``: what the jump's own ranking says
    (weights written outside the optimizer, or moved by an LR that jumped) explains the event, a little weaker
    (the jump happened somewhere between two samples)."""
    lag = jump.onset - finding.onset
    first = jump.causes[0]
    if 0 <= lag <= PARAM_SAMPLES:
        hints.add(first.cause, first.score - 0.05,
                  f"{first.evidence} ({plural(lag, 'step')} after the onset of {event}; weights are sampled every "
                  "stats_every steps, so the jump may be the onset's)", jump.signal)
    elif -PRECURSOR_WINDOW <= lag < 0:
        hints.add(first.cause, min(first.score + PRECEDING_JUMP_BONUS, 0.95),
                  f"{first.evidence} ({plural(-lag, 'step')} before the onset of {event}, in the same incident: "
                  "the event follows from the jumped weights)", jump.signal)


def _symptom_of_lr(finding: Finding, history: History, hints: _Hints) -> float:
    """Penalty for a growth finding that started after the LR was raised (the growth is a symptom): 0.2, and the
    LR increase becomes an ``lr_too_high`` hint; 0 otherwise."""
    if finding.kind not in GROWTH:
        return 0.0
    lr = history.lr
    jump = lr.last_jump if lr.last_jump is not None and finding.onset - 100 <= lr.last_jump <= finding.onset else None
    if jump is None and lr.last_jump is not None and finding.onset < lr.last_jump <= finding.step \
            and not _grew_before(history, finding.signal, lr.last_jump):
        jump = lr.last_jump  # dated before the LR intervention by its fit, but it only grew after it
    rise = lr_rise(history, finding.onset)
    if jump is not None:
        text = f"lr raised {lr.jump_factor:.3g}x at step {jump}, before {finding.signal} started to grow"
    elif rise is not None:
        text = (f"lr rose {rise.factor:.3g}x over the {plural(rise.lead, 'step')} before {finding.signal} started "
                "to grow")
    else:
        return 0.0
    hints.add("lr_too_high", 0.88, text, "lr")  # below the gradient rule's 0.9, whose evidence says more
    return 0.2


PRECURSOR_GROWTH = 1.5
"""A growth finding is a precursor of a later event only if its series grew this much before the event."""


def _grew_before(history: History, signal: str, t0: int, span: int = 48) -> bool:
    """Whether ``signal`` (a growth series) grew before step ``t0``, using only points before it: a factor of
    :data:`PRECURSOR_GROWTH` for magnitudes, a drift of 1 nat for ``logit_z``. Unknown series count as grown."""
    ring = history.modules if "/" in signal else history.globals
    pair = _growth(ring, signal, t0 - 1, span=span)
    if signal not in ring.series:
        return True
    if pair is None:
        return False
    if signal.split("/", 1)[0] == "logit_z":
        return abs(pair[1]) - abs(pair[0]) >= 1.0
    return pair[0] > 0 and pair[1] / pair[0] >= PRECURSOR_GROWTH


def _gradient_rules(finding: Finding, history: History, hints: _Hints, event: str) -> list[Move]:
    t0, glob, mods = finding.onset, history.globals, history.modules
    found: list[Move] = []

    names = ["update_ratio", *modules(mods, "grad_norm"), *modules(mods, "update_ratio")]
    if finding.kind != "grad_explosion":
        names.insert(0, "grad_norm")
    moves = [find_move(glob if "/" not in n else mods, n, t0, factor=3.0, lead_steps=8) for n in names]
    moves += [robust_move(mods, n, t0) for n in modules(mods, "update_ratio")]
    rises = [m for m in moves if m is not None and m.lead > 0]
    lr = history.lr
    jumped = lr.last_jump is not None and t0 - 100 <= lr.last_jump <= t0
    first = earliest(rises)
    if jumped:
        assert lr.last_jump is not None
        lead = t0 - lr.last_jump
        text = f"lr raised {lr.jump_factor:.3g}x at step {lr.last_jump}, {plural(lead, 'step')} before {event}"
        if first is not None:
            text += f"; {describe(first, event)}"
        hints.add("lr_too_high", 0.9, text, first.signal if first is not None else "lr")
        found.append(Move("lr", lr.last_jump, lr.jump_factor, lr.jump_factor, lead))
    elif (off := _off_schedule(history, t0, finding.step)) is not None:
        text = off if first is None else f"{off}; {describe(first, event)}"
        hints.add("lr_too_high", 0.92, text, first.signal if first is not None else "lr")
        since, factor = history.lr.off_since or t0, (history.lr.last or 1.0) / history.lr.anchor
        found.append(Move("lr", since, factor, factor, t0 - since))
    elif (rise := lr_rise(history, t0)) is not None:
        text = (f"lr rose {rise.factor:.3g}x over the {plural(rise.lead, 'step')} before the onset (rising from step "
                f"{rise.step})")
        if first is not None:
            text += f"; {describe(first, event)}"
        hints.add("lr_too_high", 0.9 if first is not None or rise.factor >= 2.0 else 0.8, text,
                  first.signal if first is not None else "lr")
        found.append(rise)
    elif first is not None:
        _unexplained_rise(finding, history, hints, first, event)
        _localized_attention(finding, history, hints, event, rises)
    if finding.kind == "update_ratio_jump" and not jumped:
        _update_jump_rule(finding, history, hints, [m for m in moves if m is not None])
    if first is not None:
        found.append(first)
    adam = _adam_rule(history, hints, t0, event, first)
    if adam is not None:
        found.append(adam)
    falls = [m for m in (find_move(mods, n, t0, factor=10.0, lead_steps=50, rise=False) for n in
                         modules(mods, "grad_norm")) if m is not None]
    if falls and not _loss_fell_with_gradients(history, t0):
        hints.add("vanishing_gradients", 0.6, describe(min(falls, key=lambda m: m.peak), event))
    _warmup_rule(history, hints, t0, event)
    return found


def _loss_fell_with_gradients(history: History, t0: int, span: int = 50) -> bool:
    """The loss of the ``span`` steps before ``t0`` is a third or less of the loss before them: gradients that fell
    10x meanwhile are a model converging (a classifier's loss 2.3 -> 0.02 takes its gradients down 65x), not
    vanishing gradients, which leave the loss where it was."""
    glob = history.globals
    if "loss" not in glob.series:
        return False
    steps, loss = glob.ordered(), glob.ordered("loss").astype(np.float64)
    ok = np.isfinite(loss) & (loss > 0) & (steps < t0)
    before, recent = loss[ok & (steps < t0 - span)][-64:], loss[ok & (steps >= t0 - span)]
    if len(before) < 3 or len(recent) < 3:
        return False
    return float(np.median(recent)) <= float(np.median(before)) / 3.0


def _param_jump_rules(finding: Finding, history: History, hints: _Hints, recent: Sequence[Finding]) -> None:
    """A module's weights jumped (:data:`~stability.detectors.update.PARAM_JUMP`): with an LR that jumped or left
    its schedule, the updates did it (``lr_too_high``); with none, the weights were written outside the optimizer:
    memory corruption (``hardware_fault``: a flipped exponent bit turns a weight into 1e4+) or code that wrote
    them (``software_regression``: a checkpoint loaded into the wrong module, an in-place edit)."""
    t0 = finding.onset
    what = f"{finding.message} at sampled step {t0}"
    changed = _lr_change(history, t0)
    off = _off_schedule(history, t0, finding.step)
    if changed is not None or off is not None:
        why = off if off is not None else f"the lr changed at step {changed}"
        hints.add("lr_too_high", 0.85, f"{what}; {why}: the updates grew the weights", "lr")
        return
    if history.lr.last is None:  # nothing rules an LR change out (a hand-written update with no lr logged)
        hints.add("lr_too_high", 0.55, f"{what}; no lr is logged to rule out a step size that jumped "
                                       "(handle.observe('lr', lr))", "lr")
        hints.add("hardware_fault", 0.5, f"{what}: or weights written outside the optimizer (a bit flip)")
        return
    spike = next((f for f in recent if f.kind == "loss_spike" and 0 <= t0 - f.onset <= PARAM_SAMPLES), None)
    if spike is not None:  # one huge gradient step (SGD without clipping) moves weights this far too
        hints.add("bad_batch", 0.6, f"{what}, after the loss spike at step {spike.onset}: a batch whose huge "
                                    "gradient the optimizer applied moves the weights this far")
        hints.add("hardware_fault", 0.5, f"{what}: or weights written outside the optimizer (a bit flip)")
        return
    hints.add("hardware_fault", 0.8, f"{what}, with the lr on its schedule: more than an optimizer's updates "
                                     "(an update ratio of 1e-4 to 1e-2 a step) can do; weights written outside the "
                                     "optimizer, as a bit flip in memory does (silent data corruption)")
    hints.add("software_regression", 0.5, f"{what}: code that writes weights (a checkpoint loaded into the wrong "
                                          "module, an in-place edit) does this too")


def _lr_change(history: History, t0: int) -> int | None:
    """Step of the LR change before ``t0`` that the LR rules blame (a jump within 100 steps, or the start of an
    off-schedule rise), if any."""
    lr = history.lr
    if lr.last_jump is not None and t0 - 100 <= lr.last_jump <= t0:
        return lr.last_jump
    return lr.off_since if lr.off_since is not None and lr.off_since <= t0 else None


def _off_schedule(history: History, t0: int, step: int) -> str | None:
    """The evidence when the LR has been off its learned schedule since before the alert at ``step`` (and still
    is); a slow loss rise's onset estimate may precede the LR's departure (the loss had flattened first)."""
    lr = history.lr
    since = lr.off_since
    if since is None or since > step or lr.last is None or lr.anchor <= 0:
        return None
    when = f"{plural(t0 - since, 'step')} before the onset" if since <= t0 else f"before the alert (step {step})"
    return (f"lr off its schedule since step {since}: it rose {lr.last / lr.anchor:.3g}x from {lr.anchor:.3g} "
            f"(step {lr.anchor_step}) outside the warm-up and restarts, {when}")


NO_WARMUP_START = 10
"""A run whose first LR record is at step <= this and whose LR did not ramp up (or ramped for at most this many
steps) had no real warm-up."""
NO_WARMUP_STEPS = 100
"""... and an instability in its first this many steps points at the missing warm-up: Adam's second moment is
still settling (BLOOM re-warmed after an optimizer reset for 5 / (1 - beta2) = 100 steps at beta2 = 0.95;
root-causes.md #8). Later instabilities of such a run get no warm-up hint (a fine-tune without warm-up is
common and usually fine)."""


def _no_warmup(history: History) -> bool:
    """The records start at the run's start (step <= :data:`NO_WARMUP_START`) and the LR did not ramp up (or for
    at most that many steps)."""
    lr, first = history.lr, history.first_step
    token = lr.warmup_end is not None and lr.warmup_end <= NO_WARMUP_START
    return first is not None and first <= NO_WARMUP_START and lr.records > 0 and (not lr.ramp_started or token)


def _warmup_rule(history: History, hints: _Hints, t0: int, event: str) -> None:
    """Instability while the LR warms up, within 3x the warm-up, or early in a run with no (or a token) warm-up
    -> ``warmup_too_short``."""
    lr, first = history.lr, history.first_step
    from_start = first is not None and first <= NO_WARMUP_START and lr.records > 0
    if _no_warmup(history) and t0 <= NO_WARMUP_STEPS:
        what = "no LR warm-up" if not lr.ramp_started else f"a {plural(lr.warmup_end or 0, 'step')} LR warm-up"
        hints.add("warmup_too_short", 0.8, f"{event} at step {t0} of a run with {what} (peak lr {lr.peak:.3g}): "
                                           "Adam's second moment has not settled yet", "lr")
    elif lr.rising:
        hints.add("warmup_too_short", 0.7, f"{event} at step {t0} while the LR is still warming up")
    elif lr.warmup_end is not None and t0 <= 3 * lr.warmup_end:
        hints.add("warmup_too_short", 0.55, f"{event} at step {t0}, within 3x the warm-up (LR peaked at step "
                                            f"{lr.warmup_end})")
    elif first is not None and not from_start and not lr.ramp_started and t0 - first <= NO_WARMUP_STEPS:
        hints.add("warmup_too_short", 0.3, f"the records start at step {first}, {plural(t0 - first, 'step')} before "
                                           f"{event}: the LR schedule before them is unknown (an instability soon "
                                           "after the warm-up is common)")


def _nan_rule(finding: Finding, history: History, hints: _Hints, scale: Move | None, event: str) -> None:
    """A NaN: ``fp16_loss_scale`` first after a loss-scale collapse, ``lr_too_high`` right after an LR raise, else
    ``numerical_nan`` (0.95). When no module is named and the run samples forward statistics, says how to get one."""
    what = f"{finding.signal} became {finding.value} at step {finding.step}"
    if "/" not in finding.signal and any(n.partition("/")[0] in FORWARD_QUANTITIES for n in history.modules.series):
        what += (" (no forward statistics on that step name the module: STABILITY_STATS_EVERY=1 samples them on "
                 "every step)")
    raised = _lr_raised_just_before(history, finding.onset)
    if scale is not None and scale.lead > 0:
        hints.add("fp16_loss_scale", 0.95, f"{describe(scale, event)}; then {what}")
        hints.add("numerical_nan", 0.7, what)
    elif raised is not None:
        hints.add("lr_too_high", 0.9, f"{raised}; then {what}", "lr")
        hints.add("numerical_nan", 0.75, what)
    else:
        hints.add("numerical_nan", 0.95, f"{what}; no loss-scale collapse before it")

CONTRADICTED = 0.15
"""Score of a cause whose own evidence contradicts it: below ``unknown`` (0.2), so it is never the first cause."""


def _unexplained_rise(finding: Finding, history: History, hints: _Hints, first: Move, event: str) -> None:
    """Gradients or update ratios rose before the onset while the logged LR neither jumped nor rose.

    For an error (the loss event lasted) the rise is the gradient outgrowing a constant LR: ``lr_too_high``
    (0.65, "lr unchanged"). For an INFO or WARNING the unchanged LR contradicts an LR cause (an operator reads the
    first cause first; a bad batch's own gradient is not an LR to lower): the hint is kept, scored below
    ``unknown`` (:data:`CONTRADICTED`), and says so. With no LR logged, nothing contradicts it."""
    t0 = finding.onset
    if history.lr.records and finding.severity is not Severity.ERROR:
        hints.add("lr_too_high", CONTRADICTED, f"{describe(first, event)}; but the logged lr did not change, which "
                                               "contradicts an LR cause", first.signal)
        return
    what = "lr unchanged" if history.lr.records else "no lr logged"
    hints.add("lr_too_high", *_confirm(history, first, t0, 0.65, f"{describe(first, event)}; {what}"), first.signal)


def _adam_rule(history: History, hints: _Hints, t0: int, event: str, first: Move | None) -> Move | None:
    """A layer's ``adam_v_ratio`` jumping 1-8 steps before -> ``adam_second_moment``; weak when a gradient or
    update-ratio precursor moved earlier still (the earliest deviating signal wins)."""
    mods = history.modules
    adam = earliest([m for m in (find_move(mods, n, t0, factor=3.0, lead_steps=8) for n in
                                  modules(mods, "adam_v_ratio")) if m is not None and 1 <= m.lead <= 8])
    if adam is None:
        return None
    if first is not None and first.step < adam.step:
        hints.add("adam_second_moment", 0.5, f"{describe(adam, event)}, after {first.signal} had moved (step "
                                             f"{first.step})", adam.signal)
    else:
        hints.add("adam_second_moment", 0.85, describe(adam, event), adam.signal)
    return adam


ATTENTION_MODULE = re.compile(r"attn|attention|qkv|q_proj|k_proj|query|key", re.IGNORECASE)
"""Module names of attention input projections (whose fast updates grow the attention logits)."""


def _attention_leaders(history: History, moves: list[Move]) -> tuple[list[str], int, int] | None:
    """``(leaders, first step, layers)`` when the update ratios that moved first (within 2 steps of the earliest)
    are only attention projections and a strict minority of the ``layers`` (an LR too high moves every layer at
    once); else ``None``."""
    moves = [m for m in moves if m.signal.startswith("update_ratio/")]
    layers = modules(history.modules, "update_ratio")
    if not moves or len(layers) < 3:
        return None
    start = min(m.step for m in moves)
    leaders = sorted({m.signal for m in moves if m.step <= start + 2})
    if 2 * len(leaders) > len(layers) or not all(ATTENTION_MODULE.search(n.split("/", 1)[1]) for n in leaders):
        return None
    return leaders, start, len(layers)


def _update_jump_rule(finding: Finding, history: History, hints: _Hints, moves: list[Move]) -> None:
    """An update-ratio jump with the logged LR unchanged: only attention projections moved -> ``attention_logit_
    growth``; otherwise the effective step grew -> ``lr_too_high`` (weaker). ``moves`` include those at the onset."""
    where = f"{finding.signal} jumped {finding.score:.3g}x"
    found = _attention_leaders(history, moves)
    if found is not None:
        leaders, _, layers = found
        hints.add("attention_logit_growth", 0.75, f"{where}; only {', '.join(leaders)} of {plural(layers, 'layer')} "
                                                  "moved, while the logged lr did not change", leaders[0])
    else:
        hints.add("lr_too_high", 0.6, f"{where} while the logged lr did not change: the effective step size grew",
                  finding.signal)
        grown = _attention_grew(history, finding.onset)
        if grown is not None and lr_rise(history, finding.onset) is None:
            hints.add("attention_logit_growth", 0.7, f"{where} while the logged lr did not change and {grown[0]} "
                                                     f"grew {grown[1]:.3g}x over the steps before", grown[0])


def _attention_grew(history: History, t0: int) -> tuple[str, float] | None:
    """The attention logit series that grew the most over the 48 steps before ``t0``, if it grew at least
    :data:`PRECURSOR_GROWTH` (an update-ratio jump at a constant LR after the logits grew is their growth catching
    up with every layer, not a step size that grew by itself)."""
    grown = [(n, pair[1] / pair[0]) for n in modules(history.modules, "attn_logit_max")
             if (pair := _growth(history.modules, n, t0 - 1)) is not None and pair[0] > 0]
    best = max(grown, key=lambda g: g[1], default=None)
    return best if best is not None and best[1] >= PRECURSOR_GROWTH else None


def _localized_attention(finding: Finding, history: History, hints: _Hints, event: str, rises: list[Move]) -> None:
    """With the LR unchanged, update ratios that rose first only in attention projections
    (:func:`_attention_leaders`) -> ``attention_logit_growth``, stronger when the attention logits grew before the
    onset too."""
    found = _attention_leaders(history, rises)
    if found is None:
        return
    leaders, start, layers = found
    text = (f"{', '.join(leaders)} rose first ({plural(finding.onset - start, 'step')} before {event}, step {start}) "
            f"while the other {plural(layers - len(leaders), 'layer')} and the lr did not: the attention "
            "projections update too fast")
    grown = [(n, pair[1] / pair[0]) for n in modules(history.modules, "attn_logit_max")
             if (pair := _growth(history.modules, n, finding.onset - 1)) is not None and pair[0] > 0]
    best = max(grown, key=lambda g: g[1], default=None)
    if best is not None and best[1] >= PRECURSOR_GROWTH:
        hints.add("attention_logit_growth", 0.88, f"{text}; {best[0]} grew {best[1]:.3g}x before {event}", best[0])
    else:
        hints.add("attention_logit_growth", 0.8, text, leaders[0])


def _confirm(history: History, move: Move, t0: int, score: float, text: str) -> tuple[float, str]:
    """Lead-lag confirmation of a precursor: +0.05 when it leads the loss (ccf), -0.1 when it lags it."""
    link = lead_lag(history, move.signal, t0)
    if link is None or abs(link[1]) < 0.3 or link[0] == 0:
        return score, text
    lag, ccf = link
    if lag > 0:
        return score + 0.05, f"{text}; it leads the loss by {plural(lag, 'record')} (ccf {ccf:.2f})"
    return score - 0.1, f"{text}; but it lags the loss by {plural(-lag, 'record')} (ccf {ccf:.2f})"


def _growth(ring: Ring, name: str, t0: int, span: int = 48) -> tuple[float, float, int] | None:
    """(first, last, steps between) finite values of ``name`` in ``[t0 - span, t0]`` when at least 8 exist."""
    if name not in ring.series:
        return None
    steps, values = ring.ordered(), ring.ordered(name).astype(np.float64)
    keep = (steps <= t0) & (steps >= t0 - span) & np.isfinite(values)
    values, steps = values[keep], steps[keep]
    return (float(values[0]), float(values[-1]), int(steps[-1] - steps[0])) if len(values) >= 8 else None


ATTN_LEVEL = 30.0
"""Attention logits below this are not blamed (healthy early training grows them from ~2 to ~15)."""


def _slow_rules(finding: Finding, history: History, hints: _Hints, event: str) -> None:
    t0, mods, glob = finding.onset, history.modules, history.globals
    best: tuple[float, str] | None = None
    last = finding.step if finding.kind in GROWTH else t0 - 1  # no points after the onset of the event it explains
    for name in modules(mods, "attn_logit_max"):
        pair = _growth(mods, name, last)
        if pair is None or pair[0] <= 0 or pair[1] < ATTN_LEVEL:
            continue
        factor = pair[1] / pair[0]
        if factor >= 1.5 and (best is None or factor > best[0]):
            best = (factor, f"{name} grew {factor:.3g}x ({pair[0]:.3g} -> {pair[1]:.3g}) over the "
                            f"{plural(pair[2], 'step')} up to {event}")
    if best is not None:
        score = 0.85 if best[0] >= 10 else 0.75 if best[0] >= 3 else 0.5
        lr_step = _lr_change(history, t0)
        before = None if lr_step is None else max(
            ((p[1] / p[0], n) for n in modules(mods, "attn_logit_max")
             if (p := _growth(mods, n, lr_step - 1)) is not None and p[0] > 0 and p[1] >= ATTN_LEVEL), default=None)
        if lr_step is not None and before is not None and before[0] >= 3.0 and best[0] >= 3.0:
            score, best = 0.91, (best[0], f"{best[1]}; {before[1]} had already grown {before[0]:.3g}x before the lr "
                                          f"changed at step {lr_step}: the lr change did not start it")
        hints.add("attention_logit_growth", score, best[1], "attn_logit_max")
    for name, ring in [("logit_z", glob)] + [(n, mods) for n in modules(mods, "logit_z")]:
        pair = _growth(ring, name, t0, span=96)
        if pair and abs(pair[1] - pair[0]) >= 2.0 and abs(pair[1]) >= 3.0:
            score = 0.7 if finding.kind == "divergence" else 0.55
            hints.add("output_logit_divergence", score, f"{name} drifted from {pair[0]:.3g} to {pair[1]:.3g} "
                                                        f"before {event}")


def _overflow_rules(finding: Finding, history: History, hints: _Hints, event: str) -> None:
    """A loss-scale drop (>= 2x) or frozen grad norms (skipped steps) right at the event: fp16 overflow."""
    t0, glob = finding.onset, history.globals
    steps = glob.ordered()
    near = (steps >= t0 - 1) & (steps <= finding.step)
    notes: list[str] = []
    if "loss_scale" in glob.series:
        scale = glob.ordered("loss_scale").astype(np.float64)
        before = scale[(steps < t0) & np.isfinite(scale) & (scale > 0)][-8:]
        inside = scale[(steps >= t0) & (steps <= finding.step) & np.isfinite(scale) & (scale > 0)]
        if len(before) and len(inside) and inside.min() <= before.max() / 2:
            notes.append(f"loss scale fell {before.max() / inside.min():.3g}x at {event}")
    if "grad_norm" in glob.series:
        grad = glob.ordered("grad_norm").astype(np.float64)[near]
        frozen = int(np.sum((grad[1:] == grad[:-1]) & np.isfinite(grad[1:]) & (grad[1:] > 0)))
        if frozen and notes:
            notes.append(f"grad norm frozen on {plural(frozen, 'step')} (skipped steps)")
    if notes:
        hints.add("fp16_loss_scale", 0.8, "; ".join(notes), "loss_scale")


def _data_rules(finding: Finding, history: History, hints: _Hints, precursors: list[Move],
                recent: Sequence[Finding] = (), budget: OddityBudget | None = None) -> None:
    if finding.evidence.get("reverted"):
        _reverted_rule(finding, history, hints, recent)
        return
    if precursors:
        return
    with_loss = _loss_jumped_with(finding)
    if finding.kind == "loss_spike" or with_loss is not None:
        ratio = finding.evidence.get("ratio", math.nan)
        jumped = (f"loss jumped {ratio:.3g}x" if with_loss is None else
                  f"grad norm jumped {ratio:.3g}x with the loss {with_loss:.3g}x on the same record")
        text = f"{jumped} at step {finding.onset} with no precursor in gradients, update ratios, LR or loss scale"
        odd = precursor_oddity(history, finding.onset, budget=budget)
        if odd is not None and not odd.checked:  # a storm: every rank spiked at this step
            text += (f"; the multivariate precursor check (IsolationForest) was skipped: it already ran for "
                     f"{odd.checked_at_step} other ranks' jumps at step {finding.onset}")
            odd = None
        if odd is not None:  # no single signal moved, but their combination did: weaker
            steps = ", ".join(str(s) for s in odd.steps)
            text += (f"; but IsolationForest finds the records at step {steps} unusual across {odd.signals} "
                     "signals (a precursor no single-signal rule names)")
        runaway = _runaway(history, finding.onset) if history.lr.last is None else None
        if runaway is not None:  # compounding, with no LR logged to show a change: not a one-batch outlier
            hints.add("lr_too_high", 0.65, f"{runaway}: the update outgrows the curvature, as a step size too large "
                                           "makes; no lr is logged to confirm it (handle.observe('lr', lr))",
                      "loss")
            text += f"; but {runaway}, which one bad batch does not do"
        hints.add("bad_batch", 0.45 if odd is not None or runaway is not None else 0.6, text)
        hints.add("data_shift", 0.35, "the loss stayed elevated after the jump without a gradient precursor")
    elif finding.kind == "divergence":
        hints.add("data_shift", 0.5, "the loss level rose and stayed up without a gradient precursor")


LOSS_WITH_GRAD = 1.5
"""A gradient explosion whose own record's loss is this much over its recent median (the grad detector's
``loss_ratio``, :class:`~stability.detectors.grad.GradConfig`) is ranked as a loss spike (:func:`_loss_jumped_with`)."""


def _loss_jumped_with(finding: Finding) -> float | None:
    """The loss ratio of a ``grad_explosion`` whose loss jumped on its onset record too (``onset_loss_ratio`` >=
    :data:`LOSS_WITH_GRAD`), else None. Such a jump is one event seen on two signals: the grad detector, whose 50x
    norm with the loss up alerts at once, heads the incident before the spike detector (3x for at once, else a
    confirmation record) can, and the headline's kind must not decide the cause. With no precursor it is the loss
    spike without precursor of the rule above (a bad batch: the loss and the gradient of one batch jump together;
    an LR too high moves the gradients first), ranked the same way (oddity, runaway)."""
    if finding.kind != "grad_explosion":
        return None
    ratio = finding.evidence.get("onset_loss_ratio", math.nan)
    return ratio if ratio >= LOSS_WITH_GRAD else None


RUNAWAY_RECORDS = 3
"""Records from the onset on over which the loss and the gradient norm must both rise at every record, ending
>= :data:`RUNAWAY_GROWTH` x their value at the onset, for a loss event to count as a runaway (:func:`_runaway`)."""
RUNAWAY_GROWTH = 2.0


def _runaway(history: History, t0: int) -> str | None:
    """The loss and the global gradient norm rising together at every record from the onset ``t0`` on (at least
    :data:`RUNAWAY_RECORDS`), both ending >= :data:`RUNAWAY_GROWTH` x their onset value: the compounding growth of
    an unstable update (root-causes.md: a bad batch is a one- to few-step outlier; the batches after it are normal
    data). Its description, or None."""
    glob = history.globals
    if "loss" not in glob.series or "grad_norm" not in glob.series:
        return None
    after = glob.ordered() >= t0
    loss = glob.ordered("loss")[after].astype(np.float64)
    grad = glob.ordered("grad_norm")[after].astype(np.float64)
    n = len(loss)
    if n < RUNAWAY_RECORDS or not (np.all(np.isfinite(loss)) and np.all(np.isfinite(grad)) and grad[0] > 0):
        return None
    if not (np.all(np.diff(loss) > 0) and np.all(np.diff(grad) > 0)):
        return None
    if loss[-1] < RUNAWAY_GROWTH * loss[0] or grad[-1] < RUNAWAY_GROWTH * grad[0]:
        return None
    return (f"the loss and the grad norm kept rising together on every one of the {n} records from the onset "
            f"({loss[0]:.4g} -> {loss[-1]:.4g}, {grad[0]:.4g} -> {grad[-1]:.4g})")


def _reverted_rule(finding: Finding, history: History, hints: _Hints, recent: Sequence[Finding]) -> None:
    """A one-step jump that reverted at the next step (whichever signal jumped: loss, grad norm) is a bad batch
    (0.93: above the structural findings of an incident it may have joined, e.g. an unrelated vanishing-gradient
    warning 70 steps earlier; below a loss-scale collapse, which makes overflow steps), unless the LR changed with
    it or another data-parallel replica disagrees at that step, or it came in the first
    :data:`NO_WARMUP_START` steps of a run with no warm-up (then 0.5: the LR / hardware / warm-up rules say more)."""
    t0, lr = finding.onset, history.lr
    text = (f"one-step jump at step {t0} with no lasting effect: it reverted at the next step, not an instability "
            "of the run")
    if lr.last_jump is not None and t0 - 2 <= lr.last_jump <= finding.step:
        hints.add("bad_batch", 0.5, f"{text}; but the lr changed at step {lr.last_jump}")
    elif any(f.kind == "rank_disagreement" and abs(f.step - t0) <= 1 for f in recent):
        hints.add("bad_batch", 0.5, f"{text}; but the data-parallel replicas disagree at that step")
    elif t0 <= NO_WARMUP_START and _no_warmup(history):
        hints.add("bad_batch", 0.5, f"{text}; but at step {t0} of a run with no LR warm-up the optimizer's moments "
                                    "rest on a few batches: any batch can jump the loss")
    else:
        hints.add("bad_batch", 0.93, text)


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


# -- causes only log sources can evidence (post-mortem of training / system logs) ---------------------------------

LOG_CONTEXT_WINDOW = 100
"""Steps after a resume boundary (or around a system event) within which an onset is attributed to it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Boundary:
    """A resume boundary read from a log: the process restarted (a step went back or a new start-up banner)."""

    step: int
    """First step of the new segment."""
    resumed_after: int
    """Last step logged before it."""
    changed: tuple[str, ...] = ()
    """``"name: old -> new"`` of the start-up context (versions, config) that differs from the previous segment."""
    offset: float | None = None
    """Median relative loss difference (new / old - 1) over the first re-logged steps (None: no overlap)."""
    converged: bool | None = None
    """Whether that difference had vanished (< 2%) by the end of the overlap (None: no overlap)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemFact:
    """A system event (Xid, ECC, hung task, OOM kill, NCCL failure) placed on the step axis."""

    kind: str
    step: int
    text: str


def context_causes(finding: Finding, end: int | None, *, boundaries: Sequence[Boundary] = (),
                   system: Sequence[SystemFact] = (), versions_known: bool = False,
                   from_start: str | None = None) -> list[CauseHint]:
    """Cause hints of ``finding`` that rest on evidence only log sources carry (none without that evidence, so the
    ranking of instrumented runs is unchanged):

    * ``software_regression``: the onset is within :data:`LOG_CONTEXT_WINDOW` steps after a resume whose start-up
      context (versions, config) changed (0.96: the change is the first suspect, even for a NaN); or the start-up
      context names versions and the anomaly is there from the first logged record and persists (``from_start``
      says how; 0.7).
    * ``resume_mismatch``: onset within the window after a resume and the event recovered, or the re-logged steps'
      loss differed from the first run's and converged (0.75): data order or optimizer state not restored.
    * ``data_pipeline``: the re-logged steps' loss is offset >= 5% from the first run's and stays so (0.75).
    * ``hardware_fault`` (Xid / ECC, 0.85), ``infrastructure`` (OOM kill, NCCL failure, 0.6), ``hang`` (hung
      task, NCCL watchdog timeout, 0.7) when such a system event lies within the window of the onset.
    """
    hints = _boundary_hints(finding, end, boundaries)
    t0 = finding.onset

    def add(cause: str, score: float, evidence: str) -> None:
        hints.append(CauseHint(cause=cause, score=score, evidence=evidence, remedy=remedy(cause)))

    if from_start and versions_known:
        add("software_regression", 0.7, f"{from_start} from the first logged step with the versions of the start-up "
                                        "banner: a software/version regression is likely")
    for fact in system:
        if abs(fact.step - t0) > LOG_CONTEXT_WINDOW:
            continue
        if fact.kind in ("xid", "ecc"):
            add("hardware_fault", 0.85, f"system log at step ~{fact.step}: {fact.text}")
        elif fact.kind in ("oom", "nccl_error"):
            add("infrastructure", 0.6, f"system log at step ~{fact.step}: {fact.text}")
        elif fact.kind in ("hung_task", "nccl_timeout"):
            add("hang", 0.7, f"system log at step ~{fact.step}: {fact.text}")
    return hints


def _boundary_hints(finding: Finding, end: int | None, boundaries: Sequence[Boundary]) -> list[CauseHint]:
    """The resume-boundary rules of :func:`context_causes`."""
    hints: list[CauseHint] = []
    event = _event_name(finding)

    def add(cause: str, score: float, evidence: str) -> None:
        hints.append(CauseHint(cause=cause, score=score, evidence=evidence, remedy=remedy(cause)))

    for b in boundaries:
        after = finding.onset - b.step
        if not 0 <= after <= LOG_CONTEXT_WINDOW:
            continue
        where = (f"{event} began {plural(after, 'step')} after the resume at step {b.step} (previous run logged up "
                 f"to {b.resumed_after})")
        if b.changed:
            add("software_regression", 0.96, f"{where}; the start-up context changed: {'; '.join(b.changed[:4])}")
        if b.offset is not None and abs(b.offset) >= 0.05:
            if b.converged:
                add("resume_mismatch", 0.75, f"{where}; on the steps both runs logged the loss differed by "
                                             f"{b.offset:+.0%} and converged back")
            else:
                add("data_pipeline", 0.75, f"{where}; on the steps both runs logged the loss is offset by "
                                           f"{b.offset:+.0%} and stays so (different data at the same step)")
        elif end is not None and (b.offset is None or b.converged):
            add("resume_mismatch", 0.6, f"{where} and recovered by step {end}: a resume transient (data order or "
                                        f"optimizer state not restored)")
    return hints


def merge_causes(causes: Sequence[CauseHint], extra: Sequence[CauseHint]) -> tuple[CauseHint, ...]:
    """``causes`` plus ``extra`` (the higher score per cause), best first; an ``unknown`` placeholder is dropped
    once another cause is named."""
    best: dict[str, CauseHint] = {}
    for hint in [*causes, *extra]:
        if hint.cause not in best or hint.score > best[hint.cause].score:
            best[hint.cause] = hint
    if len(best) > 1:
        best.pop("unknown", None)
    return tuple(sorted(best.values(), key=lambda h: -h.score))
