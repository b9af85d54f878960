"""Celery tasks: ``sweep`` (every ``STABILITY_SWEEP_S``) triggers ``drain(run_id)`` for each active run, or, for a
sharded run, ``drain_shard(run_id, shard, size)`` per shard and ``crossrank(run_id, size)`` (:mod:`.shards`), then
checks the active runs for a silence of all ranks while running (a ``hang`` finding, :mod:`.quiet`).

A trigger is cheap and may be lost or duplicated: the drain takes a per-run (per-shard) lease, and the streams hold
the data. ``sweep`` sends at most one queued task per run or shard (marker key ``keys.trigger`` /
``keys.shard_trigger``, cleared when the task starts and expiring after one lease, so a trigger lost with a killed
worker is re-sent).

**Who sweeps.** Every worker process runs a :class:`Sweeper` thread (started when the worker is ready, unless
``STABILITY_SWEEPER=0``, which ``stability worker --no-beat`` sets): each period it takes or renews the global lease
``keys.SWEEPER`` (``SET NX PX``, a few sweep periods long) and sweeps only while it holds it. When the sweeping
worker dies, however it dies, its lease expires and another worker takes over within one lease; there is no beat
process to be left orphaned. Two sweeps at once (a worker stalled past its lease) are harmless: the trigger markers
keep one queued task per run.

**Urgent first.** Between two sweeps the sweeping worker waits on ``keys.URGENT`` (``BLPOP``): an emitter pushes
its rank there with a record that has a non-finite loss or gradient, and the rank's drain (its shard's, in a sharded
run) is queued at once with :data:`URGENT_PRIORITY`, ahead of the drains already queued (every other task goes with
:data:`NORMAL_PRIORITY`; kombu's Redis transport reads the lower number first; a RabbitMQ broker ignores both: its
queues are not declared with ``x-max-priority``), at most one queued per run or shard (``keys.urgent_trigger``).
A shard that holds such a finding for the cross-rank verdict notes when the wait runs out (``keys.DUE``); the
sweeping worker queues that shard's drain then, and the cross-rank stage's release of decided steps goes ahead of
the queue too. So a NaN in a 16,384-rank job is read in the first shard
drain after it was written instead of wherever its shard falls in the sweep's order.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import signals

from stability import keys
from stability.detectors.engine import RunDiagnoser
from stability.redis_url import RedisClient, connect
from stability.worker.advice import AdviceSink
from stability.worker.app import app, settings
from stability.worker.crossrank_stage import CrossRankStage
from stability.worker.drain import Diagnoser, Drainer, DrainResult, SnapshotPolicy, run_ranks
from stability.worker.quiet import QuietCheck, QuietConfig
from stability.worker.shards import ShardDrainer, decide_shard_size, shard_size, shards_of
from stability.worker.sinks import ArchiveSink, ConsoleSink, RedisFindingsSink, ReportSink, Sink, redis_meta
from stability.worker.wandb_sink import WandbSink, _RunState

__all__ = ["Sweeper", "crossrank", "drain", "drain_shard", "sweep", "urgent_sweep"]

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


@functools.cache
def quiet_check() -> tuple[QuietCheck, list[Sink]]:
    """The sweep's quiet-run hang check (:mod:`.quiet`, ``STABILITY_QUIET_S``) and the sinks it publishes through:
    console, Redis findings and advice (the W&B sink's diagnosis run lives in the draining processes)."""
    return QuietCheck(QuietConfig.from_env()), [ConsoleSink(), RedisFindingsSink(client()), AdviceSink(client())]


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


def _trigger(marker: str, task: Any, *args: Any, affinity: str | None = None) -> int:
    """Send ``task(*args)`` unless one is queued (``marker``); 1 if sent. With an ``affinity`` key that names a
    worker's own queue (:func:`_affine`), the task goes to that queue."""
    return _trigger_all([(marker, task, args, affinity)])


def _trigger_all(triggers: list[tuple[str, Any, tuple[Any, ...], str | None]]) -> int:
    """:func:`_trigger` for each (marker, task, args, affinity), the markers and affinities in one round trip (a
    sweep triggers every shard of a run); returns how many were sent."""
    with client().pipeline(transaction=False) as pipe:
        for marker, _, _, affinity in triggers:
            pipe.set(marker, b"1", nx=True, px=settings.lease_ms)
            pipe.get(affinity if affinity is not None else marker)
        replies = pipe.execute()
    sent = 0
    for (marker, task, args, affinity), taken, queue in zip(triggers, replies[::2], replies[1::2], strict=True):
        if not taken:
            continue
        try:
            if affinity is not None and queue:
                task.apply_async(args, queue=queue.decode() if isinstance(queue, bytes) else str(queue))
            else:
                task.delay(*args)
        except Exception:
            client().delete(marker)
            raise
        sent += 1
    return sent


# -- shard affinity --------------------------------------------------------------------------------------------------
#
# A shard drain that runs in another process than the previous one recovers from the snapshot and re-processes every
# entry since it; with the tasks on one shared queue, that happens on about every other drain of a multi-worker
# deployment. So each worker also consumes a queue of its own, and a shard drain that ended caught up (``idle``)
# names that queue for the shard (``keys.shard_affinity``, expiring after AFFINITY_MS): the next trigger goes there,
# to the process that holds the shard's detectors in memory. A drain that ran out of time (``timeout``: the worker is
# behind) names nothing, so the next trigger goes to the shared queue and any free worker takes the shard over; a
# worker that dies stops renewing, so after AFFINITY_MS its shards go to the shared queue (a trigger already in its
# queue is re-sent once the trigger marker expires, one lease later).

AFFINITY_MS = 10_000
"""How long a shard stays routed to the worker that last drained it without another caught-up drain there."""

_OWN_QUEUE: list[str] = []
"""This worker's own queue (set when the worker starts)."""


def _affine(run_id: str, shard: int | str, status: str) -> None:
    """Route the shard's next triggers to this worker (``leased``: its drain took the lease here; ``idle``: it caught
    up) or to the shared queue (``timeout``: this worker is behind)."""
    if not _OWN_QUEUE:
        return
    if status in ("leased", "idle"):
        client().set(keys.shard_affinity(run_id, shard), _OWN_QUEUE[0], px=AFFINITY_MS)
    elif status == "timeout":
        client().delete(keys.shard_affinity(run_id, shard))


@signals.celeryd_after_setup.connect  # type: ignore[untyped-decorator]
def _own_queue(sender: str, instance: Any, **_: Any) -> None:
    """Consume a queue of this worker's own too (shard affinity, above)."""
    name = f"stability.worker.{sender}"
    instance.app.amqp.queues.select_add(name)
    _OWN_QUEUE[:] = [name]


URGENT_PRIORITY = 0
"""Message priority of urgent drains (kombu's Redis transport reads priority 0 first)."""
NORMAL_PRIORITY = 6
"""Every other task's priority (``task_default_priority``, set in :mod:`.app`)."""


def _send_urgent(targets: list[tuple[str, Any, tuple[Any, ...], str | None]]) -> int:
    """Queue each (urgent marker, task, args, affinity key) with :data:`URGENT_PRIORITY` unless an urgent one is
    queued already (a NaN storm must not flood the queue), whether or not a normal trigger is (a second drain finds
    nothing new: cheap); returns how many were sent. The task clears the marker when it starts."""
    if not targets:
        return 0
    with client().pipeline(transaction=False) as pipe:
        for marker, _, _, affinity in targets:
            pipe.set(marker, b"1", nx=True, px=settings.lease_ms)
            pipe.get(affinity) if affinity is not None else pipe.echo(b"")
        replies = pipe.execute()
    sent = 0
    for (marker, task, args, _), taken, queue in zip(targets, replies[::2], replies[1::2], strict=True):
        if not taken:
            continue
        try:
            route = {"queue": queue.decode() if isinstance(queue, bytes) else str(queue)} if queue else {}
            task.apply_async(args, {"urgent": True}, priority=URGENT_PRIORITY, **route)
        except Exception:
            client().delete(marker)
            raise
        sent += 1
    return sent


def urgent_sweep(urgent: list[bytes], due: list[bytes]) -> int:
    """Queue, ahead of the other drains, the drain of each rank in ``urgent`` (``keys.URGENT`` entries: its shard's
    in a sharded run) and of each shard in ``due`` (``keys.DUE`` entries); returns the tasks sent."""
    wanted: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}

    def size_of(run_id: str) -> int:
        if run_id not in sizes:
            sizes[run_id] = shard_size(client(), run_id)
        return sizes[run_id]

    for member in urgent:
        parsed = keys.parse_urgent(member)
        if parsed is not None:
            size = size_of(parsed[0])
            wanted.setdefault(parsed[0], set()).add(parsed[1] // size if size else -1)
    for member in due:
        parsed = keys.parse_urgent(member)
        if parsed is not None and size_of(parsed[0]):
            wanted.setdefault(parsed[0], set()).add(parsed[1])
    targets: list[tuple[str, Any, tuple[Any, ...], str | None]] = []
    for run_id, shards in sorted(wanted.items()):
        for shard in sorted(shards):
            if shard < 0:
                targets.append((keys.urgent_trigger(run_id), drain, (run_id,), None))
            else:
                targets.append(_urgent_shard(run_id, shard, sizes[run_id]))
    return _send_urgent(targets)


def _urgent_shard(run_id: str, shard: int, size: int) -> tuple[str, Any, tuple[Any, ...], str | None]:
    """The :func:`_send_urgent` item of ``drain_shard`` for ``shard``."""
    return keys.urgent_trigger(run_id, shard), drain_shard, (run_id, shard, size), keys.shard_affinity(run_id, shard)


def _pop_due(now: float) -> list[bytes]:
    """Take the ``keys.DUE`` entries whose time has come."""
    with client().pipeline(transaction=True) as pipe:
        pipe.zrangebyscore(keys.DUE, "-inf", now)
        pipe.zremrangebyscore(keys.DUE, "-inf", now)
        members, _ = pipe.execute()
    return list(members)


def _next_due() -> float | None:
    """Unix time of the earliest ``keys.DUE`` entry (None: none)."""
    first = client().zrange(keys.DUE, 0, 0, withscores=True)
    return float(first[0][1]) if first else None  # type: ignore[index]


@app.task(name="stability.sweep")  # type: ignore[untyped-decorator]
def sweep() -> int:
    """Send a drain task for every active run (every shard and the cross-rank stage of a sharded run) that has no
    trigger queued; return how many were sent."""
    sent = 0
    members: set[bytes] = client().smembers(keys.RUNS)  # type: ignore[assignment]
    for raw in sorted(members):
        run_id = raw.decode()
        size = decide_shard_size(client(), run_id, settings.shard_size)
        if not size:
            sent += _trigger(trigger_key(run_id), drain, run_id)
            continue
        sent += _trigger_all([*_shard_triggers(run_id, size, shards_of(run_ranks(client(), run_id), size)),
                              (keys.shard_trigger(run_id, keys.CROSSRANK), crossrank, (run_id, size),
                               keys.shard_affinity(run_id, keys.CROSSRANK))])
    check, quiet_sinks = quiet_check()
    check.sweep(client(), [raw.decode() for raw in sorted(members)], quiet_sinks)  # all ranks silent: a hang
    return sent


_SWEEP_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == false then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if cur == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
_SWEEP_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Sweeper:
    """Runs :func:`sweep` every ``every_s`` seconds while this process holds the global sweep lease (see the module
    docstring); a failing sweep is logged at most once a minute (no traceback flood)."""

    def __init__(self, every_s: float, lease_ms: int | None = None) -> None:
        self.every_s = every_s
        self.lease_ms = lease_ms if lease_ms is not None else max(2_000, int(every_s * 4_000))
        self.token = secrets.token_hex(16)
        self.holding = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stability-sweeper", daemon=True)
        self._logged = -1e9

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping and hand the lease back (another worker takes over at its next period)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        try:
            client().execute_command("EVAL", _SWEEP_RELEASE, 1, keys.SWEEPER, self.token)
        except redis.RedisError:
            pass

    def tick(self) -> int | None:
        """One period: take or renew the lease; sweep if held. Returns the tasks sent (None: another sweeps)."""
        held = bool(client().execute_command("EVAL", _SWEEP_LEASE, 1, keys.SWEEPER, self.token, self.lease_ms))
        if held != self.holding:
            logger.info("sweeper: %s the sweep lease", "took" if held else "lost")
            self.holding = held
        return sweep() if held else None

    def serve_urgent(self, wait_s: float) -> int:
        """Wait up to ``wait_s`` (at most 1 s) for an urgent rank (``keys.URGENT``) or a due shard (``keys.DUE``)
        and queue their drains ahead of the others (:func:`urgent_sweep`); returns the tasks sent."""
        now = time.time()
        due_at = _next_due()
        timeout = min(wait_s, 1.0) if due_at is None else min(wait_s, 1.0, due_at - now)
        urgent: list[bytes] = []
        popped = client().blpop([keys.URGENT], timeout=round(timeout, 3)) if timeout >= 0.001 else None
        if popped:
            urgent.append(popped[1])  # type: ignore[index]
        urgent += client().lpop(keys.URGENT, 1000) or []  # type: ignore[operator]
        due = _pop_due(time.time()) if due_at is not None and due_at <= time.time() else []
        return urgent_sweep(urgent, due) if urgent or due else 0

    def _loop(self) -> None:
        while True:
            self._wait_until(time.monotonic() + self.every_s)
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception as exc:  # Redis or the broker away: keep trying, say so once a minute
                self._failed("sweep", exc)

    def _wait_until(self, deadline: float) -> None:
        """Until ``deadline`` (or a stop): while this worker sweeps, serve urgent drains as they come."""
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not self.holding:
                self._stop.wait(left)
                continue
            try:
                self.serve_urgent(left)
            except Exception as exc:
                self._failed("urgent drains", exc)
                self._stop.wait(left)

    def _failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._logged >= 60:
            self._logged = now
            logger.warning("sweeper: %s failed (%s: %s); retrying every %.1f s", what, type(exc).__name__, exc,
                           self.every_s)


_SWEEPER: list[Sweeper] = []


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _start_sweeper(**_: Any) -> None:
    """Every worker takes part in the sweep lease (unless STABILITY_SWEEPER=0)."""
    if settings.sweeper and not _SWEEPER:
        sweeper = Sweeper(settings.sweep_s)
        _SWEEPER.append(sweeper)
        sweeper.start()
        logger.info("sweeper: started (every %.2f s, lease %d ms)", sweeper.every_s, sweeper.lease_ms)


@signals.worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _stop_sweeper(**_: Any) -> None:
    while _SWEEPER:
        _SWEEPER.pop().stop()


@app.task(name="stability.drain")  # type: ignore[untyped-decorator]
def drain(run_id: str, urgent: bool = False) -> str:
    """Drain ``run_id``'s streams (see :class:`~stability.worker.drain.Drainer`); return the drain's status.
    ``urgent``: sent by :func:`urgent_sweep` (clears its own marker, the queued normal trigger stays)."""
    client().delete(keys.urgent_trigger(run_id) if urgent else trigger_key(run_id))
    result = Drainer(
        client(), run_id, sinks=sinks(), batch=settings.batch, lease_ms=settings.lease_ms, max_seconds=settings.drain_s,
        snapshot=_snapshot_policy(), diagnoser=_diagnoser(),
    ).run()
    _log(run_id, result)
    return result.status


BENCH_NO_DETECTORS = "STABILITY_BENCH_NO_DETECTORS"
"""BENCHMARK ONLY: set to ``1`` and the ``drain`` task (unsharded runs) feeds every record to
:class:`NullDiagnoser` instead of the detectors (``bench/loadgen.py --no-detectors``): it measures the worker's
ceiling without detectors (reading, decoding, archiving, acking). Never set it on a real worker: nothing is
detected."""


class NullDiagnoser:
    """BENCHMARK ONLY (see :data:`BENCH_NO_DETECTORS`): a diagnoser that finds nothing and keeps no state."""

    def update(self, record: Any) -> list[Any]:
        """Nothing."""
        return []

    def finish(self) -> list[Any]:
        """Nothing."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """No state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state."""


@functools.cache
def _diagnoser() -> Callable[[], Diagnoser]:
    """The detector suite's factory (read once per process: the same factory keeps a drain's in-memory context)."""
    if os.environ.get(BENCH_NO_DETECTORS) == "1":
        logger.warning("%s=1: benchmark mode, the detectors are OFF (nothing will be found)", BENCH_NO_DETECTORS)
        return NullDiagnoser
    return RunDiagnoser


def _snapshot_policy() -> SnapshotPolicy:
    return SnapshotPolicy(every_s=settings.snapshot_s, every_records=settings.snapshot_n,
                          idle_s=settings.snapshot_idle_s, max_share=settings.snapshot_share,
                          rank_records=settings.snapshot_rank_n)


def _log(name: str, result: DrainResult) -> None:
    if result.processed or result.status not in ("idle", "busy"):
        logger.info(
            "%s: %s, %d entries (%d rejected), %d findings",
            name, result.status, result.processed, result.rejected, len(result.findings),
        )  # fmt: skip


@app.task(name="stability.drain_shard")  # type: ignore[untyped-decorator]
def drain_shard(run_id: str, shard: int, size: int, urgent: bool = False) -> str:
    """Drain one shard of a sharded run (:class:`~stability.worker.shards.ShardDrainer`); ``urgent``: see
    :func:`drain`."""
    client().delete(keys.urgent_trigger(run_id, shard) if urgent else keys.shard_trigger(run_id, shard))
    result = ShardDrainer(
        client(), run_id, shard, size, sinks=sinks(), batch=settings.batch, lease_ms=settings.lease_ms,
        max_seconds=settings.drain_s, snapshot=_snapshot_policy(),
        on_lease=functools.partial(_affine, run_id, shard, "leased"),
    ).run()
    _log(f"{run_id} shard {shard}", result)
    _affine(run_id, shard, result.status)
    if result.processed:  # new summaries: the cross-rank stage now, not at the next sweep
        stage = keys.shard_affinity(run_id, keys.CROSSRANK)
        if not _OWN_QUEUE or client().get(stage) != _OWN_QUEUE[0].encode() or _stage(run_id, size).status == "busy":
            # in this process if the stage's state is here (else it would load the other worker's snapshot)
            _trigger(keys.shard_trigger(run_id, keys.CROSSRANK), crossrank, run_id, size, affinity=stage)
    return result.status


@app.task(name="stability.crossrank")  # type: ignore[untyped-decorator]
def crossrank(run_id: str, size: int) -> str:
    """Run the cross-rank stage of a sharded run (:class:`~stability.worker.crossrank_stage.CrossRankStage`)."""
    client().delete(keys.shard_trigger(run_id, keys.CROSSRANK))
    return _stage(run_id, size).status


def _stage(run_id: str, size: int) -> DrainResult:
    """The cross-rank stage of a sharded run, in this process (the ``crossrank`` task; a shard drain that summarized
    records runs it at once too); returns at once if another worker runs it."""
    result = CrossRankStage(
        client(), run_id, size, sinks=sinks(), lease_ms=settings.lease_ms, max_seconds=settings.drain_s,
        snapshot=_snapshot_policy(), on_lease=functools.partial(_affine, run_id, keys.CROSSRANK, "leased"),
        on_release=functools.partial(_release, run_id, size),
    ).run()
    _log(f"{run_id} cross-rank", result)
    _affine(run_id, keys.CROSSRANK, result.status)
    return result


def _release(run_id: str, size: int, shards: list[int]) -> None:
    """The cross-rank stage decided the step of findings these shards hold: drain them now (they release them), not
    at the next sweep, ahead of the drains already queued."""
    _send_urgent([_urgent_shard(run_id, shard, size) for shard in shards])


def _shard_triggers(run_id: str, size: int, shards: list[int]) -> list[tuple[str, Any, tuple[Any, ...], str | None]]:
    """The :func:`_trigger_all` items of ``drain_shard`` for ``shards``."""
    return [(keys.shard_trigger(run_id, shard), drain_shard, (run_id, shard, size), keys.shard_affinity(run_id, shard))
            for shard in shards]
