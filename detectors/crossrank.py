"""Cross-rank disagreement: data-parallel ranks that should agree, and one that does not (suspect hardware).

Engine-level (all ranks of a run): per step it buffers ``grad_norm`` and ``loss`` of every rank, grouped by the
ranks' model-parallel coordinates (ranks with equal ``coords`` apart from ``dp`` / ``world_size`` /
``local_rank`` are data-parallel replicas). A step is decided once every expected rank reported it (expected =
``coords["world_size"]`` when present, else every rank seen so far), or once the newest step seen is ``lag``
(128) steps ahead. Later records of a decided step are ignored. State: at most ``lag + 1`` pending steps.

**Exact agreement** (any replica count >= 2). ``grad_norm`` is computed after the gradient all-reduce, so
replicas that logged it that way agree bit for bit (measured: 0 differences over 200 steps x 4 gloo replicas).
A group whose replicas agreed to ``exact_tol`` (1e-5 relative) on at least ``exact_after`` (8) decided steps, and
differed on at most ``exact_slack`` (5 %) of them, is *exact*: from then on any difference beyond ``exact_tol`` is
by itself proof of a fault (silent data corruption, a bad GPU) -> ERROR at once, kind ``rank_disagreement``. The
suspect is the replica outside the strict majority of agreeing values when there is one (3+ replicas); else (2
replicas, or a split vote) the replica that moved away from its *own* recent history (robust z of its log value
against its last ``own_window`` (32) agreed values): the healthy replica's value continues its history. A group
that differs routinely (a framework that logs each rank's pre-reduce norm) never becomes exact and keeps the
statistical rule below, with the spread of their norms floored at ``loss_floor`` like the losses' and a ratio of
``pre_reduce_ratio`` (3x).

Statistical rules for a step with at least ``min_ranks`` (3) reporting replicas (2 suffice for a non-finite value):

* ``grad_norm`` is computed after the gradient all-reduce, so replicas agree exactly. One rank whose value is
  non-finite while the others are finite, or >= ``ratio`` (1.5x) away from the median of the others with a robust
  z >= ``z_threshold`` (6; scale = MAD across ranks, floored at ``grad_floor``, 1e-3 in log) -> ERROR at once.
* ``loss`` differs between replicas (different data) but only by noise: the same test with a scale floored at
  ``loss_floor`` (0.05 in log) or at the replicas' usual spread (90th percentile over the last ``spread_window``
  (64) decided steps) when larger, and the rank must disagree on ``persist`` (2) of the last 3 decided steps (a bad
  batch on one rank is a one-step event, not a faulty GPU). A non-finite loss on one rank only -> ERROR at once.

Records of sharded parameters (coordinate ``sharded`` = 1: FSDP2, ``DTensor``) carry each rank's norm of its own
shard, which differs across ranks by design: only their losses are compared.

The finding (kind ``rank_disagreement``) is on the faulty rank and names it and its host (``StepRecord.host``).
One finding per rank until it agrees again for ``rearm`` (20) decided steps.

Calibration: exact agreement of post-reduce grad norms means a healthy run has no disagreement at all (set for
**0 false alarms per 10k steps**); the clean real baselines are single-rank logs and raise nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._stats import safe_exp
from stability.detectors.base import Finding, Severity
from stability.records import SHARDED, StepRecord

__all__ = ["CrossRankConfig", "CrossRankDetector"]

_NOT_GROUP = frozenset({"dp", "world_size", "local_rank"})


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossRankConfig:
    """Settings of :class:`CrossRankDetector`."""

    lag: int = 128
    min_ranks: int = 3
    ratio: float = 1.5
    z_threshold: float = 6.0
    grad_floor: float = 1e-3
    loss_floor: float = 0.05
    persist: int = 2
    rearm: int = 20
    exact_tol: float = 1e-5
    exact_after: int = 8
    exact_slack: float = 0.05
    spread_window: int = 64
    spread_quantile: float = 0.9
    """The loss rule's scale is at least this quantile of the replicas' recent spreads (per-batch losses are
    heavy-tailed: most steps the replicas are close, now and then one batch is far easier or harder)."""
    pre_reduce_ratio: float = 3.0
    """Replicas whose norms routinely differ (logged before the all-reduce: each rank's own data) single one out
    only this far from the others (3x: over 7 sigmas of a 0.15 log spread between ranks' batches)."""
    own_window: int = 32
    own_floor: float = 0.05
    """Floor of the own-history scale (log): a replica must move >= 6 x 5 % away from its history to be singled
    out by it alone (the other one then is closer still)."""


class CrossRankDetector:
    """Compares data-parallel ranks step by step (see the module docstring)."""

    name = "crossrank"
    kind = "rank_disagreement"

    def __init__(self, config: CrossRankConfig | None = None) -> None:
        self.config = config or CrossRankConfig()
        self._pending: dict[int, dict[int, list[float | None]]] = {}
        """step -> rank -> [loss, grad_norm]."""
        self._hosts: dict[int, str] = {}
        self._groups: dict[int, str] = {}
        self._world = 0
        self._newest = -1
        self._decided = -1
        """Every step <= this one is decided."""
        self._loss_flags: dict[int, deque[int]] = {}
        self._quiet: dict[int, int] = {}
        """rank -> decided steps since its last disagreement (absent = armed)."""
        self._just_decided: dict[int, Finding] = {}
        """Disagreements decided by the current :meth:`update` call (transient, for :meth:`suspect`)."""
        self._own: dict[int, deque[float]] = {}
        """rank -> its last ``own_window`` log grad norms that agreed with its replicas."""
        self._loss_spread: dict[str, deque[float]] = {}
        """group -> robust spread of the replicas' log losses on recent decided steps."""
        self._agreement: dict[str, list[int]] = {}
        """group -> [steps its replicas agreed exactly, steps they differed]."""

    def update(self, record: StepRecord) -> list[Finding]:
        """Buffer one record; return the findings of the steps this record lets us decide."""
        rank = record.rank
        self._just_decided = {}
        self._hosts[rank] = record.host or self._hosts.get(rank, "")
        self._groups[rank] = ",".join(f"{k}={v}" for k, v in sorted(record.coords.items()) if k not in _NOT_GROUP)
        self._world = max(self._world, int(record.coords.get("world_size", 0)))
        if record.step <= self._decided:
            return []
        grad = None if record.coords.get(SHARDED) else _value(record, "grad_norm")  # each rank's own shard's norm
        self._pending.setdefault(record.step, {})[rank] = [_value(record, "loss"), grad]
        self._newest = max(self._newest, record.step)
        out: list[Finding] = []
        expected = max(self._world, len(self._hosts))
        while self._pending:
            step = min(self._pending)
            if len(self._pending[step]) < expected and step > self._newest - self.config.lag:
                break
            out += self._decide(step, self._pending.pop(step))
            self._decided = step
        return out

    def suspect(self, rank: int, step: int) -> Finding | None:
        """Provisional verdict on ``rank`` at ``step``, for ranking a finding of that rank's own detectors.

        From the replicas that reported the step so far (or the step just decided): ``rank``'s post-reduce
        ``grad_norm`` is non-finite or >= ``ratio`` away from the others, which agree with each other. Since the
        caller's finding says this rank's own series jumped, one other replica is enough to tell which side is
        off. Returns a ``rank_disagreement`` finding that is not alerted (the decision comes once the step is
        complete); it lets the first alert of a faulty rank already name ``hardware_fault``.
        """
        if rank in self._just_decided and self._just_decided[rank].step == step:
            return self._just_decided[rank]
        values = self._pending.get(step)
        own = None if values is None or rank not in values else values[rank][1]
        if values is None or own is None:
            return None
        group = self._groups.get(rank, "")
        others = [v for r, (_, v) in values.items()
                  if r != rank and v is not None and self._groups.get(r, "") == group]
        finite = [v for v in others if math.isfinite(v)]
        if not others or len(finite) < len(others) or max(finite) > min(finite) * self.config.ratio:
            return None
        mine, middle = own, float(np.median(finite))
        if math.isfinite(mine) and max(mine, middle) < self.config.ratio * min(mine, middle):
            return None
        return self._finding(step, rank, "grad_norm", mine, middle, math.inf, len(others) + 1)

    @property
    def decided(self) -> int:
        """Every step up to this one is decided (-1: none yet)."""
        return self._decided

    def verdicts(self) -> list[Finding]:
        """The disagreements decided by the last :meth:`update` / :meth:`finish` call, alerted or not (a rank's
        repeat within ``rearm`` is not alerted but is still that step's verdict); for a sharded run's shards."""
        return list(self._just_decided.values())

    def reset(self, step: int) -> None:
        """A rank went back to ``step`` (a resume): forget pending steps and accept steps >= ``step`` again."""
        self._pending = {}
        self._decided = step - 1
        self._newest = step - 1

    def finish(self) -> list[Finding]:
        """Decide every pending step with the ranks that reported it."""
        self._just_decided = {}
        out: list[Finding] = []
        for step in sorted(self._pending):
            out += self._decide(step, self._pending.pop(step))
            self._decided = step
        return out

    def _decide(self, step: int, values: dict[int, list[float | None]]) -> list[Finding]:
        out: list[Finding] = []
        suspects = self._suspects(values) if len(values) > 1 else self._lone(values)
        for rank in values:
            flags = self._loss_flags.setdefault(rank, deque(maxlen=3))
            suspect = suspects.get(rank)
            flags.append(1 if suspect is not None and suspect[0] == "loss" and not suspect[4] else 0)
            if suspect is None:
                if rank in self._quiet:
                    self._quiet[rank] += 1
                    if self._quiet[rank] >= self.config.rearm:
                        del self._quiet[rank]
                continue
            signal, value, other, z, nonfinite = suspect
            if signal == "loss" and not nonfinite and sum(flags) < self.config.persist:
                continue
            armed = rank not in self._quiet
            self._quiet[rank] = 0
            finding = self._finding(step, rank, signal, value, other, z, len(values))
            self._just_decided[rank] = finding
            if armed:
                out.append(finding)
        return out

    def _suspects(self, values: dict[int, list[float | None]]) -> dict[int, tuple[str, float, float, float, bool]]:
        """rank -> (signal, value, the others' value, z, non-finite) for each rank the rules find disagreeing."""
        groups: dict[str, list[int]] = {}
        for rank in sorted(values):
            groups.setdefault(self._groups.get(rank, ""), []).append(rank)
        suspects: dict[int, tuple[str, float, float, float, bool]] = {}
        for ranks in groups.values():
            for index, signal in enumerate(("loss", "grad_norm")):
                got = {r: v for r in ranks if (v := values[r][index]) is not None}
                odd = self._odd(got, self._loss_floor(ranks[0], got), self.config.ratio) if index == 0 else \
                    self._odd_grad(ranks[0], got)
                for rank, (other, _, z, nonfinite) in odd.items():
                    if rank not in suspects or signal == "grad_norm":
                        suspects[rank] = (signal, got[rank], other, z, nonfinite)
        return suspects

    def _lone(self, values: dict[int, list[float | None]]) -> dict[int, tuple[str, float, float, float, bool]]:
        """:meth:`_suspects` of a step one rank reported: no rule can find a disagreement (``_odd`` and
        ``_post_reduce`` need two values), so of its work only the group's loss-spread history is created (no
        spread joins it): the same state, without the calls."""
        [only] = values
        self._loss_spread.setdefault(self._groups.get(only, ""), deque(maxlen=self.config.spread_window))
        return {}

    def _post_reduce(self, member: int, got: dict[int, float]) -> dict[int, tuple[float, float, float, bool]]:
        """The exact-agreement rule on the group of ``member`` (see the module docstring): rank -> (the others'
        value, ratio, z, False) for each suspect; updates the group's agreement counts and the own histories."""
        cfg = self.config
        finite = {r: math.log(v) for r, v in got.items() if math.isfinite(v) and v > 0}
        if len(finite) < 2 or len(finite) < len(got):
            return {}
        group = self._groups.get(member, "")
        counts = self._agreement.setdefault(group, [0, 0])
        exact = counts[0] >= cfg.exact_after and counts[1] <= cfg.exact_slack * (counts[0] + counts[1])
        agree = max(finite.values()) - min(finite.values()) <= cfg.exact_tol
        counts[0 if agree else 1] += 1
        suspects = {} if agree or not exact else self._outliers(finite)
        for rank, y in finite.items():
            if rank not in suspects:
                self._own.setdefault(rank, deque(maxlen=cfg.own_window)).append(y)
        return suspects

    def _loss_floor(self, member: int, got: dict[int, float]) -> float:
        """Scale floor of the loss rule in ``member``'s group: ``loss_floor``, or the ``spread_quantile`` (90 %) of
        the spreads of the replicas' log losses over the last ``spread_window`` decided steps when larger (replicas
        whose losses differ widely by nature, e.g. a CNN's per-batch losses near 0, must disagree by far more than
        1.5x); then this step's spread joins the history."""
        group = self._groups.get(member, "")
        spreads = self._loss_spread.setdefault(group, deque(maxlen=self.config.spread_window))
        floor = max(self.config.loss_floor, float(np.quantile(spreads, self.config.spread_quantile))) if spreads \
            else self.config.loss_floor
        positive = [v for v in got.values() if math.isfinite(v) and v > 0]
        if len(positive) >= 3:
            logs = np.log(positive)
            spreads.append(1.4826 * float(np.median(np.abs(logs - np.median(logs)))))
        return floor

    def _odd_grad(self, member: int, got: dict[int, float]) -> dict[int, tuple[float, float, float, bool]]:
        """Suspects by ``grad_norm`` in the group of ``member``: the exact-agreement rule, else the statistical one
        (with the losses' floor and ``pre_reduce_ratio`` when the group's norms routinely differ)."""
        exact = self._post_reduce(member, got)
        if exact:
            return exact
        if self._routinely_differ(member):  # each rank's own (pre-reduce) norm: noisy like the losses
            return self._odd(got, self.config.loss_floor, self.config.pre_reduce_ratio)
        return self._odd(got, self.config.grad_floor, self.config.ratio)

    def _routinely_differ(self, member: int) -> bool:
        """Whether the replicas of ``member``'s group differ on more than ``exact_slack`` of the steps (norms
        logged before the all-reduce): the statistical rule then floors their spread like the losses'."""
        counts = self._agreement.get(self._groups.get(member, ""), [0, 0])
        return counts[1] > self.config.exact_slack * (counts[0] + counts[1])

    def _outliers(self, logs: dict[int, float]) -> dict[int, tuple[float, float, float, bool]]:
        """Replicas outside the strict majority of exactly agreeing values; without one, the replica farthest
        from its own history (robust z)."""
        tol = self.config.exact_tol
        ranks = sorted(logs)
        best = max(([r for r in ranks if abs(logs[r] - logs[c]) <= tol] for c in ranks), key=len)
        if 2 * len(best) > len(ranks):
            center = logs[best[0]]
            return {r: (safe_exp(center), safe_exp(abs(logs[r] - center)), math.inf, False)
                    for r in ranks if r not in best}
        z = {r: self._own_z(r, logs[r]) for r in ranks}
        worst = max(ranks, key=lambda r: (z[r], -r))
        rest = [logs[r] for r in ranks if r != worst]
        center = float(np.median(rest))
        return {worst: (safe_exp(center), safe_exp(abs(logs[worst] - center)), z[worst], False)}

    def _own_z(self, rank: int, y: float) -> float:
        """Robust z of ``y`` against the rank's own recent agreed values (0 without at least 4 of them)."""
        own = self._own.get(rank)
        if own is None or len(own) < 4:
            return 0.0
        values = np.fromiter(own, dtype=np.float64)
        center = float(np.median(values))
        scale = max(1.4826 * float(np.median(np.abs(values - center))), self.config.own_floor)
        return abs(y - center) / scale

    def _odd(self, got: dict[int, float], floor: float,
             min_ratio: float) -> dict[int, tuple[float, float, float, bool]]:
        """rank -> (median of the others, ratio, robust z, non-finite) for the one rank that disagrees."""
        if len(got) < 2:
            return {}
        finite = {r: v for r, v in got.items() if math.isfinite(v) and v > 0}
        bad = [r for r, v in got.items() if not math.isfinite(v)]
        if len(bad) == 1 and len(finite) >= 1:
            others = float(np.median(list(finite.values())))
            return {bad[0]: (others, math.inf, math.inf, True)}
        if bad or len(finite) < self.config.min_ranks:
            return {}
        ranks = sorted(finite)
        logs = np.log(np.array([finite[r] for r in ranks]))
        center = float(np.median(logs))
        deviation = np.abs(logs - center)
        worst = int(np.argmax(deviation))
        rest = np.delete(logs, worst)
        rest_center = float(np.median(rest))
        scale = max(1.4826 * float(np.median(np.abs(rest - rest_center))), floor)
        z = abs(float(logs[worst]) - rest_center) / scale
        ratio = safe_exp(abs(float(logs[worst]) - rest_center))
        if ratio < min_ratio or z < self.config.z_threshold:
            return {}
        # only one rank may disagree: the second worst must agree with the rest
        if len(rest) >= 2:
            second = float(np.max(np.abs(rest - rest_center)))
            if safe_exp(second) >= min_ratio and second / scale >= self.config.z_threshold:
                return {}
        return {ranks[worst]: (safe_exp(rest_center), ratio, z, False)}

    def _finding(self, step: int, rank: int, signal: str, value: float, other: float, z: float,
                 n: int) -> Finding:
        host = self._hosts.get(rank, "")
        where = f"rank {rank}" + (f" (host {host})" if host else "")
        message = (f"{where} disagrees with the other {n - 1} data-parallel ranks at step {step}: {signal} "
                   f"{value:.4g} vs {other:.4g} on the others")
        return Finding(kind=self.kind, step=step, onset=step, severity=Severity.ERROR, signal=signal, value=value,
                       message=message, detector=self.name, rank=rank, host=host,
                       score=z if math.isfinite(z) else 1e9,
                       evidence={"others": other, "ratio": value / other if other > 0 else math.inf,
                                 "z": z, "ranks": float(n)})

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (bounded: at most ``lag + 1`` pending steps)."""
        return {"pending": [[s, [[r, v] for r, v in d.items()]] for s, d in self._pending.items()],
                "hosts": [[r, h] for r, h in self._hosts.items()], "groups": [[r, g] for r, g in self._groups.items()],
                "world": self._world, "newest": self._newest, "decided": self._decided,
                "loss_flags": [[r, list(f)] for r, f in self._loss_flags.items()],
                "quiet": [[r, q] for r, q in self._quiet.items()],
                "own": [[r, list(v)] for r, v in self._own.items()],
                "agreement": [[g, list(c)] for g, c in self._agreement.items()],
                "loss_spread": [[g, list(v)] for g, v in self._loss_spread.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._pending = {int(s): {int(r): [None if x is None else float(x) for x in v] for r, v in d}
                         for s, d in state["pending"]}
        self._hosts = {int(r): str(h) for r, h in state["hosts"]}
        self._groups = {int(r): str(g) for r, g in state["groups"]}
        self._world = int(state["world"])
        self._newest, self._decided = int(state["newest"]), int(state["decided"])
        self._loss_flags = {int(r): deque((int(x) for x in f), maxlen=3) for r, f in state["loss_flags"]}
        self._quiet = {int(r): int(q) for r, q in state["quiet"]}
        self._own = {int(r): deque((float(x) for x in v), maxlen=self.config.own_window)
                     for r, v in state.get("own", [])}
        self._agreement = {str(g): [int(c[0]), int(c[1])] for g, c in state.get("agreement", [])}
        self._loss_spread = {str(g): deque((float(x) for x in v), maxlen=self.config.spread_window)
                             for g, v in state.get("loss_spread", [])}


def _value(record: StepRecord, name: str) -> float | None:
    """The signal's value, ``None`` when absent or non-positive (a norm printed as 0 was not computed)."""
    value = record.signals.get(name)
    if value is None or (math.isfinite(value) and value <= 0):
        return None
    return float(value)
