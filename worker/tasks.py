"""Celery tasks: ``sweep`` (beat, every few seconds) triggers ``drain(run_id)`` for each active run.

A trigger is cheap and may be lost or duplicated: the drain takes a per-run lease, and the streams hold the data.
``sweep`` sends at most one queued ``drain`` per run (marker key ``<lock>:trigger``, cleared when the drain starts
and expiring after one lease, so a trigger lost with a killed worker is re-sent).
"""

from __future__ import annotations

import functools
import logging

import redis

from stability import keys
from stability.redis_url import RedisClient, connect
from stability.worker.advice import AdviceSink
from stability.worker.app import app, settings
from stability.worker.drain import Drainer, SnapshotPolicy
from stability.worker.sinks import ArchiveSink, ConsoleSink, RedisFindingsSink, ReportSink, Sink, redis_meta
from stability.worker.wandb_sink import WandbSink, _RunState

__all__ = ["drain", "sweep"]

logger = logging.getLogger(__name__)


@functools.cache
def client() -> RedisClient:
    """This process's Redis client (created lazily, so after a prefork fork); a cluster client for a
    ``redis+cluster://`` URL (every command stability sends touches one hash slot, see :mod:`stability.redis_url`)."""
    return connect(settings.client_url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=25)


@functools.cache
def sinks() -> list[Sink]:
    """This process's sinks (the W&B sink keeps one diagnosis run per training run)."""
    meta = redis_meta(client())
    # order matters at the end of a run: the archive is compacted and the W&B URL stored before the report is made
    return [ConsoleSink(), RedisFindingsSink(client()), ArchiveSink(meta), AdviceSink(client()), _LinkedWandbSink(meta),
            ReportSink(meta, client())]


class _LinkedWandbSink(WandbSink):
    """The W&B sink, logging the diagnosis run's URL and storing it in the run's metadata (``wandb_url``)."""

    def _start(self, run_id: str) -> _RunState | None:
        state = super()._start(run_id)
        url = getattr(state.run, "url", None) if state is not None else None
        if url:
            logger.info("%s: W&B diagnosis run: %s", run_id, url)
            try:
                client().hset(keys.meta(run_id), "wandb_url", str(url))
            except redis.RedisError as exc:
                logger.info("%s: could not store the W&B URL (%s)", run_id, exc)
        return state


def trigger_key(run_id: str) -> str:
    """Marker of a queued drain trigger of ``run_id``."""
    return keys.trigger(run_id)


@app.task(name="stability.sweep")  # type: ignore[untyped-decorator]
def sweep() -> int:
    """Send ``drain(run_id)`` for every active run that has no trigger queued; return how many were sent."""
    sent = 0
    members: set[bytes] = client().smembers(keys.RUNS)  # type: ignore[assignment]
    for raw in sorted(members):
        run_id = raw.decode()
        if client().set(trigger_key(run_id), b"1", nx=True, px=settings.lease_ms):
            try:
                drain.delay(run_id)
            except Exception:
                client().delete(trigger_key(run_id))
                raise
            sent += 1
    return sent


@app.task(name="stability.drain")  # type: ignore[untyped-decorator]
def drain(run_id: str) -> str:
    """Drain ``run_id``'s streams (see :class:`~stability.worker.drain.Drainer`); return the drain's status."""
    client().delete(trigger_key(run_id))
    result = Drainer(
        client(), run_id, sinks=sinks(), batch=settings.batch, lease_ms=settings.lease_ms, max_seconds=settings.drain_s,
        snapshot=SnapshotPolicy(every_s=settings.snapshot_s, every_records=settings.snapshot_n),
    ).run()
    if result.processed or result.status not in ("idle", "busy"):
        logger.info(
            "%s: %s, %d entries (%d rejected), %d findings",
            run_id, result.status, result.processed, result.rejected, len(result.findings),
        )  # fmt: skip
    return result.status
