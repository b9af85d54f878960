"""A run session on the training side: run directory, Redis (embedded or external), emitter, local worker.

``Session.open(config)`` decides where records go:

* ``redis_url`` set (``STABILITY_REDIS_URL``): that server; workers run elsewhere (``stability worker``).
* otherwise: an **embedded** real redis-server in ``<run_dir>/redis`` (append-only persistence, unix socket),
  started by local rank 0, plus one local worker process (``python -m stability.worker``) that lives and dies
  with the training process. Other local ranks wait for ``<run_dir>/redis/url`` and connect to the same server.

Training-side module: imports only stdlib, redis (via the transport) and the records layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stability import keys
from stability.config import WatchConfig
from stability.embedded import RedisServer
from stability.errors import EmbeddedServerError
from stability.transport import Emitter

__all__ = ["Session", "rank_from_env"]

log = logging.getLogger(__name__)

URL_FILE = "url"
DRAIN_WAIT_S = 60.0


def rank_from_env() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from torch.distributed when initialized, else the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size()
    except Exception:  # pragma: no cover - torch without distributed
        pass
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
    server: RedisServer | None = None
    worker: subprocess.Popen[bytes] | None = None

    @classmethod
    def open(cls, config: WatchConfig) -> Session:
        """Start (or connect to) Redis and the local worker, and return a session with a running emitter."""
        rank, local_rank, _world = rank_from_env()
        run_dir = config.resolved_run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        server = worker = None
        if config.redis_url is not None:
            url = config.redis_url
        elif local_rank == 0:
            server = RedisServer(run_dir / "redis").start()
            url = server.url
            (run_dir / "redis" / URL_FILE).write_text(url)
            if config.local_worker:
                worker = _start_worker(server, run_dir)
        else:
            url = _wait_for_url(run_dir / "redis" / URL_FILE)
        emitter = Emitter(
            redis_url=url,
            run_id=config.run_id,
            spool_dir=run_dir / "spool",
            rank=rank,
            queue_size=config.queue_size,
            timeout_s=config.redis_timeout_s,
            meta=_run_meta(config, run_dir),
        )
        log.info("stability: run %s, rank %d, records -> %s, run dir %s", config.run_id, rank, url, run_dir)
        return cls(config=config, run_dir=run_dir, redis_url=url, emitter=emitter, rank=rank, server=server,
                   worker=worker)

    def close(self, timeout: float = DRAIN_WAIT_S) -> None:
        """Flush the emitter; with an embedded Redis wait for the local worker to drain, then stop both."""
        self.emitter.close(timeout=min(timeout, 30.0))
        if self.server is None:
            return
        if self.worker is not None:
            self._wait_drained(timeout)
            _stop_process(self.worker)
            self.worker = None
        self.server.stop()
        self.server = None

    def _wait_drained(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2.0)
        try:
            while time.monotonic() < deadline:
                if self.worker is not None and self.worker.poll() is not None:
                    log.warning("stability: local worker exited with code %s", self.worker.returncode)
                    return
                if client.hexists(keys.meta(self.config.run_id), "drained"):
                    return
                time.sleep(0.1)
            log.warning("stability: worker did not finish draining run %s within %.0fs", self.config.run_id, timeout)
        finally:
            client.close()


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


def _start_worker(server: RedisServer, run_dir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["STABILITY_REDIS_URL"] = server.url
    env.setdefault("STABILITY_SWEEP_S", "0.5")
    env.setdefault("OMP_NUM_THREADS", "1")
    logfile = open(run_dir / "worker.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "stability.worker", "--loglevel", "INFO"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise EmbeddedServerError(f"cannot start the local worker: {exc}") from None
    finally:
        logfile.close()


def _wait_for_url(path: Path, timeout: float = 60.0) -> str:
    """The URL local rank 0 published, once that server answers (a stale file from an earlier run does not)."""
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text().strip()
            if text:
                try:
                    with redis.Redis.from_url(text, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                        client.ping()
                    return text
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
        time.sleep(0.05)
    raise EmbeddedServerError(f"local rank 0 did not publish the embedded Redis URL in {path} within {timeout}s")


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
