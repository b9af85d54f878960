"""From device tensors to records: one non-blocking copy per step, read back by a background thread.

On the training thread, :func:`stage` concatenates a step's device statistics into one vector, starts one
``non_blocking`` copy into a pinned host buffer and records a CUDA event; it never waits. The :class:`Reader`
thread waits on the event (on the CPU the values are ready at once), builds the :class:`StepRecord` and hands it to
the sink. Its queue is bounded: when the reader falls behind, the oldest staged step is dropped and counted.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stability.errors import RecordError
from stability.records import StepRecord, split_signal

__all__ = ["ABSENT", "Reader", "RecordSink", "StagedStep", "stage"]

logger = logging.getLogger(__name__)

ABSENT = -1.0
"""Value a device statistic takes to mean "no value" (used where the true value cannot be negative)."""
_ABSENT_QUANTITIES = frozenset({"adam_v_ratio"})


class RecordSink(Protocol):
    """Where records go; the transport's ``Emitter`` satisfies it. ``put`` returns False when it dropped the record."""

    def put(self, record: StepRecord) -> bool: ...


@dataclass
class StagedStep:
    """One step on its way to the host: metadata, host-side values and the device values being copied."""

    run_id: str
    step: int
    rank: int
    wall_time: float
    host: str
    coords: Mapping[str, int]
    batch: str | None
    host_signals: dict[str, float] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    values: torch.Tensor | None = None
    event: Any = None
    """A ``torch.cuda.Event`` recorded after the copy, or None when ``values`` is ready."""
    pinned: bool = False
    """``values`` is a pinned host buffer of the pool, given back once read."""

    def to_record(self) -> StepRecord:
        """Wait for the copy (reader thread only) and build the record."""
        if self.event is not None:
            self.event.synchronize()
        signals = dict(self.host_signals)
        if self.values is not None:
            values = self.values.tolist()
            if self.pinned:
                _PINNED.give_back(self.values)
                self.pinned = False
            for name, value in zip(self.names, values, strict=True):
                if value == ABSENT and split_signal(name)[0] in _ABSENT_QUANTITIES:
                    continue
                signals[name] = value
        return StepRecord(
            run_id=self.run_id,
            step=self.step,
            rank=self.rank,
            wall_time=self.wall_time,
            host=self.host,
            coords=dict(self.coords),
            batch=self.batch,
            signals=signals,
        )


def stage(parts: list[tuple[list[str], torch.Tensor]], staged: StagedStep) -> None:
    """Start copying ``parts`` (names and a 1-D device tensor of as many values) into ``staged``; no sync.

    Raises:
        RecordError: a part has not as many values as names.
    """
    if not parts:
        return
    for names, tensor in parts:
        if tensor.numel() != len(names):
            raise RecordError(f"{len(names)} signal names ({names[:2]}...) for {tensor.numel()} values")
    device = parts[0][1].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    vector = torch.cat([t.reshape(-1).to(device=device, dtype=dtype, non_blocking=True) for _, t in parts])
    staged.names = [n for names, _ in parts for n in names]
    if device.type == "cpu":
        staged.values = vector
    elif device.type == "cuda":
        host = _PINNED.take(vector.numel(), dtype)
        host.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        staged.values, staged.event, staged.pinned = host, event, True
    else:  # other accelerators: a plain copy (only CUDA is known to be sync-free here)
        staged.values = vector.cpu()


class _PinnedPool:
    """Pinned host buffers by size, reused from step to step: a step has one of a few sizes (sampled or not), so
    after the first steps no pinned memory is allocated (``cudaHostAlloc`` is slow and may synchronise)."""

    KEEP = 8
    """Free buffers kept per size (more are left to the caching host allocator)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned 1-D buffer of ``numel`` elements (reused when one is free)."""
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer whose copy has completed and whose values were read."""
        with self._lock:
            free = self._free.setdefault((buffer.numel(), buffer.dtype), [])
            if len(free) < self.KEEP:
                free.append(buffer)


_PINNED = _PinnedPool()


class Reader:
    """A daemon thread turning :class:`StagedStep` into records for ``sink``, through a bounded queue."""

    def __init__(self, sink: RecordSink, on_error: Callable[[BaseException, str], None], limit: int) -> None:
        self._sink = sink
        self._on_error = on_error
        self._limit = max(1, limit)
        self._queue: collections.deque[StagedStep] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self.dropped = 0
        """Staged steps dropped because the queue was full, plus records the sink refused."""
        self.delivered = 0
        """Records the sink accepted."""
        self._negative_loss_said = False
        self._thread = threading.Thread(target=self._run, name="stability-capture-reader", daemon=True)
        self._thread.start()

    def submit(self, staged: StagedStep) -> None:
        """Queue a staged step (never blocks; drops the oldest one when full)."""
        with self._cond:
            if len(self._queue) >= self._limit:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(staged)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued step was handed to the sink; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=max(0.0, timeout))

    def close(self, timeout: float) -> bool:
        """Flush, then stop the thread; False when something was left behind."""
        done = self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, min(timeout, 5.0)))
        return done and not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                staged = self._queue.popleft()
                self._busy = True
            try:
                self._deliver(staged)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, staged: StagedStep) -> None:
        try:
            record = staged.to_record()
        except Exception as exc:
            self._on_error(exc, "reader")
            return
        if not self._negative_loss_said:
            self._say_negative_loss(record)
        try:
            accepted = self._sink.put(record)
        except Exception as exc:
            self._on_error(exc, "sink.put")
            return
        if accepted is False:
            self.dropped += 1
        else:
            self.delivered += 1

    def _say_negative_loss(self, record: StepRecord) -> None:
        """Once: a negative loss (a policy-gradient or WGAN critic loss, a log-density) is out of reach of the
        detectors that read the loss on a log scale; say so in the training console instead of staying silent."""
        loss = record.signals.get("loss")
        if isinstance(loss, float) and loss < 0:
            self._negative_loss_said = True
            logger.warning(
                "stability: the loss is negative (%.4g at step %d): a signed objective, which the loss-spike, "
                "divergence and plateau detectors (log scale) stop judging from here on; gradient, NaN, update-ratio "
                "and the other detectors still watch the run (observe a positive loss with handle.observe('loss', "
                "value))",
                loss, record.step)
