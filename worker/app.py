"""The Celery app of the stability worker.

The broker is the Redis that carries the records (``STABILITY_REDIS_URL``; a ``unix://`` socket URL is turned
into kombu's ``redis+socket://`` form), unless ``STABILITY_BROKER_URL`` names another one. Tasks are only
triggers, the data stays in Redis Streams, so the app needs no result backend. When the records live in a Redis
Cluster (``redis+cluster://...``, see :mod:`stability.redis_url`) the broker must be set apart: kombu's Redis
transport talks to one server (it has no cluster client), so a cluster URL without ``STABILITY_BROKER_URL`` (or
a cluster URL as broker) is a :class:`ConfigError` at start. Settings follow service-notes §3: late acks,
re-queue when a worker process dies, one message prefetched per process, JSON only. ``sweep`` runs every
``STABILITY_SWEEP_S`` seconds (default 1.0) in whichever worker holds the sweep lease (``worker.tasks.Sweeper``);
the beat schedule below is kept only for a deployment that still runs a separate ``celery beat``.

Environment:

==========================  ==========================  ===============================================
variable                    default                     meaning
==========================  ==========================  ===============================================
``STABILITY_REDIS_URL``     ``redis://127.0.0.1:6379/0``  Redis with the record streams (also the broker);
                                                        ``redis+cluster://h:p[,h:p]`` for a Redis Cluster
``STABILITY_BROKER_URL``    (the Redis above)           Celery broker: ``redis://``, ``rediss://``, ``unix://``,
                                                        ``amqp://``...; required when the Redis is a cluster
``STABILITY_SWEEP_S``       ``1.0``                     seconds between sweeps over the active runs
``STABILITY_BATCH``         ``500``                     entries read per rank and batch
``STABILITY_LEASE_MS``      ``30000``                   per-run drain lease (and abandoned-entry idle time)
``STABILITY_DRAIN_S``       ``20``                      time budget of one drain task
``STABILITY_SNAPSHOT_S``    ``5``                       seconds between detector snapshots (+ acks, trim)
``STABILITY_SNAPSHOT_N``    ``5000``                    entries after which a snapshot is taken anyway
``STABILITY_SHARD_SIZE``    ``0``                       ranks per shard of a run not drained yet (0: runs
                                                        are not sharded unless their metadata says so)
``STABILITY_SWEEPER``       ``1``                       0: this worker never takes the sweep lease
==========================  ==========================  ===============================================

``STABILITY_SNAPSHOT_SHARE`` (default ``0.1``): timed snapshots take at most about this share of a drain's time; after
a commit that took c seconds the next timed one waits until the drain has spent c (1 / share - 1) seconds of its own
busy time (at most 120 s of wall time; ``SnapshotPolicy.max_share``, 1: off).

``STABILITY_SNAPSHOT_RANK_N`` (default ``20``): a snapshot by ``STABILITY_SNAPSHOT_N`` also waits until this many
entries per rank that moved were processed (at most 120 s; ``SnapshotPolicy.rank_records``): a snapshot packs every
rank that moved, so a shard of 1,024 ranks would otherwise pack a rank's state for every 5 records.

``STABILITY_SNAPSHOT_IDLE_S`` (default: ``STABILITY_SNAPSHOT_S``): a drain that has caught up commits once this long
has passed since the last commit (``SnapshotPolicy.idle_s``; shorter: less to re-process when the run's next drain
runs in another process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from celery import Celery

from stability.errors import ConfigError
from stability.redis_url import check_url, is_cluster_url, redis_py_url, safe_url

__all__ = ["WorkerSettings", "app", "broker_url"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def broker_url(redis_url: str) -> str:
    """The kombu broker URL of a redis-py URL (``unix://path`` becomes ``redis+socket://path``).

    Raises:
        ConfigError: ``redis_url`` names a Redis Cluster, which cannot be Celery's broker.
    """
    if is_cluster_url(redis_url):
        raise ConfigError(
            f"{safe_url(redis_url)!r} is a Redis Cluster, which cannot be the Celery broker (kombu's Redis transport "
            "needs one server); set STABILITY_BROKER_URL to a single Redis (redis://HOST:PORT/DB) or another broker"
        )
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://") :]
    return redis_url


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings:
    """Worker settings, read from the environment by :meth:`from_env`."""

    redis_url: str = DEFAULT_REDIS_URL
    """URL of the Redis with the streams (``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``)."""
    broker_url: str | None = None
    """Celery broker URL (``STABILITY_BROKER_URL``); None: the Redis of ``redis_url`` (which must not be a cluster)."""
    sweep_s: float = 1.0
    """Seconds between beat sweeps."""
    batch: int = 500
    """Entries read per rank and batch."""
    lease_ms: int = 30_000
    """Per-run lease; a worker that dies holding it blocks that run for at most this long."""
    drain_s: float = 20.0
    """Time budget of one drain task."""
    snapshot_s: float = 5.0
    """Seconds between commits of a run (detector snapshot, acks, stream trim); see ``drain.SnapshotPolicy``."""
    snapshot_n: int = 5_000
    """Entries processed after which a run is committed anyway."""
    snapshot_rank_n: int = 20
    """A commit by ``snapshot_n`` also waits for this many entries per rank that moved
    (``SnapshotPolicy.rank_records``; at most 120 s)."""
    snapshot_share: float = 0.1
    """Timed commits take at most about this share of a drain's time (``SnapshotPolicy.max_share``; 1: off)."""
    snapshot_idle_s: float | None = None
    """A drain that caught up commits once this long has passed since the last commit (``SnapshotPolicy.idle_s``;
    None: ``snapshot_s``)."""
    shard_size: int = 0
    """Ranks per shard for runs this worker starts draining (0: no sharding; see ``worker.shards``)."""
    sweeper: bool = True
    """Whether this worker takes part in the sweep lease (``worker.tasks.Sweeper``)."""

    def __post_init__(self) -> None:
        check_url(self.redis_url, "STABILITY_REDIS_URL")
        _ = self.broker  # raises ConfigError for a cluster without a separate broker
        if not self.sweep_s > 0:
            raise ConfigError(f"STABILITY_SWEEP_S must be > 0, got {self.sweep_s}")
        if self.batch < 1:
            raise ConfigError(f"STABILITY_BATCH must be >= 1, got {self.batch}")
        if self.lease_ms < 100:
            raise ConfigError(f"STABILITY_LEASE_MS must be >= 100, got {self.lease_ms}")
        if not self.drain_s > 0:
            raise ConfigError(f"STABILITY_DRAIN_S must be > 0, got {self.drain_s}")
        if self.snapshot_s < 0:
            raise ConfigError(f"STABILITY_SNAPSHOT_S must be >= 0, got {self.snapshot_s}")
        if self.snapshot_n < 1:
            raise ConfigError(f"STABILITY_SNAPSHOT_N must be >= 1, got {self.snapshot_n}")
        if self.snapshot_rank_n < 1:
            raise ConfigError(f"STABILITY_SNAPSHOT_RANK_N must be >= 1, got {self.snapshot_rank_n}")
        if not 0 < self.snapshot_share <= 1:
            raise ConfigError(f"STABILITY_SNAPSHOT_SHARE must be in (0, 1], got {self.snapshot_share}")
        if self.snapshot_idle_s is not None and self.snapshot_idle_s < 0:
            raise ConfigError(f"STABILITY_SNAPSHOT_IDLE_S must be >= 0, got {self.snapshot_idle_s}")
        if self.shard_size < 0:
            raise ConfigError(f"STABILITY_SHARD_SIZE must be >= 0, got {self.shard_size}")

    @property
    def client_url(self) -> str:
        """The URL for :func:`stability.redis_url.connect` (``redis+socket://path`` becomes ``unix://path``)."""
        return redis_py_url(self.redis_url)

    @property
    def broker(self) -> str:
        """The kombu URL of the Celery broker: ``broker_url`` if set, else the Redis of ``redis_url``.

        Raises:
            ConfigError: the broker would be a Redis Cluster.
        """
        if self.broker_url is None:
            if is_cluster_url(self.redis_url):
                raise ConfigError(
                    f"STABILITY_REDIS_URL={safe_url(self.redis_url)!r} is a Redis Cluster, which cannot be the Celery "
                    "broker; set STABILITY_BROKER_URL to a single Redis (redis://HOST:PORT/DB) or another broker"
                )
            return broker_url(self.redis_url)
        if is_cluster_url(self.broker_url):
            raise ConfigError(
                f"STABILITY_BROKER_URL={safe_url(self.broker_url)!r} is a Redis Cluster, which cannot be the Celery "
                "broker (kombu's Redis transport needs one server); use a single Redis or another broker"
            )
        return broker_url(self.broker_url)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """Settings from ``STABILITY_*`` variables (unset or empty: the default)."""
        env = os.environ if env is None else env

        def get(name: str, kind: type[int] | type[float], default: float) -> float:
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None

        return cls(
            redis_url=env.get("STABILITY_REDIS_URL") or DEFAULT_REDIS_URL,
            broker_url=env.get("STABILITY_BROKER_URL") or None,
            sweep_s=get("STABILITY_SWEEP_S", float, 1.0),
            batch=int(get("STABILITY_BATCH", int, 500)),
            lease_ms=int(get("STABILITY_LEASE_MS", int, 30_000)),
            drain_s=get("STABILITY_DRAIN_S", float, 20.0),
            snapshot_s=get("STABILITY_SNAPSHOT_S", float, 5.0),
            snapshot_n=int(get("STABILITY_SNAPSHOT_N", int, 5_000)),
            snapshot_rank_n=int(get("STABILITY_SNAPSHOT_RANK_N", int, 20)),
            snapshot_share=get("STABILITY_SNAPSHOT_SHARE", float, 0.1),
            snapshot_idle_s=get("STABILITY_SNAPSHOT_IDLE_S", float, -1.0) if env.get("STABILITY_SNAPSHOT_IDLE_S")
            else None,
            shard_size=int(get("STABILITY_SHARD_SIZE", int, 0)),
            sweeper=int(get("STABILITY_SWEEPER", int, 1)) != 0,
        )


settings = WorkerSettings.from_env()

app = Celery("stability", include=["stability.worker.tasks"])
app.conf.update(
    broker_url=settings.broker,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600, "socket_timeout": 5},
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    task_default_priority=6,  # tasks.NORMAL_PRIORITY: urgent drains (priority 0) are read first (Redis transport)
    worker_hijack_root_logger=False,
    beat_scheduler="celery.beat:Scheduler",  # in memory: no celerybeat-schedule file in the working directory
    beat_schedule={"sweep": {"task": "stability.sweep", "schedule": settings.sweep_s}},
)
