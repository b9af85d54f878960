"""Realistic synthetic step records for the load generator and the worker profile (``bench/loadgen.py``).

A record looks like what :class:`stability.hooks.capture.Capture` produces for a small GPT with Adam: the global
signals of every step (``loss``, ``lr``, ``grad_norm``, ``nonfinite_grads``, ``micro_batches``, ``tokens``) and,
per module of a transformer-shaped module list (embeddings, per block ``attn.c_attn``, ``attn.c_proj``,
``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``, ``lm_head``), ``grad_norm/<module>`` every step plus ``param_norm``,
``update_ratio``, ``adam_v_ratio`` and ``act_absmax`` every ``stats_every`` steps (1 = every record, the worst case
the throughput targets are set for: ~200 signals per record with 40 modules).

Values follow a warm-up + cosine LR, a decaying loss, per-module gradient levels with log-normal noise, slowly
growing parameter norms and update ratios proportional to the LR, so every detector keeps real baselines and
judges every value. Anomalies are injected on request (:meth:`RecordFactory.record`, ``anomaly=``):

* ``"nan"``: a non-finite loss and global grad norm on that record (the NaN detector alerts at that step: the
  latency probe);
* ``"layer_grad"``: one module's gradient norm 200x up for one record (per-layer jump, confirmed next record);
* ``"spike"``: the loss 4x up for one record (loss-spike detector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stability.records import StepRecord

__all__ = ["QUANTITIES", "RecordFactory", "module_names"]

QUANTITIES = ("param_norm", "update_ratio", "adam_v_ratio", "act_absmax")
"""Per-module quantities of a stats step (``grad_norm/<module>`` is on every step)."""

GLOBALS = ("loss", "lr", "grad_norm", "nonfinite_grads", "micro_batches", "tokens")


def module_names(modules: int) -> list[str]:
    """``modules`` names shaped like a nanoGPT module list (at least 4)."""
    names = ["transformer.wte", "transformer.wpe"]
    block = 0
    while len(names) < modules - 2:
        names += [f"transformer.h.{block}.{part}" for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
        block += 1
    names = names[: max(modules - 2, 2)]
    return [*names, "transformer.ln_f", "lm_head"][:modules]


@dataclass
class RecordFactory:
    """Makes the records of one simulated rank (deterministic per ``seed``)."""

    run_id: str
    rank: int
    modules: int = 40
    stats_every: int = 1
    warmup: int = 100
    total_steps: int = 100_000
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng([self.seed, self.rank])
        self._names = module_names(self.modules)
        self._grad_level = np.exp(self._rng.normal(-1.0, 0.8, len(self._names)))
        self._param_level = np.exp(self._rng.normal(3.0, 0.5, len(self._names)))
        self._grad_keys = [f"grad_norm/{m}" for m in self._names]
        self._stat_keys = {q: [f"{q}/{m}" for m in self._names] for q in QUANTITIES}

    @property
    def signal_count(self) -> int:
        """Signals of a stats step."""
        return len(GLOBALS) + len(self._names) * (1 + len(QUANTITIES))

    def lr(self, step: int) -> float:
        """Warm-up then cosine decay to 10 % of the peak."""
        peak = 3e-4
        if step < self.warmup:
            return peak * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))

    def record(self, step: int, wall_time: float, anomaly: str | None = None) -> StepRecord:
        """The record of ``step`` (with ``anomaly`` injected: ``nan``, ``layer_grad``, ``spike`` or None)."""
        rng = self._rng
        lr = self.lr(step)
        loss = 2.5 + 3.0 / math.sqrt(1.0 + step / 50.0) + float(rng.normal(0.0, 0.02))
        decay = 1.0 / math.sqrt(1.0 + step / 500.0)
        grads = self._grad_level * decay * np.exp(rng.normal(0.0, 0.12, len(self._names)))
        if anomaly == "layer_grad":
            grads[len(grads) // 2] *= 200.0
        global_grad = float(np.sqrt(np.sum(grads * grads)))
        if anomaly == "spike":
            loss *= 4.0
        if anomaly == "nan":
            loss, global_grad = math.nan, math.inf
        signals: dict[str, float] = {"loss": loss, "lr": lr, "grad_norm": global_grad, "nonfinite_grads": 0.0,
                                     "micro_batches": 1.0, "tokens": 8192.0}
        signals.update(zip(self._grad_keys, grads.tolist(), strict=True))
        if self.stats_every and step % self.stats_every == 0:
            n = len(self._names)
            params = self._param_level * (1.0 + 1e-5 * step)
            values = {
                "param_norm": params,
                "update_ratio": lr * 3.0 * np.exp(rng.normal(0.0, 0.1, n)),
                "adam_v_ratio": np.exp(rng.normal(0.0, 0.15, n)),
                "act_absmax": 8.0 * np.exp(rng.normal(0.0, 0.05, n)),
            }
            for quantity, array in values.items():
                signals.update(zip(self._stat_keys[quantity], array.tolist(), strict=True))
        return StepRecord(run_id=self.run_id, step=step, rank=self.rank, wall_time=wall_time,
                          host=f"node{self.rank // 8:04d}", coords={"dp": self.rank}, signals=signals)
