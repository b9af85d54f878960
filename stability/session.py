"""A run session on the training side: run directory, Redis (embedded or external), emitter, local worker.

``Session.open(config)`` decides where records go:

* ``redis_url`` set (``STABILITY_REDIS_URL``): that server; workers run elsewhere (``stability worker``). Local
  rank 0 starts the supervisor in watch-only mode: if this process vanishes, the run is recorded as died and its
  ranks are marked ended, so the remote workers finish it.
* otherwise: an **embedded** real redis-server in ``<run_dir>/redis`` (append-only persistence, unix socket)
  plus one local worker process (``python -m stability.worker``), both owned by a small supervisor process that
  local rank 0 starts (:mod:`stability.supervisor`): it stops them when the training process closes the session,
  and also when the training process vanishes (SIGKILL, a signal with no handler), after the worker has finished
  the run from what reached Redis. Other local ranks wait for ``<run_dir>/redis/url`` and connect to the same
  server.

The run's status (:mod:`stability.runstate`) is ``running`` from :meth:`Session.open`, ``finished`` when the last
rank closes cleanly, ``died`` at the last step when :meth:`Session.terminate` runs (SIGTERM handler, see
:mod:`stability._sigterm`) or :meth:`Session.close` is told the process is dying of an exception.

Local rank 0 also starts a :class:`~stability.console.ConsoleReporter` (unless ``quiet``): the start line, the
run's alerts as the worker decides them, and a summary line at :meth:`Session.close`. Global rank 0 writes the run
metadata (host, versions, configuration) to ``<run_dir>/run.json`` for the report.

:class:`LazySession` is what ``import stability.auto`` uses: it creates nothing until the first record arrives (a
process that imports stability but never trains gets no run directory, Redis or worker), then opens the session
on a background thread while it buffers records, so the training thread never waits for Redis to start.

Training-side module: imports only stdlib, redis (via the transport) and the records layer.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stability import keys
from stability._children import child_ordinal
from stability._files import make_private_dir, open_private, write_private_text
from stability.config import WatchConfig
from stability.errors import EmbeddedServerError
from stability.records import StepRecord
from stability.redis_url import connect

if TYPE_CHECKING:  # redis-py (via the transport and runstate) is imported when a session opens, not before
    from stability.console import ConsoleReporter
    from stability.transport import Emitter

__all__ = ["LazySession", "Session", "rank_from_env"]

log = logging.getLogger(__name__)

URL_FILE = "url"
DRAIN_WAIT_S = 60.0
EXIT_FLUSH_S = 1.0
"""Default bound of the emitter flush when a process using ``import stability.auto`` exits
(``STABILITY_EXIT_FLUSH_S``); records not in Redis by then go to the run's spool (``stability replay RUN_DIR`` sends
them), and the exit then touches Redis no more: the run's end goes to ``status.json``, the summary line is printed
from what the console already read."""
SUPERVISOR_STOP_S = 45.0
"""How long :meth:`Session.close` waits for the supervisor to stop the worker and redis-server."""


def rank_from_env() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from torch.distributed when initialized, else the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    ordinal = child_ordinal()
    if ordinal is not None:  # a multiprocessing child training on its own: its own rank, it may own the run dir
        return ordinal, 0, 1
    env = os.environ
    local = int(env.get("LOCAL_RANK", "0"))
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name]), local, int(env.get("WORLD_SIZE", "1"))
    # Lightning's DDP launcher sets only LOCAL_RANK/NODE_RANK for the processes it starts; on one node that is it
    rank = local if env.get("NODE_RANK", "0") == "0" else 0
    return rank, local, int(env.get("WORLD_SIZE", "1"))


@dataclass
class Session:
    """Owns the transport of one training process. Use :meth:`open`; :meth:`close` flushes everything."""

    config: WatchConfig
    run_dir: Path
    redis_url: str
    emitter: Emitter
    rank: int
    supervisor: subprocess.Popen[bytes] | None = None
    """The local supervisor owning the embedded redis-server and local worker (local rank 0 only)."""
    local_worker: bool = False
    reporter: ConsoleReporter | None = None
    forked: bool = False
    """A forked child's session (Hogwild, :meth:`LazySession.fork_child`): it only emits; the parent owns Redis,
    the worker and the run's end."""
    owner_lock: int | None = None
    """The descriptor holding the run directory's owner lock (:func:`_claim_run_dir`), released at :meth:`close`."""

    @classmethod
    def open(cls, config: WatchConfig, *, fork_rank: int | None = None) -> Session:
        """Start (or connect to) Redis and the local worker, and return a session with a running emitter.
        ``fork_rank``: a forked child's own rank; it connects to the Redis its parent's session publishes."""
        rank, local_rank, world = rank_from_env()
        if fork_rank is not None:
            rank, local_rank = fork_rank, -1  # like a second local rank: no server, no worker, no console
        run_dir = make_private_dir(config.resolved_run_dir.resolve())
        supervisor = None
        owner: int | None = None
        if config.redis_url is not None:
            url = config.redis_url
            if local_rank == 0:
                supervisor = _start_watchdog(config, run_dir)
        elif local_rank == 0:
            supervisor, owner = _own_run_dir(config, run_dir)
            if supervisor is None:  # another process of this host owns the run dir's Redis: join it like a local rank
                local_rank = -1
        # imported while the supervisor starts the embedded Redis (redis-py alone takes 0.1-0.3 s to import)
        from stability import runstate
        from stability.console import ConsoleReporter
        from stability.transport import Emitter

        if config.redis_url is None:
            if supervisor is not None:
                try:
                    url = _supervisor_url(supervisor, run_dir)
                except BaseException:
                    if owner is not None:
                        os.close(owner)
                    raise
            else:
                url = _wait_for_url(run_dir / "redis" / URL_FILE)
        local_worker = supervisor is not None and config.local_worker and config.redis_url is None
        meta = _run_meta(config, run_dir)
        if rank == 0 and fork_rank is None:
            _write_run_json(run_dir, config, meta, world)
        _record_status(url, config.run_id, runstate.RUNNING, run_dir=run_dir if local_rank == 0 else None)
        reporter = None
        if local_rank == 0 and not config.quiet:
            reporter = ConsoleReporter(url, config.run_id, run_dir, start_line(config, run_dir, url, meta,
                                                                               local_worker=local_worker))
            reporter.start()
        emitter = Emitter(
            redis_url=url,
            run_id=config.run_id,
            spool_dir=run_dir / "spool",
            rank=rank,
            queue_size=config.queue_size,
            timeout_s=config.redis_timeout_s,
            meta=meta,
        )
        log.info("stability: run %s, rank %d, records -> %s, run dir %s", config.run_id, rank, url, run_dir)
        return cls(config=config, run_dir=run_dir, redis_url=url, emitter=emitter, rank=rank, supervisor=supervisor,
                   local_worker=local_worker, reporter=reporter, forked=fork_rank is not None,
                   owner_lock=owner if supervisor is not None else None)

    def close(self, timeout: float = DRAIN_WAIT_S, *, died: str | None = None, wait_drained: bool = True,
              flush_s: float | None = None) -> None:
        """Flush the emitter and record the run's end (``died`` names why the process is dying, e.g. the uncaught
        exception; None: a clean end); with an embedded Redis wait for the local worker to drain (it writes the
        findings and the report), print the summary line, then stop the worker and the server.

        ``wait_drained=False`` (the exit of ``import stability.auto``): flush the emitter for at most ``flush_s``
        seconds, record the end, print the summary line and return; the local supervisor sees this process go,
        lets the worker finish the run (findings.json, report.html) and then stops it and redis-server.
        """
        try:
            self._close(timeout, died=died, wait_drained=wait_drained, flush_s=flush_s)
        finally:
            if self.owner_lock is not None:
                with contextlib.suppress(OSError):
                    os.close(self.owner_lock)
                self.owner_lock = None

    def _close(self, timeout: float, *, died: str | None, wait_drained: bool, flush_s: float | None) -> None:
        if self.forked:  # the rank's end (``ended:<rank>``) is the emitter's; the run's is the parent's
            self.emitter.close(timeout=min(timeout, EXIT_FLUSH_S if flush_s is None else flush_s))
            return
        if not wait_drained:
            self.emitter.close(timeout=min(timeout, EXIT_FLUSH_S if flush_s is None else flush_s))
            offline = not self.emitter.reachable  # Redis down or hung: the records are spooled, do not wait on it
            self._record_end(died, offline=offline)
            if self.reporter is not None:
                self.reporter.stop(drained=False, timeout=1.0, offline=offline, died=died)
                self.reporter = None
            if self.supervisor is not None and self.supervisor.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # "clean exit": let the other ranks end first
                    os.kill(self.supervisor.pid, signal.SIGUSR1)
            self.supervisor = None  # it outlives us on purpose (see stability.supervisor)
            return
        self.emitter.close(timeout=min(timeout, 30.0))
        offline = not self.emitter.reachable
        self._record_end(died, offline=offline)
        drained = False
        if self.supervisor is not None and self.local_worker and not offline:
            drained = self._wait_drained(timeout)
        if self.reporter is not None:
            self.reporter.stop(drained=drained, offline=offline, died=died)
            self.reporter = None
        if self.supervisor is not None:
            _stop_process(self.supervisor, SUPERVISOR_STOP_S, group=False)
            self.supervisor = None

    def terminate(self, reason: str, timeout: float = 10.0) -> None:
        """The process is being killed (SIGTERM): flush what is queued, record the run as died, and return fast.

        The embedded redis-server and worker are left to the supervisor, which sees this process go, lets the
        worker finish the run (findings and report of what was recorded) and then stops them.
        """
        self.emitter.close(timeout=timeout)
        offline = not self.emitter.reachable
        self._record_end(reason, offline=offline)
        if self.reporter is not None:
            with contextlib.suppress(Exception):
                self.reporter.stop(drained=False, offline=offline, died=reason)
            self.reporter = None

    def _record_end(self, died: str | None, *, offline: bool = False) -> None:
        """``died`` (with the reason), or ``finished`` once every rank with a stream has ended cleanly.

        ``offline``: Redis did not answer the emitter in time; the end goes to ``status.json`` only (``stability
        replay`` carries it to Redis with the spool), so the exit does not wait on Redis again."""
        import redis

        from stability import runstate

        run_dir = self.run_dir if self.supervisor is not None or self.rank == 0 else None
        if offline:
            if run_dir is not None:
                self._write_local_end(run_dir, died)
            return
        client = _quick_client(self.redis_url, 2.0)
        try:
            # whichever rank records the end mirrors Redis's verdict into its run dir (the last to close may be any
            # rank: spawned Hogwild processes, or an mp.spawn rank 1 that outlives rank 0)
            if died is not None:
                runstate.mark(client, self.config.run_id, runstate.DIED, reason=died, run_dir=self.run_dir)
                return
            ranks: Any = client.smembers(keys.ranks(self.config.run_id))
            fields = [f"ended:{int(r)}" for r in ranks]
            ended: Any = client.hmget(keys.meta(self.config.run_id), fields) if fields else []
            if all(ended):
                runstate.mark(client, self.config.run_id, runstate.FINISHED, run_dir=self.run_dir)
        except (redis.RedisError, OSError) as exc:
            log.info("stability: could not record the end of run %s (%s)", self.config.run_id, exc)
            if run_dir is not None:  # ``stability replay`` carries it to Redis with the spool
                self._write_local_end(run_dir, died)
        finally:
            client.close()

    def _write_local_end(self, run_dir: Path, died: str | None) -> None:
        from stability import runstate

        local_end = runstate.RunStatus(status=runstate.DIED if died is not None else runstate.FINISHED,
                                       reason=died or "", time=time.time(), host=socket.gethostname(), pid=os.getpid())
        runstate.write_status_file(run_dir, self.config.run_id, local_end)

    def _wait_drained(self, timeout: float) -> bool:

        deadline = time.monotonic() + timeout
        client = connect(self.redis_url, socket_timeout=2.0)
        try:
            while time.monotonic() < deadline:
                if self.supervisor is not None and self.supervisor.poll() is not None:
                    log.warning("stability: local supervisor exited with code %s", self.supervisor.returncode)
                    return False
                if client.hexists(keys.meta(self.config.run_id), "drained"):
                    return True
                time.sleep(0.1)
            log.warning("stability: worker did not finish draining run %s within %.0fs", self.config.run_id, timeout)
            return False
        finally:
            client.close()


class LazySession:
    """A record sink that opens its :class:`Session` on the first record (see the module docstring).

    ``put`` never blocks: before the session is up, records wait in a buffer of ``config.queue_size`` (older ones
    are kept, newer ones dropped and counted when it is full) and are handed to the emitter in order once it runs.
    If the session cannot be opened, the failure is logged once and records are dropped from then on.
    """

    def __init__(self, config: WatchConfig, *, fork_rank: int | None = None) -> None:
        self.config = config
        self._fork_rank = fork_rank
        self._lock = threading.Lock()
        self._buffer: collections.deque[StepRecord] = collections.deque()
        self._session: Session | None = None
        self._thread: threading.Thread | None = None
        self._failed = False
        self._closed = False
        self._terminated: str | None = None
        self.dropped = 0
        """Records dropped before the session was up (buffer full, or the session failed to open)."""

    @property
    def session(self) -> Session | None:
        """The open session (None before the first record, while it starts, or when it failed)."""
        return self._session

    @property
    def started(self) -> bool:
        """True once the first record (or :meth:`start`) asked for the session."""
        return self._thread is not None

    def put(self, record: StepRecord) -> bool:
        """Hand ``record`` to the emitter, or buffer it while the session starts; False when it was dropped."""
        session = self._session
        if session is not None:
            return session.emitter.put(record)
        with self._lock:
            session = self._session
            if session is None:
                if self._failed or self._closed or len(self._buffer) >= self.config.queue_size:
                    self.dropped += 1
                    return False
                self._buffer.append(record)
                self._start_locked()
                return True
        return session.emitter.put(record)

    def prepare_fork(self) -> None:
        """Called right before ``os.fork`` while capturing: import what a forked child's session needs (here, in
        the forking thread: a child must not inherit a module lock held by another thread mid-import), then start
        this process's session without waiting (a Hogwild child connects to the Redis it publishes)."""
        import redis  # noqa: F401

        from stability import runstate  # noqa: F401
        from stability.console import ConsoleReporter  # noqa: F401
        from stability.transport import Emitter  # noqa: F401

        self.start()

    def fork_child(self, rank: int) -> LazySession:
        """The sink of a forked child that trains (Hogwild), recorded as ``rank``: a session of its own that
        connects to the Redis this process's session publishes (:meth:`Session.open` with ``fork_rank``)."""
        return LazySession(self.config, fork_rank=rank)

    def start(self) -> None:
        """Start opening the session now (without waiting for a record)."""
        with self._lock:
            self._start_locked()

    def wait(self, timeout: float = 60.0) -> Session | None:
        """Start the session if needed and wait until it is open; the session (None if it failed)."""
        self.start()
        if self._thread is not None:
            self._thread.join(timeout)
        return self._session

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._open, name="stability-session", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            session = Session.open(self.config, fork_rank=self._fork_rank)
        except Exception as exc:
            log.warning("stability: could not start the session, records are dropped (%s: %s)",
                        type(exc).__name__, exc)
            with self._lock:
                self._failed = True
                self.dropped += len(self._buffer)
                self._buffer.clear()
            return
        with self._lock:  # hand over the buffer before any later put can reach the emitter: order is kept
            while self._buffer:
                session.emitter.put(self._buffer.popleft())
            self._session = session
            terminated = self._terminated is not None
        if terminated:
            self._terminated_meanwhile(session)

    def close(self, timeout: float = DRAIN_WAIT_S, *, died: str | None = None, wait_drained: bool = True,
              flush_s: float | None = None) -> Session | None:
        """Close the session if it was started (waiting for it to open first, so the buffered records reach the
        emitter); the closed session or None. ``wait_drained`` / ``flush_s``: see :meth:`Session.close`."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return None
        thread.join(timeout)
        session = self._session
        if session is not None:
            session.close(timeout=timeout, died=died, wait_drained=wait_drained, flush_s=flush_s)
        return session

    def terminate(self, reason: str, timeout: float = 10.0) -> None:
        """See :meth:`Session.terminate`; waits up to ``timeout`` for a session that is still opening.

        A session still not open by then (the embedded Redis slow to start, a remote one not answering) cannot
        reach Redis: local rank 0 writes the end to ``<run dir>/status.json`` (the supervisor, if it was started,
        keeps that reason instead of "vanished"), and a session that opens after all records it at once."""
        with self._lock:
            self._closed = True
            self._terminated = reason
            thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if self._session is not None:
            self._session.terminate(reason, timeout=timeout)
        elif thread.is_alive() and self._fork_rank is None and rank_from_env()[1] == 0:
            _write_early_end(self.config, reason)

    def _terminated_meanwhile(self, session: Session) -> None:
        """The process was told to terminate while ``session`` was opening: record the end now."""
        with contextlib.suppress(Exception):
            session.terminate(self._terminated or "terminated", timeout=2.0)


def _write_early_end(config: WatchConfig, reason: str) -> None:
    """``status.json`` of a run whose session never opened: died for ``reason``, at no recorded step."""
    from stability import runstate

    end = runstate.RunStatus(status=runstate.DIED, reason=reason, time=time.time(), host=socket.gethostname(),
                             pid=os.getpid())
    with contextlib.suppress(OSError):
        runstate.write_status_file(make_private_dir(config.resolved_run_dir.resolve()), config.run_id, end)


def start_line(config: WatchConfig, run_dir: Path, url: str, meta: dict[str, str], *, local_worker: bool) -> str:
    """``stability: run <id> -> <run dir> · embedded Redis · local worker · W&B <project|off>``."""
    if config.redis_url is None:
        parts = ["embedded Redis", "local worker" if local_worker else "no local worker (STABILITY_LOCAL_WORKER=0)"]
    else:
        parts = [f"Redis {_safe_url(url)}", "remote workers (stability worker)"]
    project = meta.get("wandb_project")
    parts.append(f"W&B {project}" if project else "W&B off")
    return f"stability: run {config.run_id} -> {run_dir} · " + " · ".join(parts)


def _safe_url(url: str) -> str:
    """``url`` without a password."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def _write_run_json(run_dir: Path, config: WatchConfig, meta: dict[str, str], world: int) -> None:
    """Run metadata for the report: ids, host, versions, configuration (secrets left out)."""
    from stability import __version__

    torch = sys.modules.get("torch")
    info: dict[str, object] = {
        "run_id": config.run_id,
        "run_dir": str(run_dir),
        "host": meta.get("host", ""),
        "world_size": world,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": str(getattr(torch, "__version__", "")),
        "stability": __version__,
        "command": " ".join(sys.argv)[:500],
        "config": {f.name: str(getattr(config, f.name)) for f in fields(config)
                   if f.name != "redis_url" and getattr(config, f.name) is not None},
    }
    if meta.get("wandb_project"):
        info["wandb_project"] = meta["wandb_project"]
    try:
        write_private_text(run_dir / "run.json", json.dumps(info, indent=2) + "\n")
    except OSError as exc:
        log.info("stability: could not write %s (%s)", run_dir / "run.json", exc)


def _run_meta(config: WatchConfig, run_dir: Path) -> dict[str, str]:
    meta = {"run_dir": str(run_dir), "host": socket.gethostname(), "pid": str(os.getpid())}
    project = config.wandb_project or os.environ.get("WANDB_PROJECT")
    wandb = sys.modules.get("wandb")  # never import wandb here; only look at a run the script already started
    active = getattr(wandb, "run", None) if wandb is not None else None
    mode = os.environ.get("WANDB_MODE", "online")
    if active is not None:
        project = project or getattr(active, "project", None)
        meta["wandb_run_id"] = str(getattr(active, "id", ""))
        meta["wandb_group"] = str(getattr(active, "group", "") or "")
        mode = str(getattr(getattr(active, "settings", None), "mode", None) or mode)
    if project:
        meta["wandb_project"] = project
        meta["wandb_mode"] = mode
    return meta


OWNER_LOCK = "owner.lock"
"""``<run dir>/redis/owner.lock``: held (``flock``) by the one process of the host that starts the run directory's
supervisor, embedded Redis and local worker."""


def _claim_run_dir(run_dir: Path) -> int | None:
    """An exclusive lock on the run directory's :data:`OWNER_LOCK` (its descriptor), or None when another process
    holds it. Local rank 0 normally comes from the launcher; ``torch.multiprocessing.spawn`` (the PyTorch DDP
    tutorial) sets no ``LOCAL_RANK``, so every spawned rank read itself as local rank 0 and started a supervisor and
    a console of its own on one run directory. The first to claim it owns them; the others join its Redis."""
    import fcntl

    path = run_dir / "redis" / OWNER_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _own_run_dir(config: WatchConfig, run_dir: Path) -> tuple[subprocess.Popen[bytes] | None, int | None]:
    """(the supervisor, the owner lock) when this process claims the run directory (:func:`_claim_run_dir`);
    ``(None, None)`` when another process owns it."""
    owner = _claim_run_dir(run_dir)
    if owner is None:
        return None, None
    try:
        return _start_supervisor(config, run_dir), owner
    except BaseException:
        os.close(owner)
        raise


def _start_supervisor(config: WatchConfig, run_dir: Path) -> subprocess.Popen[bytes]:
    """Start ``python -m stability.supervisor`` for this process (:func:`_supervisor_url` waits for its Redis)."""
    url_file = run_dir / "redis" / URL_FILE
    url_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        url_file.unlink()  # a stale URL of an earlier run in this directory
    cmd = [sys.executable, "-m", "stability.supervisor", "--run-dir", str(run_dir), "--run-id", config.run_id,
           "--watch-pid", str(os.getpid())]
    if not config.local_worker:
        cmd.append("--no-worker")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    logfile = open_private(run_dir / "worker.log")
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        raise EmbeddedServerError(f"cannot start the local supervisor: {exc}") from None
    finally:
        logfile.close()
    return proc


def _supervisor_url(proc: subprocess.Popen[bytes], run_dir: Path) -> str:
    """The URL of the redis-server the supervisor ``proc`` started, once it answers (the supervisor is stopped if
    it never comes)."""
    try:
        return _wait_for_url(run_dir / "redis" / URL_FILE, process=proc, log_file=run_dir / "worker.log")
    except BaseException:
        _stop_process(proc, 5.0, group=False)
        raise


def _start_watchdog(config: WatchConfig, run_dir: Path) -> subprocess.Popen[bytes] | None:
    """With an external Redis: the supervisor in watch-only mode, which records the run as died and its ranks ended
    if this process vanishes (the remote workers then finish the run). None if it cannot be started."""
    assert config.redis_url is not None
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["STABILITY_WATCH_URL"] = config.redis_url
    cmd = [sys.executable, "-m", "stability.supervisor", "--run-dir", str(run_dir), "--run-id", config.run_id,
           "--watch-pid", str(os.getpid()), "--external"]
    try:
        with open_private(run_dir / "supervisor.log") as logfile:
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    except OSError as exc:
        log.info("stability: no watchdog for run %s (%s)", config.run_id, exc)
        return None


def _record_status(url: str, run_id: str, status: str, *, run_dir: Path | None) -> None:
    """Best effort: Redis may be down (the emitter spools meanwhile); the status is only a label."""
    import redis

    from stability import runstate

    try:
        with _quick_client(url, 1.0) as client:
            runstate.mark(client, run_id, status, run_dir=run_dir)
    except (redis.RedisError, OSError) as exc:
        log.info("stability: could not record run %s as %s (%s)", run_id, status, exc)


def _quick_client(url: str, timeout: float) -> Any:
    """A redis-py client that gives up after one try (the status is a label: never hold up training for it)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return connect(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))


def _wait_for_url(path: Path, timeout: float = 60.0, *, process: subprocess.Popen[bytes] | None = None,
                  log_file: Path | None = None) -> str:
    """The URL local rank 0 published, once that server answers (a stale file from an earlier run does not).

    With ``process`` (the supervisor that publishes it), its early exit is an error at once, not after ``timeout``.
    """
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EmbeddedServerError(f"the local supervisor exited with code {process.returncode} before Redis was "
                                      f"up; see {log_file or path.parent}")
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text().strip()
            if text:
                try:
                    with redis.Redis.from_url(text, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                        client.ping()
                    return text
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
        time.sleep(0.01)  # the URL appears ~0.1-0.3 s after the supervisor starts: a short script's exit waits for it
    raise EmbeddedServerError(f"local rank 0 did not publish the embedded Redis URL in {path} within {timeout}s")


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0, *, group: bool = True) -> None:
    """SIGTERM ``proc`` (its process group with ``group``), SIGKILL after ``timeout``; reaps it."""
    if proc.poll() is not None:
        return
    kill = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError):
        kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            kill(proc.pid, signal.SIGKILL)
        proc.wait()
