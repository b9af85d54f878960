"""What a post-mortem of logs adds to the detectors' incidents: resume boundaries, fp16 overflow messages and system
events, and the causes only they can evidence (:func:`~stability.detectors.ranking.context_causes`).

* **Resumes**: each segment after the first is a :class:`~stability.detectors.ranking.Boundary`; its loss on the
  steps both runs logged is compared (median relative offset of the first five re-logged steps; converged when the
  last third of the overlap is within 2%). An offset >= 5% with no incident near is a ``resume_offset`` warning of
  its own (``data_pipeline`` when it stays, ``resume_mismatch`` when it converges).
* **fp16 messages** (DeepSpeed ``OVERFLOW!``, fairseq ``overflow detected``): routine overflows (each run of them
  ended by successful steps) are one ``fp16_overflows`` info finding; the scale hitting its minimum, a run of
  >= :data:`OVERFLOW_RUN` overflows in a row, or a log that ends inside a run of >= :data:`END_RUN` overflows is a
  ``loss_scale_collapse`` error (``fp16_loss_scale``); so is an overflow taking the scale to
  :data:`SCALE_FLOOR` or below, and so is a log whose last >= :data:`END_RUN` records all skipped iterations.
* **A rank whose log stops** more than two logging intervals before the others' last step is a ``hang`` warning;
  so is a ``rank_stopped`` event of multi-rank logs (:mod:`stability.sources.ranks`: a rank whose lines stop while
  the others log on), an error when the others' NCCL watchdogs timed out waiting for it; it names the rank, its
  host and its last step, with ``hardware_fault`` when a kernel / nvidia-smi event hit that host.
* **System events** are placed on the step axis (their own step, else the last record at or before their date,
  else the end of the log): NCCL watchdog timeouts / hung tasks are a ``hang`` error, Xid / ECC a
  ``hardware_error`` error (``hardware_fault``; a system-log event on a host names the ranks that ran there), OOM
  kills / NCCL errors an ``infrastructure`` error; each also
  adds its cause to incidents within the window of its step.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy
from stability.detectors.engine import Incident
from stability.detectors.fp16 import LossScaleConfig
from stability.detectors.ranking import LOG_CONTEXT_WINDOW, Boundary, SystemFact, context_causes, merge_causes
from stability.records import StepRecord
from stability.sources._model import SYSTEM_KINDS, LogEvent, Segment

__all__ = ["END_RUN", "OVERFLOW_RUN", "LogAnalysis", "apply_log_context", "boundaries", "place_events"]

OVERFLOW_RUN = 8
"""Overflows in a row (no successful step between) that are no longer routine."""
END_RUN = 4
"""Overflows in a row at the very end of a log (the run gave up or was killed while skipping)."""
SCALE_FLOOR = LossScaleConfig().floor
"""An overflow that takes the scale to this or below is the scale at its minimum (the loss-scale detector's floor)."""
_VERSION_KEYS = frozenset({"deepspeed", "torch", "transformers", "megatron", "apex", "cuda", "nccl"})


@dataclass(frozen=True, slots=True, kw_only=True)
class LogAnalysis:
    """The log context of one post-mortem."""

    boundaries: tuple[Boundary, ...]
    system: tuple[SystemFact, ...]
    versions_known: bool
    from_start: str | None


def _loss_by_step(records: Sequence[StepRecord]) -> dict[int, float]:
    rank = min((r.rank for r in records), default=0)
    return {r.step: r.signals["loss"] for r in records if r.rank == rank and "loss" in r.signals}


def boundaries(records: Sequence[StepRecord], segments: Sequence[Segment]) -> list[Boundary]:
    """One :class:`Boundary` per segment after the first (see the module docstring)."""
    out = []
    for prev, seg in itertools.pairwise(segments):
        old = _loss_by_step(records[prev.start:prev.stop])
        new = _loss_by_step(records[seg.start:seg.stop])
        rel = [new[s] / old[s] - 1.0 for s in sorted(set(old) & set(new))
               if math.isfinite(old[s]) and math.isfinite(new[s]) and old[s] > 0 and new[s] > 0]
        offset = converged = None
        if len(rel) >= 3:
            offset = statistics.median(rel[:5])  # right after the resume
            tail = rel[-max(1, len(rel) // 3):]
            converged = abs(statistics.median(tail)) < 0.02
        changed = tuple(f"{k}: {prev.context[k]} -> {v}" for k, v in seg.context.items()
                        if k in prev.context and prev.context[k] != v)
        out.append(Boundary(step=seg.first_step, resumed_after=prev.last_step, changed=changed, offset=offset,
                            converged=converged))
    return out


def place_events(events: Sequence[LogEvent], records: Sequence[StepRecord]) -> list[tuple[int, LogEvent]]:
    """``(step, event)``: the event's own step, else the last record at or before its date, else the last step."""
    last = max((r.step for r in records), default=0)
    dated = sorted((r.wall_time, r.step) for r in records if r.wall_time > 0)
    times = [t for t, _ in dated]
    out = []
    for event in events:
        step = event.step
        if step is None and event.wall_time is not None and dated:
            i = bisect.bisect_right(times, event.wall_time)
            step = dated[max(i - 1, 0)][1]
        out.append((last if step is None else step, event))
    return out


def _from_start(records: Sequence[StepRecord]) -> str | None:
    if not records:
        return None
    rank = min(r.rank for r in records)
    first = list(itertools.islice((r for r in records if r.rank == rank), 200))
    if len(first) < 3:
        return None
    grads = [r.signals["grad_norm"] for r in first if "grad_norm" in r.signals]
    if grads and not math.isfinite(grads[0]) and sum(not math.isfinite(g) for g in grads) >= 0.9 * len(grads):
        return f"grad norm is non-finite on {sum(not math.isfinite(g) for g in grads)} of {len(grads)} lines"
    losses = [r.signals["loss"] for r in first if "loss" in r.signals]
    if losses and losses[0] == 0.0 and sum(v == 0.0 for v in losses) >= 0.9 * len(losses):
        return f"loss is exactly 0 on {sum(v == 0.0 for v in losses)} of {len(losses)} lines"
    return None


def _finding(kind: str, step: int, severity: Severity, message: str, causes: list[tuple[str, float, str]],
             *, rank: int = 0, host: str = "", value: float = math.nan, signal: str = "log") -> Finding:
    hints = tuple(CauseHint(cause=c, score=s, evidence=e, remedy=remedy(c)) for c, s, e in causes)
    return Finding(kind=kind, step=step, onset=step, severity=severity, signal=signal, value=value, message=message,
                   detector="log", rank=rank, host=host, causes=tuple(sorted(hints, key=lambda h: -h.score)))


def _fp16_findings(placed: Sequence[tuple[int, LogEvent]]) -> list[Finding]:
    overflows = [(s, e) for s, e in placed if e.kind == "overflow"]
    minimum = [(s, e) for s, e in placed if e.kind == "scale_minimum"]
    out = []
    if minimum:
        step, event = minimum[0]
        out.append(_finding("loss_scale_collapse", step, Severity.ERROR, f"the loss scale hit its minimum: "
                            f"{event.message}", [("fp16_loss_scale", 0.95, f"{event.source}: {event.message}")],
                            signal="loss_scale", value=event.value if event.value is not None else math.nan))
    if not overflows:
        return out
    scales = [e.value for _, e in overflows if e.value is not None]
    longest = max((e.count or 1 for _, e in overflows), default=1)
    end_step, end_event = overflows[-1]
    floor = [(s, e) for s, e in overflows if e.value is not None and e.value <= SCALE_FLOOR]
    if floor and not minimum:
        step, event = floor[0]
        text = f"an overflow reduced the loss scale to {event.value:g} (<= {SCALE_FLOOR:g}): gradients underflow"
        found = _finding("loss_scale_collapse", step, Severity.ERROR, text,
                         [("fp16_loss_scale", 0.9, f"{event.source}: {event.message}")], signal="loss_scale",
                         value=event.value if event.value is not None else math.nan)
        out.append(found)
    ending = (end_event.count or 1) >= END_RUN and end_event is placed[-1][1]
    if longest >= OVERFLOW_RUN or ending:
        run = end_event.count or 1 if ending else longest
        i = max(i for i, (_, e) in enumerate(overflows) if (e.count or 1) == run)
        start_step = overflows[i - run + 1][0]
        what = ("the log ends after" if ending else "the scaler skipped") + f" {run} overflows in a row"
        text = f"{what}, loss scale falling to {overflows[i][1].value:g}: skipped iterations that do not stop"
        found = _finding("loss_scale_collapse", overflows[i][0], Severity.ERROR, text,
                         [("fp16_loss_scale", 0.9, f"{overflows[i - run + 1][1].source} .. {overflows[i][1].source}: "
                                                   f"{text}")], signal="loss_scale",
                         value=overflows[i][1].value or math.nan)
        out.append(replace(found, onset=start_step))
    elif not floor and not out:
        text = (f"{len(overflows)} fp16 overflows (longest run {longest}), loss scale between {min(scales):g} and "
                f"{max(scales):g}: routine dynamic loss scaling" if scales else f"{len(overflows)} fp16 overflows")
        found = _finding("fp16_overflows", end_step, Severity.INFO, text,
                         [("fp16_loss_scale", 0.3, text)], signal="loss_scale")
        out.append(replace(found, onset=overflows[0][0]))
    return out


def _skipping_tail(records: Sequence[StepRecord], segments: Sequence[Segment]) -> list[Finding]:
    """The log ends with >= :data:`END_RUN` logged steps all skipped (Megatron's ``number of skipped iterations``,
    DeepSpeed's ``skipped=`` increase): skipped iterations that do not stop."""
    if not segments:
        return []
    last = records[segments[-1].start:segments[-1].stop]
    rank = min((r.rank for r in last), default=0)
    tail: list[StepRecord] = []
    for record in reversed([r for r in last if r.rank == rank]):
        if record.signals.get("skipped", 0.0) <= 0:
            break
        tail.append(record)
    if len(tail) < END_RUN:
        return []
    first, end = tail[-1], tail[0]
    scale = end.signals.get("loss_scale", math.nan)
    text = (f"the log ends with {len(tail)} logged steps ({first.step}-{end.step}) that all skipped iterations"
            + (f", loss scale {scale:g}" if math.isfinite(scale) else "") + ": skipped iterations that do not stop")
    found = _finding("loss_scale_collapse", end.step, Severity.ERROR, text, [("fp16_loss_scale", 0.9, text)],
                     signal="skipped", value=end.signals.get("skipped", math.nan), rank=rank)
    return [replace(found, onset=first.step)]


def _stopped_ranks(records: Sequence[StepRecord], segments: Sequence[Segment],
                   reported: frozenset[int] = frozenset()) -> list[Finding]:
    """A rank whose log stops (in the last segment) more than two of its logging intervals before the others'
    last step: it hung or died while the others went on (or waited in a collective). Ranks in ``reported`` (a
    ``rank_stopped`` event of the multi-rank reader names them) are left to :func:`_rank_hangs`."""
    if not segments:
        return []
    last: dict[int, list[int]] = {}
    for record in records[segments[-1].start:segments[-1].stop]:
        last.setdefault(record.rank, []).append(record.step)
    if len(last) < 2:
        return []
    from stability.sources.ranks.hangs import logging_interval

    newest = max(max(steps) for steps in last.values())
    out = []
    for rank, steps in sorted(last.items()):
        steps.sort()
        interval = logging_interval(steps)
        if newest - steps[-1] > 2 * interval and len(steps) >= 3 and rank not in reported:
            text = f"rank {rank}'s log stops at step {steps[-1]} while other ranks logged up to step {newest}"
            out.append(_finding("hang", steps[-1], Severity.WARNING, text, [("hang", 0.7, text)], rank=rank))
    return out


def _where(event: LogEvent) -> str:
    """`` on node-b (ranks 4-7)`` for a system event matched to the ranks of its host."""
    from stability.sources.ranks import span

    text = f" on {event.host}" if event.host and event.host not in event.message else ""
    if len(event.ranks) > 1:
        text += f" (ranks {span(event.ranks)})"
    elif event.ranks:
        text += f" (rank {event.ranks[0]})"
    return text


def _rank_hangs(placed: Sequence[tuple[int, LogEvent]], hardware: Sequence[tuple[int, LogEvent]]) -> list[Finding]:
    """The ``hang`` findings of ``rank_stopped`` events (:func:`stability.sources.ranks.stopped_ranks`): one per
    stopped rank, an error when the other ranks' NCCL watchdogs timed out waiting (or the kernel saw hung tasks),
    with ``hardware_fault`` when a hardware event hit the rank's host (or any host, when the hosts are unknown)."""
    stopped = [(s, e) for s, e in placed if e.kind == "rank_stopped"]
    waited = [e for _, e in placed if e.kind in ("nccl_timeout", "hung_task")]
    out = []
    for step, event in stopped[:8]:
        causes = [("hang", 0.85 if event.value else 0.7, f"{event.source}: {event.message}")]
        if waited:
            causes[0] = ("hang", 0.85, f"{event.source}: {event.message}; {waited[0].source}: {waited[0].message}")
        mine = [e for _, e in hardware if event.rank in e.ranks or (e.host and e.host == event.host)
                or not (e.host and event.host)]
        if mine:
            causes.append(("hardware_fault", 0.9, f"{mine[0].source}: {mine[0].message}{_where(mine[0])}"))
        severity = Severity.ERROR if event.value or waited else Severity.WARNING
        out.append(_finding("hang", step, severity, event.message, causes, rank=event.rank or 0, host=event.host))
    return out


def _system_findings(placed: Sequence[tuple[int, LogEvent]], last_step: int) -> list[Finding]:
    system = [(s, e) for s, e in placed if e.kind in SYSTEM_KINDS]
    groups = {"hang": [p for p in system if p[1].kind in ("nccl_timeout", "hung_task")],
              "hardware_error": [p for p in system if p[1].kind in ("xid", "ecc")]
              + [p for p in system if p[1].kind == "gpu_throttle"],
              "infrastructure_error": [p for p in system if p[1].kind in ("oom", "nccl_error")]}
    hardware = groups["hardware_error"]
    out = _rank_hangs(placed, hardware)
    for kind, items in groups.items():
        if not items or (kind == "hang" and out):
            continue
        step, event = items[0]
        more = f" (+{len(items) - 1} more)" if len(items) > 1 else ""
        causes: list[tuple[str, float, str]] = []
        throttle_only = False
        if kind == "hang":
            message = f"the log stops at step {last_step}; {event.message}{more}"
            causes.append(("hang", 0.8, f"{event.source}: {event.message}"))
            if hardware:
                causes.append(("hardware_fault", 0.85, f"{hardware[0][1].source}: {hardware[0][1].message}"
                                                       f"{_where(hardware[0][1])}"))
        elif kind == "hardware_error":
            message = f"{event.message}{_where(event)}{more}"
            throttle_only = event.kind == "gpu_throttle"  # errors sort first: only slowdowns, no memory error
            causes.append(("hardware_fault", 0.6 if throttle_only else 0.9, f"{event.source}: {event.message}"))
        else:
            message = f"{event.message}{more}"
            causes.append(("infrastructure", 0.8, f"{event.source}: {event.message}"))
        severity = Severity.WARNING if kind == "hardware_error" and throttle_only else Severity.ERROR
        out.append(_finding(kind, step, severity, message, causes, rank=event.rank or 0, host=event.host))
    return out


def _resume_findings(bounds: Sequence[Boundary], incidents: Sequence[Incident],
                     owner: Mapping[int, int]) -> list[Finding]:
    out = []
    for k, b in enumerate(bounds, start=1):
        if b.offset is None or abs(b.offset) < 0.05:
            continue
        if any(owner.get(id(i)) == k and b.step <= i.onset <= b.step + LOG_CONTEXT_WINDOW for i in incidents):
            continue  # that incident gets the cause
        cause = "resume_mismatch" if b.converged else "data_pipeline"
        how = "and converged back" if b.converged else "and stays so"
        text = (f"after the resume at step {b.step} (previous run logged up to {b.resumed_after}) the loss on the "
                f"re-logged steps differs from the first run's by {b.offset:+.0%} {how}")
        out.append(_finding("resume_offset", b.step, Severity.WARNING, text, [(cause, 0.75, text)], signal="loss",
                            value=b.offset))
    return out


def apply_log_context(incidents: list[Incident], records: Sequence[StepRecord], segments: Sequence[Segment],
                      events: Sequence[LogEvent], *, owner: Mapping[int, int] | None = None
                      ) -> tuple[list[Incident], LogAnalysis]:
    """Add the log findings to ``incidents`` (joining an incident of the same rank within the window when there
    is one) and the log-only causes to every incident's headline; returns the incidents sorted by onset.

    ``owner``: ``id(incident)`` -> index of the segment it was found in (a resume rule applies only to incidents of
    the segment after that resume: a NaN at step 260 before a rollback to 200 is not "right after the resume").
    """
    owner = dict(owner or {})
    placed = place_events(events, records)
    bounds = boundaries(records, segments)
    last_step = max((r.step for r in records), default=0)
    facts = tuple(SystemFact(kind=e.kind, step=s, text=e.message) for s, e in placed if e.kind in SYSTEM_KINDS)
    contexts = [s.context for s in segments]
    analysis = LogAnalysis(boundaries=tuple(bounds), system=facts,
                           versions_known=any(_VERSION_KEYS & set(c) for c in contexts),
                           from_start=_from_start(records[segments[0].start:segments[0].stop]) if segments else None)
    out = list(incidents)
    fp16 = _fp16_findings(placed)
    if not any(f.severity is Severity.ERROR for f in fp16):
        fp16 += _skipping_tail(records, segments)
    reported = frozenset(e.rank for e in events if e.kind == "rank_stopped" and e.rank is not None)
    found = [*fp16, *_system_findings(placed, last_step), *_stopped_ranks(records, segments, reported),
             *_resume_findings(bounds, out, owner)]
    for finding in found:
        near = [i for i in out if i.rank == finding.rank and finding.kind in _JOINS.get(i.headline.kind, ())
                and abs(i.onset - finding.onset) <= LOG_CONTEXT_WINDOW]
        if near:
            near[0].findings.append(finding)
        else:
            out.append(Incident(rank=finding.rank, findings=[finding], alerted=finding.severity,
                                last_step=finding.step))
    first = segments[0].first_step if segments else None
    for incident in out:
        head = incident.headline
        seg = owner.get(id(incident))
        from_start = (analysis.from_start if first is not None and seg in (None, 0) and head.onset - first <= 10
                      else None)
        mine = [b for k, b in enumerate(bounds, start=1) if seg is None or seg == k]
        hints = context_causes(head, incident.end, boundaries=mine, system=analysis.system,
                               versions_known=analysis.versions_known, from_start=from_start)
        if hints:
            index = incident.findings.index(head)
            incident.findings[index] = replace(head, causes=merge_causes(head.causes, hints))
    out.sort(key=lambda i: (i.onset, i.rank))
    return out, analysis


_JOINS: dict[str, tuple[str, ...]] = {
    "loss_scale_collapse": ("loss_scale_collapse", "fp16_overflows"),
    "nan": ("loss_scale_collapse", "fp16_overflows"),
}
"""Engine incident headline kind -> log finding kinds that join it instead of opening a new incident."""
