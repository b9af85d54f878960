"""Stream entry IDs of record streams: ``"<wall-time ms>-<step>"``, strictly increasing per emitter.

An ID is assigned once, when a record is queued, and travels with it into the spool, so every resend of a record
carries the same ID and Redis rejects it as "equal or smaller than the target stream top item" instead of storing
it twice.
"""

from __future__ import annotations

import math
import time

from stability.errors import RecordError

__all__ = ["IdClock", "parse_id"]


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    """Split a stream entry ID ``"<ms>-<seq>"`` into ``(ms, seq)``; for record streams ``seq`` is the step.

    Raises:
        RecordError: ``entry_id`` is not of that form.
    """
    text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
    ms, sep, seq = text.partition("-")
    if not (sep and ms.isdigit() and seq.isdigit() and ms.isascii() and seq.isascii()):
        raise RecordError(f"stream entry id {entry_id!r} is not of the form '<ms>-<seq>'")
    return int(ms), int(seq)


class IdClock:
    """Assigns strictly increasing entry IDs ``(ms, step)``: wall-time ms, bumped when it would not increase."""

    def __init__(self) -> None:
        self.last = (0, 0)

    def next(self, wall_time: float, step: int) -> str:
        """The ID of a record of ``step`` taken at ``wall_time`` (seconds; <= 0 or not finite: now)."""
        if not (wall_time > 0 and math.isfinite(wall_time)):
            wall_time = time.time()
        ms = max(int(wall_time * 1000), self.last[0])
        if (ms, step) <= self.last:
            ms = self.last[0] + 1
        self.last = (ms, step)
        return f"{ms}-{step}"
