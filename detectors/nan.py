"""NaN / Inf detector: a non-finite loss, gradient norm or per-module statistic is an error at once."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from stability.detectors._modules import layout
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["FORWARD_QUANTITIES", "NanConfig", "NanDetector"]

_CHECKED_GLOBALS = ("loss", "grad_norm", "logit_z", "batch_loss_max")

_BACKWARD = frozenset({"grad_norm", "adam_v_ratio", "update_ratio", "nonfinite_grads"})
"""Gradient-side quantities: non-finite on a step the fp16 loss scaler skipped is the scaler doing its job (an
overflow, handled); bursts of those are the loss-scale detector's business."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NanConfig:
    """Settings of :class:`NanDetector`."""

    rearm_steps: int = 20
    """Report once per incident: re-arm after this many consecutive finite records."""


class NanDetector:
    """Fires ``nan`` (ERROR, delay 0) on the first non-finite signal of an incident.

    Checked: ``loss``, ``grad_norm``, ``logit_z``, ``batch_loss_max``, every per-module signal (``<q>/<module>``)
    and ``nonfinite_grads > 0``; on a record with ``skipped > 0`` (the fp16 scaler skipped the step) non-finite
    gradient-side signals are an overflow the scaler handled, not a NaN event. The finding names the first
    non-finite per-module signal when there is one (it names the module; see :func:`signal_order`), else the first
    global one.
    """

    name = "nan"

    def __init__(self, config: NanConfig | None = None) -> None:
        self.config = config or NanConfig()
        self._armed = True
        self._finite_run = 0

    def update(self, record: StepRecord) -> list[Finding]:
        """Check one record."""
        culprit = _first_nonfinite(record)
        if culprit is None:
            self._finite_run += 1
            if self._finite_run >= self.config.rearm_steps:
                self._armed = True
            return []
        self._finite_run = 0
        if not self._armed:
            return []
        self._armed = False
        name, value = culprit
        loss = record.get("loss")
        message = f"{name} is {value} at step {record.step}"
        if name != "loss" and not math.isfinite(loss):
            message += f" (loss {loss})"
        followed = sum(1 for n, v in record.signals.items() if n.startswith("grad_norm/") and not math.isfinite(v))
        if name == "loss" and followed:
            message += (f"; the gradients of {followed} module(s) followed: the non-finite value came out of the "
                        "forward pass or the loss (no activation statistics on this step name the module)")
        return [
            Finding(
                kind="nan",
                step=record.step,
                onset=record.step,
                severity=Severity.ERROR,
                signal=name,
                value=value,
                message=message,
                detector=self.name,
                rank=record.rank,
                end=None,
                score=1.0,
                evidence={name: value, "loss": loss},
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"armed": self._armed, "finite_run": self._finite_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._armed = bool(state["armed"])
        self._finite_run = int(state["finite_run"])


def _first_nonfinite(record: StepRecord) -> tuple[str, float] | None:
    """The first non-finite checked signal, chosen independently of the order of the record's signals.

    Per-module signals come first (they name a module), ordered by :func:`signal_order` (the order in which a NaN
    reaches them within a step); with a non-finite loss only forward ones (activations, attention logits): the
    gradients of a non-finite loss are, whatever module it came from.
    Otherwise the first non-finite global signal in :data:`_CHECKED_GLOBALS` order, then ``nonfinite_grads > 0``.
    """
    if math.isfinite(layout(record)[1].sum()):  # every signal is finite (a non-finite one makes the sum one)
        count = record.signals.get("nonfinite_grads")
        if count is not None and count > 0 and not record.get("skipped", 0.0) > 0:
            return "nonfinite_grads", count
        return None
    skipped = record.get("skipped", 0.0) > 0
    # a non-finite loss makes the gradients computed from it non-finite: the backward and optimizer sides then say
    # nothing of where the NaN came from (naming the output head's gradient would send the reader to the wrong end
    # of the model). Decided from the non-finite signals alone: the fast post-mortem drops quiet finite columns.
    forward_only = not math.isfinite(record.signals.get("loss", 0.0))
    modules = [name for name, value in record.signals.items() if "/" in name and not math.isfinite(value)
               and not (skipped and name.partition("/")[0] in _BACKWARD)
               and not (forward_only and _PHASES.get(name.partition("/")[0], 3) > 0)]
    if modules:
        name = min(modules, key=signal_order)
        return name, record.signals[name]
    for name in _CHECKED_GLOBALS:
        value = record.signals.get(name)
        if value is not None and not math.isfinite(value) and not (skipped and name in _BACKWARD):
            return name, value
    count = record.signals.get("nonfinite_grads")
    if count is not None and count > 0 and not skipped:
        return "nonfinite_grads", count
    return None


_PHASES = {"act_absmax": 0, "act_rms": 0, "attn_logit_max": 0, "logit_z": 0, "grad_norm": 1, "adam_v_ratio": 2,
           "update_ratio": 2, "param_norm": 2}
"""Where in a step a quantity is computed: forward (0), backward (1), optimizer step (2)."""

FORWARD_QUANTITIES = frozenset(q for q, phase in _PHASES.items() if phase == 0)
"""Quantities of the forward pass: the first non-finite per-module one names where a NaN arose."""

_INPUT_PARTS = frozenset({"wte", "wpe", "tok", "pos", "tok_embeddings", "embed_tokens", "embeddings", "embedding",
                          "word_embeddings", "position_embeddings", "embed_in", "tok_emb", "pos_emb"})
_FINAL_NORM_PARTS = frozenset({"ln_f", "norm_f", "final_norm", "final_layernorm", "norm"})
_HEAD_PARTS = frozenset({"lm_head", "head", "output_layer", "output", "embed_out"})


def module_position(module: str) -> tuple[int, list[tuple[int, int | str]]]:
    """A guess of a module's place from the input (small) to the output (large), from its path alone:
    embeddings first, then numbered blocks in numeric order (``h.2`` before ``h.10``), the final norm, the output
    head last."""
    parts = module.lower().split(".")
    if any(p in _INPUT_PARTS or ("embed" in p and p != "embed_out") for p in parts):
        place = 0
    elif parts[-1] in _HEAD_PARTS or parts[0] in _HEAD_PARTS:
        place = 3
    elif parts[-1] in _FINAL_NORM_PARTS and not any(c.isdigit() for c in module):
        place = 2
    else:
        place = 1
    natural: list[tuple[int, int | str]] = [(0, int(c)) if c.isdigit() else (1, c)
                                            for c in re.split(r"(\d+)", module) if c]
    return place, natural


def signal_order(name: str) -> tuple[int, Any, str]:
    """Sort key of a per-module signal: the order in which a NaN would reach it within one step.

    Forward quantities first, from the input to the output; then gradients, from the output back to the input
    (the backward pass starts at the loss); then optimizer quantities. Deterministic whatever the column order
    of the source (the Parquet archive sorts its columns; the live record does not).
    """
    quantity, _, module = name.partition("/")
    phase = _PHASES.get(quantity, 3)
    place, natural = module_position(module)
    if phase == 1:  # backward: output first
        key: Any = (-place, _Reversed(natural))
    else:
        key = (place, natural)
    return phase, key, name


class _Reversed:
    """Inverts the order of a comparable value (descending sort inside an ascending key)."""

    __slots__ = ("value",)

    def __init__(self, value: list[tuple[int, int | str]]) -> None:
        self.value = value

    def __lt__(self, other: _Reversed) -> bool:
        return other.value < self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Reversed) and other.value == self.value

    def __hash__(self) -> int:
        return hash(repr(self.value))
