"""Step timing, memory and the hang watchdog: the performance signals of a step, training side.

:class:`StepTiming` is owned by :class:`~stability.hooks.capture.Capture`, which calls it at four points of a step
(a timestamp store each, no device access): the first forward of the step (:meth:`StepTiming.forward`), the first
``backward()`` (:meth:`StepTiming.backward`) and the end of the step (:meth:`StepTiming.end_step`, which returns the
host signals below). Signals (global names, same record format as every other signal, seconds and bytes):

* ``step_time``: wall time from the previous step's end to this one's (the first step: from its first forward).
* ``data_time``: previous step's end -> this step's first forward of the model: the time the loop waited for its
  batch (data loader, host-to-device copy, logging of the loop itself).
* ``compute_time``: first forward -> first ``backward()``: the forward pass, which in data-parallel training runs
  before the first gradient collective (DDP's all-reduce runs inside ``backward()``). The all-reduce evens out the
  ranks' wall step times, so a slow rank shows in ``data_time`` + ``compute_time`` only (NVIDIA resiliency-ext's
  straggler detector times sections the same way). On CUDA the host timestamps measure launch time unless the loop
  syncs; ``device_step_time`` is the device's own.
* ``samples_per_s``: leading dimension of the model's first tensor input, summed over the step's grad-enabled
  forwards, / ``step_time``; ``tokens_per_s`` when the loop observes ``tokens`` as a host number.
* ``host_rss`` (bytes, ``/proc/self/statm``, one small read) and ``host_mem_limit`` (cgroup ``memory.max`` or
  ``MemTotal``, read once); on CUDA ``mem_allocated``, ``mem_reserved``, ``mem_peak`` (the caching allocator's host
  counters: no sync) and ``mem_limit`` (device total); ``device_step_time`` from CUDA events, read one step later
  with ``Event.query()`` (never waits): the record of step k carries the device time of step k-1.

:class:`Watchdog` is a daemon thread that looks at the last step-end timestamp every ``poll_s``: when no step
completed and the model ran no forward (evaluation between steps is activity) within ``factor`` x the usual step
time (median of the last steps, at least ``min_s``), it dumps every thread's Python stack with
:func:`faulthandler.dump_traceback` into ``<run_dir>/hang-rank<r>-step<s>.txt`` and calls ``on_hang`` (Capture
emits a ``hang_s`` record so the worker sees the silence). Once per stall. When the training thread is inside a
checkpoint save (``torch.save``, ``torch.distributed.checkpoint``, safetensors, HF ``save_pretrained``) the stacks
are dumped but no hang is reported.

Training-side module: stdlib and torch only.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TIMING_SIGNALS", "Performance", "StepTiming", "TimingConfig", "Watchdog", "host_memory_limit",
           "host_rss"]

logger = logging.getLogger(__name__)

TIMING_SIGNALS = ("step_time", "data_time", "compute_time", "samples_per_s", "tokens_per_s", "host_rss",
                  "host_mem_limit", "device_step_time", "mem_allocated", "mem_reserved", "mem_peak", "mem_limit",
                  "hang_s")
"""Signal names this module produces (``hang_s``: seconds without a completed step, from the watchdog)."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class TimingConfig:
    """Settings of :class:`StepTiming` and its :class:`Watchdog`."""

    watchdog: bool = True
    """Run the hang watchdog (needs a run directory for the stack dumps)."""
    hang_factor: float = 2.0
    """No step within this many usual step times is a hang."""
    hang_min_s: float = 10.0
    """... and at least this many seconds (short steps jitter; a pause of the loop between steps is not a hang)."""
    warmup_steps: int = 3
    """Steps before the watchdog arms (the first steps compile, warm caches, allocate)."""
    poll_s: float = 0.25
    """Watchdog period."""

    @classmethod
    def from_env(cls) -> TimingConfig:
        """Defaults, overridden by ``STABILITY_WATCHDOG`` (0 = off), ``STABILITY_HANG_FACTOR``,
        ``STABILITY_HANG_MIN_S``; a malformed value is logged and ignored."""
        values: dict[str, Any] = {}
        raw = os.environ.get("STABILITY_WATCHDOG", "").strip().lower()
        if raw:
            values["watchdog"] = raw not in ("0", "false", "no", "off")
        for env, name in (("STABILITY_HANG_FACTOR", "hang_factor"), ("STABILITY_HANG_MIN_S", "hang_min_s")):
            text = os.environ.get(env, "").strip()
            if text:
                try:
                    values[name] = float(text)
                except ValueError:
                    logger.warning("stability: %s=%r is not a number; ignored", env, text)
        return cls(**values)


_STATM: dict[int, int] = {}
"""pid -> an open descriptor of its ``/proc/<pid>/statm`` (re-read with ``pread``: a few microseconds, no open per
step; keyed by pid because a forked child inherits the parent's descriptor)."""


def host_rss() -> float | None:
    """Resident set size of this process in bytes (``/proc/self/statm``), or None off Linux."""
    try:
        pid = os.getpid()
        fd = _STATM.get(pid)
        if fd is None:
            fd = _STATM[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        return float(int(os.pread(fd, 128, 0).split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        return None


def host_memory_limit() -> float | None:
    """The memory this process may use: the cgroup limit when set, else the machine's ``MemTotal`` (bytes)."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return float(raw)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


class StepTiming:
    """Per-step timing and memory signals of one process (see the module docstring)."""

    def __init__(self, config: TimingConfig | None = None) -> None:
        self.config = config or TimingConfig()
        self.last_end: float | None = None
        """Monotonic time of the last completed step (the watchdog reads it)."""
        self.last_step = -1
        self.recent: deque[float] = deque(maxlen=32)
        """Recent step times (the watchdog's notion of the usual step time)."""
        self._forward_at: float | None = None
        self._backward_at: float | None = None
        self._samples = 0
        self._mem_limit: float | None = None
        self._host_limit = host_memory_limit()
        self._events: deque[Any] = deque(maxlen=3)
        self.last_active: float | None = None
        """Monotonic time of the model's last forward, with or without grad (evaluation between steps is activity,
        not a hang)."""
        self.thread: int | None = None
        """Ident of the training thread (the one ending steps), whose stack the watchdog inspects."""

    def forward(self, args: tuple[Any, ...]) -> None:
        """A forward of the model starts (a pre-hook): the first one of a step ends its data wait."""
        now = self.last_active = time.monotonic()
        if not torch.is_grad_enabled():
            return
        if self._forward_at is None:
            self._forward_at = now
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if arg.dim() > 0:
                    self._samples += int(arg.shape[0])
                break

    def backward(self) -> None:
        """A ``backward()`` starts: the first one of a step ends its compute-before-collective section."""
        if self._backward_at is None:
            self._backward_at = time.monotonic()

    def end_step(self, step: int, device: torch.device, observed: dict[str, float]) -> dict[str, float]:
        """The step ended: its host signals. ``observed`` are the loop's host values (``tokens``)."""
        now = time.monotonic()
        out: dict[str, float] = {}
        start = self.last_end if self.last_end is not None else self._forward_at
        if start is not None:
            step_time = now - start
            out["step_time"] = step_time
            self.recent.append(step_time)
            if step_time > 0:
                if self._samples:
                    out["samples_per_s"] = self._samples / step_time
                tokens = observed.get("tokens")
                if tokens is not None:
                    out["tokens_per_s"] = tokens / step_time
        if self._forward_at is not None:
            if self.last_end is not None:
                out["data_time"] = max(0.0, self._forward_at - self.last_end)
            if self._backward_at is not None and self._backward_at >= self._forward_at:
                out["compute_time"] = self._backward_at - self._forward_at
        rss = host_rss()
        if rss is not None:
            out["host_rss"] = rss
        if self._host_limit is not None:
            out["host_mem_limit"] = self._host_limit
        if device.type == "cuda":
            self._cuda(device, out)
        self.last_end, self.last_step = now, step
        if self.thread is None:
            self.thread = threading.get_ident()
        self._forward_at = self._backward_at = None
        self._samples = 0
        return out

    def _cuda(self, device: torch.device, out: dict[str, float]) -> None:
        """Allocator counters (host-side, no sync) and the previous step's device time (events, never waits)."""
        out["mem_allocated"] = float(torch.cuda.memory_allocated(device))
        out["mem_reserved"] = float(torch.cuda.memory_reserved(device))
        out["mem_peak"] = float(torch.cuda.max_memory_allocated(device))
        if self._mem_limit is None:
            self._mem_limit = float(torch.cuda.get_device_properties(device).total_memory)
        out["mem_limit"] = self._mem_limit
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        events = self._events
        events.append(event)
        if len(events) == 3 and events[1].query():  # the previous step's end has run on the device
            out["device_step_time"] = events[0].elapsed_time(events[1]) / 1000.0


PAUSE_S = 10.0
"""A paused run (no step for this long) writes a heartbeat this often (see :meth:`Performance._beat`)."""

_SAVING = ("torch/serialization.py", "torch/distributed/checkpoint/", "safetensors/", "transformers/modeling_utils.py")
"""Frames of these files on the training thread's stack mean a checkpoint save is in progress."""


def _busy_with(thread: int | None) -> str | None:
    """What the training thread is doing when it is saving a checkpoint (None otherwise, or unknown)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if any(part in filename for part in _SAVING):
            return f"saving a checkpoint ({frame.f_code.co_name} in {filename.rsplit('/', 2)[-2]})"
        frame = frame.f_back
    return None


class Watchdog:
    """Daemon thread dumping the Python stacks when no step completes in time (see the module docstring)."""

    def __init__(self, timing: StepTiming, run_dir: Path, rank: int,
                 on_hang: Callable[[int, float, Path], None] | None = None,
                 poll: Callable[[float], None] | None = None) -> None:
        self._timing = timing
        self._poll = poll
        self._dir = run_dir
        self._rank = rank
        self._on_hang = on_hang
        self._stop = threading.Event()
        self._reported_step = -2
        self.dumps: list[Path] = []
        self._thread = threading.Thread(target=self._run, name="stability-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cfg = self._timing.config
        while not self._stop.wait(cfg.poll_s):
            try:
                now = time.monotonic()
                self.check(now)
                if self._poll is not None:
                    self._poll(now)
            except Exception:  # the watchdog must never take the run down
                logger.debug("stability watchdog: check failed", exc_info=True)

    def limit(self) -> float | None:
        """Seconds without a step that count as a hang (None: not armed yet)."""
        timing, cfg = self._timing, self._timing.config
        if timing.last_step + 1 < cfg.warmup_steps or not timing.recent:
            return None
        return max(cfg.hang_min_s, cfg.hang_factor * statistics.median(timing.recent))

    def check(self, now: float) -> Path | None:
        """Dump the stacks if the run is stalled and this stall was not reported yet; the dump's path."""
        timing = self._timing
        last, step, limit = timing.last_end, timing.last_step, self.limit()
        if last is None or limit is None or step == self._reported_step:
            return None
        waited = now - last
        if now - max(last, timing.last_active or last) < limit:
            return None
        self._reported_step = step
        busy = _busy_with(timing.thread)
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"hang-rank{self._rank}-step{step + 1}.txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"stability watchdog: rank {self._rank} pid {os.getpid()}: no step completed for {waited:.2f} s "
                    f"(limit {limit:.2f} s) after step {step}{'; ' + busy if busy else ''}; Python stacks of every "
                    "thread:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.dumps.append(path)
        if busy:  # a checkpoint save between steps is no hang
            logger.info("stability: rank %d: no step for %.1f s after step %d, %s; stacks in %s",
                        self._rank, waited, step, busy, path)
            return path
        logger.warning("stability: rank %d: no step for %.1f s after step %d; stacks dumped to %s",
                       self._rank, waited, step, path)
        if self._on_hang is not None:
            self._on_hang(step + 1, waited, path)
        return path

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


class Performance:
    """What :class:`~stability.hooks.capture.Capture` holds: step timing, the watchdog and the on-demand profiler.

    ``emit(step, signals)`` sends a record of host signals for ``step`` (the watchdog's ``hang_s`` record); it is
    called from the watchdog thread. ``rank()`` is asked once, at the first step end (after ``init_process_group``).
    """

    def __init__(self, run_id: str, run_dir: Path, redis_url: str | None,
                 emit: Callable[[int, dict[str, float]], None], rank: Callable[[], int],
                 config: TimingConfig | None = None, *, enabled: bool = True) -> None:
        from stability.hooks.profiler import ProfileRequests

        self.enabled = enabled
        """False: :meth:`end_step` records nothing and starts no watchdog (``WatchConfig.timing=False``)."""
        self.timing = StepTiming(config or TimingConfig.from_env())
        self.run_dir = run_dir
        self._run_id = run_id
        self._emit = emit
        self._rank = rank
        self._requests = ProfileRequests(run_id, redis_url, run_dir)
        self.watchdog: Watchdog | None = None
        self.profiler: Any = None
        """The :class:`~stability.hooks.profiler.Profiler` (made at the first step end)."""
        self._next_beat = 0.0
        self._rank_id = 0
        self.hooked: list[int] = []
        """ids of the modules whose forward pre-hook feeds :meth:`StepTiming.forward`."""

    def end_step(self, step: int, device: torch.device, observed: dict[str, float]) -> dict[str, float]:
        """The step's performance signals (and a finished profile's summary)."""
        if not self.enabled:
            return {}
        signals = self.timing.end_step(step, device, observed)
        if self.profiler is None:
            self._start(step)
        if self.profiler.active or self.profiler.pending:
            signals.update(self.profiler.step_end(step, signals.get("data_time")))
        return signals

    def _start(self, step: int) -> None:
        from stability.hooks.profiler import Profiler

        rank = self._rank_id = self._rank()
        self.profiler = Profiler(self.run_dir, rank)
        if self.timing.config.watchdog:
            self.watchdog = Watchdog(self.timing, self.run_dir, rank, self._on_hang, self._poll)

    def _on_hang(self, step: int, waited: float, path: Path) -> None:
        self._emit(step, {"hang_s": waited})

    def _poll(self, now: float) -> None:
        request = self._requests.poll(now)
        if request is not None and self.profiler is not None:
            self.profiler.request(request["steps"], request["reason"])
        self._beat(now)

    def _beat(self, now: float) -> None:
        """While no step ends for ``PAUSE_S``, say every ``PAUSE_S`` that this process lives and what it does.

        Nothing is written while steps end (a normal run costs nothing). The sweep's quiet-run check
        (:mod:`stability.worker.quiet`) leaves a run alone while the heartbeat is fresh: a live process's own
        watchdog reports a real stall (with its stacks), and a long checkpoint save or evaluation is no hang."""
        timing = self.timing
        if timing.last_end is None or now - timing.last_end < PAUSE_S or now < self._next_beat:
            return
        self._next_beat = now + PAUSE_S
        busy = _busy_with(timing.thread)
        if busy is None and timing.last_active is not None and now - timing.last_active < PAUSE_S:
            busy = "running forward passes between steps (evaluation?)"
        self._requests.beat({"rank": self._rank_id, "step": timing.last_step, "state": busy or "no step",
                             "t": time.time()}, ttl_s=3 * PAUSE_S)

    def close(self) -> None:
        """Stop the watchdog and any profile in progress."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.profiler is not None:
            self.profiler.close()
        self._requests.close()
