"""What a log source yields besides step records: events (overflows, resumes, system faults) and segments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stability.records import StepRecord

__all__ = ["EVENT_KINDS", "LoadedLog", "LogEvent", "Segment"]

EVENT_KINDS: tuple[str, ...] = (
    "overflow",          # fp16 overflow: step skipped, loss scale reduced (DeepSpeed, fairseq, Megatron)
    "scale_minimum",     # the loss scale hit its minimum and the run gave up (DeepSpeed, fairseq)
    "startup",           # a start-up banner / argument dump (a new process)
    "checkpoint_load",   # "loading checkpoint ... at iteration N"
    "xid",               # NVIDIA driver Xid error
    "ecc",               # ECC / uncorrectable memory error (kernel log, nvidia-smi -q)
    "gpu_throttle",      # nvidia-smi -q: clocks slowed by a hardware / thermal slowdown
    "hung_task",         # kernel: task blocked for more than N seconds
    "oom",               # kernel OOM killer
    "nccl_timeout",      # NCCL watchdog: a collective timed out
    "nccl_error",        # other NCCL / communication failures
    "crash",             # a Python traceback / fatal error line
    "rank_stopped",      # multi-rank logs: a rank whose log stops while the others go on or wait
    "phase_start",       # captured runs: another optimizer (other parameters) took over, a new training phase
)
"""Kinds of :class:`LogEvent`."""

SYSTEM_KINDS = frozenset({"xid", "ecc", "gpu_throttle", "hung_task", "oom", "nccl_timeout", "nccl_error"})
"""Event kinds that come from the machine, not the training loop."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogEvent:
    """One dated thing a log says happened (not a per-step value)."""

    kind: str
    """One of :data:`EVENT_KINDS`."""
    message: str
    """The log line (stripped, at most 300 characters)."""
    source: str
    """``file:line`` where it was read."""
    step: int | None = None
    """The training step it belongs to, when the log says (or it follows a step line)."""
    wall_time: float | None = None
    """Unix time when the line carries a date."""
    rank: int | None = None
    host: str = ""
    value: float | None = None
    """Kind-specific number: the new loss scale, the Xid code, the timeout in seconds."""
    count: int | None = None
    """``overflow``: how many overflows in a row up to this one (no successful step logged between)."""
    ranks: tuple[int, ...] = ()
    """A system-log event of a host: the ranks that ran there (:func:`stability.sources.ranks.attribute_hosts`)."""

    def to_dict(self) -> dict[str, object]:
        """Plain data for the findings JSON."""
        out: dict[str, object] = {
            "kind": self.kind, "step": self.step, "wall_time": self.wall_time, "rank": self.rank, "host": self.host,
            "value": self.value, "count": self.count, "message": self.message, "source": self.source}
        if self.ranks:
            out["ranks"] = list(self.ranks)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A stretch of a run logged by one process: a resume (a step going back, a new start-up banner) starts a new
    one. ``records[start:stop]`` of the loaded list are its records."""

    index: int
    start: int
    stop: int
    first_step: int
    last_step: int
    reason: str = "start"
    """``start`` (the first), ``step went back`` or ``start-up banner``."""
    resumed_after: int | None = None
    """Last step of the previous segment (None for the first)."""
    context: Mapping[str, str] = field(default_factory=dict)
    """Start-up context of this segment (versions, parallel sizes, precision, LR schedule) when the log dumps it."""

    def to_dict(self) -> dict[str, object]:
        """Plain data for the findings JSON."""
        return {"index": self.index, "first_step": self.first_step, "last_step": self.last_step,
                "records": self.stop - self.start, "reason": self.reason, "resumed_after": self.resumed_after}


@dataclass(slots=True, kw_only=True)
class LoadedLog:
    """Everything read from one source: records in log order, grouped into segments, plus events and context."""

    format: str
    records: list[StepRecord]
    segments: list[Segment]
    events: list[LogEvent] = field(default_factory=list)
    context: dict[str, str] = field(default_factory=dict)
    """Run context (the first start-up banner's arguments, versions); shown in the report's metadata."""
    notes: list[str] = field(default_factory=list)
    """Caveats of the reading (e.g. steps are log-line ordinals), shown in the report."""
    hosts: dict[int, str] = field(default_factory=dict)
    """Rank -> host, where the logs say (multi-rank logs, :mod:`stability.sources.ranks`): matches system logs."""
