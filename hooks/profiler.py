"""Profile on demand: ``torch.profiler`` for the next N steps, asked for through Redis, traced into the run directory.

Control channel (the guard's: a Redis key the training side polls from a background thread, never on the training
thread): ``stability profile RUN_ID --steps N`` (or a worker sink on an incident) stores a JSON request
``{"id", "steps", "reason", "requested"}`` at ``keys.profile(run_id)`` (:func:`request_profile`, 1 h expiry). Each
training process polls it (:class:`ProfileRequests`, from the capture's watchdog thread, every ``POLL_S``) and
hands a request it has not seen to :meth:`Profiler.request`. At the next step boundary the training thread starts
``torch.profiler.profile`` (CPU, plus CUDA when available), and after ``steps`` steps stops it and writes

* ``<run_dir>/profile-rank<r>-step<s>.json.gz``: the Chrome trace (open in Perfetto / ``chrome://tracing``);
* ``<run_dir>/profile-rank<r>-step<s>.summary.json``: top operators by self time, and the split of the profiled
  time between compute, communication (c10d / NCCL / gloo collectives), memory copies (memcpy / memset) and data
  waiting (the steps' ``data_time``);

and the record of the last profiled step carries ``profile_compute_s``, ``profile_comm_s``, ``profile_memcpy_s``,
``profile_data_s`` (that step's record format, so the finding's report and the post-mortem can show them).

A performance incident asks for one too: the worker's advice sink (:class:`stability.worker.advice.AdviceSink`)
stores a 5-step request when a batch holds a ``straggler``, ``dataloader_stall``, ``slowdown`` or ``memory_leak``
warning/error, unless a request was stored within the hour (so an incident profiles once, an operator's request is
not replaced).

Inactive, the profiler costs one attribute test per step (``bench/bench_profiler.py``). Training-side module:
stdlib, torch (imported when a profile starts) and redis only.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from stability import keys

__all__ = ["POLL_S", "ProfileRequests", "Profiler", "request_from_cli", "request_profile", "summarize"]

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often a training process polls for a profile request."""
REQUEST_TTL_S = 3600
MAX_STEPS = 100
STALE_S = 60.0

_COMM = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
         "broadcast", "alltoall", "all_to_all", "barrier", "send", "recv")
_MEMCPY = ("memcpy", "memset", "cudamemcpy", "htod", "dtoh")


def request_profile(client: Any, run_id: str, steps: int, reason: str = "on demand", *,
                    only_if_none: bool = False) -> dict[str, Any] | None:
    """Store a profile request for ``run_id`` (every rank profiles its next ``steps`` steps); the request.
    ``only_if_none``: not when a request was stored within the last hour (an incident's automatic profile); None
    then."""
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"profile steps must be 1-{MAX_STEPS}, got {steps}")
    request = {"id": uuid.uuid4().hex[:12], "steps": int(steps), "reason": reason, "requested": time.time()}
    stored = client.set(keys.profile(run_id), json.dumps(request), ex=REQUEST_TTL_S, nx=only_if_none)
    return request if stored else None


def request_from_cli(run_id: str, steps: int, redis_url: str | None, run_dir: Path | None) -> str:
    """``stability profile``: store the request in the run's Redis; the line to print.

    Raises:
        ConfigError: no Redis URL (``--redis``, ``STABILITY_REDIS_URL``, ``--run-dir``'s embedded Redis), a bad run
            id or step count.
    """
    from stability.errors import ConfigError
    from stability.records import check_run_id
    from stability.redis_url import connect

    check_run_id(run_id)
    url = redis_url or os.environ.get("STABILITY_REDIS_URL")
    if url is None and run_dir is not None:
        try:
            url = (run_dir / "redis" / "url").read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{run_dir}: no embedded Redis URL ({exc})") from None
    if not url:
        raise ConfigError("stability profile: give --redis URL, STABILITY_REDIS_URL or --run-dir")
    if not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"stability profile: --steps must be 1-{MAX_STEPS}, got {steps}")
    client = connect(url, socket_timeout=5.0)
    try:
        request = request_profile(client, run_id, steps)
    finally:
        client.close()
    assert request is not None
    return (f"profile {request['id']} requested: each rank of {run_id} profiles its next {steps} steps; traces "
            "appear as profile-rank<r>-step<s>.json.gz in the run directory")


class ProfileRequests:
    """Polls ``keys.profile(run_id)`` with short timeouts and no retries (background thread only)."""

    def __init__(self, run_id: str, redis_url: str | None, run_dir: Path | None) -> None:
        self._run_id = run_id
        self._url = redis_url
        self._run_dir = run_dir
        self._client: Any = None
        self._seen: str | None = None
        self._failing = False
        self._next = 0.0
        self._created = time.time()

    def _resolve_url(self) -> str | None:
        if self._url is None and self._run_dir is not None:  # the embedded Redis of the session writes its URL
            try:
                self._url = (self._run_dir / "redis" / "url").read_text().strip() or None
            except OSError:
                return None
        return self._url

    def poll(self, now: float) -> dict[str, Any] | None:
        """A request not seen before (at most one poll per ``POLL_S``), or None."""
        if now < self._next:
            return None
        self._next = now + POLL_S
        try:
            client = self._connect()
            if client is None:
                return None
            raw = client.get(keys.profile(self._run_id))
        except Exception as exc:
            if not self._failing:
                logger.info("stability profiler: cannot read profile requests (%s: %s)", type(exc).__name__, exc)
            self._failing = True
            return None
        self._failing = False
        if raw is None:
            return None
        try:
            request = json.loads(raw)
            steps = int(request["steps"])
            rid = str(request["id"])
        except (ValueError, KeyError, TypeError):
            logger.warning("stability profiler: ignoring a malformed profile request %r", raw[:200])
            return None
        if rid == self._seen:
            return None
        stale = float(request.get("requested", 0.0)) < self._created - STALE_S  # asked of an earlier process
        self._seen = rid
        return None if stale else {"id": rid, "steps": max(1, min(MAX_STEPS, steps)),
                                   "reason": str(request.get("reason", ""))}

    def _connect(self) -> Any:
        """The client (made on first use; short timeouts, no retries), or None while the URL is unknown."""
        if self._client is None:
            url = self._resolve_url()
            if url is None:
                return None
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            from stability.redis_url import connect

            self._client = connect(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        return self._client

    def beat(self, payload: dict[str, Any], ttl_s: float) -> None:
        """Write the paused run's heartbeat (``keys.alive``, expiring after ``ttl_s``); failures are ignored."""
        try:
            client = self._connect()
            if client is not None:
                client.set(keys.alive(self._run_id), json.dumps(payload), px=int(ttl_s * 1000))
        except Exception as exc:
            logger.debug("stability: heartbeat not written (%s: %s)", type(exc).__name__, exc)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class Profiler:
    """Runs ``torch.profiler`` over the next N steps when asked (see the module docstring)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self._pending: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._prof: Any = None
        self._left = 0
        self._first = 0
        self._data_s = 0.0
        self._reason = ""
        self.traces: list[Path] = []
        """Trace files written so far."""

    def request(self, steps: int, reason: str = "on demand") -> None:
        """Profile the next ``steps`` steps (any thread; ignored while a profile runs)."""
        with self._lock:
            self._pending = {"steps": max(1, min(MAX_STEPS, int(steps))), "reason": reason}

    @property
    def pending(self) -> bool:
        """A request waits for the next step boundary."""
        return self._pending is not None

    @property
    def active(self) -> bool:
        """A profile is being recorded."""
        return self._prof is not None

    def step_end(self, step: int, data_time: float | None) -> dict[str, float]:
        """Called at every step end on the training thread: start, count or finish a profile; the summary signals
        of a finished one (else empty)."""
        if self._prof is None:
            if self._pending is None:
                return {}
            self._start(step + 1)
            return {}
        self._data_s += data_time or 0.0
        self._left -= 1
        return self._finish(step) if self._left <= 0 else {}

    def _start(self, first: int) -> None:
        with self._lock:
            request, self._pending = self._pending, None
        assert request is not None
        import torch  # here: the worker imports request_profile without torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.start()
        self._prof, self._left, self._first, self._data_s = prof, request["steps"], first, 0.0
        self._reason = request["reason"]
        logger.info("stability: rank %d: profiling steps %d-%d (%s)", self.rank, first,
                    first + request["steps"] - 1, self._reason)

    def _finish(self, step: int) -> dict[str, float]:
        prof, self._prof = self._prof, None
        prof.stop()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        base = self.run_dir / f"profile-rank{self.rank}-step{self._first}"
        trace = base.with_name(base.name + ".json.gz")
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.run_dir)
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            with open(tmp, "rb") as src, gzip.open(trace, "wb", compresslevel=5) as dst:
                shutil.copyfileobj(src, dst)
        finally:
            os.unlink(tmp)
        summary = summarize(prof, self._data_s)
        summary.update(rank=self.rank, first_step=self._first, last_step=step, reason=self._reason,
                       trace=str(trace))
        base.with_name(base.name + ".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.traces.append(trace)
        logger.warning("stability: rank %d: profile of steps %d-%d written to %s", self.rank, self._first, step, trace)
        split = summary["split_s"]
        return {f"profile_{k}_s": float(v) for k, v in split.items()}

    def close(self) -> None:
        """Stop a profile in progress without writing it."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()


def _category(name: str) -> str:
    low = name.lower()
    if any(k in low for k in _MEMCPY):
        return "memcpy"
    if any(k in low for k in _COMM):
        return "comm"
    return "compute"


def summarize(prof: Any, data_s: float, top: int = 15) -> dict[str, Any]:
    """Top operators by self time and the compute / comm / memcpy / data split (seconds) of a stopped profile."""
    rows = []
    split = {"compute": 0.0, "comm": 0.0, "memcpy": 0.0, "data": data_s}
    for avg in prof.key_averages():
        cpu = float(avg.self_cpu_time_total) / 1e6
        device = float(getattr(avg, "self_device_time_total", 0.0) or 0.0) / 1e6
        self_s = device if device > 0 else cpu
        if self_s <= 0:
            continue
        category = _category(avg.key)
        split[category] += self_s
        rows.append({"name": avg.key, "self_s": self_s, "calls": int(avg.count), "category": category})
    rows.sort(key=lambda r: -float(r["self_s"]))
    return {"top_ops": rows[:top], "split_s": split}
