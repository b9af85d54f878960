"""Hangs: a rank whose records stop while the others continue, or a training process whose watchdog saw no step.

Engine-level (all ranks), two sources:

* **the watchdog's record** (:class:`stability.hooks.timing.Watchdog`): a record carrying ``hang_s`` says the
  process saw no step complete for that long after the record's step - 1 (all ranks stopped while the process
  lives, or this one); its Python stacks are in ``<run_dir>/hang-rank<r>-step<s>.txt`` -> ``hang`` ERROR at once.
* **silence seen from the others** (:meth:`HangDetector.update`, or :meth:`HangDetector.check` from a sweep with the
  current time): a rank whose last record is older than ``factor`` (2) x its usual step time (median of its last
  ``window`` ``step_time`` values), and at least ``min_s`` (5), behind the record of another rank at least two
  steps further -> ``hang`` ERROR on the silent rank, naming it, its host and its last step.

Only ranks whose records carry ``step_time`` (the timing hooks) are watched, so older corpora raise nothing; forked
Hogwild processes (coordinate ``fork``) only through their own watchdog (each ends when its own loop does). One
finding per rank and last step; a rank that reports again is re-armed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from stability.detectors.base import Finding, Severity
from stability.records import FORK, StepRecord

__all__ = ["HangConfig", "HangDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HangConfig:
    """Settings of :class:`HangDetector`."""

    factor: float = 2.0
    min_s: float = 5.0
    """At least this much silence (records of one rank can reach the worker a little after another's)."""
    window: int = 32
    min_steps: int = 3


@dataclass(slots=True)
class _Rank:
    step: int
    wall: float
    host: str
    times: deque[float]
    reported: int = -1


class HangDetector:
    """Silence of a rank against the others, and the watchdog's ``hang_s`` records (see the module docstring)."""

    name = "hang"

    def __init__(self, config: HangConfig | None = None) -> None:
        self.config = config or HangConfig()
        self._ranks: dict[int, _Rank] = {}

    def update(self, record: StepRecord) -> list[Finding]:
        hang_s = record.signals.get("hang_s")
        if hang_s is not None:
            return self._watchdog(record, hang_s)
        step_time = record.signals.get("step_time")
        if step_time is None or record.coords.get(FORK):  # a Hogwild process may end before the others
            return []
        state = self._ranks.get(record.rank)
        if state is None:
            state = self._ranks[record.rank] = _Rank(record.step, record.wall_time, record.host,
                                                     deque(maxlen=self.config.window))
        if math.isfinite(step_time) and step_time > 0:
            state.times.append(step_time)
        state.step, state.host = record.step, record.host or state.host
        state.wall = max(state.wall, record.wall_time)
        return self.check(record.wall_time, ahead=(record.rank, record.step))

    def limit(self, rank: int) -> float | None:
        """Seconds of silence that make ``rank`` hung (None: too few steps seen)."""
        state = self._ranks.get(rank)
        if state is None or len(state.times) < self.config.min_steps:
            return None
        return max(self.config.min_s, self.config.factor * statistics.median(state.times))

    def check(self, now: float, *, ahead: tuple[int, int] | None = None) -> list[Finding]:
        """Ranks silent for longer than their limit at wall time ``now`` (a sweep passes ``time.time()``).

        ``ahead`` = (rank, step) of the record being read: only ranks at least two steps behind it are judged (ranks
        report one step in turn: the first one past a checkpoint pause is not a sign that the others hang)."""
        out: list[Finding] = []
        for rank, state in self._ranks.items():
            limit = self.limit(rank)
            silent = now - state.wall
            if ahead is not None and (rank == ahead[0] or ahead[1] < state.step + 2):
                continue
            if limit is None or state.reported == state.step or silent < limit:
                continue
            state.reported = state.step
            where = f"rank {rank}" + (f" on {state.host}" if state.host else "")
            moving = [r for r, s in self._ranks.items() if r != rank and s.wall > state.wall]
            others = (f"while rank(s) {', '.join(map(str, sorted(moving)[:8]))} continued" if moving
                      else "and no rank reported since")
            out.append(Finding(
                kind="hang", step=state.step + 1, onset=state.step + 1, severity=Severity.ERROR, signal="step_time",
                value=silent, score=silent / limit, detector=self.name, rank=rank, host=state.host,
                evidence={"silent_s": silent, "limit_s": limit, "last_step": float(state.step)},
                message=f"{where} hung after step {state.step}: no record for {silent:.1f} s (usual step "
                        f"{limit / self.config.factor:.3g} s) {others}"))
        return out

    def _watchdog(self, record: StepRecord, hang_s: float) -> list[Finding]:
        state = self._ranks.get(record.rank)
        last = record.step - 1
        if state is not None:
            if state.reported == last:
                return []
            state.reported = last
        where = f"rank {record.rank}" + (f" on {record.host}" if record.host else "")
        return [Finding(
            kind="hang", step=record.step, onset=record.step, severity=Severity.ERROR, signal="hang_s", value=hang_s,
            score=hang_s, detector=self.name, rank=record.rank, host=record.host,
            evidence={"silent_s": hang_s, "last_step": float(last)},
            message=f"{where}: the training process completed no step for {hang_s:.1f} s after step {last}; "
                    f"its Python stacks are in the run directory (hang-rank{record.rank}-step{record.step}.txt)")]

    def state_dict(self) -> dict[str, Any]:
        return {str(r): {"step": s.step, "wall": s.wall, "host": s.host, "times": list(s.times),
                         "reported": s.reported} for r, s in self._ranks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ranks = {int(r): _Rank(int(v["step"]), float(v["wall"]), str(v["host"]),
                                     deque((float(t) for t in v["times"]), maxlen=self.config.window),
                                     int(v["reported"])) for r, v in state.items()}
