"""Labels of the families corpus, from the injection and each event's defining signal (never from a detector).

The conventions of :mod:`stability.evaluation.corpus` hold (``SPIKE_FACTOR`` 1.5x the median of the 20 pre-fault
losses, recovery under 1.2x, at most 60 steps). Additions:

* ``bad_batch``: a batch whose loss stays under 1.5x but whose global gradient norm is >= 5x the median of the 20
  pre-fault steps and back under 2x at the next step is a ``bad_batch`` event (INFO detects it) too; every
  bad-batch event notes its loss and gradient ratios (e.g. ``loss x2.3, grad x31``).
* ``lr_spike`` that moves the loss < 1.5x: an ``lr_spike`` event (cause ``lr_too_high``, INFO detects it) over the
  injected steps: the defining signal is the LR itself.
* ``lr_drift`` whose loss never reaches 1.5x (the run ends first): an ``lr_rise`` event (cause ``lr_too_high``)
  from the departure to the end: the defining signal is the LR itself.
* ``lr_drift`` / ``attn_growth``: ``divergence`` with ``precursor_start`` = the LR's departure from its schedule,
  ``onset`` = the first step whose 10-step running median loss is >= 1.5x the pre-fault median (or a non-finite
  loss: one noisy batch of a regressor is not a divergence), and ``rise`` = the step the loss first rose
  sustainedly: after the lowest 10-step running median between the departure and the onset, the first step from
  which that running median stays >= 5 % above the low until the onset. An ``attn_growth`` whose loss stays under
  1.5x while the max attention logit reached 4x its pre-fault median is an ``attention_growth`` event (its
  defining signal), onset at the 4x.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stability.evaluation.corpus import (
    RECOVERED_FACTOR,
    SPIKE_FACTOR,
    Event,
    _baseline,
    _first,
    _label_warmup,
    _loss_by_step,
    _recovery,
    label_tail,
)
from stability.records import StepRecord

if TYPE_CHECKING:
    from stability.evaluation.families import FamilySpec

__all__ = ["ATTN_FACTOR", "GRAD_FACTOR", "RISE_FACTOR", "label_family", "sustained_rise"]

GRAD_FACTOR = 5.0
"""A bad batch moved the gradient when its global norm is at least this many times the pre-fault median."""
ATTN_FACTOR = 4.0
"""Attention growth without a loss divergence: the defining signal is the max attention logit at 4x its level."""
RISE_FACTOR = 1.05
"""A sustained rise: the 10-step running median of the loss stays this far above its low."""


def label_family(spec: FamilySpec, records: Sequence[StepRecord]) -> list[Event]:
    """Events of a families-corpus run; an injection without effect on its defining signal gives no event."""
    if spec.fault == "clean" or not records:
        return []
    last = max(r.step for r in records)
    if spec.fault == "vanishing":
        return [Event(kind="grad_vanishing", cause="vanishing_gradients", onset=0, end=last, precursor_start=0,
                      note=f"{spec.depth} tanh layers, init std {spec.magnitude:.3g}")]
    loss = _loss_by_step(records, spec.faulty_rank if spec.fault == "dp_rank" else 0)
    if spec.fault == "short_warmup":
        return _label_warmup(loss, last)
    if spec.fault_step > last:
        return []
    f0, f1 = spec.fault_step, spec.fault_step + max(1, spec.duration) - 1
    base = _baseline(loss, f0)
    if spec.fault in ("bad_batch", "lr_spike"):
        return _spike(spec, records, loss, base, last)
    if spec.fault in ("lr_drift", "attn_growth"):
        cause = "lr_too_high" if spec.fault == "lr_drift" else "attention_logit_growth"
        level = _running_median(loss, f0, last)  # a slow divergence is a sustained level, not one noisy batch
        onset = _first(level, f0, last, lambda v: not math.isfinite(v) or v >= SPIKE_FACTOR * base)
        if onset is None:  # the loss never diverged: the defining signal is the LR (or attention logits) itself
            if spec.fault == "attn_growth":
                return _attention_only(spec, records, last)
            return [Event(kind="lr_rise", cause=cause, onset=f0, end=last, precursor_start=f0,
                          note=f"x{spec.magnitude:.4g} per step from {f0}; loss never 1.5x")]
        rise = sustained_rise(loss, f0, onset)
        return [Event(kind="divergence", cause=cause, onset=onset, end=last, precursor_start=f0, rise=rise,
                      note=f"x{spec.magnitude:.4g} per step from {f0}; sustained loss rise at {rise}")]
    return label_tail("fp16" if spec.fault == "fp16_collapse" else spec.fault, records, loss, f0, f1, last,
                      one_step=bool(spec.duration), faulty_rank=spec.faulty_rank,
                      note=f"{spec.ranks} replicas, x{spec.magnitude:.3g}" if spec.fault == "dp_rank" else "")


def _attention_only(spec: FamilySpec, records: Sequence[StepRecord], last: int) -> list[Event]:
    """Attention logits that grew ``ATTN_FACTOR`` x over their pre-fault median while the loss stayed under 1.5x:
    an ``attention_growth`` event from that step to the end of the run."""
    top = {r.step: max((v for k, v in r.signals.items() if k.startswith("attn_logit_max/")), default=math.nan)
           for r in records if r.rank == 0}
    base = _baseline(top, spec.fault_step)
    onset = _first(top, spec.fault_step, last, lambda v: math.isfinite(v) and v >= ATTN_FACTOR * base)
    if onset is None:
        return []
    return [Event(kind="attention_growth", cause="attention_logit_growth", onset=onset, end=last,
                  precursor_start=spec.fault_step,
                  note=f"max attention logit {ATTN_FACTOR:g}x its pre-fault median {base:.3g}; loss < 1.5x")]


def _spike(spec: FamilySpec, records: Sequence[StepRecord], loss: dict[int, float], base: float,
           last: int) -> list[Event]:
    f0, f1 = spec.fault_step, spec.fault_step + max(1, spec.duration) - 1
    grad = {r.step: r.get("grad_norm") for r in records if r.rank == 0}
    gbase = _baseline(grad, f0)
    ratio = loss.get(f0, math.nan) / base if base > 0 else math.nan
    gratio = grad.get(f0, math.nan) / gbase if gbase > 0 else math.nan
    note = f"loss x{ratio:.3g}, grad x{gratio:.3g}"
    bad = spec.fault == "bad_batch"
    cause = "bad_batch" if bad else "lr_too_high"
    onset = _first(loss, f0, f1 + 5, lambda v: not math.isfinite(v) or v >= SPIKE_FACTOR * base)
    if onset is None:
        if bad:
            after = grad.get(f0 + 1, math.nan)
            if gratio >= GRAD_FACTOR and math.isfinite(after) and after <= 2 * gbase:
                return [Event(kind="bad_batch", cause=cause, onset=f0, end=f0, precursor_start=f0, info_ok=True,
                              note=note)]
            return []
        return [Event(kind="lr_spike", cause=cause, onset=f0, end=f1, precursor_start=f0, info_ok=True,
                      note=f"LR x{spec.magnitude:.3g} for {spec.duration} steps; {note}")]
    end = _recovery(loss, max(onset, f1) + 1, RECOVERED_FACTOR * base, last)
    if bad and end == onset:  # reverted at once: a batch outlier, not an instability
        return [Event(kind="bad_batch", cause=cause, onset=onset, end=end, precursor_start=f0, info_ok=True,
                      note=note)]
    return [Event(kind="loss_spike", cause=cause, onset=onset, end=end, precursor_start=f0, note=note)]


def _running_median(loss: dict[int, float], start: int, stop: int, width: int = 10) -> dict[int, float]:
    """The median of the last ``width`` losses at each recorded step in ``[start, stop]``; a non-finite loss is
    kept as it is (a NaN is the event)."""
    out: dict[int, float] = {}
    for t in range(start, stop + 1):
        if t not in loss:
            continue
        if not math.isfinite(loss[t]):
            out[t] = loss[t]
            continue
        window = sorted(v for s in range(t - width + 1, t + 1) if math.isfinite(v := loss.get(s, math.nan)))
        out[t] = window[len(window) // 2]
    return out


def sustained_rise(loss: dict[int, float], start: int, onset: int, width: int = 10) -> int:
    """The step the loss first rose sustainedly between ``start`` and ``onset`` (see the module docstring)."""
    smooth = {t: v for t, v in _running_median(loss, start, onset, width).items() if math.isfinite(v)}
    if not smooth:
        return onset
    low_step = min(smooth, key=lambda t: (smooth[t], t))
    low = smooth[low_step]
    rise = onset
    for t in range(onset, low_step, -1):  # walk back from the onset while the median stays above the low
        if t in smooth and smooth[t] < RISE_FACTOR * low:
            break
        rise = t
    return rise
