"""RunDiagnoser: runs the detector suite over the records of one training run (all ranks).

INTERFACE (stable; the worker and post-mortem depend on it):

    diag = RunDiagnoser()                      # or RunDiagnoser(config=DiagnoserConfig(...))
    findings = diag.update(record)             # records of each rank in step order; ranks may interleave
    findings += diag.finish()                  # end of run: flush pending (e.g. unconfirmed spikes)
    state = diag.state_dict(); diag2.load_state_dict(state)   # plain data (msgpack/JSON-able)

Per rank it keeps one suite of detectors (NaN, loss spike, divergence, grad explosion, fp16 loss scale, vanishing
gradients, logit/activation growth, per-layer update-ratio and gradient jumps, Adam lag, plateau) and a recent
:class:`~stability.detectors.history.History` for ranking; across ranks a
:class:`~stability.detectors.crossrank.CrossRankDetector` compares data-parallel replicas (its findings are on the
faulty rank and name its host). A rank whose step goes backwards was resumed from a checkpoint: its detectors and
history start afresh (new baselines) and its next finding opens a new incident.

Findings of one rank within ``fuse_steps`` of the open incident's last finding (or within ``fuse_records`` records
of it, for sparse logs) join that incident: only the first finding of an incident is returned (alerted);
a later one is returned only when it raises the incident's severity (an escalation, e.g. a grad-norm WARNING
followed by a loss-spike ERROR). A finding of a kind already alerted on that rank within ``cooldown_steps`` at the
same or higher severity is not re-alerted either (it joins the last incident). Closing findings
(``evidence["closes"]``) only set the incident's ``end``. A ``rank_disagreement`` is alerted once per incident even
when it does not raise the severity (it names a machine to cordon). Every finding gets ranked causes (with the
incident's earlier findings as precursors), ``rollback_step`` and ``skip_batches``
(:func:`~stability.detectors.ranking.rank_causes`). :attr:`RunDiagnoser.incidents` lists the fused
incidents (what ``stability postmortem`` reports).

On a step the fp16 scaler skipped (``skipped``, a loss-scale back-off, or an inf grad norm with a loss scale) every
detector but the NaN and loss-scale ones, and the history, see the record without its gradient statistics, so an
overflow feeds no baseline (:data:`SEES_SKIPPED_STEPS`). A warning/error stronger than the rank's last incident,
within ``rediagnose_steps`` of its onset and with another first cause, re-diagnoses it: the finding carries
``evidence["rediagnoses"]`` (the earlier onset) and the earlier incident's headline shows the new causes.

With several ranks, a rank's warning/error findings are held until every known rank has reported their step (at
most until some rank is ``hold_steps`` (2) steps past it; at most ``max_held`` findings), then ranked: a faulty
rank that reports a step first is alerted with that step's cross-rank verdict (``hardware_fault``), not
``unknown``. In step order the delay is 0 steps; a single rank is never held.

**Sharded runs** (``RunDiagnoser(verdicts=...)``): the diagnoser of one shard of a run's ranks has no cross-rank
detector; the cross-rank verdicts come from outside (:class:`Verdicts`, the run's cross-rank stage). A rank's
warning/error findings are then held until the cross-rank stage has decided their step (at most
``verdict_wait_s`` seconds, at most ``max_held`` findings) and ranked with that step's verdict on the rank, exactly
as above; :meth:`RunDiagnoser.release` releases what became decidable while no record arrived. A finding whose
wait ran out (a 16k-rank step takes the workers seconds to read) is alerted with its rank's own evidence and stays
*provisional*: once its step is decided, a verdict against its rank ranks the incident's headline again with it,
and a changed first cause is alerted again as a revision (``evidence["revised"]``), as for a one-record jump.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stability.detectors.base import Detector, Finding, Severity, is_skipped_step, without_step_statistics
from stability.detectors.crossrank import CrossRankConfig, CrossRankDetector
from stability.detectors.divergence import DivergenceConfig, DivergenceDetector
from stability.detectors.fp16 import LossScaleConfig, LossScaleDetector
from stability.detectors.grad import GradConfig, GradExplosionDetector
from stability.detectors.growth import GrowthConfig, GrowthDetector
from stability.detectors.hang import HangConfig, HangDetector
from stability.detectors.history import History
from stability.detectors.memory import MemoryConfig, MemoryDetector
from stability.detectors.nan import NanConfig, NanDetector
from stability.detectors.oddity import OddityBudget
from stability.detectors.plateau import PlateauConfig, PlateauDetector
from stability.detectors.ranking import KIND_CAUSE, MAX_SKIP_BATCHES, rank_causes
from stability.detectors.schedule import ScheduleConfig, ScheduleDetector
from stability.detectors.spike import SpikeConfig, SpikeDetector
from stability.detectors.steptime import PERF_KINDS, StepTimeConfig, StepTimeDetector
from stability.detectors.straggler import StragglerConfig, StragglerDetector
from stability.detectors.update import (
    LAYER_GRAD,
    PARAM_JUMP,
    UPDATE_RATIO,
    AdamLagConfig,
    AdamLagDetector,
    LayerJumpConfig,
    LayerJumpDetector,
)
from stability.detectors.vanish import GradVanishingDetector, VanishConfig
from stability.records import StepRecord

__all__ = ["DiagnoserConfig", "Incident", "RankFetch", "RunDiagnoser", "Verdicts"]

logger = logging.getLogger(__name__)

SIGNED_LOSS_DETECTORS = frozenset({"spike", "divergence", "plateau"})
"""Detectors (by name) that read the loss on a log scale: a rank whose loss went negative no longer feeds them."""
SIGNED_HOLD = 8
"""The loss detectors' findings in a rank's first this many records are alerted only after them (a REINFORCE
loss is negative in about every other episode: its first swings must not be alerted as spikes)."""
SIGNED_EARLY = 32
"""A loss negative within this many records was signed from the start (the spike detector's ``min_points``)."""

KIND_PRIORITY = ("rank_disagreement", "nan", "loss_spike", "divergence", "grad_explosion", "loss_scale_collapse",
                 "lr_off_schedule", "grad_vanishing", "attention_logit_growth", "logit_divergence", "activation_growth",
                 "update_ratio_jump", "adam_v_lag", "plateau")
"""Headline preference among findings of equal severity in one incident (the loss-level event names it)."""

SEES_SKIPPED_STEPS = frozenset({"nan", "loss_scale"})
"""Detectors that get the whole record of a step the fp16 scaler skipped (a non-finite loss is still a NaN event;
overflow bursts are the loss-scale detector's business); every other detector and the history get it without its
gradient statistics, so an overflow feeds no baseline (:meth:`_RankSuite.step_view`)."""

MAX_KEPT_INCIDENTS = 16
"""Closed incidents per rank kept in :meth:`RunDiagnoser.state_dict` (all are kept in memory)."""

RankFetch = Callable[[int], "dict[str, Any] | None"]
"""Reads one rank's part of a parted state (:meth:`RunDiagnoser.state_parts`); None: nothing saved for it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnoserConfig:
    """Settings of :class:`RunDiagnoser` and its detectors."""

    nan: NanConfig = field(default_factory=NanConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    grad: GradConfig = field(default_factory=GradConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    vanish: VanishConfig = field(default_factory=VanishConfig)
    growth: GrowthConfig = field(default_factory=GrowthConfig)
    update: LayerJumpConfig = UPDATE_RATIO
    layer_grad: LayerJumpConfig = LAYER_GRAD
    param_jump: LayerJumpConfig = PARAM_JUMP
    adam_lag: AdamLagConfig = field(default_factory=AdamLagConfig)
    plateau: PlateauConfig = field(default_factory=PlateauConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    crossrank: CrossRankConfig = field(default_factory=CrossRankConfig)
    steptime: StepTimeConfig = field(default_factory=StepTimeConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    fuse_steps: int = 20
    """Findings within this many steps of an incident's last finding join it."""
    fuse_records: int = 2
    """... or within this many records of the rank and ``cooldown_steps`` steps (sparse logs: one line every 10-100
    steps)."""
    cooldown_steps: int = 100
    """No second alert of the same kind and severity on a rank within this many steps."""
    hold_steps: int = 2
    """A rank's warning/error findings wait until every known rank reported their step (so the first alert is
    ranked with the cross-rank verdict of that step), at most until another rank is this many steps ahead."""
    max_held: int = 64
    """At most this many findings wait (the oldest is released first)."""
    verdict_wait_s: float = 1.0
    """Sharded runs: a held finding waits at most this long for the cross-rank stage's verdict on its step, then
    is alerted provisionally and revised if the verdict changes its diagnosis (a NaN must reach the operator within
    ~2 s even when the workers need longer to read a 16k-rank step)."""
    rediagnose_steps: int = 100
    """A warning/error within this many steps (onset to onset) of a weaker earlier incident of the same rank, with a
    different first cause, re-diagnoses it (:meth:`RunDiagnoser._rediagnose`)."""
    oddity_fits_per_step: int = 16
    """At most this many IsolationForest precursor checks (~0.1 s of CPU each) for the findings of one onset step
    (a bad batch every rank saw); later ones say in their evidence that the check was skipped."""
    history_steps: int = 256
    module_history_steps: int = 96
    max_series: int = 512


@dataclass(slots=True)
class Incident:
    """Fused findings of one rank."""

    rank: int
    findings: list[Finding]
    alerted: Severity
    last_step: int
    end: int | None = None
    late_batches: list[str] = field(default_factory=list)
    """Batch ids of anomalous steps after the alert (known once the anomaly ended)."""
    rediagnosed_by: int | None = None
    """Step of the later, stronger finding whose causes replaced the headline's (None: its own diagnosis)."""

    @property
    def headline(self) -> Finding:
        """The most severe finding (loss-level kinds first on ties, then the earliest)."""
        def key(f: Finding) -> tuple[int, int, int]:
            prio = KIND_PRIORITY.index(f.kind) if f.kind in KIND_PRIORITY else len(KIND_PRIORITY)
            return (-f.severity.rank, prio, f.step)
        return min(self.findings, key=key)

    @property
    def onset(self) -> int:
        """Earliest onset of its findings."""
        return min(f.onset for f in self.findings)

    @property
    def first_step(self) -> int:
        """Step of the first alert."""
        return self.findings[0].step

    @property
    def kinds(self) -> list[str]:
        """Distinct kinds, in order of appearance."""
        return list(dict.fromkeys(f.kind for f in self.findings))

    @property
    def skip_batches(self) -> list[str]:
        """Batch ids to skip on replay: the headline's plus those of later anomalous steps."""
        return list(dict.fromkeys([*self.headline.skip_batches, *self.late_batches]))[:MAX_SKIP_BATCHES]

    def to_state(self) -> dict[str, Any]:
        """Plain data."""
        return {"rank": self.rank, "findings": [f.to_dict() for f in self.findings], "alerted": self.alerted.value,
                "last_step": self.last_step, "end": self.end, "late_batches": self.late_batches,
                "rediagnosed_by": self.rediagnosed_by}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Incident:
        """Inverse of :meth:`to_state`."""
        return cls(rank=int(state["rank"]), findings=[Finding.from_dict(f) for f in state["findings"]],
                   alerted=Severity(state["alerted"]), last_step=int(state["last_step"]), end=state["end"],
                   late_batches=list(state.get("late_batches", [])), rediagnosed_by=state.get("rediagnosed_by"))


class Verdicts(Protocol):
    """Cross-rank verdicts decided outside the diagnoser (a sharded run's cross-rank stage)."""

    def decided(self) -> int:
        """Every step up to this one has been decided by the cross-rank comparison."""
        ...

    def suspect(self, rank: int, step: int) -> Finding | None:
        """The ``rank_disagreement`` decided on ``rank`` at ``step`` (alerted or not), if any."""
        ...


class _RankSuite:
    """Detectors, history and incident bookkeeping of one rank."""

    def __init__(self, config: DiagnoserConfig, history: Callable[[], History] | None = None) -> None:
        self.detectors: list[Detector] = [
            ScheduleDetector(config.schedule),  # first: an LR change precedes everything it causes
            NanDetector(config.nan), SpikeDetector(config.spike), DivergenceDetector(config.divergence),
            GradExplosionDetector(config.grad), LossScaleDetector(config.loss_scale),
            GradVanishingDetector(config.vanish), GrowthDetector(config.growth), LayerJumpDetector(config.update),
            LayerJumpDetector(config.layer_grad), LayerJumpDetector(config.param_jump),
            AdamLagDetector(config.adam_lag), PlateauDetector(config.plateau),
            StepTimeDetector(config.steptime), MemoryDetector(config.memory),  # performance: detectors/steptime.py
        ]
        self.history = history() if history is not None else History(
            steps=config.history_steps, module_steps=config.module_history_steps, max_series=config.max_series)
        self.last_alert: dict[str, tuple[int, int]] = {}
        """kind -> (step, severity rank) of its last alert."""
        self.last_step = -1
        self.records = 0
        """Records seen (fusion of sparse logs counts records, not only steps)."""
        self.host = ""
        """Host of the rank (from its latest record); every finding of the rank names it."""
        self.incident_record = -1
        """Value of ``records`` at the open incident's last finding."""
        self.perf_record = -1
        """The same for the open performance incident (slowdown, hang: :data:`PERF_KINDS`)."""
        self.scale: float | None = None
        """The rank's last recorded fp16 loss scale (a fall marks a skipped step)."""
        self.signed: int | None = None
        """Step of the rank's first negative loss: a signed objective (see :data:`SIGNED_LOSS_DETECTORS`)."""
        self.judging = self.detectors
        """The detectors fed each record: all of them, less the loss-scale ones once the loss is signed."""

    def step_view(self, record: StepRecord) -> StepRecord:
        """What the baselines may see of ``record``: without its gradient statistics on a step the fp16 scaler
        skipped (:func:`~stability.detectors.base.is_skipped_step`); the record itself otherwise."""
        skipped = is_skipped_step(record, self.scale)
        scale = record.get("loss_scale")
        if math.isfinite(scale) and scale > 0:
            self.scale = scale
        return without_step_statistics(record) if skipped else record

    def state_dict(self) -> dict[str, Any]:
        return {"detectors": {d.name: d.state_dict() for d in self.detectors}, "history": self.history.state_dict(),
                "last_alert": {k: list(v) for k, v in self.last_alert.items()}, "last_step": self.last_step,
                "records": self.records, "incident_record": self.incident_record, "perf_record": self.perf_record,
                "host": self.host, "scale": self.scale, "signed": self.signed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for detector in self.detectors:
            if detector.name in state["detectors"]:  # a state from before a detector was added keeps it fresh
                detector.load_state_dict(state["detectors"][detector.name])
        self.history.load_state_dict(state["history"])
        self.last_alert = {k: (int(v[0]), int(v[1])) for k, v in state["last_alert"].items()}
        self.last_step = int(state.get("last_step", -1))
        self.records = int(state.get("records", 0))
        self.incident_record = int(state.get("incident_record", -1))
        self.perf_record = int(state.get("perf_record", -1))
        self.host = str(state.get("host", ""))
        scale = state.get("scale")
        self.scale = None if scale is None else float(scale)
        signed = state.get("signed")
        self.sign_loss(None if signed is None else int(signed))

    def sign_loss(self, step: int | None) -> None:
        """The loss took a negative value at ``step``: stop feeding the detectors that read it on a log scale."""
        self.signed = step
        self.judging = self.detectors if step is None else [
            d for d in self.detectors if d.name not in SIGNED_LOSS_DETECTORS]


class RunDiagnoser:
    """Detector suite for one run (all ranks); see the module docstring."""

    def __init__(self, config: DiagnoserConfig | None = None, *, verdicts: Verdicts | None = None,
                 history: Callable[[], History] | None = None) -> None:
        self.config = config or DiagnoserConfig()
        self._history = history
        """Makes each rank's :class:`History` (None: the default); the columnar post-mortem's lazy one."""
        self._verdicts = verdicts
        """External cross-rank verdicts (a shard of a sharded run); None: compare the ranks here."""
        self._ranks: dict[int, _RankSuite] = {}
        self._incidents: list[Incident] = []
        """Every incident seen by this object (per rank in order of creation; :attr:`incidents`)."""
        self._dirty: set[int] = set()
        """Ranks whose state may have changed since the last :meth:`state_parts`."""
        self._unloaded: set[int] = set()
        """Ranks of a parted state not loaded yet (:meth:`load_state_parts`), read by ``_fetch`` on first use."""
        self._fetch: RankFetch | None = None
        self._open: dict[int, Incident] = {}
        """Last incident of each rank (findings may still join it); performance incidents (a straggler, a hang)
        are apart, under key ``~rank`` (:func:`_open_key`)."""
        self._crossrank = CrossRankDetector(self.config.crossrank)
        self._oddity = OddityBudget(self.config.oddity_fits_per_step)
        """IsolationForest fits per onset step (not saved: a restarted worker may fit a step's forests again)."""
        self._fleet: list[Detector] = [StragglerDetector(self.config.straggler), HangDetector(self.config.hang)]
        """Engine-level performance detectors (a straggler rank, a silent rank); a shard's see only its ranks."""
        self._held: list[tuple[int, Finding, float]] = []
        """(rank, finding, unix time held) waiting for the other ranks to report its step (see :meth:`_release`)."""
        self._provisional: list[tuple[int, int]] = []
        """(rank, step) of findings alerted before the cross-rank stage decided their step (sharded runs, after
        ``verdict_wait_s``): the verdict, once decided, may revise their incident (:meth:`_settle`)."""
        self._revised: list[Finding] = []
        """Alerted incidents whose diagnosis changed since their alert (:meth:`_revise`), to alert again."""
        self.resumes: list[tuple[int, int, int]] = []
        """(rank, last step before, first step after) of every detected resume (step going backwards)."""

    @property
    def incidents(self) -> list[Incident]:
        """Every incident seen by this object (and those of a loaded state), per rank in order of creation."""
        self._load_all()
        return self._incidents

    def _suite(self, rank: int) -> _RankSuite:
        """The rank's suite, created or loaded if need be, and marked changed (the caller may change it)."""
        self._dirty.add(rank)
        return self._ranks.get(rank) or self._loaded(rank)

    def _loaded(self, rank: int) -> _RankSuite:
        suite = self._ranks.get(rank)
        if suite is not None:
            return suite
        suite = self._ranks[rank] = _RankSuite(self.config, self._history)
        if rank in self._unloaded:
            self._unloaded.discard(rank)
            part = self._fetch(rank) if self._fetch is not None else None
            if part is not None:
                suite.load_state_dict(part["suite"])
                self._add_incidents([Incident.from_state(i) for i in part["incidents"]])
        return suite

    def _load_all(self) -> None:
        """Load every rank of a parted state not loaded yet (what iterates over all ranks needs them)."""
        for rank in sorted(self._unloaded):
            self._loaded(rank)

    def _add_incidents(self, incidents: list[Incident]) -> None:
        self._incidents += incidents
        self._open.update((_open_key(i.rank, i.headline), i) for i in incidents)

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record; return the findings to alert on."""
        suite = self._suite(record.rank)
        alerts: list[Finding] = []
        if record.step < suite.last_step:
            alerts = self._release(flush=True)  # held findings belong to the run before the resume
            suite = self._resume(record.rank, suite.last_step, record.step)
        elif record.signals.get("phase_start", 0.0) > 0 and suite.records:
            alerts = self._release(flush=True)
            suite = self._new_phase(record.rank, record.step)
        suite.last_step = record.step
        suite.records += 1
        suite.host = record.host or suite.host
        view = suite.step_view(record)
        suite.history.push(view)
        found: list[Finding] = []
        if suite.signed is None and record.signals.get("loss", 0.0) < 0:
            self._signed_loss(suite, record)
        for detector in suite.judging:
            found.extend(detector.update(record if detector.name in SEES_SKIPPED_STEPS else view))
        decided = self._crossrank.update(record) if self._verdicts is None else []
        decided += [f for d in self._fleet for f in d.update(record)]
        now = time.time() if found else 0.0
        self._held += [(record.rank, f, now) for f in found]
        alerts += self._release()
        for finding in decided:
            alerts += self._fuse(self._suite(finding.rank), finding.rank, [finding])
        return self._with_revisions(alerts)

    def oldest_held(self) -> int | None:
        """Step of the oldest finding held back for the other ranks' reports or the cross-rank verdict (None:
        none)."""
        return min([*(finding.step for _, finding, _ in self._held), *(step for _, step in self._provisional)],
                   default=None)

    def release_due(self) -> float | None:
        """With external verdicts (a shard): the unix time the longest-held finding stops waiting for its verdict
        (None: nothing held); a release then alerts it provisionally."""
        if self._verdicts is None or not self._held:
            return None
        return min(since for _, _, since in self._held) + self.config.verdict_wait_s

    def release(self) -> list[Finding]:
        """Fuse and return the held findings that became decidable (a sharded run's shard calls this when the
        cross-rank stage decided more steps while no record of the shard arrived)."""
        return self._with_revisions(self._release())

    def _with_revisions(self, alerts: list[Finding]) -> list[Finding]:
        if self._revised:
            alerts += self._revised
            self._revised = []
        return alerts

    def _revise(self, incident: Incident, before: Finding, after: Finding) -> None:
        """An incident already alerted (warning/error) whose headline changed its first cause or fell to INFO is
        alerted again as a revision (``evidence["revised"]``: the training console prints what changed; the
        other sinks keep the first alert)."""
        if incident.alerted not in (Severity.WARNING, Severity.ERROR):
            return
        old = before.causes[0].cause if before.causes else None
        new = after.causes[0].cause if after.causes else None
        if old != new or after.severity is not before.severity:
            self._revised.append(dataclasses.replace(after, evidence={**after.evidence, "revised": 1.0}))

    def _release(self, *, flush: bool = False) -> list[Finding]:
        """Fuse the held findings whose step every known rank has reported (or that waited long enough).

        A finding is held only while other ranks are known and have not reported its step yet, and only when it
        is a warning/error (or queued behind one of its rank, to keep each rank's order): with the faulty rank
        reporting first, its own detectors fire before the cross-rank verdict of that step exists. With external
        verdicts (a shard) it is held until the cross-rank stage decided its step, at most ``verdict_wait_s``.
        """
        if self._provisional:
            self._settle(flush=flush)
        alerts: list[Finding] = []
        if not self._held:
            return alerts
        cfg = self.config
        if self._verdicts is None:
            self._load_all()
            ranks = self._ranks.values()
            complete = min(s.last_step for s in ranks)
            newest = max(s.last_step for s in ranks)
            wait_until = 0.0
        else:
            complete, newest = self._verdicts.decided(), -(2**62)  # newest - step < hold_steps: always
            wait_until = time.time() - cfg.verdict_wait_s
        waiting: set[int] = set()
        keep: list[tuple[int, Finding, float]] = []
        over = len(self._held) - cfg.max_held
        for i, (rank, finding, since) in enumerate(self._held):
            serious = finding.severity in (Severity.WARNING, Severity.ERROR) and not finding.evidence.get("closes")
            hold = not flush and i >= over and (rank in waiting or (serious and ((
                finding.step > complete and newest - finding.step < cfg.hold_steps and since >= wait_until)
                or self._unsure_of_sign(rank, finding))))
            if hold:
                waiting.add(rank)
                keep.append((rank, finding, since))
                continue
            if serious and not flush and finding.step > complete and self._verdicts is not None:
                self._provisional = [*self._provisional, (rank, finding.step)][-cfg.max_held:]
            alerts += self._fuse(self._suite(rank), rank, [finding])
        self._held = keep
        return alerts

    def _settle(self, *, flush: bool) -> None:
        """Provisional findings whose step the cross-rank stage has decided meanwhile: a verdict against the rank
        at that step ranks its incident's headline again with it (a revision when the first cause changes).
        ``flush`` (the end of the records) gives up on the ones still undecided."""
        assert self._verdicts is not None
        complete = self._verdicts.decided()
        waiting: list[tuple[int, int]] = []
        for rank, step in self._provisional:
            if step > complete:
                if not flush:
                    waiting.append((rank, step))
                continue
            suspect = self._verdicts.suspect(rank, step)
            suite = self._suite(rank)  # loads the rank's part (and its incidents) after a restart
            incident = next((i for i in reversed(self._incidents)
                             if i.rank == rank and any(f.step == step for f in i.findings)), None)
            if suspect is not None and incident is not None:
                self._rerank(suite, incident, incident.headline, extra=[suspect])
        self._provisional = waiting

    def _resume(self, rank: int, before: int, after: int) -> _RankSuite:
        """``rank`` went back from ``before`` to ``after``: fresh detectors and history, a new incident next."""
        logger.info("rank %d resumed: step %d after step %d; re-baselining its detectors", rank, after, before)
        self.resumes.append((rank, before, after))
        suite = self._ranks[rank] = _RankSuite(self.config, self._history)
        self._open.pop(rank, None)
        self._open.pop(~rank, None)
        self._crossrank.reset(after)
        return suite

    def _new_phase(self, rank: int, step: int) -> _RankSuite:
        """``rank`` started a new training phase at ``step`` (another optimizer over other parameters: the capture's
        ``phase_start``): fresh detectors and history, as after a resume, since its loss is another objective's."""
        logger.info("rank %d: a new training phase at step %d; re-baselining its detectors", rank, step)
        last = self._ranks[rank].last_step
        suite = self._ranks[rank] = _RankSuite(self.config, self._history)
        suite.last_step = last
        self._open.pop(rank, None)
        self._open.pop(~rank, None)
        return suite

    def finish(self) -> list[Finding]:
        """Flush what the detectors hold back (unconfirmed spikes) at the end of the records."""
        self._load_all()
        out = self._release(flush=True)
        for rank, suite in sorted(self._ranks.items()):
            found: list[Finding] = []
            for detector in suite.judging:
                flush = getattr(detector, "finish", None)
                if flush is not None:
                    found.extend(flush())
            out.extend(self._fuse(suite, rank, found))
        if self._verdicts is None:
            for finding in self._crossrank.finish():
                out += self._fuse(self._suite(finding.rank), finding.rank, [finding])
        return self._with_revisions(out)

    def _unsure_of_sign(self, rank: int, finding: Finding) -> bool:
        """A loss detector's finding in a rank's first :data:`SIGNED_HOLD` records waits for them: a loss that
        goes negative among them is a signed objective and the finding is demoted (:meth:`_signed_loss`)."""
        if finding.detector not in SIGNED_LOSS_DETECTORS:
            return False
        suite = self._ranks.get(rank)
        return suite is not None and suite.signed is None and suite.records < SIGNED_HOLD

    def _signed_loss(self, suite: _RankSuite, record: StepRecord) -> None:
        """The rank's loss went negative: a signed objective (a policy-gradient surrogate, a WGAN critic, a
        log-density), which the loss-spike, divergence and plateau detectors cannot judge on their log scale. They
        stop for the rest of the run. When it happened within the first :data:`SIGNED_EARLY` records the loss was
        signed from the start: what those detectors said about it before (a REINFORCE loss swings 10x between
        episodes) is kept as INFO with the reason."""
        suite.sign_loss(record.step)
        if suite.records > SIGNED_EARLY:
            return
        note = (f"; not judged: the loss turned negative at step {record.step} (a signed objective, e.g. a policy "
                "gradient), so its ratios mean nothing")

        def demoted(finding: Finding) -> Finding:
            if finding.detector not in SIGNED_LOSS_DETECTORS or finding.severity is Severity.INFO:
                return finding
            return dataclasses.replace(finding, severity=Severity.INFO, message=finding.message + note,
                                       evidence={**finding.evidence, "signed_loss": float(record.step)})

        for incident in self._incidents:
            if incident.rank == record.rank:
                head = incident.headline
                incident.findings[:] = [demoted(f) for f in incident.findings]
                self._revise(incident, head, demoted(head))
        self._held = [(rank, demoted(f) if rank == record.rank else f, since) for rank, f, since in self._held]

    def _fuse(self, suite: _RankSuite, rank: int, found: list[Finding]) -> list[Finding]:
        alerts: list[Finding] = []
        if found:
            self._dirty.add(rank)
        for raw in found:
            if raw.evidence.get("closes"):
                self._close(rank, raw)
                continue
            incident = self._open.get(rank)
            recent = list(incident.findings) if incident is not None else []
            suspect = None
            if raw.kind != "rank_disagreement":
                source = self._crossrank if self._verdicts is None else self._verdicts
                suspect = source.suspect(rank, raw.step)
            if suspect is not None:
                recent.append(suspect)
            if raw.kind == "update_ratio_jump" and raw.severity is not Severity.INFO:
                raw = _followed_gradient(raw, suite.history)
            ranking = rank_causes(raw, suite.history, recent, oddity=self._oddity)
            finding = dataclasses.replace(raw, causes=ranking.causes, rollback_step=ranking.rollback_step,
                                          skip_batches=ranking.skip_batches, host=raw.host or suite.host)
            finding = self._rediagnose(rank, finding)
            if self._join(suite, rank, finding):
                alerts.append(finding)
        return alerts

    def _join(self, suite: _RankSuite, rank: int, finding: Finding) -> bool:
        """Add ``finding`` to an incident; True when it must be alerted."""
        cfg = self.config
        incident = self._open.get(_open_key(rank, finding))
        perf = finding.kind in PERF_KINDS  # its own incidents: a slowdown keeps no loss incident open
        last_record = suite.perf_record if perf else suite.incident_record
        last = suite.last_alert.get(finding.kind)
        cooled = last is not None and finding.step - last[0] < cfg.cooldown_steps and last[1] >= finding.severity.rank
        gap = finding.step - incident.last_step if incident is not None else cfg.cooldown_steps + 1
        near = gap <= cfg.fuse_steps or (gap <= cfg.cooldown_steps
                                          and suite.records - last_record <= cfg.fuse_records)
        if perf:
            suite.perf_record = suite.records
        else:
            suite.incident_record = suite.records
        if incident is not None and (near or cooled):
            new_machine = finding.kind == "rank_disagreement" and finding.kind not in incident.kinds
            head = incident.headline
            incident.findings.append(finding)
            if incident.headline is head and head is not finding and (
                    finding.kind in KIND_CAUSE or finding.kind == "param_jump"
                    or _grew_unexplained(head, finding, suite.history)):
                self._rerank(suite, incident, head, only_stronger=finding.kind == "param_jump")
            incident.last_step = max(incident.last_step, finding.step)
            if finding.end is not None:
                incident.end = max(incident.end or finding.end, finding.end)
            if finding.severity.rank <= incident.alerted.rank and not new_machine:
                return False
            incident.alerted = max(incident.alerted, finding.severity, key=lambda s: s.rank)
        else:
            incident = Incident(rank=rank, findings=[finding], alerted=finding.severity, last_step=finding.step,
                                end=finding.end)
            self._open[_open_key(rank, finding)] = incident
            self._incidents.append(incident)
        suite.last_alert[finding.kind] = (finding.step, finding.severity.rank)
        return True

    def _rediagnose(self, rank: int, finding: Finding) -> Finding:
        """A warning/error stronger than a recent incident of the rank (onset within ``rediagnose_steps`` before
        its own), whose first cause differs: the later, stronger evidence supersedes the earlier diagnosis (the
        first thing an operator read must not stay wrong). The finding gets ``evidence["rediagnoses"]`` = the
        earliest such onset; each such incident's headline takes the new causes (its report shows them, the old
        ones follow, scored no higher) and records ``rediagnosed_by``. Incidents in between (an LR precursor that
        already names the same cause) are not touched."""
        if finding.severity is Severity.INFO or not finding.causes or finding.kind in PERF_KINDS:
            return finding
        new = finding.causes[0]
        earliest: int | None = None
        for earlier in reversed(self._incidents):  # only the rank's own, which are loaded
            if earlier.rank != rank:
                continue
            if finding.onset - earlier.onset > self.config.rediagnose_steps:
                break
            head = earlier.headline
            if (head.kind in PERF_KINDS or finding.severity.rank <= earlier.alerted.rank
                    or finding.onset < earlier.onset or (head.causes and head.causes[0].cause == new.cause)):
                continue
            note = f"re-diagnosed by the {finding.kind} {finding.severity.value} at step {finding.step}"
            lowest = finding.causes[-1].score
            causes = (dataclasses.replace(new, evidence=f"{note}: {new.evidence}"), *finding.causes[1:],
                      *(dataclasses.replace(c, score=min(c.score, lowest)) for c in head.causes
                        if c.cause not in {h.cause for h in finding.causes}))
            index = next(i for i, f in enumerate(earlier.findings) if f is head)
            earlier.findings[index] = dataclasses.replace(head, causes=causes)
            earlier.rediagnosed_by = finding.step
            earliest = earlier.onset
        if earliest is None:
            return finding
        return dataclasses.replace(finding, evidence={**finding.evidence, "rediagnoses": float(earliest)})

    def _rerank(self, suite: _RankSuite, incident: Incident, head: Finding, *, reverted: bool = False,
                only_stronger: bool = False, extra: Sequence[Finding] = ()) -> None:
        """Rank the headline again with a structural finding that joined later (one incident, all evidence), or,
        with ``reverted``, as the one-record jump it turned out to be (:func:`_one_record_jump`). ``only_stronger``
        (a weight jump seen at a later sample): the new ranking replaces the headline's only if its first cause
        scores higher (rules that read the records right after the onset, such as the runaway rule, cannot speak
        again 20-50 steps later). ``extra``: evidence that is not one of the incident's findings (a cross-rank
        verdict decided after a provisional alert)."""
        if reverted:
            head = dataclasses.replace(head, evidence={**head.evidence, "reverted": 1.0})
        ranking = rank_causes(head, suite.history, [*incident.findings, *extra], oddity=self._oddity)
        if only_stronger and head.causes and (not ranking.causes or ranking.causes[0].score <= head.causes[0].score):
            return
        if extra and head.causes and ranking.causes and ranking.causes[0].cause != head.causes[0].cause and (
                ranking.causes[0].score <= head.causes[0].score):
            return  # a late verdict may add causes or outrank the first one, not reshuffle it on later history
        index = next(i for i, f in enumerate(incident.findings) if f is incident.headline)
        before = incident.findings[index]
        incident.findings[index] = dataclasses.replace(head, causes=ranking.causes,
                                                       rollback_step=ranking.rollback_step)
        self._revise(incident, before, incident.findings[index])

    def _close(self, rank: int, closing: Finding) -> None:
        for incident in reversed(self._incidents):
            match = [f for f in incident.findings if f.kind == closing.kind and f.onset == closing.onset]
            if incident.rank == rank and match:
                end = closing.end if closing.end is not None else closing.step
                incident.end = max(incident.end or end, end)
                batches = self._ranks[rank].history.batches
                incident.late_batches += [batches[s] for s in sorted(batches) if match[0].step < s <= end]
                if _one_record_jump(incident.headline, match[0], closing, self.config.spike.max_gap):
                    self._rerank(self._ranks[rank], incident, incident.headline, reverted=True)
                return

    def state_dict(self) -> dict[str, Any]:
        """Plain data (msgpack-able: the history is stored as float32 bytes); a few hundred KB per rank at most."""
        self._load_all()
        kept = self._kept_incidents(set(self._ranks))
        run = self._run_state()
        return {
            "version": 1,
            "ranks": {str(r): s.state_dict() for r, s in self._ranks.items()},
            "crossrank": run["crossrank"],
            "fleet": run["fleet"],
            "incidents": [i.to_state() for r in sorted(kept) for i in kept[r]],
            "held": run["held"],
            "held_since": run["held_since"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (every rank counts as changed for the next :meth:`state_parts`)."""
        self._load_run_state(state, None)
        for rank, suite_state in state["ranks"].items():
            self._suite(int(rank)).load_state_dict(suite_state)
        self._add_incidents([Incident.from_state(i) for i in state["incidents"]])

    def state_parts(self, *, changed_only: bool = True) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The state split for an incremental snapshot: ``(run part, {rank: rank part})``, plain data.

        The run part (cross-rank and fleet detectors, held findings, the list of ranks) is small; a rank part is the
        rank's detectors, history and last incidents. With ``changed_only``, only the ranks that may have changed
        since the last call are returned (a snapshot rewrites those and keeps the others); the two together are
        :meth:`state_dict`'s content. :meth:`load_state_parts` restores it, loading each rank on first use.
        """
        ranks = set(self._dirty) if changed_only else set(self._ranks)
        self._dirty = set()
        kept = self._kept_incidents(ranks)
        parts = {r: {"suite": self._ranks[r].state_dict(), "incidents": [i.to_state() for i in kept.get(r, [])]}
                 for r in sorted(ranks)}
        return {"version": 2, "all": sorted(set(self._ranks) | self._unloaded), **self._run_state()}, parts

    def load_state_parts(self, run: dict[str, Any], fetch: RankFetch) -> None:
        """Restore a run part of :meth:`state_parts`; each rank's part is read with ``fetch(rank)`` when the rank is
        first needed (a record of it, a finding on it, or something that visits every rank)."""
        self._load_run_state(run, fetch)
        self._unloaded = {int(r) for r in run["all"]}

    def _kept_incidents(self, ranks: set[int]) -> dict[int, list[Incident]]:
        kept: dict[int, list[Incident]] = {}
        for incident in self._incidents:
            if incident.rank in ranks:
                kept.setdefault(incident.rank, []).append(incident)
        return {r: found[-MAX_KEPT_INCIDENTS:] for r, found in kept.items()}

    def _run_state(self) -> dict[str, Any]:
        return {
            "crossrank": self._crossrank.state_dict(),
            "fleet": {d.name: d.state_dict() for d in self._fleet},
            "held": [[rank, f.to_dict()] for rank, f, _ in self._held],
            "held_since": [since for _, _, since in self._held],
            "provisional": [list(p) for p in self._provisional],
        }

    def _load_run_state(self, state: dict[str, Any], fetch: RankFetch | None) -> None:
        self._ranks, self._incidents, self._open = {}, [], {}
        self._dirty, self._unloaded, self._fetch = set(), set(), fetch
        held = state.get("held", [])
        since = state.get("held_since") or [time.time()] * len(held)
        self._held = [(int(rank), Finding.from_dict(f), float(t)) for (rank, f), t in zip(held, since, strict=True)]
        self._provisional = [(int(rank), int(step)) for rank, step in state.get("provisional", [])]
        self._crossrank = CrossRankDetector(self.config.crossrank)
        if "crossrank" in state:
            self._crossrank.load_state_dict(state["crossrank"])
        self._fleet = [StragglerDetector(self.config.straggler), HangDetector(self.config.hang)]
        for detector in self._fleet:
            if detector.name in state.get("fleet", {}):
                detector.load_state_dict(state["fleet"][detector.name])


def _followed_gradient(finding: Finding, history: History) -> Finding:
    """An update-ratio jump no larger than how far the step's global gradient norm sits above the smallest one of
    the :data:`GRADIENT_SPAN` steps before: the update did what the gradient asked (plain SGD: Δw = lr·g; a
    hand-written loop on heavy-tailed batches swings its gradient 50x within a few steps, and a ratio sampled
    every 50 steps jumps over its line with it), so it is INFO with the reason. An LR that jumped leaves the
    gradient in its usual range. Unchanged when the gradient norm is not recorded."""
    ratio = finding.evidence.get("ratio", 0.0)
    ring = history.globals
    if ratio <= 1.0 or "grad_norm" not in ring.series:
        return finding
    steps, grads = ring.ordered(), ring.ordered("grad_norm")
    now = grads[steps == finding.step]
    before = grads[(steps < finding.step) & np.isfinite(grads) & (grads > 0)][-GRADIENT_SPAN:]
    if len(now) != 1 or not math.isfinite(now[0]) or len(before) < GRADIENT_SPAN // 4:
        return finding
    follows = float(now[0]) / float(before.min())
    if follows < ratio:
        return finding
    note = (f"; the gradient norm of that step was {follows:.3g}x the smallest of the {len(before)} steps before "
            "(the update followed the gradient; the LR did not move it)")
    return dataclasses.replace(finding, severity=Severity.INFO, message=finding.message + note,
                               evidence={**finding.evidence, "grad_follows": follows})


GRADIENT_SPAN = 64
"""Steps of gradient norms an update jump is compared with (at least a quarter of them needed)."""


def _grew_unexplained(head: Finding, joined: Finding, history: History) -> bool:
    """A divergence joined an incident headed by a loss spike ranked at detection, with no LR logged: the spike was
    ranked on its first records only, and the runaway rule (``ranking._runaway``) reads the records after the onset,
    so the headline is ranked again with them (with an LR logged the LR rules have already spoken)."""
    return joined.kind == "divergence" and head.kind == "loss_spike" and history.lr.last is None


def _one_record_jump(head: Finding, closed: Finding, closing: Finding, max_gap: int) -> bool:
    """The incident's headline is a huge loss jump alerted at once (before a next record could say whether it
    reverted) and the spike detector closed it at the very next record (within ``max_gap`` steps, not averaged over
    several steps): it was a one-record outlier, ranked again as the spike detector's reverted jumps are."""
    return (head is closed and head.kind == "loss_spike" and closing.end == head.onset
            and closing.step - head.onset <= max_gap and "loss_steps" not in head.evidence
            and "confirm_ratio" not in head.evidence and not head.evidence.get("reverted"))


def _open_key(rank: int, finding: Finding) -> int:
    """Key of the open incident ``finding`` may join: a slow or hung rank is not a loss event (``~rank`` for the
    performance kinds of :data:`~stability.detectors.steptime.PERF_KINDS`, ``rank`` for the others)."""
    return ~rank if finding.kind in PERF_KINDS else rank
