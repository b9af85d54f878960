"""Hangs seen from the logs alone: a rank whose log stops while the other ranks wait for it or go on.

Every rank's last line is kept (:class:`LastLine`: its date, the step the run was at, the text). From these,
:func:`stopped_ranks` makes ``rank_stopped`` events, read by :mod:`stability.sources.analysis` as the ``hang``
finding:

* some ranks report NCCL watchdog timeouts: the ranks of the world (``world_size`` of the start-up arguments, else
  the highest rank seen + 1) that reported none, when they are at most half of it, are the ones waited for;
* otherwise a rank that printed at >= 3 different steps and whose last line is more than two logging intervals (or
  two of its own widest gaps between lines, for a rank that prints now and then) behind the newest step any rank
  printed at.

A rank whose lines carry no step (it prints no training records) is placed by the date of its last line on the
run's records, where both are dated.
"""

from __future__ import annotations

import bisect
import itertools
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from stability.records import StepRecord
from stability.sources._model import LogEvent

_WATCHDOG_WORK = re.compile(r"SeqNum=(\d+),\s*OpType=(\w+)")


@dataclass(slots=True)
class LastLine:
    """What one rank's log last said, kept line by line (:meth:`note`)."""

    last_wall: float | None = None
    first_wall: float | None = None
    dated: int = 0
    """Lines that carried a date."""
    last_step: int | None = None
    steps: int = 0
    """Distinct steps the run was at when this rank printed (a rank that printed only at start-up has 1)."""
    gap: int = 0
    """Largest step gap seen so far between two of its lines (how sparsely this rank prints)."""
    last_line: str = ""
    last_source: str = ""

    def note(self, wall: float | None, at: int | None, line: str, where: str) -> None:
        """A line: its date (``wall``), the step the run was at (``at``), its text and ``file:line``."""
        if wall is not None:
            self.last_wall = wall
            self.first_wall = self.first_wall if self.first_wall is not None else wall
            self.dated += 1
        if at is not None and at != self.last_step:
            self.steps += 1
            if self.last_step is not None:
                self.gap = max(self.gap, at - self.last_step)
        self.last_step = at if at is not None else self.last_step
        self.last_line, self.last_source = line.strip()[:200], where


def span(ranks: Iterable[int]) -> str:
    """``0-3, 5`` for a set of ranks."""
    items = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(out)


def logging_interval(steps: Iterable[int]) -> float:
    """The median gap between the distinct logged steps (1 with fewer than two)."""
    ordered = sorted(set(steps))
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    return statistics.median(gaps) if gaps else 1


def stopped_ranks(lines: Iterable[tuple[int, LastLine]], hosts: dict[int, str], records: Sequence[StepRecord],
                  events: Sequence[LogEvent], context: dict[str, str]) -> list[LogEvent]:
    """``rank_stopped`` events: ranks whose log stops while the others wait or go on (see the module docstring).

    ``lines``: each stream's rank and last line (a rank may have several streams: its newest counts)."""
    last = _last_by_rank(lines, records)
    waiting = [e for e in events if e.kind == "nccl_timeout" and e.rank is not None]
    waiters = {e.rank for e in waiting if e.rank is not None}
    newest = max((s.last_step for s in last.values() if s.last_step is not None), default=None)
    if waiters:
        world_text = context.get("world_size", "")
        world = int(world_text) if world_text.isdigit() else max([*last, *waiters], default=-1) + 1
        return _waited_for(last, waiting, waiters, world, newest, hosts)
    if newest is None:
        return []
    lowest = min((r.rank for r in records), default=0)
    interval = logging_interval(r.step for r in records if r.rank == lowest)
    out: list[LogEvent] = []
    for rank, s in sorted(last.items()):
        if s.last_step is None or s.steps < 3 or newest - s.last_step <= 2 * max(interval, s.gap):
            continue
        where = _where(rank, hosts)
        ahead = sorted(r for r, o in last.items() if o.last_step is not None and o.last_step > s.last_step)
        out.append(LogEvent(kind="rank_stopped", message=f"{where}: its log stops at step {s.last_step} "
                            f"({s.last_source}: {s.last_line}) while rank(s) {span(ahead)} went on to step {newest}",
                            source=s.last_source, step=s.last_step, wall_time=s.last_wall, rank=rank,
                            host=hosts.get(rank, ""), value=0.0))
    return out


def _last_by_rank(lines: Iterable[tuple[int, LastLine]], records: Sequence[StepRecord]) -> dict[int, LastLine]:
    """Each rank's newest last line; one with no step is placed by its date on the run's records."""
    timeline = sorted((r.wall_time, r.step) for r in records if r.wall_time > 0)
    times = [t for t, _ in timeline]
    last: dict[int, LastLine] = {}
    for rank, s in lines:
        if s.last_step is None and s.last_wall is not None and timeline:
            step = timeline[max(bisect.bisect_right(times, s.last_wall) - 1, 0)][1]
            first = timeline[max(bisect.bisect_right(times, s.first_wall or 0.0) - 1, 0)][1]
            s = replace(s, last_step=step, steps=3 if s.dated >= 3 and step > first else 1)
        old = last.get(rank)
        if old is None or (s.last_step or -1) > (old.last_step or -1):
            last[rank] = s
    return last


def _waited_for(last: dict[int, LastLine], waiting: Sequence[LogEvent], waiters: set[int], world: int,
                newest: int | None, hosts: dict[int, str]) -> list[LogEvent]:
    """The ranks of the world that reported no NCCL watchdog timeout while the others did (at most half of it)."""
    suspects = sorted(set(range(world)) - waiters) if world <= 65536 else []
    if not suspects or len(suspects) > max(1, world // 2):
        return []
    timeout = waiting[0]
    work = _WATCHDOG_WORK.search(timeout.message)
    what = f" in {work.group(2)} SeqNum={work.group(1)}" if work else ""
    if not any(r in last for r in suspects):  # none of them is in these logs (e.g. another node's console)
        text = (f"rank(s) {span(suspects)} are not in these logs; rank(s) {span(waiters)} timed out waiting"
                f"{what} (NCCL watchdog): the rank that stopped is among them")
        return [LogEvent(kind="rank_stopped", message=text, source=timeout.source, step=timeout.step,
                         wall_time=timeout.wall_time, rank=suspects[0], host=hosts.get(suspects[0], ""), value=1.0)]
    out: list[LogEvent] = []
    for rank in suspects[:8]:
        quiet = last.get(rank)
        if quiet is None:
            text = f"{_where(rank, hosts)} printed nothing"
            step = timeout.step if timeout.step is not None else newest
        else:
            step = quiet.last_step
            text = f"{_where(rank, hosts)}: its log stops" + (f" at step {step}" if step is not None else "") + \
                f" ({quiet.last_source}: {quiet.last_line})"
        out.append(LogEvent(kind="rank_stopped", message=f"{text} while rank(s) {span(waiters)} timed out waiting "
                            f"for it{what} (NCCL watchdog)", source=quiet.last_source if quiet else timeout.source,
                            step=step, wall_time=quiet.last_wall if quiet else None, rank=rank,
                            host=hosts.get(rank, ""), value=1.0))
    return out


def _where(rank: int, hosts: dict[int, str]) -> str:
    host = hosts.get(rank, "")
    return f"rank {rank}" + (f" on {host}" if host else "")
