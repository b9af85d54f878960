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
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._modules import Rings, Schema, layout, line_predict, log_list
from stability.detectors._stats import median, predict_line, safe_exp
from stability.detectors.base import Finding, Severity
from stability.detectors.history import LrTracker
from stability.records import StepRecord, split_signal

MAX_SERIES = 512
"""Series with an own baseline (per rank)."""

_MARGIN = 1e-9
"""Slack (log units) under a threshold within which a value is decided on scalars (``math.exp``, as before)."""

__all__ = ["EMBEDDING_MODULE", "LAYER_GRAD", "UPDATE_RATIO", "AdamLagConfig",
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


UPDATE_RATIO = LayerJumpConfig(per_lr=True)
"""Per-layer update-ratio jumps, judged per unit of the scheduled LR."""

LAYER_GRAD = LayerJumpConfig(quantity="grad_norm", kind="grad_explosion", name="layer_grad", modules_only=True,
                             factor=20.0, confirm=True)
"""Per-layer gradient explosions: a layer's ``grad_norm/<module>`` 20x over its own level (clean corpus: 1.6x)."""


class LayerJumpDetector:
    """Streaming per-layer jump detector for one rank (see the module docstring).

    Vectorised (issue #14 item 8): the windows of all its series are rows of one :class:`~._modules.Rings`, a
    record's values are mapped to rows once per signal layout, and each record's robust lines are fitted for all
    its series at once (:func:`~._modules.line_predict`, bit-identical to ``_stats.predict_line`` per series);
    only the values at or near the jump threshold are decided one by one, with the scalar code's exps.
    """

    def __init__(self, config: LayerJumpConfig | None = None) -> None:
        self.config = config or UPDATE_RATIO
        self.name = self.config.name
        self.kind = self.config.kind
        self._rings = Rings(self.config.window)
        self._names: list[str] = []
        """Row -> series name, in order of creation."""
        self._rows: dict[str, int] = {}
        self._quiet = np.zeros(0, dtype=np.int64)
        self._plans: dict[Schema, tuple[np.ndarray, list[str], np.ndarray]] = {}
        """Signal layout -> (positions of this detector's series, their names, their rows or -1)."""
        self._lr = LrTracker()
        self._pending: dict[str, Any] | None = None
        """A jump waiting for its series' next record (``confirm``): step, rank, host, jumps, levels."""

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
        signals = record.signals
        now = {n: safe_exp(math.log(v) - level) for n, level in levels.items()
               if (v := signals.get(n)) is not None and v > 0 and math.isfinite(v)}
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

    def _plan(self, schema: Schema) -> tuple[np.ndarray, list[str], np.ndarray]:
        """This detector's series in a signal layout: positions, names, rows (-1: no row yet)."""
        plan = self._plans.get(schema)
        if plan is None:
            cfg = self.config
            pos = [i for i in schema.by_quantity.get(cfg.quantity, ())
                   if not (cfg.modules_only and schema.modules[i] is None)]
            names = [schema.names[i] for i in pos]
            rows = np.array([self._rows.get(n, -1) for n in names], dtype=np.int64)
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[schema] = (np.array(pos, dtype=np.int64), names, rows)
        return plan

    def _add_series(self, name: str) -> int:
        """A row for a new series, or -1 when ``max_series`` are tracked."""
        if len(self._names) >= self.config.max_series:
            return -1
        row = self._rows[name] = self._rings.add_row()
        self._names.append(name)
        if len(self._quiet) < len(self._rings.count):
            self._quiet = np.resize(self._quiet, len(self._rings.count))
        self._quiet[row] = 0
        return row

    def _rows_for(self, names: list[str], rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """The rows of the selected series, creating the missing ones in record order (``max_series``); a series
        without a row (over the limit) is left out (-1 filtered by the caller)."""
        for i in sel[rows[sel] < 0].tolist():
            row = self._rows.get(names[i], -1)
            rows[i] = row if row >= 0 else self._add_series(names[i])
        out: np.ndarray = rows[sel]
        return out

    def _jumps(self, record: StepRecord) -> dict[str, Any] | None:
        """This record's jumps, or ``None``."""
        cfg = self.config
        self._lr.update(record.step, record.get("lr"))
        warming = self._lr.in_warmup(record.step, cfg.warmup_gate)
        shift = self._lr_unit(record.get("lr")) if cfg.per_lr else 0.0
        schema, all_values = layout(record)
        pos, names, plan_rows = self._plan(schema)
        if not len(pos):
            return None
        values = all_values[pos]
        sel = np.flatnonzero((values > 0) & np.isfinite(values))
        rows = self._rows_for(names, plan_rows, sel)
        if (rows < 0).any():
            sel, rows = sel[rows >= 0], rows[rows >= 0]
        if not len(sel):
            return None
        y = log_list(values[sel]) - shift
        step = record.step
        count = self._rings.count[rows]
        accept, jumped = self._judge(rows, y, count, step)
        quiet = self._quiet
        ok_rows = rows[accept]
        self._rings.push(ok_rows, float(step), y[accept])
        counted = ok_rows[count[accept] >= cfg.min_points]
        quiet[counted] = np.maximum(quiet[counted] - 1, 0)
        if not jumped:
            return None
        jumps: list[tuple[float, str, float, float, float]] = []
        levels_out: dict[str, float] = {}
        for i, level, z in sorted(jumped):
            row = int(rows[i])
            if quiet[row] == 0 and not warming:
                name = names[int(sel[i])]
                yi = float(y[i])
                jumps.append((safe_exp(yi - level), name, record.signals[name], safe_exp(level + shift), z))
                levels_out[name] = level + shift
            quiet[row] = cfg.cooldown
        if not jumps:
            return None
        return {"step": record.step, "rank": record.rank, "host": record.host, "jumps": [list(j) for j in jumps],
                "levels": levels_out}

    def _judge(self, rows: np.ndarray, y: np.ndarray, count: np.ndarray,
               step: int) -> tuple[np.ndarray, list[tuple[int, float, float]]]:
        """Which values to accept into their baselines, and the (index, predicted level, z) of those that jumped:
        every row's line bound at once, the full fit for the rows the bound does not clear, and a scalar decision
        for the values at the threshold."""
        cfg = self.config
        accept = np.ones(len(rows), dtype=bool)
        judged = np.flatnonzero(count >= cfg.min_points)
        jumped: list[tuple[int, float, float]] = []
        log_factor = math.log(cfg.factor)
        counts = count[judged]
        groups = [] if not len(judged) else [int(counts[0])] if counts.min() == counts.max() else np.unique(
            counts).tolist()
        for n in groups:
            idx = judged if len(groups) == 1 else judged[counts == n]
            xs, ys = self._rings.slab(int(n))
            if not _is_range(rows[idx], self._rings.rows):
                xs, ys = xs[rows[idx]], ys[rows[idx]]
            idx = idx[~self._surely_below(xs, ys, y[idx], float(step), log_factor)]
            if not len(idx):
                continue
            if len(idx) < len(xs):
                xs, ys = self._rings.slab(int(n))
                xs, ys = xs[rows[idx]], ys[rows[idx]]
            levels, scales = self._predict(xs, ys, step)
            d = y[idx] - levels
            with np.errstate(invalid="ignore", divide="ignore"):
                z = d / scales
            near = ~((d < log_factor - _MARGIN) | (z < cfg.z_threshold))
            for k in np.flatnonzero(near).tolist():
                ratio, zk = safe_exp(float(d[k])), float(z[k])
                if not (ratio < cfg.factor or zk < cfg.z_threshold):
                    accept[idx[k]] = False
                    jumped.append((int(idx[k]), float(levels[k]), zk))
        return accept, jumped

    @staticmethod
    def _surely_below(xs: np.ndarray, ys: np.ndarray, y: np.ndarray, x: float, log_factor: float) -> np.ndarray:
        """Per row: ``y`` is less than ``log_factor`` over the robust line's prediction at ``x``, proven without
        fitting it (:func:`~stability.detectors._rolling.level_lower_bound` for all rows at once: the median plus
        the steepest possible fall; x strictly increasing by >= 1 and ``x`` past the window, else not proven)."""
        n = xs.shape[1]
        if n < 2:
            return np.zeros(len(xs), dtype=bool)
        s = np.sort(ys, axis=1)
        bound = (0.5 * (s[:, (n - 1) // 2] + s[:, n // 2]) + (s[:, 0] - s[:, -1]) / (n // 2) * (x - xs[:, 0])) - _MARGIN
        regular = ((xs[:, 1:] - xs[:, :-1]).min(axis=1) >= 1.0) & (x >= xs[:, -1]) & np.isfinite(s[:, -1])
        out: np.ndarray = regular & (y - bound < log_factor)
        return out

    def _predict(self, xs: np.ndarray, ys: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The robust line's level at ``step`` and its scale for each row of the windows ``xs``, ``ys``."""
        cfg = self.config
        if xs.shape[1] >= 2:
            with np.errstate(invalid="ignore", divide="ignore"):
                return line_predict(xs, ys, float(step), cfg.scale_floor)
        preds = [predict_line(xs[k], ys[k], step, min_points=cfg.min_points, scale_floor=cfg.scale_floor)
                 for k in range(len(xs))]
        return np.array([p.level for p in preds]), np.array([p.scale for p in preds])

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
        """Plain-data state (the per-series format of the per-value implementation)."""
        return {"series": {n: {"base": self._rings.row_state(r), "quiet": int(self._quiet[r])}
                           for r, n in enumerate(self._names)},
                "lr": self._lr.state_dict(), "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._rings = Rings(self.config.window)
        self._names, self._rows, self._plans = [], {}, {}
        self._quiet = np.zeros(0, dtype=np.int64)
        for name, st in state["series"].items():
            row = self._add_series(str(name))
            if row < 0:
                break
            self._rings.load_row(row, st["base"]["x"], st["base"]["y"])
            self._quiet[row] = int(st["quiet"])
        self._lr.load_state_dict(state["lr"])
        self._pending = state.get("pending")


def _is_range(rows: np.ndarray, n: int) -> bool:
    """``rows`` is ``0, 1, ..., n - 1`` (a slab of all rows is then already in their order)."""
    return len(rows) == n and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1 and bool((np.diff(rows) == 1).all())))


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


class AdamLagDetector:
    """Streaming Adam second-moment lag detector for one rank (see the module docstring).

    Vectorised (issue #14 item 8): a module's own baseline (its last ``own_window`` values that raised no alarm)
    is a row of one :class:`~._modules.Rings`, peaks and cooldowns are arrays, and a record's ``adam_v_ratio``
    values are compared, counted down and appended with a few numpy operations; a module's threshold is computed
    (from its row, as before) only for a value at or above ``min(lag, sparse_lag)``, which no threshold is under.
    """

    name = "adam_lag"
    kind = "adam_v_lag"

    def __init__(self, config: AdamLagConfig | None = None) -> None:
        self.config = config or AdamLagConfig()
        self._lr = LrTracker()
        self._losses: deque[float] = deque(maxlen=self.config.loss_window)
        self._reset()

    def _reset(self) -> None:
        self._idx: dict[str, int] = {}
        self._names: list[str] = []
        """Index -> series name (every ``adam_v_ratio`` series seen, in order)."""
        self._quiet = np.zeros(0, dtype=np.int64)
        self._in_quiet = np.zeros(0, dtype=bool)
        """The series has a cooldown entry (it alarmed once): kept in the state as the per-value code did."""
        self._row = np.zeros(0, dtype=np.int64)
        """Index -> its row of own values (created with its first value that raised no alarm), or -1."""
        self._peak = np.zeros(0)
        self._rings = Rings(self.config.own_window)
        self._row_names: list[str] = []
        self._plans: dict[Schema, tuple[np.ndarray, list[str], np.ndarray]] = {}

    def _index(self, name: str) -> int:
        idx = self._idx.get(name)
        if idx is None:
            idx = self._idx[name] = len(self._names)
            self._names.append(name)
            if idx >= len(self._quiet):
                cap = max(16, 2 * idx)
                self._quiet, self._in_quiet = np.resize(self._quiet, cap), np.resize(self._in_quiet, cap)
                self._row, self._peak = np.resize(self._row, cap), np.resize(self._peak, cap)
            self._quiet[idx], self._in_quiet[idx], self._row[idx], self._peak[idx] = 0, False, -1, 0.0
        return idx

    def _plan(self, schema: Schema) -> tuple[np.ndarray, list[str], np.ndarray]:
        plan = self._plans.get(schema)
        if plan is None:
            pos = schema.by_quantity.get("adam_v_ratio", [])
            names = [schema.names[i] for i in pos]
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[schema] = (np.array(pos, dtype=np.int64), names,
                                          np.array([self._index(n) for n in names], dtype=np.int64))
        return plan

    def _threshold(self, name: str) -> float:
        """The lag that alarms on ``name``: ``lag``, or more for a module whose own baseline is heavy-tailed or
        spread (``tail_factor`` x its peak, ``own_z`` robust sigmas of its positive values over their median); at
        least ``sparse_lag`` for a sparse-gradient module (no gradient, a ratio of 0, on ``sparse_zeros`` of its
        records: an MoE expert no token was routed to; or an embedding by name); an embedding whose own history is
        still too short: never."""
        cfg = self.config
        idx = self._idx.get(name)
        row = -1 if idx is None else int(self._row[idx])
        sparse = EMBEDDING_MODULE.search(split_signal(name)[1] or "") is not None
        if row < 0 or self._rings.count[row] < cfg.own_min_points:
            return math.inf if sparse else cfg.lag
        values = self._rings.row(row)[1]
        positive = values[values > 0]
        sparse = sparse or len(positive) <= (1.0 - cfg.sparse_zeros) * len(values)
        assert idx is not None
        threshold = max(cfg.sparse_lag if sparse else cfg.lag, cfg.tail_factor * float(self._peak[idx]))
        if len(positive) >= cfg.own_min_points:
            logs = np.log(positive)
            center = median(logs)
            spread = max(1.4826 * median(np.abs(logs - center)), cfg.own_floor)
            threshold = max(threshold, safe_exp(center + cfg.own_z * spread))
        return threshold

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        self._lr.update(record.step, record.get("lr"))
        lags = []
        schema, all_values = layout(record)
        pos, names, plan_idx = self._plan(schema)
        if len(pos):
            lags = self._lags(record, all_values[pos], names, plan_idx)
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

    def _lags(self, record: StepRecord, values: np.ndarray, names: list[str],
              plan_idx: np.ndarray) -> list[tuple[float, str]]:
        """Judge, count down and append this record's values; the (value, name) of the modules that lag."""
        cfg = self.config
        sel = np.flatnonzero(np.isfinite(values))
        v, idx = values[sel], plan_idx[sel]
        threshold = np.full(len(sel), math.inf)
        for k in np.flatnonzero(v >= min(cfg.lag, cfg.sparse_lag)).tolist():
            threshold[k] = self._threshold(names[int(sel[k])])
        hit = v >= threshold
        quiet = self._quiet[idx]
        lags = [(record.signals[names[int(sel[k])]], names[int(sel[k])])
                for k in np.flatnonzero(hit & (quiet == 0)).tolist()]
        self._in_quiet[idx] |= hit | (quiet > 0)
        self._quiet[idx] = np.where(hit, cfg.cooldown, np.where(quiet > 0, quiet - 1, quiet))
        keep = np.flatnonzero(~hit)
        rows = self._row[idx[keep]]
        for k in np.flatnonzero(rows < 0).tolist():
            if len(self._row_names) < MAX_SERIES:
                i = int(idx[keep[k]])
                rows[k] = self._row[i] = self._rings.add_row()
                self._row_names.append(self._names[i])
        if (rows < 0).any():
            keep, rows = keep[rows >= 0], rows[rows >= 0]
        order = np.argsort(rows, kind="stable")
        self._rings.push(rows[order], float(record.step), v[keep][order])
        kept = idx[keep]
        self._peak[kept] = np.maximum(self._peak[kept] * 0.5 ** (1.0 / cfg.peak_half_life), v[keep])
        return lags

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (the per-series format of the per-value implementation)."""
        by_row = {int(self._row[self._idx[n]]): n for n in self._row_names}
        return {"lr": self._lr.state_dict(), "losses": list(self._losses),
                "quiet": {n: int(self._quiet[i]) for i, n in enumerate(self._names) if self._in_quiet[i]},
                "own": {by_row[r]: self._rings.row(r)[1].tolist() for r in range(len(self._row_names))},
                "peak": {n: float(self._peak[self._idx[n]]) for n in self._row_names}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._lr.load_state_dict(state["lr"])
        self._losses = deque((float(v) for v in state["losses"]), maxlen=self.config.loss_window)
        self._reset()
        for name, q in state["quiet"].items():
            i = self._index(str(name))
            self._quiet[i], self._in_quiet[i] = int(q), True
        peaks = state.get("peak", {})
        for name, own in state.get("own", {}).items():
            i = self._index(str(name))
            row = self._row[i] = self._rings.add_row()
            self._row_names.append(str(name))
            self._rings.load_row(row, [0.0] * len(own), own)
            self._peak[i] = float(peaks.get(name, 0.0))
