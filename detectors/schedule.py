"""The LR schedule, learned online from the ``lr`` signal, and the ``lr_off_schedule`` finding.

:class:`LrSchedule` is the one place that knows the schedule (the detectors, the history and the ranking read it).
From the logged LR alone it learns, in O(1) per record:

* the **warm-up**: a rise that starts within the first ``settle`` records (from the first record of an excerpt
  that starts mid-ramp too). It may pause: an LR printed with few decimals repeats a value for several records
  on a long ramp (llm.c's 6 decimals: 0.000003 twice), so it ends only when the LR *falls* below its maximum, or
  stays under it for ``settle`` records and 3x the longest pause between its new maxima. Linear, exponential
  or any monotone warm-up of any length is one ramp.
* the **peak** (the largest LR on the schedule) and the **departure level** ``anchor``: the lowest LR since the
  LR last fell (on a decay it follows the LR down; on a constant phase it stays put).
* after the warm-up every rise is judged. Decays of any shape (cosine, linear, inverse sqrt, WSD, steps, planned
  drops) never rise. Explained rises: a **restart** (one record jumps >= ``jump_factor`` back to at most
  ``peak_tol`` x the peak, a previously seen level, and the next record does not rise again: SGDR, hard
  restarts, a planned re-raise; an exponential rise logged every N steps is a chain of such "jumps", so a
  second rising record undoes the restart) and a **re-warm** (a ramp that starts with a >= ``jump_factor``
  jump out of an annealed floor below ``rewarm_floor`` of the peak, and stays under the peak; the first
  record that does not rise ends it: a restart out of the floor is a one-record re-warm).
  Float noise: changes below ``noise`` (relative) are no change, and a rise must span ``quanta`` logging quanta
  (the printing resolution shown by small LR changes: llm.c prints 6 decimals, so near the end of its decay
  0.000001 -> 0.000002 would be a 2x "rise").
* **Fallen off schedule** (the same finding, evidence ``fell``, cause ``lr_too_low``): a one-record fall of
  ``fall_factor`` (100x; to 0, say) after the warm-up, from at least ``rewarm_floor`` of the peak to below it (an
  LR back from a spike lands on its schedule), that the slope into the last record did not predict (a linear decay
  ending at 0 predicts it). The training all but stops.
* **Off schedule** (:class:`ScheduleDetector`, a WARNING ``lr_off_schedule``, cause ``lr_too_high``): a rise to
  ``rise_factor`` (1.2x) over the departure level that is neither (a slow drift of ~1.5 %/step reaches 1.2x in
  10-13 steps; logged every 10 steps, in 1-2 records), or a one-record jump above the peak (an LR spike).
  One finding per departure; it re-arms when the LR falls again. The peak is the warm-up's: an off-schedule
  rise never becomes the schedule.

Calibration: the invariant (a schedule does not rise outside warm-up and restarts) sets the rule; the numbers
are margins. ``rise_factor`` 1.2x is 40x the largest relative LR increase of llm.c's 6-decimal log after its
warm-up (0, it decays) and of float round-off (1e-7); on the clean synthetic schedules (warm-up + cosine,
linear, constant, step) no post-warm-up record rises at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stability.detectors._stats import plural
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord

__all__ = ["LrSchedule", "OffSchedule", "ScheduleConfig", "ScheduleDetector", "resolution"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleConfig:
    """Settings of :class:`LrSchedule`."""

    settle: int = 20
    """Records without a new maximum that end the warm-up (at least 3x its longest pause)."""
    rise_factor: float = 1.2
    """An unexplained rise to this many times the departure level is off schedule."""
    quanta: float = 3.0
    """... and spans at least this many logging quanta (the smallest LR change seen)."""
    peak_tol: float = 1.5
    """A restart lands at most this many times the peak seen (a warm-up multiplied into a cosine never reaches
    the nominal base LR that the restarts go back to: 1.24x in the families corpus's SGDR runs)."""
    rewarm_floor: float = 0.05
    """A ramp starting below this fraction of the peak, up to the peak, is a re-warm."""
    noise: float = 1e-3
    """Relative LR changes below this are float noise."""
    jump_factor: float = 1.5
    """A one-record rise of this much after >= 5 non-rising records is a *jump* (``last_jump``, for ranking)."""
    fall_factor: float = 100.0
    """A one-record fall of this much (to 0, say) out of a flat or slowly decaying LR is off the schedule (a
    scheduler whose horizon is shorter than the run, a misconfigured ``LambdaLR``): ``lr_off_schedule``, cause
    ``lr_too_low``. Planned drops are 10x (step schedules' 0.1); decays that end at 0 get there on their trend."""


@dataclass(frozen=True, slots=True)
class OffSchedule:
    """An unexplained LR rise."""

    start: int
    """First step above the departure level."""
    anchor_step: int
    anchor: float
    """LR at the departure."""
    lr: float
    peak: float
    records: int
    """Records the rise took."""

    @property
    def factor(self) -> float:
        """``lr / anchor``."""
        return self.lr / self.anchor


_RESOLUTIONS: dict[float, float] = {}
"""Cache of :func:`resolution` (an LR takes few distinct values; ``repr`` is the cost). Equal floats give the same
resolution (0.0 and -0.0 both give 1.0), so the float is the key."""


def resolution(value: float) -> float:
    """Place value of the last significant digit of ``value``'s shortest repr: 1e-06 for 0.000526 (an LR printed
    with 6 decimals), ~1e-20 for a float computed by a scheduler."""
    found = _RESOLUTIONS.get(value)
    if found is None:
        if len(_RESOLUTIONS) >= 4096:
            _RESOLUTIONS.clear()
        found = _RESOLUTIONS[value] = _resolution(value)
    return found


def _resolution(value: float) -> float:
    text = repr(value)
    mantissa, _, exponent = text.partition("e")
    decimals = len(mantissa.partition(".")[2].rstrip("0"))
    return 10.0 ** (int(exponent or 0) - decimals)


class LrSchedule:
    """Online model of the LR schedule (see the module docstring).

    Attributes read elsewhere: ``rising`` (the warm-up ramp still rises), ``warmup_end`` (first non-rising step
    after it), ``ramp_started``, ``peak``, ``records``, ``last_jump`` / ``jump_factor`` (the latest one-record
    jump out of a flat or decaying LR) and ``off_since`` (start of the current off-schedule rise, or None).
    """

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        self.config = config or ScheduleConfig()
        self.last: float | None = None
        self.last_step = 0
        self.records = 0
        self.quantum = math.inf
        """Printing resolution shown by LR changes of a few last digits in the warm-up or a decrease (inf while
        unknown: an LR that never changed, or only jumped between round values, tells nothing about it)."""
        self.warming = True
        """The initial phase (before and during the warm-up ramp) is not over."""
        self.ramp_started = False
        self.rising = False
        self.warmup_end: int | None = None
        self.ramp_max = 0.0
        self.since_max = 0
        self.ramp_gap = 0
        self.peak = 0.0
        self.anchor = 0.0
        self.anchor_step = 0
        self.anchor_records = 0
        """``records`` at the departure level."""
        self.top = 0.0
        """Largest LR since the departure level."""
        self.flat_run = 0
        self.last_jump: int | None = None
        self.jump_factor = 1.0
        self.off_since: int | None = None
        self.alerted = False
        self.rewarming = False
        """The current rise started with a jump out of the annealed floor (a re-warm)."""
        self.restart: tuple[float, int, int] | None = None
        """Departure level before a restart seen at the previous record (restored if the LR keeps rising)."""
        self._steady = self.config.noise >= 0
        """An unchanged LR cannot count as a rise (``lr > lr * (1 + noise)`` is false): :meth:`update`'s shortcut."""

    def update(self, step: int, lr: float) -> OffSchedule | None:
        """Consume the LR of one record (non-finite or non-positive values are ignored); an unexplained rise
        the first time it is seen."""
        if lr == self.last and not self.warming and self._steady and self.last is not None:
            # the same LR again after the warm-up (most records): what the general path below does then, less
            # its tests that cannot pass (no rise, no jump, no quantum change)
            self.records += 1
            self.last, self.last_step, prev_step = lr, step, self.last_step
            self.flat_run += 1
            return self._judge(step, lr, lr, prev_step)
        if not math.isfinite(lr) or lr <= 0:
            return None
        cfg = self.config
        self.records += 1
        last = self.last
        self.last, self.last_step, prev_step = lr, step, self.last_step
        if last is None:
            self.ramp_max = self.peak = self.anchor = self.top = lr
            self.anchor_step, self.anchor_records = step, self.records
            return None
        up = lr > last * (1 + cfg.noise)
        if up and self.flat_run >= 5 and lr >= cfg.jump_factor * last:
            self.last_jump, self.jump_factor = step, lr / last
        self.flat_run = 0 if up else self.flat_run + 1
        found = None
        if self.warming:
            self._warmup(step, lr)
        else:
            found = self._judge(step, lr, last, prev_step)
        if lr < last or (lr > last and self.warming):
            step_res = min(resolution(lr), resolution(last))
            if abs(lr - last) <= cfg.quanta * step_res:
                self.quantum = min(self.quantum, step_res)  # a change of a few printed digits (not a rise to judge)
        return found

    @property
    def _q(self) -> float:
        """The logging quantum, 0 while unknown."""
        return 0.0 if math.isinf(self.quantum) else self.quantum

    def _warmup(self, step: int, lr: float) -> None:
        cfg = self.config
        if lr > self.ramp_max * (1 + cfg.noise):
            if self.ramp_started:
                self.ramp_gap = max(self.ramp_gap, self.since_max + 1)
            self.ramp_max, self.since_max = lr, 0
            self.ramp_started = self.rising = True
            self.warmup_end = None
            return
        self.since_max += 1
        if self.rising:
            self.rising, self.warmup_end = False, step
        fell = lr < self.ramp_max * (1 - cfg.noise) and self.ramp_max - lr > cfg.quanta * self._q
        if fell or self.since_max >= max(cfg.settle, 3 * self.ramp_gap):
            self.warming = False  # (no ramp: no warm-up, ``warmup_end`` stays None)
            self.peak = max(self.peak, self.ramp_max)
            self._depart(step, lr)

    def _depart(self, step: int, lr: float) -> None:
        self.anchor, self.anchor_step, self.anchor_records, self.top = lr, step, self.records, lr
        self.off_since, self.alerted, self.rewarming = None, False, False

    def _judge(self, step: int, lr: float, last: float, prev_step: int) -> OffSchedule | None:
        cfg = self.config
        if self.restart is not None:  # the record after a restart: rising again means it was part of a rise
            if lr > last * (1 + cfg.noise):
                self.anchor, self.anchor_step, self.anchor_records = self.restart
            self.restart = None
        if self.rewarming and lr <= last * (1 + cfg.noise):  # the re-warm (or restart out of the floor) is over
            self._depart(step, lr)
            return None
        if lr < self.top * (1 - cfg.noise) and self.top - lr > self._q:  # fell: a new departure level
            self._depart(step, lr)
            return None
        self.top = max(self.top, lr)
        if lr <= self.anchor:
            self.anchor, self.anchor_step, self.anchor_records = lr, step, self.records
            return None
        if lr < cfg.rise_factor * self.anchor or lr - self.anchor < cfg.quanta * self._q:
            return None
        one_record = last <= self.anchor * (1 + cfg.noise)
        jump = one_record and lr >= cfg.jump_factor * self.anchor
        if lr <= self.peak * cfg.peak_tol and (jump or self.rewarming):
            if jump and self.anchor <= cfg.rewarm_floor * self.peak:
                self.rewarming = True  # a ramp out of the annealed floor: explained up to the peak
            elif jump and not self.rewarming:  # a restart (confirmed unless the next record rises again)
                self.restart = (self.anchor, self.anchor_step, self.anchor_records)
                self._depart(step, lr)
            return None
        if self.off_since is None:
            self.off_since = prev_step + 1 if one_record else self.anchor_step + 1
        if self.alerted:
            return None
        self.alerted = True
        return OffSchedule(self.off_since, self.anchor_step, self.anchor, lr, self.peak,
                           self.records - self.anchor_records)

    def in_warmup(self, step: int, gate: float = 1.0) -> bool:
        """True while the warm-up ramp rises, or at ``step`` before ``gate`` times the step it ended."""
        end = self.warmup_end
        return self.rising or (end is None and self.ramp_started) or (end is not None and step < gate * end)

    _STATE = ("last", "last_step", "records", "quantum", "warming", "ramp_started", "rising", "warmup_end",
              "ramp_max", "since_max", "ramp_gap", "peak", "anchor", "anchor_step", "anchor_records", "top",
              "flat_run", "last_jump", "jump_factor", "off_since", "alerted", "rewarming", "restart")
    """The attributes :meth:`state_dict` saves, in ``__init__``'s order. Named, not read from ``vars(self)``: on
    CPython 3.11+ reading an object's ``__dict__`` turns its inline attributes into a dict for good, which slows
    every later attribute read of this hot object (a worker snapshots thousands of ranks' trackers)."""

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (``quantum`` is ``None`` while unknown)."""
        state = {k: getattr(self, k) for k in self._STATE}
        state["quantum"] = None if math.isinf(self.quantum) else self.quantum
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a state of the older tracker keeps the fields it has)."""
        for key, value in state.items():
            if key in self._STATE:
                setattr(self, key, value)
        if self.restart is not None:
            anchor, anchor_step, records = self.restart
            self.restart = (float(anchor), int(anchor_step), int(records))
        self.quantum = math.inf if state.get("quantum") is None else float(state["quantum"])
        if "warming" not in state:  # an older tracker's state: its warm-up was over once it had ended
            self.warming = self.warmup_end is None


class ScheduleDetector:
    """``lr_off_schedule``: the LR rose outside its warm-up and its restarts, or fell off its schedule (see the
    module docstring)."""

    name = "schedule"
    kind = "lr_off_schedule"

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        self.schedule = LrSchedule(config)
        self.trend: tuple[int, float] | None = None
        """(step, lr) of the positive LR before the schedule's last one (the slope into the last record)."""
        self.fell = False
        """A fall was reported; re-armed by the next positive LR that is no fall."""

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        lr = record.get("lr")
        sched = self.schedule
        last, last_step = sched.last, sched.last_step
        off = sched.update(record.step, lr)
        fell = None
        if lr is not None and last is not None and lr < last / sched.config.fall_factor:
            fell = self._fell(record, lr, last, last_step)
        elif self.fell and lr is not None and lr > 0:
            self.fell = False
        if sched.last != last or sched.last_step != last_step:
            self.trend = None if last is None else (last_step, last)
        if fell is not None:
            return [fell]
        if off is None:
            return []
        steps = max(1, record.step - off.anchor_step)
        rate = math.log(off.factor) / steps
        if off.lr > off.peak * self.schedule.config.peak_tol and off.records <= 1:
            what = (f"lr jumped {off.factor:.3g}x at step {record.step} ({off.anchor:.3g} -> {off.lr:.3g}), above "
                    f"the schedule's peak {off.peak:.3g} (not a restart)")
        else:
            what = (f"lr rose {off.factor:.3g}x over {plural(steps, 'step')} ({off.anchor:.3g} at step "
                    f"{off.anchor_step} -> {off.lr:.3g}, {100 * math.expm1(rate):+.2g}%/step) after the warm-up, "
                    f"not a restart (peak {off.peak:.3g}): off its learned schedule")
        evidence = {"factor": off.factor, "from": off.anchor, "to": off.lr, "peak": off.peak,
                    "rate": math.expm1(rate), "records": float(off.records)}
        return [Finding(kind=self.kind, step=record.step, onset=min(off.start, record.step), severity=Severity.WARNING,
                        signal="lr", value=off.lr, message=what, detector=self.name,
                        rank=record.rank, host=record.host, score=off.factor, evidence=evidence)]

    def _fell(self, record: StepRecord, lr: float, last: float, last_step: int) -> Finding | None:
        """The LR fell ``fall_factor``x (to 0, say) in one record, from at least ``rewarm_floor`` of its peak to below
        it: off the schedule unless it was still warming up or was heading there (the line through the two records
        before predicts under a tenth of the last LR: the end of a linear decay)."""
        sched, cfg = self.schedule, self.schedule.config
        floor = cfg.rewarm_floor * sched.peak
        if self.fell or sched.warming or not math.isfinite(lr) or last < floor or lr >= floor:
            return None  # (landing at or above the floor: back from an LR spike, or a planned drop)
        if self.trend is not None and last_step > self.trend[0]:
            slope = (last - self.trend[1]) / (last_step - self.trend[0])
            if last + slope * (record.step - last_step) < 0.1 * last:
                return None
        self.fell = True
        what = (f"lr fell from {last:.3g} (step {last_step}) to {lr:.3g} at step {record.step} in one record, off its "
                f"schedule (peak {sched.peak:.3g}): training all but stops at this LR")
        evidence = {"fell": 1.0, "from": last, "to": lr, "peak": sched.peak, "factor": lr / last}
        return Finding(kind=self.kind, step=record.step, onset=record.step, severity=Severity.WARNING, signal="lr",
                       value=lr, message=what, detector=self.name, rank=record.rank, host=record.host,
                       score=last / max(lr, 1e-30), evidence=evidence)

    def finish(self) -> list[Finding]:
        """Nothing to flush."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {**self.schedule.state_dict(), "fall_trend": None if self.trend is None else list(self.trend),
                "fell": self.fell}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.schedule.load_state_dict(state)
        trend = state.get("fall_trend")
        self.trend = None if trend is None else (int(trend[0]), float(trend[1]))
        self.fell = bool(state.get("fell", False))
