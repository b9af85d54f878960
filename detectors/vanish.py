"""Vanishing gradients: global or per-layer gradient norms collapsing, or updates that no longer move a layer.

Rules, per rank (log space; a series is only judged on the records that carry it, so a per-layer signal sampled
every ``stats_every`` steps works too):

* **Collapse against its own history**: ``grad_norm`` or ``grad_norm/<module>`` at least ``factor`` (100x) below
  the median of its last ``window`` (64) accepted values (at least ``min_points``, 16), for ``persist`` (5)
  consecutive records. Low points are not accepted, so the reference stays at the pre-collapse level; after
  ``rebaseline`` records at the new level it becomes the reference (a new regime, reported once).
* **Collapse against the other layers**: a layer's ``grad_norm/<module>`` at least ``layer_factor`` (1e4x) below
  the median over all layers of that record, for ``persist`` records (dead layers from a bad initialisation are
  low from the start and have no history to fall from).
* **Frozen updates**: ``update_ratio/<module>`` below ``min_update_ratio`` (1e-6) for ``persist`` records while the
  LR is above ``lr_floor`` (1%) of its peak (a decayed LR legitimately stops the updates).

A module whose gradient norm or update ratio is exactly 0 took no part in the step (an MoE expert that got no
tokens, a frozen or unused branch): that record is skipped for it, since vanishing is a gradient that is small,
not absent. Each rule gives a ``grad_vanishing`` WARNING naming the layer.

Calibration: the clean llm.c baseline (the only one with a grad norm) falls 57x from step 0 (15.4) to its median
0.27, and never 100x below its trailing median; per-layer norms of healthy transformers stay within ~10^2 of each
other. Defaults are set for **0 false alarms per 10k steps** on the clean baselines (measured: 0 over ~61k steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._modules import VECTOR_MIN, Rings, Schema, SizeSwitch, layout, log_list, row_median
from stability.detectors._stats import median, safe_exp
from stability.detectors._vanish_scalar import ScalarVanishing, one_per_rule
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord, split_signal

__all__ = ["VanishConfig", "GradVanishingDetector"]

_TINY = 1e-30


@dataclass(frozen=True, slots=True, kw_only=True)
class VanishConfig:
    """Settings of :class:`GradVanishingDetector`."""

    window: int = 64
    min_points: int = 16
    factor: float = 100.0
    layer_factor: float = 1e4
    min_layers: int = 4
    persist: int = 5
    rebaseline: int = 200
    min_update_ratio: float = 1e-6
    lr_floor: float = 0.01
    max_series: int = 512


_HISTORY, _FROZEN, _LAYERS = 0, 1, 2
"""Kinds of a series key: a gradient norm against its own history, ``<name>#frozen``, ``<name>#layers``."""
_MARGIN = 1e-9
"""Slack (log units) under the layer threshold within which a value is decided with ``math.exp`` (as before)."""


class _Plan:
    """This detector's view of one signal layout (positions in record order, sorted by name as the rules run)."""

    __slots__ = ("by_row", "grad_is_module", "grad_keys", "grad_names", "grad_pos", "layer_keys", "order",
                 "ur_keys", "ur_names", "ur_pos")

    def __init__(self, schema: Schema, keys: dict[str, int]) -> None:
        grads = sorted((schema.names[i], i) for i in schema.by_quantity.get("grad_norm", ()))
        urs = sorted((schema.names[i], i) for i in schema.by_quantity.get("update_ratio", ())
                     if schema.modules[i] is not None)
        self.grad_names = [n for n, _ in grads]
        self.grad_pos = np.array([i for _, i in grads], dtype=np.int64)
        self.grad_is_module = np.array([schema.modules[i] is not None for _, i in grads], dtype=bool)
        self.ur_names = [n for n, _ in urs]
        self.ur_pos = np.array([i for _, i in urs], dtype=np.int64)
        self.grad_keys = np.array([keys.get(n, -1) for n in self.grad_names], dtype=np.int64)
        self.ur_keys = np.array([keys.get(n + "#frozen", -1) for n in self.ur_names], dtype=np.int64)
        self.layer_keys = np.array([keys.get(n + "#layers", -1) for n in self.grad_names], dtype=np.int64)
        self.order = sorted([(n, _HISTORY, k) for k, n in enumerate(self.grad_names)]
                            + [(n, _FROZEN, k) for k, n in enumerate(self.ur_names)])
        """(name, kind, index) of the history and frozen series in name order: the order they are created in."""
        self.by_row: tuple[np.ndarray, np.ndarray, int] | None = None
        """Once every series of the layout has its key: the gradient norms' positions and is-module flags in ring
        row order, and their number (:meth:`_VectorVanishing._fast`)."""


class _VectorVanishing:
    """The vectorised implementation of :class:`GradVanishingDetector` (records with many series).

    Vectorised (issue #14 item 8): the reference windows of the gradient-norm series are rows of one
    :class:`~._modules.Rings` (their medians one sort per record), the run lengths of every rule are arrays, and
    a record's layout is parsed once; findings are built one by one, as before, when a rule fires.
    """

    name = "vanish"
    kind = "grad_vanishing"

    def __init__(self, config: VanishConfig) -> None:
        self.config = config
        self._lr_peak = 0.0
        self._reset()

    def _reset(self) -> None:
        self._rings = Rings(self.config.window)
        self._keys: dict[str, int] = {}
        self._names: list[str] = []
        """Key -> series name (``grad_norm/x``, ``update_ratio/x#frozen``, ``grad_norm/x#layers``), in order."""
        self._row: list[int] = []
        """Key -> its ring row (history series) or -1."""
        self._low = np.zeros(0, dtype=np.int64)
        self._onset = np.zeros(0, dtype=np.int64)
        self._has_onset = np.zeros(0, dtype=bool)
        self._fired = np.zeros(0, dtype=bool)
        self._plans: dict[Schema, _Plan] = {}
        self._calm = True
        """No run under way: every key's run length is 0, without onset, not fired (:meth:`_fast`'s premise)."""
        self._full = False
        """Every ring row holds ``window`` points."""

    def _get(self, name: str, kind: int) -> int:
        """The key of series ``name``, created when new (-1 when ``max_series`` are tracked)."""
        key = self._keys.get(name)
        if key is not None:
            return key
        if len(self._names) >= self.config.max_series:
            return -1
        key = self._keys[name] = len(self._names)
        self._names.append(name)
        self._row.append(self._rings.add_row() if kind == _HISTORY else -1)
        if key >= len(self._low):
            cap = max(16, 2 * key)
            self._low, self._onset = np.resize(self._low, cap), np.resize(self._onset, cap)
            self._has_onset, self._fired = np.resize(self._has_onset, cap), np.resize(self._fired, cap)
        self._low[key], self._onset[key], self._has_onset[key], self._fired[key] = 0, 0, False, False
        return key

    def _plan(self, schema: Schema) -> _Plan:
        plan = self._plans.get(schema)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[schema] = _Plan(schema, self._keys)
        return plan

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        cfg = self.config
        lr = record.get("lr")
        if math.isfinite(lr) and lr > self._lr_peak:
            self._lr_peak = lr
        schema, values = layout(record)
        plan = self._plan(schema)
        if self._calm and self._full and self._fast(record, plan, values, lr):
            return []
        found = self._update(record, plan, values, lr)
        n = len(self._names)
        self._calm = not (self._low[:n].any() or self._has_onset[:n].any() or self._fired[:n].any())
        self._full = bool((self._rings.count[: self._rings.rows] == cfg.window).all())
        return found

    def _fast(self, record: StepRecord, plan: _Plan, values: np.ndarray, lr: float) -> bool:
        """The common record, in a few numpy calls: every series has its key and a full window, no run is under
        way, and every value is usable and clears every rule (no collapse against its history: over the window's
        maximum less ``log(factor)``, which is at least its median less that; no frozen update; no layer
        ``layer_factor`` under the median layer). Pushes the values and returns True; else changes nothing."""
        cfg = self.config
        if plan.by_row is None:
            layers_keyed = int(plan.grad_is_module.sum()) < cfg.min_layers or bool(
                (plan.layer_keys[plan.grad_is_module] >= 0).all())
            if not ((plan.grad_keys >= 0).all() and (plan.ur_keys >= 0).all() and layers_keyed):
                return False
            rows = np.array([self._row[k] for k in plan.grad_keys.tolist()], dtype=np.int64)
            order = np.argsort(rows, kind="stable")
            plan.by_row = (plan.grad_pos[order], plan.grad_is_module[order], int(plan.grad_is_module.sum()))
        pos, is_module, modules = plan.by_row
        if len(pos) != self._rings.rows or not len(pos) or cfg.min_points > cfg.window:
            return False
        grads = values[pos].tolist()  # (Python's min and sum beat numpy reductions on ~40 values)
        if not (min(grads) > 0 and math.isfinite(sum(grads))):  # (a NaN or an infinity makes the sum one)
            return False
        if len(plan.ur_pos):
            ratios = values[plan.ur_pos].tolist()
            lr_ok = not math.isfinite(lr) or self._lr_peak <= 0 or lr >= cfg.lr_floor * self._lr_peak
            least = min(ratios)
            if not (least > 0 and least >= (cfg.min_update_ratio if lr_ok else 0.0) and math.isfinite(sum(ratios))):
                return False
        y = np.array(list(map(math.log, grads)))  # (math.log: as log_list)
        _, ys = self._rings.slab(cfg.window)
        if not bool((y > ys.max(axis=1) - math.log(cfg.factor)).all()):
            return False
        if modules >= cfg.min_layers:
            layers = y[is_module]
            if median(layers) - float(layers.min()) >= math.log(cfg.layer_factor) - _MARGIN:
                return False
        self._rings.push_all(float(record.step), y, full=True)
        return True

    def _update(self, record: StepRecord, plan: _Plan, values: np.ndarray, lr: float) -> list[Finding]:
        """Any record (see :meth:`update`)."""
        cfg = self.config
        gv, uv = values[plan.grad_pos], values[plan.ur_pos]
        g_ok = np.flatnonzero(np.isfinite(gv) & (gv >= 0) & ~((gv == 0.0) & plan.grad_is_module))
        u_ok = np.flatnonzero(np.isfinite(uv) & (uv > 0))
        if (plan.grad_keys[g_ok] < 0).any() or (plan.ur_keys[u_ok] < 0).any():
            self._create(plan, set(g_ok.tolist()), set(u_ok.tolist()))
        g_keys, u_keys = plan.grad_keys[g_ok], plan.ur_keys[u_ok]
        y = log_list(np.maximum(gv[g_ok], _TINY))
        found: list[tuple[str, Finding]] = []
        tracked = g_keys >= 0
        found += self._history_rule(record, plan, g_ok[tracked], g_keys[tracked], y[tracked])
        if len(u_ok):
            lr_ok = not math.isfinite(lr) or self._lr_peak <= 0 or lr >= cfg.lr_floor * self._lr_peak
            uvals = uv[u_ok]
            low = (uvals < cfg.min_update_ratio) & lr_ok
            keep = u_keys >= 0
            for k, key in self._persist(u_keys[keep], low[keep], record.step):
                name, value = plan.ur_names[int(u_ok[keep][k])], float(uvals[keep][k])
                found.append((name, self._finding(
                    record, name, int(self._onset[key]), value,
                    f"{name} = {value:.3g} < {cfg.min_update_ratio:g}: the layer no longer moves for "
                    f"{int(self._low[key])} records", {"ratio": value})))
        out = one_per_rule([f for _, f in sorted(found, key=lambda item: item[0])])
        modules = plan.grad_is_module[g_ok]
        if int(modules.sum()) >= cfg.min_layers:
            out += self._layer_rule(record, plan, g_ok[modules], y[modules])
        return one_per_rule(out)

    def _create(self, plan: _Plan, grads: set[int], urs: set[int]) -> None:
        """Create the missing series of this record's usable values, in the order the rules meet them."""
        for name, kind, k in plan.order:
            if kind == _HISTORY and k in grads and plan.grad_keys[k] < 0:
                plan.grad_keys[k] = self._get(name, _HISTORY)
            elif kind == _FROZEN and k in urs and plan.ur_keys[k] < 0:
                plan.ur_keys[k] = self._get(name + "#frozen", _FROZEN)

    def _history_rule(self, record: StepRecord, plan: _Plan, idx: np.ndarray, keys: np.ndarray,
                      y: np.ndarray) -> list[tuple[str, Finding]]:
        """Collapse against the series' own history (see the module docstring)."""
        cfg = self.config
        if not len(keys):
            return []
        rings = self._rings
        rows = np.array([self._row[k] for k in keys.tolist()], dtype=np.int64)
        count = rings.count[rows]
        push = count < cfg.min_points
        ref = np.full(len(rows), np.nan)
        judged = np.flatnonzero(~push)
        counts = count[judged]
        for n in ([] if not len(judged) else [int(counts[0])] if counts.min() == counts.max()
                  else np.unique(counts).tolist()):
            sub = judged if counts.min() == counts.max() else judged[counts == n]
            _, ys = rings.slab(int(n))
            ref[sub] = row_median(ys[rows[sub]])
        up = ~push
        up[judged] = y[judged] > ref[judged] - math.log(cfg.factor)
        up &= ~push
        reset = keys[up]
        self._low[reset], self._has_onset[reset], self._fired[reset] = 0, False, False
        down = np.flatnonzero(~push & ~up)
        out: list[tuple[str, Finding]] = []
        step = record.step
        for i in down.tolist():
            key = int(keys[i])
            self._low[key] += 1
            if not self._has_onset[key]:
                self._onset[key], self._has_onset[key] = step, True
            if self._low[key] >= cfg.rebaseline:
                rings.clear(int(rows[i]))
                push[i] = True
                self._low[key], self._has_onset[key] = 0, False
                continue
            if self._low[key] < cfg.persist or self._fired[key]:
                continue
            self._fired[key] = True
            name = plan.grad_names[int(idx[i])]
            r, yi = float(ref[i]), float(y[i])
            factor = safe_exp(r - yi)
            where = "the global gradient norm" if "/" not in name else f"layer {split_signal(name)[1]}"
            out.append((name, self._finding(
                record, name, int(self._onset[key]), safe_exp(yi),
                f"{name} collapsed {factor:.3g}x below its recent median {safe_exp(r):.3g} for "
                f"{int(self._low[key])} records ({where})", {"factor": factor, "baseline": safe_exp(r)})))
        push |= up
        order = np.flatnonzero(push)
        order = order[np.argsort(rows[order], kind="stable")]
        rings.push(rows[order], float(step), y[order])
        return out

    def _persist(self, keys: np.ndarray, low: np.ndarray, step: int) -> list[tuple[int, int]]:
        """Advance the run lengths of ``keys`` (``low``: below the rule's threshold this record); the (index, key)
        of those that reach ``persist`` records and have not fired yet (now marked fired)."""
        high = keys[~low]
        self._low[high], self._has_onset[high], self._fired[high] = 0, False, False
        if not low.any():
            return []
        fire: list[tuple[int, int]] = []
        for i in np.flatnonzero(low).tolist():
            key = int(keys[i])
            self._low[key] += 1
            if not self._has_onset[key]:
                self._onset[key], self._has_onset[key] = step, True
            if self._low[key] >= self.config.persist and not self._fired[key]:
                self._fired[key] = True
                fire.append((i, key))
        return fire

    def _layer_rule(self, record: StepRecord, plan: _Plan, idx: np.ndarray, y: np.ndarray) -> list[Finding]:
        """Collapse against the median layer of this record (see the module docstring)."""
        cfg = self.config
        keys = plan.layer_keys[idx]
        for i in np.flatnonzero(keys < 0).tolist():
            keys[i] = plan.layer_keys[idx[i]] = self._get(plan.grad_names[int(idx[i])] + "#layers", _LAYERS)
        middle = median(y)
        d = middle - y
        low = d >= math.log(cfg.layer_factor) - _MARGIN
        for i in np.flatnonzero(low).tolist():
            low[i] = safe_exp(float(d[i])) >= cfg.layer_factor
        keep = keys >= 0
        out = []
        for k, key in self._persist(keys[keep], low[keep], record.step):
            i = int(np.flatnonzero(keep)[k])
            name, yi = plan.grad_names[int(idx[i])], float(y[i])
            below = safe_exp(middle - yi)
            out.append(self._finding(record, name, int(self._onset[key]), safe_exp(yi),
                                     f"{name} is {below:.3g}x below the median layer ({safe_exp(middle):.3g}) "
                                     f"for {int(self._low[key])} records", {"factor": below}))
        return out

    def _finding(self, record: StepRecord, signal: str, onset: int, value: float, message: str,
                 evidence: dict[str, float]) -> Finding:
        return Finding(kind=self.kind, step=record.step, onset=onset, severity=Severity.WARNING, signal=signal,
                       value=value, message=message, detector=self.name, rank=record.rank, host=record.host,
                       score=evidence.get("factor", 1.0), evidence=evidence)

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (the per-series format of the per-value implementation)."""
        empty: dict[str, Any] = {"x": [], "y": []}
        return {"series": {name: {"win": self._rings.row_state(self._row[k]) if self._row[k] >= 0 else dict(empty),
                                  "low": int(self._low[k]),
                                  "low_onset": int(self._onset[k]) if self._has_onset[k] else None,
                                  "fired": bool(self._fired[k])}
                           for k, name in enumerate(self._names)}, "lr_peak": self._lr_peak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._reset()
        for name, st in state["series"].items():
            kind = _FROZEN if name.endswith("#frozen") else _LAYERS if name.endswith("#layers") else _HISTORY
            key = self._get(str(name), kind)
            if key < 0:
                break
            if kind == _HISTORY:
                self._rings.load_row(self._row[key], st["win"])
            self._low[key], self._fired[key] = int(st["low"]), bool(st["fired"])
            onset = st["low_onset"]
            self._has_onset[key] = onset is not None
            self._onset[key] = 0 if onset is None else int(onset)
        self._lr_peak = float(state["lr_peak"])
        n = len(self._names)
        self._calm = not (self._low[:n].any() or self._has_onset[:n].any() or self._fired[:n].any())
        self._full = bool((self._rings.count[: self._rings.rows] == self.config.window).all())


class GradVanishingDetector(SizeSwitch):
    """Streaming vanishing-gradient detector for one rank (see the module docstring).

    Records with at least :data:`~._modules.VECTOR_MIN` gradient-norm / update-ratio series go through the
    vectorised rules, records with fewer through the per-value loop (:mod:`~._vanish_scalar`, cheaper for a
    handful); the detector moves its state from one to the other (same format) when a record's layout crosses
    that size, which changes no decision.
    """

    name = "vanish"
    kind = "grad_vanishing"

    def __init__(self, config: VanishConfig | None = None) -> None:
        self.config = config or VanishConfig()
        super().__init__()

    def _make(self, wide: bool) -> _VectorVanishing | ScalarVanishing:
        return _VectorVanishing(self.config) if wide else ScalarVanishing(self.config)

    def _wide(self, schema: Schema) -> bool | None:
        n = len(schema.by_quantity.get("grad_norm", ())) + len(schema.by_quantity.get("update_ratio", ()))
        return None if n == 0 else n >= VECTOR_MIN
