"""Event-window scoring (shared reference detection.md section 2.6); never point-adjusted F1.

Inputs are neutral: labelled :class:`~stability.evaluation.corpus.Event` windows and :class:`Alarm` lists, so
stability's findings and the simple baselines are scored by the same code.

* **Recall** per event kind: an event is detected when >= 1 warning/error alarm (any rank) falls in
  ``[precursor_start, end + tol]`` (for ``info_ok`` events, one-step batch outliers that revert, any finding).
* **Delay**: first such alarm minus ``onset`` (negative = before the defining signal moved): median, p90.
* **False alarms** per 10k steps: warning/error alarms merged into incidents (same rank, within ``merge`` steps
  of the previous alarm) outside every ``[precursor_start - guard, end + guard]``; steps are records (rank,
  step) outside those guarded windows. Reported on fully clean runs and on the clean segments of faulty runs.
* **Precursor hit rate**: events whose defining signal moved after the injection (``onset > precursor_start``)
  with an alarm in ``[max(precursor_start, onset - l_pre), onset)``, against a random alarm process at the same
  rate as the detector's false alarms on clean runs: ``P = 1 - exp(-lambda * L)`` per event, averaged.
  ``lambda`` is floored at ``Protocol.min_alarm_rate`` (1 per 10k steps, the false-alarm budget of the targets):
  a detector with fewer clean alarms is compared with a random process that spends the whole budget, so a
  detector that never alarms on clean runs is not credited with a huge ratio.
* **Root cause**: the first alarm of a detected event; AC@k = the true cause is among its first k causes.
* **Faulty rank**: for a cross-rank event, the ranks an alarm blames are those it names as ``rank N`` in its
  text, else the ranks it fired on; the event's rank must be the only blamed one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from stability.evaluation.corpus import Event

__all__ = [
    "Alarm",
    "EventOutcome",
    "KindScore",
    "Protocol",
    "RunResult",
    "Score",
    "blamed_ranks",
    "false_alarms",
    "incidents",
    "match_event",
    "percentile",
    "score",
]

ALERT_SEVERITIES = frozenset({"warning", "error"})
_RANK_TEXT = re.compile(r"\brank (\d+)\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class Protocol:
    """Window parameters (detection.md section 2.6)."""

    tol: int = 10
    """Steps after an event's end during which an alarm still detects it."""
    guard: int = 50
    """Steps around each event window excluded from false-alarm counting."""
    l_pre: int = 200
    """Longest precursor window."""
    merge: int = 20
    """Alarms of one rank within this many steps of the previous one form one incident."""
    min_alarm_rate: float = 1e-4
    """Floor of the random alarm process's rate per step for the precursor comparison (the FA budget)."""
    any_severity: bool = False
    """Recall, delay and AC@k count any finding, INFO included (issue #8: "recall at any severity"); false
    alarms are still warnings and errors only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Alarm:
    """One alarm of a detector (a finding, or a baseline rule firing)."""

    step: int
    rank: int = 0
    severity: str = "error"
    kind: str = ""
    causes: tuple[str, ...] = ()
    """Ranked cause ids, best first (empty for detectors without root-cause ranking)."""
    text: str = ""
    """Message and evidence (searched for ``rank N``)."""

    @property
    def alert(self) -> bool:
        """A warning or an error (infos are not alerts)."""
        return self.severity in ALERT_SEVERITIES


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """One run's labels and one detector's alarms on it."""

    name: str
    events: Sequence[Event]
    alarms: Sequence[Alarm]
    steps: Mapping[int, Sequence[int]]
    """Rank -> recorded steps."""
    clean: bool = False
    count_false_alarms: bool = True
    """False for excerpts cut around an event (no clean segment to speak of)."""
    source: str = "synthetic"


@dataclass(frozen=True, slots=True, kw_only=True)
class EventOutcome:
    """How one event was scored."""

    run: str
    source: str
    event: Event
    first: Alarm | None
    delay: int | None
    precursor_lead: int | None
    """``onset - step`` of the first alarm before the onset (None: none, or not eligible)."""
    ac1: bool | None
    ac3: bool | None
    rank_named: bool | None
    first_alert: Alarm | None = None
    """The first warning/error in the event window (the first finding ``first`` may be an INFO)."""


@dataclass(slots=True)
class KindScore:
    """Aggregates of one event kind."""

    events: int = 0
    detected: int = 0
    delays: list[int] = field(default_factory=list)

    @property
    def recall(self) -> float:
        return self.detected / self.events if self.events else math.nan

    @property
    def median_delay(self) -> float:
        return percentile(self.delays, 50)

    @property
    def p90_delay(self) -> float:
        return percentile(self.delays, 90)


@dataclass(slots=True)
class Score:
    """Everything measured for one detector over one corpus."""

    kinds: dict[str, KindScore]
    outcomes: list[EventOutcome]
    clean_alarms: int
    clean_steps: int
    segment_alarms: int
    segment_steps: int
    precursor_events: int
    precursor_hits: int
    random_hit_rate: float
    rca_events: int
    ac1: int
    ac3: int
    rank_events: int
    ranks_named: int
    false_alarm_runs: list[tuple[str, int]] = field(default_factory=list)
    """(run, step) of each false-alarm incident."""
    clean_by_source: dict[str, list[int]] = field(default_factory=dict)
    """Source (``synthetic``, ``real-clean``) -> [false alarms, steps] on its clean runs."""

    def by_source(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, source) -> (detected, events)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for o in self.outcomes:
            hit, n = out.get((o.event.kind, o.source), (0, 0))
            out[(o.event.kind, o.source)] = (hit + (o.first is not None), n + 1)
        return out

    def fa_per_10k(self, source: str) -> float:
        """False alarms per 10k steps on the clean runs of one source."""
        alarms, steps = self.clean_by_source.get(source, [0, 0])
        return 1e4 * alarms / steps if steps else math.nan

    @property
    def events(self) -> int:
        return sum(k.events for k in self.kinds.values())

    @property
    def detected(self) -> int:
        return sum(k.detected for k in self.kinds.values())

    @property
    def recall(self) -> float:
        return self.detected / self.events if self.events else math.nan

    @property
    def fa_clean_per_10k(self) -> float:
        return 1e4 * self.clean_alarms / self.clean_steps if self.clean_steps else math.nan

    @property
    def fa_segments_per_10k(self) -> float:
        return 1e4 * self.segment_alarms / self.segment_steps if self.segment_steps else math.nan

    @property
    def precursor_hit_rate(self) -> float:
        return self.precursor_hits / self.precursor_events if self.precursor_events else math.nan

    @property
    def precursor_leads(self) -> list[int]:
        """Lead (onset - first alert) of every precursor hit."""
        return [o.precursor_lead for o in self.outcomes if o.precursor_lead is not None]

    @property
    def precursor_ratio(self) -> float:
        if not self.precursor_events or not self.random_hit_rate:
            return math.nan
        return self.precursor_hit_rate / self.random_hit_rate

    @property
    def ac1_rate(self) -> float:
        return self.ac1 / self.rca_events if self.rca_events else math.nan

    @property
    def ac3_rate(self) -> float:
        return self.ac3 / self.rca_events if self.rca_events else math.nan

    @property
    def ranks_named_rate(self) -> float:
        return self.ranks_named / self.rank_events if self.rank_events else math.nan

    def to_dict(self) -> dict[str, object]:
        """Plain numbers (NaN as None) for ``--json``."""
        def num(x: float) -> float | None:
            return None if isinstance(x, float) and math.isnan(x) else x
        return {
            "recall": num(self.recall), "events": self.events, "detected": self.detected,
            "kinds": {k: {"events": v.events, "detected": v.detected, "recall": num(v.recall),
                          "median_delay": num(v.median_delay), "p90_delay": num(v.p90_delay)}
                      for k, v in sorted(self.kinds.items())},
            "false_alarms_clean": {"alarms": self.clean_alarms, "steps": self.clean_steps,
                                   "per_10k": num(self.fa_clean_per_10k)},
            "false_alarms_clean_by_source": {k: {"alarms": a, "steps": n, "per_10k": num(self.fa_per_10k(k))}
                                             for k, (a, n) in sorted(self.clean_by_source.items())},
            "false_alarms_segments": {"alarms": self.segment_alarms, "steps": self.segment_steps,
                                      "per_10k": num(self.fa_segments_per_10k)},
            "false_alarm_incidents": [list(x) for x in self.false_alarm_runs],
            "precursor": {"events": self.precursor_events, "hits": self.precursor_hits,
                          "hit_rate": num(self.precursor_hit_rate), "random_hit_rate": num(self.random_hit_rate),
                          "median_lead": num(percentile(self.precursor_leads, 50)),
                          "ratio": num(self.precursor_ratio)},
            "rca": {"events": self.rca_events, "ac1": num(self.ac1_rate), "ac3": num(self.ac3_rate)},
            "faulty_rank": {"events": self.rank_events, "named": self.ranks_named},
            "outcomes": [{"run": o.run, "source": o.source, "kind": o.event.kind, "cause": o.event.cause,
                          "onset": o.event.onset, "end": o.event.end, "rank": o.event.rank,
                          "alert_step": None if o.first is None else o.first.step,
                          "alert_kind": None if o.first is None else o.first.kind,
                          "causes": [] if o.first is None else list(o.first.causes[:3]), "delay": o.delay,
                          "precursor_lead": o.precursor_lead} for o in self.outcomes],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """``numpy.percentile`` (linear), NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def incidents(alarms: Iterable[Alarm], merge: int) -> list[Alarm]:
    """Alerts (warning/error) merged per rank: an alarm within ``merge`` steps of the previous one joins it."""
    out: list[Alarm] = []
    last: dict[int, int] = {}
    for alarm in sorted((a for a in alarms if a.alert), key=lambda a: (a.step, a.rank)):
        prev = last.get(alarm.rank)
        last[alarm.rank] = alarm.step
        if prev is None or alarm.step - prev > merge:
            out.append(alarm)
    return out


def match_event(event: Event, alarms: Iterable[Alarm], tol: int, *, any_severity: bool = False) -> Alarm | None:
    """The first alert (any finding when ``event.info_ok`` or ``any_severity``) in ``[precursor_start, end + tol]``
    (any rank)."""
    inside = [a for a in alarms if (a.alert or event.info_ok or any_severity)
              and event.precursor_start <= a.step <= event.end + tol]
    return min(inside, key=lambda a: (a.step, a.rank)) if inside else None


def blamed_ranks(alarms: Iterable[Alarm]) -> set[int]:
    """Ranks named as ``rank N`` in the alarms' text, else the ranks the alarms fired on."""
    alarms = list(alarms)
    named = {int(m) for a in alarms for m in _RANK_TEXT.findall(a.text)}
    return named or {a.rank for a in alarms}


def false_alarms(result: RunResult, protocol: Protocol) -> tuple[list[Alarm], int]:
    """False-alarm incidents of a run and the number of (rank, step) records they were counted over."""
    guarded = [(e.precursor_start - protocol.guard, e.end + protocol.guard) for e in result.events]

    def outside(step: int) -> bool:
        return not any(lo <= step <= hi for lo, hi in guarded)

    steps = sum(1 for rank_steps in result.steps.values() for s in rank_steps if outside(s))
    return [a for a in incidents(result.alarms, protocol.merge) if outside(a.step)], steps


def _outcome(result: RunResult, event: Event, protocol: Protocol) -> EventOutcome:
    first = match_event(event, result.alarms, protocol.tol, any_severity=protocol.any_severity)
    first_alert = first if first is not None and first.alert else match_event(
        replace(event, info_ok=False), result.alarms, protocol.tol)
    lead = None
    if event.onset > event.precursor_start:
        lo = max(event.precursor_start, event.onset - protocol.l_pre)
        early = [a.step for a in result.alarms if a.alert and lo <= a.step < event.onset]
        lead = event.onset - min(early) if early else None
    ac1 = ac3 = named = None
    if first is not None and event.cause is not None:
        ac1, ac3 = event.cause in first.causes[:1], event.cause in first.causes[:3]
    if event.rank is not None:
        window = [a for a in result.alarms if a.alert and event.precursor_start <= a.step <= event.end + protocol.tol]
        named = bool(window) and blamed_ranks(window) == {event.rank}
    return EventOutcome(run=result.name, source=result.source, event=event, first=first,
                        delay=None if first is None else first.step - event.onset, precursor_lead=lead,
                        ac1=ac1, ac3=ac3, rank_named=named, first_alert=first_alert)


def score(results: Iterable[RunResult], protocol: Protocol | None = None) -> Score:
    """Score one detector's alarms over a corpus."""
    p = protocol or Protocol()
    results = list(results)
    out = Score(kinds={}, outcomes=[], clean_alarms=0, clean_steps=0, segment_alarms=0, segment_steps=0,
                precursor_events=0, precursor_hits=0, random_hit_rate=math.nan, rca_events=0, ac1=0, ac3=0,
                rank_events=0, ranks_named=0)
    windows: list[int] = []
    for result in results:
        if result.count_false_alarms:
            fas, steps = false_alarms(result, p)
            out.false_alarm_runs += [(result.name, a.step) for a in fas]
            if result.clean:
                out.clean_alarms, out.clean_steps = out.clean_alarms + len(fas), out.clean_steps + steps
                per = out.clean_by_source.setdefault(result.source, [0, 0])
                per[0], per[1] = per[0] + len(fas), per[1] + steps
            else:
                out.segment_alarms, out.segment_steps = out.segment_alarms + len(fas), out.segment_steps + steps
        for event in result.events:
            o = _outcome(result, event, p)
            out.outcomes.append(o)
            kind = out.kinds.setdefault(event.kind, KindScore())
            kind.events += 1
            if o.first is not None:
                kind.detected += 1
                assert o.delay is not None
                kind.delays.append(o.delay)
            if event.onset > event.precursor_start:
                out.precursor_events += 1
                out.precursor_hits += o.precursor_lead is not None
                windows.append(min(p.l_pre, event.onset - event.precursor_start))
            if o.ac1 is not None:
                out.rca_events += 1
                out.ac1 += bool(o.ac1)
                out.ac3 += bool(o.ac3)
            if o.rank_named is not None:
                out.rank_events += 1
                out.ranks_named += bool(o.rank_named)
    if windows and out.clean_steps:
        lam = max(out.clean_alarms / out.clean_steps, p.min_alarm_rate)
        out.random_hit_rate = float(np.mean([1.0 - math.exp(-lam * w) for w in windows]))
    return out
