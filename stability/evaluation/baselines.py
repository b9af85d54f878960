"""Simple baselines scored exactly like stability (shared reference detection.md section 3).

Detection rules run per rank over the records in step order and return :class:`~stability.evaluation.scoring.Alarm`
lists (severity ``error``, no causes):

* :func:`olmo_6sigma` — OLMo-core ``StabilityMonitorCallback``: train loss and total grad norm, spike if
  ``value > mean + 6 * std`` of the previous 128 values (full window required, skipped if std < 1e-10).
* :func:`megatron_10x` — Megatron-LM: a NaN/Inf loss is fatal; ``--check-for-spiky-loss`` flags
  ``|loss| >= 10 * max |loss|`` of the first 100 values.
* :func:`lightning_rtol` — Lightning Fabric ``SpikeDetection`` (mode min, window 10, warmup 1, rtol 2): a
  non-finite loss is a spike; otherwise a loss above the running mean with ``|loss - mean| >= 2 * |mean|``;
  the running mean is updated with finite, non-spike values only.

Root cause: :func:`maxz_causes` — BARO-style max robust z: every signal (log of positive values) is scaled by the
median and MAD of a reference window before the event and scored by its largest |z| in the evaluation window;
causes are ranked by their best signal through :data:`SIGNAL_CAUSES` (a signal-name -> cause table).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from stability.evaluation.scoring import Alarm
from stability.records import StepRecord

__all__ = ["BASELINES", "SIGNAL_CAUSES", "lightning_rtol", "maxz_causes", "megatron_10x", "olmo_6sigma"]


def _by_rank(records: Iterable[StepRecord]) -> dict[int, list[StepRecord]]:
    ranks: dict[int, list[StepRecord]] = {}
    for record in records:
        ranks.setdefault(record.rank, []).append(record)
    return {r: sorted(recs, key=lambda x: x.step) for r, recs in ranks.items()}


def olmo_6sigma(records: Iterable[StepRecord], *, window: int = 128, k: float = 6.0,
                signals: Sequence[str] = ("loss", "grad_norm")) -> list[Alarm]:
    """OLMo-core's mean + 6 sigma over the last 128 values, on loss and grad norm."""
    alarms = []
    for rank, recs in _by_rank(records).items():
        history: dict[str, deque[float]] = {s: deque(maxlen=window) for s in signals}
        for record in recs:
            fired = []
            for name in signals:
                if name not in record.signals:
                    continue
                value, past = record.get(name), history[name]
                if len(past) == window:
                    arr = np.asarray(past)
                    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN in the window: never fires
                        mean, std = float(arr.mean()), float(arr.std())
                    if std >= 1e-10 and value > mean + k * std:
                        fired.append(name)
                past.append(value)
            if fired:
                alarms.append(Alarm(step=record.step, rank=rank, kind="spike", text=", ".join(fired)))
    return alarms


def megatron_10x(records: Iterable[StepRecord], *, first: int = 100, factor: float = 10.0) -> list[Alarm]:
    """Megatron-LM: NaN/Inf loss, or ``|loss| >= 10 x`` the largest ``|loss|`` of the first 100 values."""
    alarms = []
    for rank, recs in _by_rank(records).items():
        seen: list[float] = []
        for record in recs:
            if "loss" not in record.signals:
                continue
            loss = record.get("loss")
            if not math.isfinite(loss):
                alarms.append(Alarm(step=record.step, rank=rank, kind="nan"))
                continue
            if len(seen) >= first and abs(loss) >= factor * max(seen):
                alarms.append(Alarm(step=record.step, rank=rank, kind="spike"))
            if len(seen) < first:
                seen.append(abs(loss))
    return alarms


def lightning_rtol(records: Iterable[StepRecord], *, window: int = 10, warmup: int = 1, rtol: float = 2.0
                   ) -> list[Alarm]:
    """Lightning Fabric ``SpikeDetection`` with its defaults."""
    alarms = []
    for rank, recs in _by_rank(records).items():
        running: deque[float] = deque(maxlen=window)
        for i, record in enumerate(r for r in recs if "loss" in r.signals):
            loss = record.get("loss")
            spike = False
            if not math.isfinite(loss):
                spike = i >= warmup
            elif running and i >= warmup:
                mean = sum(running) / len(running)
                spike = loss > mean and abs(loss - mean) >= rtol * abs(mean)
            if spike:
                alarms.append(Alarm(step=record.step, rank=rank, kind="spike"))
            elif math.isfinite(loss):
                running.append(loss)
    return alarms


BASELINES: dict[str, Callable[[Iterable[StepRecord]], list[Alarm]]] = {
    "olmo-6sigma/128": olmo_6sigma,
    "megatron-10x": megatron_10x,
    "lightning-rtol2": lightning_rtol,
}
"""Detection baselines by display name."""

SIGNAL_CAUSES: tuple[tuple[str, str], ...] = (
    ("loss_scale", "fp16_loss_scale"),
    ("skipped", "fp16_loss_scale"),
    ("nonfinite_grads", "numerical_nan"),
    ("attn_logit_max", "attention_logit_growth"),
    ("logit_z", "output_logit_divergence"),
    ("adam_v_ratio", "adam_second_moment"),
    ("update_ratio", "lr_too_high"),
    ("lr", "lr_too_high"),
    ("grad_norm", "lr_too_high"),
    ("act_absmax", "lr_too_high"),
    ("act_rms", "lr_too_high"),
    ("param_norm", "lr_too_high"),
    ("loss", "bad_batch"),
)
"""Quantity (the part of a signal name before ``/``) -> cause; a falling per-layer grad norm maps to
``vanishing_gradients`` and a non-finite value to ``numerical_nan``."""


def _cause_of(name: str, falling: bool, nonfinite: bool) -> str | None:
    if nonfinite:
        return "numerical_nan"
    quantity = name.partition("/")[0]
    if quantity == "grad_norm" and "/" in name and falling:
        return "vanishing_gradients"
    return dict(SIGNAL_CAUSES).get(quantity)


def maxz_causes(records: Sequence[StepRecord], t0: int, *, ref: int = 100, before: int = 10, after: int = 2,
                rank: int | None = None) -> tuple[str, ...]:
    """Causes ranked by the largest robust z of their signals in ``[t0 - before, t0 + after]``.

    The reference is ``[t0 - before - ref, t0 - before)`` (the first 20 steps when the event starts the run).
    """
    recs = [r for r in records if rank is None or r.rank == rank]
    lo = t0 - before
    ref_recs = [r for r in recs if lo - ref <= r.step < lo] or [r for r in recs if r.step < 20]
    eval_recs = [r for r in recs if lo <= r.step <= t0 + after]
    scores: dict[str, float] = {}
    for name in {n for r in eval_recs for n in r.signals}:
        ref_vals = _logs(r.signals.get(name, math.nan) for r in ref_recs)
        vals = [r.signals[name] for r in eval_recs if name in r.signals]
        if not vals:
            continue
        nonfinite = any(not math.isfinite(v) for v in vals)
        if nonfinite:
            z, falling = math.inf, False
        elif len(ref_vals) < 3:
            continue
        else:
            med = float(np.median(ref_vals))
            mad = 1.4826 * float(np.median(np.abs(ref_vals - med))) + 1e-3
            zs = (_logs(vals) - med) / mad
            if len(zs) == 0:
                continue
            i = int(np.argmax(np.abs(zs)))
            z, falling = abs(float(zs[i])), bool(zs[i] < 0)
        cause = _cause_of(name, falling, nonfinite)
        if cause is not None and z > scores.get(cause, -1.0):
            scores[cause] = z
    return tuple(sorted(scores, key=lambda c: -scores[c]))


def _logs(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    return np.log(np.maximum(np.abs(arr), 1e-30))
