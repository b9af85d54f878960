"""Per-layer anomalies: update ratios or layer gradients that jump, and Adam's second moment lagging the gradient.

**Per-layer jumps** (:class:`LayerJumpDetector`; two instances per rank: update ratios, kind ``update_ratio_jump``,
and per-layer gradient norms, kind ``grad_explosion`` with ``factor`` 20, :data:`LAYER_GRAD`). Update-ratio series:
``update_ratio/<module>`` (and a global ``update_ratio`` if a loop reports one), each judged on the records that
carry it (the capture samples them every ``stats_every`` steps). Per series, in log space:

* baseline = a robust line through the last ``window`` (32) accepted values (``_stats.Baseline``, at least
  ``min_points`` = 8);
* a value ``factor`` (10x) or more over it with a robust z of at least ``z_threshold`` (6) is a jump; jumps are not
  accepted into the baseline, so a run of them stays visible;
* no alarm while the LR warms up or before ``warmup_gate`` (2) times the end of the warm-up (updates grow with the
  LR ramp and Adam's early steps).

One WARNING per record (the largest jump; the message counts the other layers that jumped), then that series is
quiet for ``cooldown`` (20) of its records. Per-layer gradient norms (``grad_norm/<module>`` only; the global norm
has :mod:`~stability.detectors.grad`) use the same rule at 20x: a single layer can explode while the global norm,
dominated by larger layers, hardly moves. The cause is ranked like a loss spike's
(``ranking._gradient_rules``): an LR that jumped with it -> ``lr_too_high``; only attention projections ->
``attention_logit_growth``.

**Weights that jump** (kind ``param_jump``, :data:`PARAM_JUMP`): the same rule on ``param_norm/<module>`` at 10x
over 4+ samples: weights changed by more than the optimizer's updates can do (see :data:`PARAM_JUMP`).

**Adam second-moment lag** (:class:`AdamLagDetector`, kind ``adam_v_lag``). ``adam_v_ratio/<module>`` is
``sum(g^2) / sum(v_hat)`` with ``v_hat`` Adam's bias-corrected second moment *before* the step
(``hooks/stats.adam_lag``): about 1 when steady, large when the gradient outgrew what Adam expects, so the update
``~ g / sqrt(v)`` is too large (Wortsman et al. 2023; SPAM clips at ``g^2 / v > 5000`` per element). A module at
``lag`` (20) or more after the warm-up gate is a WARNING when the loss of that record is still normal (below
``loss_ratio`` (1.3) x the median of the last 16 losses): a precursor. When the loss jumped at the same record, the
lag is that batch's doing and the finding is INFO (the loss-spike finding tells the story).

Each module is judged against its own baseline too (its values that raised no alarm): the lag must also be
``tail_factor`` (2) x their peak (a running maximum that halves every ``peak_half_life`` (200) records) and ``own_z``
(6) robust sigmas of their log over their median (the last ``own_window`` (128) of them). A dense layer's ratio stays
near 1 with a small spread, so this changes nothing there; a sparse-gradient module (an ``nn.Embedding`` whose rarely
seen rows have a decayed ``v``) has a heavy-tailed, widely spread ratio by nature and needs far more (the word-level
LSTM false alarm at step 200 of a clean run). While a module has fewer than ``own_min_points`` (8) values, an embedding
by name (:data:`EMBEDDING_MODULE`) is not judged. A sparse-gradient module needs at least ``sparse_lag`` (200): the
first batch of its rare rows after a quiet stretch is a lag of 20-130 that no history foresees. Sparse is measured
first (a ratio of exactly 0, no gradient, on ``sparse_zeros`` (10 %) of its records: an MoE expert no token was
routed to, 0 -> 127 on a clean families-calib MoE run) and else taken from the name (an embedding), as a fallback.

Calibration (evaluation corpus, seeds 0-4, tiny GPT with ``stats_every = 10``, generator v4): after the warm-up gate
clean runs reach an update-ratio jump of 3.2x (z < 7) and an Adam lag of 8.8 at most; LR spikes give update-ratio
jumps of 260-780x, LR ramps ~360x, attention-LR growth 46-90x; bad batches an Adam lag of 29-52 (with the loss 3-4x
up at the same step: INFO), a corrupted data-parallel rank 47 to 1e6 (loss normal: WARNING). Defaults are set for
**0 false alarms per 10k steps** on the clean runs (measured: 0). Per-layer gradient norms: clean runs reach 1.6x (z
>= 6) after the gate, bad batches 6-12x (under 20x: the loss-spike finding names them), corrupted data-parallel
ranks 33-1300x, LR spikes 18-180x. The real baselines carry none of these signals.
"""

from __future__ import annotations

import math
import re
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._adamrows import AdamRows
from stability.detectors._jumprows import Jump, JumpRows, JumpSettings
from stability.detectors._modules import VECTOR_MIN, Schema, schema_of
from stability.detectors._rolling import FastBaseline, level_lower_bound
from stability.detectors._stats import median, pack_floats, safe_exp, unpack_floats
from stability.detectors.base import Finding, Severity
from stability.detectors.history import LrTracker
from stability.records import StepRecord, split_signal

MAX_SERIES = 512
"""Series with an own baseline (per rank)."""

__all__ = ["EMBEDDING_MODULE", "LAYER_GRAD", "PARAM_JUMP", "UPDATE_RATIO", "AdamLagConfig",
           "AdamLagDetector", "LayerJumpConfig", "LayerJumpDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerJumpConfig:
    """Settings of :class:`LayerJumpDetector` (defaults: update-ratio jumps)."""

    quantity: str = "update_ratio"
    kind: str = "update_ratio_jump"
    name: str = "update"
    """Detector name (unique in a rank's suite: the key of its state)."""
    modules_only: bool = False
    """Judge only ``<quantity>/<module>`` series (the global one has its own detector)."""
    window: int = 32
    min_points: int = 8
    factor: float = 10.0
    z_threshold: float = 6.0
    scale_floor: float = 0.05
    warmup_gate: float = 2.0
    cooldown: int = 20
    max_series: int = 512
    per_lr: bool = False
    """Judge ``value / lr`` (update ratios scale with the LR): a jump the logged, on-schedule LR explains (a warm
    restart, a re-warm) is no jump; while the LR is off its schedule the pre-departure LR is the unit, so an
    unexplained LR rise still shows as a jump."""
    confirm: bool = False
    """Wait for the jumped series' next record: still ``>= confirm_ratio`` over its baseline -> WARNING, back
    under it -> INFO with ``evidence["reverted"]`` (a one-step jump that reverted: a bad batch's gradient)."""
    confirm_ratio: float = 2.5
    max_wait: int = 100
    """Steps to wait for that next record; past them the jump is reported unconfirmed (WARNING)."""
    skip_experts: bool = False
    """Leave out the modules of one MoE expert (:data:`EXPERT_MODULE`): an expert's gradient and update follow the
    tokens routed to it, which swing between batches (none on many steps): in the families corpus's clean MoE runs
    its jumps were the commonest false alarm. The global gradient norm, the loss and the router still show an
    expert that blows up; its weights (``param_jump``) are still judged."""


EXPERT_MODULE = re.compile(r"(?:^|\.)(?:(?:experts|local_experts|deepspeed_experts)\.|expert_)\d+(?:\.|$)")
"""A module of one MoE expert: ``experts.3`` (Mixtral's ``block_sparse_moe.experts.3.w1``, GPT-style MoE code),
Megatron-core's ``experts.local_experts.3``, DeepSpeed's ``deepspeed_experts.3``, HF Switch's ``experts.expert_3``.
Grouped-GEMM experts (all experts in one weight, no index) are not one expert's and do not match."""

UPDATE_RATIO = LayerJumpConfig(per_lr=True, skip_experts=True)
"""Per-layer update-ratio jumps, judged per unit of the scheduled LR."""

LAYER_GRAD = LayerJumpConfig(quantity="grad_norm", kind="grad_explosion", name="layer_grad", modules_only=True,
                             factor=20.0, confirm=True, skip_experts=True)
"""Per-layer gradient explosions: a layer's ``grad_norm/<module>`` 20x over its own level (clean corpus: 1.6x)."""

PARAM_JUMP = LayerJumpConfig(quantity="param_norm", kind="param_jump", name="param_jump", modules_only=True,
                             factor=10.0, window=8, min_points=4)
"""A module's weights (``param_norm/<module>``, sampled every ``stats_every`` steps) 10x over their own level: an
optimizer moves a module's norm by ``~ update ratio`` (1e-4-1e-2) a step, so 10x between two samples is a weight
written outside the optimizer (a bit flip in memory, a checkpoint loaded into the wrong module) or an LR that
jumped (``ranking._param_jump_rules``). Weight norms are smooth: a line through the last 8 samples is the baseline
(4 make one), which also keeps the per-rank state small (~6 KB more at 40 modules)."""


class _Series:
    def __init__(self, cfg: LayerJumpConfig) -> None:
        self.base = FastBaseline(window=cfg.window, min_points=cfg.min_points, scale_floor=cfg.scale_floor)
        """``_stats.Baseline``'s robust line, with its points also sorted: a cheap bound of its prediction."""
        self.quiet = 0

    def surely_below(self, x: float, y: float, log_factor: float) -> bool:
        """``y`` is less than ``log_factor`` over the baseline's prediction at ``x``, proven without fitting it
        (:func:`~stability.detectors._rolling.level_lower_bound`); False also when it cannot be proven."""
        return y - level_lower_bound(self.base, x) < log_factor


class LayerJumpDetector:
    """Streaming per-layer jump detector for one rank (see the module docstring).

    Its series live in one of two banks with one state format: per series a ``FastBaseline`` (records with fewer
    than :data:`~._modules.VECTOR_MIN` of its series: a Python loop is cheaper), or matrix rows screened for all
    series at once (:class:`~._jumprows.JumpRows`); a record whose layout crosses that size moves them (no decision
    changes).
    """

    def __init__(self, config: LayerJumpConfig | None = None) -> None:
        self.config = config or UPDATE_RATIO
        self.name = self.config.name
        self.kind = self.config.kind
        self._series: dict[str, _Series] = {}
        """The per-value bank (records with few series; empty while :attr:`_rows` holds the series)."""
        self._rows: JumpRows | None = None
        """The vectorised bank (records with at least :data:`~._modules.VECTOR_MIN` series), or None."""
        self._lr = LrTracker()
        self._pending: dict[str, Any] | None = None
        """A jump waiting for its series' next record (``confirm``): step, rank, host, jumps, levels."""
        self._kept: dict[Schema, list[str]] = {}
        """Layout -> its judged series when experts are left out (:meth:`_names`)."""

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        out = self._judge_pending(record) if self._pending is not None else []
        found = self._jumps(record)
        if found is not None and self.config.confirm and self._pending is None:
            self._pending = found
            return out
        return out + ([] if found is None else [self._finding(found, Severity.WARNING, found["step"])])

    def _judge_pending(self, record: StepRecord) -> list[Finding]:
        """The jumped series' next record: still up -> WARNING; all back -> INFO reverted; none yet -> wait."""
        pending = self._pending
        assert pending is not None
        levels = pending["levels"]
        now = {n: safe_exp(math.log(v) - levels[n]) for n, v in record.signals.items()
               if n in levels and v > 0 and math.isfinite(v)}
        if not now:
            if record.step - pending["step"] <= self.config.max_wait:
                return []
            self._pending = None
            return [self._finding(pending, Severity.WARNING, record.step, unconfirmed=True)]
        self._pending = None
        peak = max(now.values())
        if peak >= self.config.confirm_ratio:
            return [self._finding(pending, Severity.WARNING, record.step, confirm=peak)]
        return [self._finding(pending, Severity.INFO, record.step, confirm=peak)]

    def _finding(self, found: dict[str, Any], severity: Severity, step: int, *, confirm: float | None = None,
                 unconfirmed: bool = False) -> Finding:
        jumps = found["jumps"]
        ratio, name, value, baseline, z = max(tuple(j) for j in jumps)
        message = f"{name} jumped {ratio:.3g}x over its recent level ({baseline:.3g} -> {value:.3g})"
        if len(jumps) > 1:
            message += f"; {len(jumps) - 1} more layers jumped too"
        evidence = {"ratio": ratio, "z": z, "baseline": baseline, "layers": float(len(jumps))}
        end = None
        if confirm is not None:
            evidence["confirm_ratio"] = confirm
            if severity is Severity.INFO:
                evidence["reverted"] = 1.0
                end = found["step"]
                message += f"; back to {confirm:.3g}x at step {step}: a one-step jump that reverted"
            else:
                message += f"; still {confirm:.3g}x at step {step}"
        if unconfirmed:
            evidence["unconfirmed"] = 1.0
        return Finding(kind=self.kind, step=step, onset=found["step"], severity=severity, signal=name,
                       value=value, message=message, detector=self.name, rank=found["rank"], host=found["host"],
                       end=end, score=ratio, evidence=evidence)

    def _jumps(self, record: StepRecord) -> dict[str, Any] | None:
        """This record's jumps, or ``None``."""
        cfg = self.config
        self._lr.update(record.step, record.get("lr"))
        warming = self._lr.in_warmup(record.step, cfg.warmup_gate)
        shift = self._lr_unit(record.get("lr")) if cfg.per_lr else 0.0
        names = self._names(schema_of(record))  # (the record's, in its order)
        if not names:
            return None
        wide = len(names) >= VECTOR_MIN
        if wide != (self._rows is not None):
            self._switch(wide)
        log_factor = math.log(cfg.factor)
        if self._rows is not None:
            jumps, levels = self._rows.judge(record, names, shift, warming, log_factor)
        else:
            jumps, levels = self._judge_each(record, names, shift, warming, log_factor)
        if not jumps:
            return None
        return {"step": record.step, "rank": record.rank, "host": record.host, "jumps": [list(j) for j in jumps],
                "levels": levels}

    def _names(self, schema: Schema) -> list[str]:
        """The series of ``schema`` this detector judges (one list object per layout: the banks key plans on it)."""
        cfg = self.config
        names = schema.series(cfg.quantity, cfg.modules_only)
        if not cfg.skip_experts:
            return names
        kept = self._kept.get(schema)
        if kept is None:
            if len(self._kept) >= 64:
                self._kept.clear()
            kept = self._kept[schema] = [n for n in names if not EXPERT_MODULE.search(n.partition("/")[2])]
        return kept

    def _judge_each(self, record: StepRecord, names: list[str], shift: float, warming: bool,
                    log_factor: float) -> tuple[list[Jump], dict[str, float]]:
        """The per-value bank: each series of the record judged and accepted in turn (record order)."""
        cfg = self.config
        jumps: list[Jump] = []
        levels: dict[str, float] = {}
        signals = record.signals
        for name in names:
            value = signals[name]
            if not (value > 0 and math.isfinite(value)):
                continue
            series = self._series.get(name)
            if series is None:
                if len(self._series) >= cfg.max_series:
                    continue
                series = self._series[name] = _Series(cfg)
            y = math.log(value) - shift
            if len(series.base) < cfg.min_points:
                series.base.accept(record.step, y)
                continue
            if series.surely_below(record.step, y, log_factor):  # the common case: no line fit needed
                series.base.accept(record.step, y)
                series.quiet = max(0, series.quiet - 1)
                continue
            pred = series.base.predict(record.step)
            ratio, z = safe_exp(y - pred.level), pred.z(y)
            if ratio < cfg.factor or z < cfg.z_threshold:
                series.base.accept(record.step, y)
                series.quiet = max(0, series.quiet - 1)
                continue
            if series.quiet == 0 and not warming:
                jumps.append((ratio, name, value, safe_exp(pred.level + shift), z))
                levels[name] = pred.level + shift
            series.quiet = cfg.cooldown
        return jumps, levels

    def _switch(self, wide: bool) -> None:
        """Move the series to the vectorised bank (``wide``) or back to the per-value one (same state)."""
        series = self._series_state()
        self._load_series(series, wide)

    def _series_state(self) -> dict[str, Any]:
        if self._rows is not None:
            return self._rows.state()
        return {n: {"base": s.base.state_dict(), "quiet": s.quiet} for n, s in self._series.items()}

    def _load_series(self, series: dict[str, Any], wide: bool) -> None:
        cfg = self.config
        self._series = {}
        self._rows = None
        if wide:
            self._rows = JumpRows(JumpSettings(window=cfg.window, min_points=cfg.min_points, factor=cfg.factor,
                                               z_threshold=cfg.z_threshold, scale_floor=cfg.scale_floor,
                                               cooldown=cfg.cooldown, max_series=cfg.max_series))
            self._rows.load(series)
            return
        for name, st in series.items():
            s = self._series[name] = _Series(cfg)
            s.base.load_state_dict(st["base"])
            s.quiet = int(st["quiet"])

    def _lr_unit(self, lr: float) -> float:
        """log of the LR that explains this record's step size: the logged LR while it follows its schedule,
        the level it departed from while it rises off it; 0 without a usable LR."""
        if not (math.isfinite(lr) and lr > 0):
            return 0.0
        unit = self._lr.anchor if self._lr.off_since is not None and self._lr.anchor > 0 else lr
        return math.log(unit)

    def finish(self) -> list[Finding]:
        """A jump still waiting for its confirmation is reported unconfirmed (WARNING)."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        return [self._finding(pending, Severity.WARNING, pending["step"], unconfirmed=True)]

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"series": self._series_state(), "lr": self._lr.state_dict(), "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._load_series(state["series"], self._rows is not None)
        self._lr.load_state_dict(state["lr"])
        self._pending = state.get("pending")


EMBEDDING_MODULE = re.compile(r"(^|[._])(wte|wpe|embed\w*|embedding\w*|\w*_emb|emb|encoder|tok\w*)$", re.IGNORECASE)
"""Module names of embedding tables (nanoGPT ``wte``/``wpe``, HF ``embed_tokens``, pytorch/examples
``word_language_model``'s ``encoder``): the fallback for sparse gradients while a module's own history is short."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamLagConfig:
    """Settings of :class:`AdamLagDetector`."""

    lag: float = 20.0
    loss_ratio: float = 1.3
    loss_window: int = 16
    warmup_gate: float = 2.0
    cooldown: int = 20
    own_window: int = 128
    """Records of a module's own ``adam_v_ratio`` kept as its baseline (values that raised no alarm)."""
    own_min_points: int = 8
    tail_factor: float = 2.0
    """A lag must also be this many times the module's own peak (values that raised no alarm) ..."""
    peak_half_life: float = 200.0
    """... a running maximum that halves every this many of the module's records (a tail seen long ago fades)."""
    own_z: float = 6.0
    """... and this many robust sigmas (of its log values) over their median: a module whose ``g^2 / v`` is
    heavy-tailed or widely spread by nature (sparse gradients: embedding rows that rarely get one, whose ``v`` has
    decayed) needs more than a dense layer, whose ratio stays near 1."""
    own_floor: float = 0.1
    sparse_zeros: float = 0.1
    """A module whose ratio is 0 (no gradient at all) on this share of its own records has sparse gradients."""
    sparse_lag: float = 200.0
    """The least lag that alarms on a sparse-gradient module (an embedding by name, :data:`EMBEDDING_MODULE`, or
    an MoE expert that often gets no token): its rows get a gradient only when their tokens occur, so the first
    batch of rare rows after a quiet stretch is a lag of 20-130 by nature, which its own history cannot foresee (a
    corrupted replica's lag reaches 1e3-1e6)."""


class _Ring:
    """The last ``size`` values of a series as float64 (a ``deque(maxlen=size)`` of Python floats held ~4x the
    memory: 128 values per module of thousands of ranks, issue #10)."""

    __slots__ = ("_a", "_head", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._a = array("d")
        self._head = 0

    def __len__(self) -> int:
        return len(self._a)

    def append(self, value: float) -> None:
        """Add a value, dropping the oldest beyond ``size``."""
        if len(self._a) < self.size:
            self._a.append(value)
        else:
            self._a[self._head] = value
            self._head = self._head + 1 if self._head + 1 < self.size else 0

    def array(self) -> np.ndarray:
        """The values (in ring order: the callers' statistics do not depend on the order)."""
        return np.frombuffer(self._a, dtype=np.float64).copy() if len(self._a) else np.zeros(0)

    def ordered(self) -> np.ndarray:
        """The values, oldest first."""
        return np.roll(self.array(), -self._head)


def _lag_threshold(cfg: AdamLagConfig, name: str, own: np.ndarray | None, peak: float) -> float:
    """:meth:`AdamLagDetector._threshold` from the module's own values (any order; None: none yet) and peak."""
    sparse = EMBEDDING_MODULE.search(split_signal(name)[1] or "") is not None
    if own is None or len(own) < cfg.own_min_points:
        return math.inf if sparse else cfg.lag
    positive = own[own > 0]
    sparse = sparse or len(positive) <= (1.0 - cfg.sparse_zeros) * len(own)
    threshold = max(cfg.sparse_lag if sparse else cfg.lag, cfg.tail_factor * peak)
    if len(positive) >= cfg.own_min_points:
        logs = np.log(positive)
        center = median(logs)
        spread = max(1.4826 * median(np.abs(logs - center)), cfg.own_floor)
        threshold = max(threshold, safe_exp(center + cfg.own_z * spread))
    return threshold


class AdamLagDetector:
    """Streaming Adam second-moment lag detector for one rank (see the module docstring).

    The modules' own baselines live in dicts (records with fewer than :data:`~._modules.VECTOR_MIN` series) or in
    matrix rows appended for all series at once (:class:`~._adamrows.AdamRows`); one state format.
    """

    name = "adam_lag"
    kind = "adam_v_lag"

    def __init__(self, config: AdamLagConfig | None = None) -> None:
        self.config = config or AdamLagConfig()
        self._lr = LrTracker()
        self._losses: deque[float] = deque(maxlen=self.config.loss_window)
        self._quiet: dict[str, int] = {}
        self._own: dict[str, _Ring] = {}
        self._peak: dict[str, float] = {}
        """series -> its recent values that raised no alarm (its own baseline), and their decaying peak: the
        per-value bank (empty while :attr:`_rows` holds them)."""
        self._rows: AdamRows | None = None
        """The vectorised bank (records with at least :data:`~._modules.VECTOR_MIN` series), or None."""
        self._rows_ok = True
        """The state can move to the vectorised bank (``peak`` has the keys of ``own``: always, but for a
        hand-made state)."""

    def _threshold(self, name: str) -> float:
        """The lag that alarms on ``name``: ``lag``, or more for a module whose own baseline is heavy-tailed or
        spread (``tail_factor`` x its peak, ``own_z`` robust sigmas of its positive values over their median); at
        least ``sparse_lag`` for a sparse-gradient module (no gradient, a ratio of 0, on ``sparse_zeros`` of its
        records: an MoE expert no token was routed to; or an embedding by name); an embedding whose own history is
        still too short: never."""
        if self._rows is not None:
            return _lag_threshold(self.config, name, self._rows.own(name), self._rows.peak(name))
        ring = self._own.get(name)
        return _lag_threshold(self.config, name, None if ring is None else ring.array(), self._peak.get(name, 0.0))

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        self._lr.update(record.step, record.get("lr"))
        least = min(cfg.lag, cfg.sparse_lag)  # no threshold is lower: a value under it needs none computed
        names = schema_of(record).series("adam_v_ratio")  # (the record's, in its order)
        wide = len(names) >= VECTOR_MIN and self._rows_ok
        if names and wide != (self._rows is not None):
            own, peak = self._bank_state()
            self._load_bank(own, peak, wide)
        if self._rows is None:
            lags = self._judge_each(record, names, least)
        elif (self._quiet and any(self._quiet.values())) or not self._rows.append_all(record, names, least):
            lags = self._rows.judge_each(record, names, self._quiet, cfg.cooldown, least, self._threshold)
        else:
            lags = []
        alarm = bool(lags) and not self._lr.in_warmup(record.step, cfg.warmup_gate)
        loss = record.get("loss")
        typical = median(np.fromiter(self._losses, dtype=np.float64)) if alarm and self._losses else math.nan
        if math.isfinite(loss):
            self._losses.append(loss)
        if not alarm:
            return []
        value, name = max(lags)
        loss_up = math.isfinite(loss) and typical > 0 and loss >= cfg.loss_ratio * typical
        message = (f"{name} = {value:.3g}: the squared gradient is {value:.3g}x Adam's second-moment estimate "
                   "(the update is too large)")
        if len(lags) > 1:
            message += f"; {len(lags) - 1} more layers lag too"
        if loss_up:
            message += f"; the loss jumped {loss / typical:.3g}x at the same step (the batch's gradient)"
        return [Finding(kind=self.kind, step=record.step, onset=record.step,
                        severity=Severity.INFO if loss_up else Severity.WARNING, signal=name, value=value,
                        message=message, detector=self.name, rank=record.rank, host=record.host, score=value,
                        evidence={"lag": value, "layers": float(len(lags))})]

    def _judge_each(self, record: StepRecord, names: list[str], least: float) -> list[tuple[float, str]]:
        """The per-value bank: each series of the record judged and appended in turn (record order)."""
        cfg = self.config
        lags = []
        signals = record.signals
        for name in names:
            value = signals[name]
            if not math.isfinite(value):
                continue
            quiet = self._quiet.get(name, 0)
            threshold = self._threshold(name) if value >= least else math.inf
            if value >= threshold and quiet == 0:
                lags.append((value, name))
            if value >= threshold or quiet:
                self._quiet[name] = cfg.cooldown if value >= threshold else quiet - 1
            if value < threshold and (name in self._own or len(self._own) < MAX_SERIES):
                own = self._own.get(name)
                if own is None:
                    own = self._own[name] = _Ring(cfg.own_window)
                own.append(value)
                self._peak[name] = max(self._peak.get(name, 0.0) * 0.5 ** (1.0 / cfg.peak_half_life), value)
        return lags

    def _bank_state(self) -> tuple[dict[str, Any], dict[str, float]]:
        if self._rows is not None:
            return self._rows.state()
        return {k: pack_floats(v.ordered()) for k, v in self._own.items()}, dict(self._peak)

    def _load_bank(self, own: dict[str, Any], peak: dict[str, Any], wide: bool) -> None:
        """Hold ``own`` and ``peak`` in the vectorised bank (``wide``) or the per-value one."""
        cfg = self.config
        self._rows, self._own, self._peak = None, {}, {}
        self._rows_ok = list(own) == list(peak)
        if wide and self._rows_ok:
            self._rows = AdamRows(cfg.own_window, MAX_SERIES, 0.5 ** (1.0 / cfg.peak_half_life))
            self._rows.load(own, peak)
            return
        for k, v in own.items():  # (float64 bytes, or the former lists)
            ring = self._own[str(k)] = _Ring(cfg.own_window)
            for x in unpack_floats(v).tolist():
                ring.append(x)
        self._peak = {str(k): float(v) for k, v in peak.items()}

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        own, peak = self._bank_state()
        return {"lr": self._lr.state_dict(), "losses": list(self._losses), "quiet": dict(self._quiet),
                "own": own, "peak": peak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._lr.load_state_dict(state["lr"])
        self._losses = deque((float(v) for v in state["losses"]), maxlen=self.config.loss_window)
        self._quiet = {str(k): int(v) for k, v in state["quiet"].items()}
        self._load_bank(state.get("own", {}), state.get("peak", {}), self._rows is not None)
