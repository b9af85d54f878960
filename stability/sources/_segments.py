"""Group records read in log order into segments (one per process lifetime / resume).

A resume from checkpoint N re-logs steps N+1... that the log already holds. Keying rows by (rank, step) and
keeping the last would silently drop what happened before the rollback (the NaN that caused it), so the records
of each segment are kept apart and analysed one after the other (the detectors re-baseline at the step going
back, :class:`~stability.detectors.engine.RunDiagnoser`).

Two policies:

* ``log`` (text logs, JSON lines, event files read in time order): a rank's step going **back** starts a new
  segment; the same step logged again right away is merged into one record (e.g. a DeepSpeed ``step=`` line and the
  loss print of that step); a start-up banner between records starts a new segment too.
* ``table`` (CSV files, which may be sorted or concatenate excerpts in any order): only a (rank, step) that the
  current segment already holds starts a new one; each segment is sorted by (rank, step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from stability.records import StepRecord
from stability.sources._model import Segment

__all__ = ["SegmentBuilder"]


class SegmentBuilder:
    """Collects records in log order; :meth:`finish` returns them grouped by segment, with the segments."""

    def __init__(self, policy: str = "log") -> None:
        if policy not in ("log", "table"):
            raise ValueError(f"unknown segment policy {policy!r}")
        self.policy = policy
        self._done: list[tuple[list[StepRecord], str, int | None, dict[str, str]]] = []
        self._current: dict[tuple[int, int], StepRecord] = {}
        self._last: dict[int, int] = {}
        self._reason = "start"
        self._resumed_after: int | None = None
        self._context: dict[str, str] = {}
        self._pending_banner: dict[str, str] | None = None

    @property
    def last_step(self) -> int | None:
        """Highest step of the current segment (None before the first record)."""
        return max(self._last.values()) if self._last else None

    def banner(self, context: Mapping[str, str] | None = None) -> None:
        """A start-up banner was read: the next record opens a new segment (unless none was read yet)."""
        merged = dict(self._pending_banner or {})
        merged.update(context or {})
        self._pending_banner = merged

    def add_context(self, context: Mapping[str, str]) -> None:
        """Start-up context read outside a banner (a version line): kept for the segment about to start (a
        pending banner, or a segment with no record yet); ignored mid-segment."""
        if self._pending_banner is not None:
            self._pending_banner.update(context)
        elif not self._current:
            self._context.update(context)

    def add(self, record: StepRecord) -> None:
        """Add one record (log order)."""
        if self._pending_banner is not None:
            banner, self._pending_banner = self._pending_banner, None
            if self._current:
                self._close("start-up banner")
            self._context.update(banner)
        key = (record.rank, record.step)
        last = self._last.get(record.rank)
        if self.policy == "log":
            if last is not None and record.step < last:
                self._close("step went back")
                last = None
            elif last == record.step and key in self._current:
                old = self._current[key]
                self._current[key] = replace(old, signals={**old.signals, **record.signals},
                                             wall_time=record.wall_time or old.wall_time, host=record.host or old.host)
                return
        elif key in self._current:
            self._close("step went back")
            last = None
        self._current[key] = record
        self._last[record.rank] = record.step if last is None else max(last, record.step)

    def _close(self, reason: str) -> None:
        records = list(self._current.values())
        if self.policy == "table":
            records.sort(key=lambda r: (r.rank, r.step))
        self._done.append((records, self._reason, self._resumed_after, self._context))
        self._resumed_after = self.last_step
        self._reason = reason
        self._current, self._last, self._context = {}, {}, {}

    def finish(self) -> tuple[list[StepRecord], list[Segment]]:
        """All records, segment by segment, and the segments (empty segments are dropped)."""
        if self._current:
            self._close("end")
        records: list[StepRecord] = []
        segments: list[Segment] = []
        for chunk, reason, after, context in self._done:
            if not chunk:
                continue
            steps = [r.step for r in chunk]
            segments.append(Segment(index=len(segments), start=len(records), stop=len(records) + len(chunk),
                                    first_step=min(steps), last_step=max(steps),
                                    reason=reason if segments else "start",
                                    resumed_after=after if segments else None, context=context))
            records.extend(chunk)
        self._done = []
        return records, segments
