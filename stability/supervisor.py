"""The local supervisor of an embedded run: owns its redis-server and local worker, and outlives the trainer.

Why a separate process: a training process ended by SIGTERM (``timeout``, a scheduler) or SIGKILL cannot stop what
it started, and redis-server cannot watch its parent. So local rank 0 starts ``python -m stability.supervisor``
(its own session: a Ctrl-C or a signal to the training process group does not reach it), which

1. starts redis-server in ``<run dir>/redis`` and the local worker (``python -m stability.worker``) from its main
   thread with ``PR_SET_PDEATHSIG`` = SIGTERM, so if the supervisor itself is killed, both stop too (redis-server
   saves its append-only file on SIGTERM, the worker shuts down warm);
2. publishes the server's URL in ``<run dir>/redis/url`` once it answers PING;
3. watches the training process (a pidfd, or ``getppid`` polling where pidfds are missing):

   * SIGTERM from the training side (:meth:`stability.session.Session.close`, after the run drained): stop the
     worker, then redis-server, exit 0;
   * SIGUSR1 from the training side: its fast exit (``import stability.auto`` at interpreter exit) is under way;
     when it is gone, the local worker finishes the run (once every rank has ended on its own; nothing is marked
     for the others, which may still be training) within ``STABILITY_EXIT_DRAIN_S``, then both are stopped;
   * the training process gone without either: record the run as ``died`` at its last step (unless the trainer
     recorded it first, e.g. on SIGTERM), mark every rank ended so the worker finishes the run (findings.json
     and report.html from what reached Redis), wait for that (``STABILITY_EXIT_DRAIN_S``, default 120 s), then
     stop the worker and redis-server.

While it runs, ``<run dir>/redis/supervisor.pid`` holds its pid (removed when it has stopped everything);
:func:`wait_stopped` waits for that, e.g. for the report after a fast exit.

With an external Redis (``--external``; the URL comes in the environment variable ``STABILITY_WATCH_URL``, so no
password shows in ``ps``) it only watches: a vanished trainer is recorded as
died and its run's ranks are marked ended, so the remote workers finish the run instead of waiting for it forever.

Imports only the standard library, redis and stability's training-side modules (never Celery: the worker is a
separate process).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stability import keys
from stability.embedded import RedisServer, parent_death_preexec
from stability.errors import StabilityError
from stability.redis_url import connect

__all__ = ["ParentWatch", "main", "wait_stopped"]

log = logging.getLogger("stability.supervisor")

URL_FILE = "url"
PID_FILE = "supervisor.pid"
EXIT_DRAIN_S = 120.0
"""Default bound of the drain after the training process died (``STABILITY_EXIT_DRAIN_S``)."""
STOP_WAIT_S = 20.0
MAX_RESTARTS = 3
"""A worker or redis-server that dies while the trainer runs is restarted at most this many times each."""


class ParentWatch:
    """Tells when process ``pid`` has exited: a pidfd becomes readable (Linux >= 5.3), else ``getppid`` changes
    (the supervisor is the trainer's child, so it is re-parented when the trainer dies), else ``kill(pid, 0)``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._fd = os.pidfd_open(pid)

    def gone(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True once the process has exited."""
        if self._fd is not None:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            return bool(poller.poll(int(timeout * 1000)))
        deadline = time.monotonic() + timeout
        while os.getppid() == self.pid and _alive(self.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return True

    def close(self) -> None:
        """Release the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Supervisor:
    """See the module docstring; :meth:`run` is the whole life of the process."""

    def __init__(self, *, run_dir: Path, run_id: str, watch_pid: int, worker: bool, exit_drain_s: float,
                 redis_url: str | None = None) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.watch = ParentWatch(watch_pid)
        self.want_worker = worker and redis_url is None
        self.exit_drain_s = exit_drain_s
        self.server = RedisServer(run_dir / "redis", parent_death_signal=signal.SIGTERM) if redis_url is None else None
        self.url = redis_url if redis_url is not None else self.server.url  # type: ignore[union-attr]
        self.worker: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._clean_exit = threading.Event()
        self._restarts = {"redis-server": 0, "worker": 0}

    def run(self) -> int:
        """Start everything, watch the trainer, stop everything; the exit status."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGUSR1, lambda *_: self._clean_exit.set())  # the trainer's fast exit is under way
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the trainer (SIGTERM) or its death stops us
        if self.watch.gone(0):
            log.warning("stability supervisor: training process %d is already gone", self.watch.pid)
            return 1
        pid_file = self.run_dir / "redis" / PID_FILE
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        _publish(pid_file, str(os.getpid()))
        try:
            return self._run()
        finally:
            with contextlib.suppress(OSError):
                pid_file.unlink()

    def _run(self) -> int:
        try:
            if self.server is not None:
                self.server.start()
        except StabilityError as exc:
            log.error("stability supervisor: %s", exc)
            return 1
        try:
            if self.server is not None:
                _publish(self.run_dir / "redis" / URL_FILE, self.server.url)
            if self.want_worker:
                self.worker = self._start_worker()
            log.info("stability supervisor: redis-server pid %s, worker pid %s, watching training pid %d",
                     self.server.pid if self.server else "(external)", self.worker.pid if self.worker else None,
                     self.watch.pid)
            while not self._stop.is_set():
                if self.watch.gone(0.5):
                    if self._clean_exit.is_set():
                        self._after_clean_exit()
                    else:
                        self._after_death()
                    break
                self._restart_crashed()
            else:
                log.info("stability supervisor: stop requested by the training process")
        finally:
            self._stop_worker()
            if self.server is not None:
                self.server.stop()
            self.watch.close()
        return 0

    def _restart_crashed(self) -> None:
        """Bring back a redis-server (same socket, its append-only file) or worker that died under a live trainer."""
        if self.server is not None and self.server.pid is None and self._restarts["redis-server"] < MAX_RESTARTS:
            self._restarts["redis-server"] += 1
            log.warning("stability supervisor: redis-server died; restarting it (%d/%d)",
                        self._restarts["redis-server"], MAX_RESTARTS)
            try:
                self.server.start()
            except StabilityError as exc:
                log.error("stability supervisor: %s", exc)
        if (self.worker is not None and self.worker.poll() is not None and self._stop.is_set() is False
                and self._restarts["worker"] < MAX_RESTARTS):
            self._restarts["worker"] += 1
            log.warning("stability supervisor: the worker exited with %s; restarting it (%d/%d)",
                        self.worker.returncode, self._restarts["worker"], MAX_RESTARTS)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.worker.pid, signal.SIGKILL)  # its beat child, if it outlived it
            self.worker = self._start_worker()

    def _start_worker(self) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
        env["STABILITY_REDIS_URL"] = self.url
        env.setdefault("STABILITY_SWEEP_S", "0.5")
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.Popen(
            [sys.executable, "-m", "stability.worker", "--loglevel", "INFO"],
            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=parent_death_preexec(signal.SIGTERM),
        )  # fmt: skip

    def _after_death(self) -> None:
        """The training process vanished without a clean close: record it, let the worker finish the run."""
        import redis

        from stability import runstate  # imported here: the URL is published before redis-py is loaded

        client = connect(self.url, socket_timeout=5, socket_connect_timeout=5)
        try:
            # its own last word, if it could only write it to status.json (Redis did not answer it in time)
            said = runstate.read_status_file(self.run_dir)
            reason = (said.reason if said is not None and said.pid == self.watch.pid and said.status == runstate.DIED
                      and said.reason else "vanished without a clean close")
            status = runstate.mark(client, self.run_id, runstate.DIED, reason=reason, run_dir=self.run_dir)
            log.warning("stability supervisor: training process %d is gone; run %s %s", self.watch.pid,
                        self.run_id, status.describe())
            ranks = sorted(int(r) for r in client.smembers(keys.ranks(self.run_id)))  # type: ignore[union-attr]
            now = f"{time.time():.3f}"
            for rank in ranks:
                client.hsetnx(keys.meta(self.run_id), f"ended:{rank}", now)
            if self.worker is not None and ranks:
                self._wait_drained(client)
        except redis.RedisError as exc:
            log.error("stability supervisor: could not finish run %s (%s)", self.run_id, exc)
        finally:
            client.close()

    def _after_clean_exit(self) -> None:
        """The trainer exited after its fast close (records flushed, its rank ended, the run's end recorded): let the
        local worker finish the run, which includes waiting for the run's other ranks to end on their own (nothing
        is marked for them: they may still be training, e.g. on other nodes), then stop."""
        import redis

        log.info("stability supervisor: training process %d has exited; run %s finished on this rank, finishing "
                 "its diagnosis", self.watch.pid, self.run_id)
        if self.worker is None:
            return
        try:
            client = connect(self.url, socket_timeout=5, socket_connect_timeout=5)
            try:
                self._wait_drained(client)
            finally:
                client.close()
        except redis.RedisError as exc:
            log.error("stability supervisor: could not follow run %s (%s)", self.run_id, exc)

    def _wait_drained(self, client: Any) -> None:
        deadline = time.monotonic() + self.exit_drain_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if client.hexists(keys.meta(self.run_id), "drained"):
                log.info("stability supervisor: run %s drained after the training process ended", self.run_id)
                return
            if self.worker is not None and self.worker.poll() is not None:
                log.warning("stability supervisor: the worker exited (%s) before the run drained",
                            self.worker.returncode)
                return
            time.sleep(0.2)
        log.warning("stability supervisor: run %s not drained within %.0fs; stopping anyway", self.run_id,
                    self.exit_drain_s)

    def _stop_worker(self) -> None:
        proc, self.worker = self.worker, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the worker and its beat child
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_stopped(run_dir: Path, timeout: float) -> bool:
    """Wait until the supervisor of ``run_dir`` (if any) has stopped its worker and redis-server; False on timeout.

    After the fast exit of ``import stability.auto`` this is when findings.json and report.html are complete.
    """
    pid_file = Path(run_dir) / "redis" / PID_FILE
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid = int(pid_file.read_text().strip() or "0")
        except (OSError, ValueError):
            return True
        if pid <= 0 or not _alive(pid):  # gone without removing its file (SIGKILL)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _publish(path: Path, url: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(url)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """``python -m stability.supervisor --run-dir D --run-id R --watch-pid P [--no-worker | --external]``."""
    parser = argparse.ArgumentParser(prog="python -m stability.supervisor", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--watch-pid", type=int, required=True, help="the training process")
    parser.add_argument("--no-worker", action="store_true", help="do not start a local worker")
    parser.add_argument("--external", action="store_true",
                        help="watch only: the run's records are in the Redis named by $STABILITY_WATCH_URL (kept out "
                             "of the command line: it may hold a password); start no server or worker")
    args = parser.parse_args(argv)
    os.umask(0o077)  # the run directory is private: url, findings, report, archive, redis files (issue 14 item 6)
    redis_url = os.environ.get("STABILITY_WATCH_URL") if args.external else None
    if args.external and not redis_url:
        parser.error("--external needs STABILITY_WATCH_URL")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/supervisor] %(message)s")
    raw = os.environ.get("STABILITY_EXIT_DRAIN_S", "")
    try:
        exit_drain_s = float(raw) if raw else EXIT_DRAIN_S
    except ValueError:
        log.warning("STABILITY_EXIT_DRAIN_S=%r is not a number; using %.0f", raw, EXIT_DRAIN_S)
        exit_drain_s = EXIT_DRAIN_S
    return Supervisor(run_dir=args.run_dir.resolve(), run_id=args.run_id, watch_pid=args.watch_pid,
                      worker=not args.no_worker, exit_drain_s=exit_drain_s, redis_url=redis_url).run()


if __name__ == "__main__":
    sys.exit(main())
