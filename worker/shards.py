"""Sharded runs: one run's ranks drained by several workers at once (issue #10).

A run whose metadata has ``shard_size`` > 0 is split into shards of ranks, ``shard = rank // shard_size``. Each shard
is drained like an unsharded run (:class:`ShardDrainer`: its own lease, detector snapshot and trigger, the same
commit of snapshot + acks + trim in one ``MULTI/EXEC``), with the per-rank detectors of its ranks only
(:class:`~stability.detectors.engine.RunDiagnoser` with external verdicts). What needs all ranks at one step, the
cross-rank comparison, runs in the run's cross-rank stage (:mod:`stability.worker.crossrank_stage`), fed by a compact
summary stream per shard (``keys.summaries``: rank, step, loss, grad norm, host, coordinates, entry id of each record;
~60 bytes against ~9 KB for a 200-signal record).

**Summaries exactly once, with no commit delay.** After each batch a shard drain appends the summaries of the
batch's records to its stream and moves its per-rank watermark (``keys.summary_pos``: the last entry id summarized
per rank) in one ``MULTI/EXEC`` guarded (``WATCH``) by the shard's lease. A drain that re-processes entries after a
crash (they were pending since the last snapshot) skips every entry at or below the watermark, so the cross-rank
stage sees each record once, within one batch of its processing (not one snapshot period later, as it would if the
summaries waited for the snapshot commit). The same hash carries the shard's ``progress`` (every record of the
shard's ranks up to this entry id is summarized), ``idle`` (its last read found nothing new) and ``ended`` (every
rank ended and everything is summarized): the cross-rank stage merges the shards' summaries in entry-id order up to
the slowest shard, as the unsharded drain merges ranks, so a shard that is behind does not make a step look
complete with only the other shards' ranks.

**Held findings.** A shard's warning/error findings wait until the cross-rank stage has decided their step
(``keys.crossrank`` field ``decided``) and are then ranked, in the shard, with that step's verdict on the rank
(``keys.verdicts``), so the first alert of a faulty rank names ``hardware_fault`` as in an unsharded run. The shard
ranks them itself because ranking needs the rank's history, which only the shard has. While it holds any, the
shard's watermark hash carries ``held`` (the oldest held step, written with the summaries): the cross-rank stage
triggers this shard's drain as soon as it decides that step.

**End of the run.** A shard whose ranks all ended marks itself ``ended`` and waits for the cross-rank stage to
finish (its ``finish`` decides the last steps); then it flushes its detectors and marks ``shard_done:<shard>`` in
the run's metadata. Whoever sees every shard done and the cross-rank stage finished closes the sinks (archive
compaction, report) under the run's own lease (:func:`finalize_run`), marks the run ``drained`` and removes it from
``keys.RUNS``.

**Which runs are sharded.** A worker with ``STABILITY_SHARD_SIZE`` > 0 fixes the run's ``shard_size`` on its first
sweep of a run that no worker has drained yet (:func:`decide_shard_size`: atomic; a run with a detector snapshot or
a held lease keeps ``0``, i.e. the unsharded drain); the training side or an operator may also write ``shard_size``
into the run's metadata before it starts. ``shard_size`` never changes for a run (the snapshots are per shard). A
run without it drains exactly as before.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import redis

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.engine import DiagnoserConfig, RunDiagnoser
from stability.errors import ConfigError
from stability.redis_url import RedisClient
from stability.worker.drain import (
    _EXTEND,
    _RELEASE,
    Drainer,
    SnapshotPolicy,
    _Batch,
    _Context,
    _LeaseLost,
    run_ranks,
)
from stability.worker.sinks import Sink

__all__ = ["RedisVerdicts", "ShardDrainer", "decide_shard_size", "finalize_run", "id_key", "shard_size", "shards_of"]

logger = logging.getLogger(__name__)

DONE_STEP = 2**62
"""``decided`` once the cross-rank stage finished: every step is decided."""

_DECIDE = """
local v = redis.call('HGET', KEYS[1], 'shard_size')
if v then return v end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[1], 'shard_size', '0')
  return '0'
end
redis.call('HSET', KEYS[1], 'shard_size', ARGV[1])
return ARGV[1]
"""


def decide_shard_size(client: RedisClient, run_id: str, wanted: int) -> int:
    """The run's ``shard_size``, fixing it to ``wanted`` if no worker has drained the run yet (else 0 for good).

    With ``wanted`` <= 0 nothing is written: the run is sharded only if its metadata already says so.
    """
    if wanted <= 0:
        return shard_size(client, run_id)
    # execute_command: redis-py's ClusterPipeline/RedisCluster script objects differ; EVAL works on both
    raw = client.execute_command("EVAL", _DECIDE, 3, keys.meta(run_id), keys.state(run_id), keys.lock(run_id), wanted)
    return _int(raw)


def shard_size(client: RedisClient, run_id: str) -> int:
    """The run's ``shard_size`` from its metadata (0: not sharded)."""
    return _int(client.hget(keys.meta(run_id), "shard_size"))


def _int(raw: Any) -> int:
    if raw is None:
        return 0
    try:
        return max(0, int(raw.decode() if isinstance(raw, bytes) else raw))
    except ValueError:
        logger.warning("ignoring a shard_size that is not an integer: %r", raw)
        return 0


def shards_of(ranks: Iterable[int], size: int) -> list[int]:
    """The shards holding ``ranks``."""
    if size < 1:
        raise ConfigError(f"shard_size must be >= 1, got {size}")
    return sorted({r // size for r in ranks})


def id_key(entry_id: bytes | str) -> tuple[int, int]:
    """Sort key of a stream id ``<ms>-<seq>``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class RedisVerdicts:
    """The cross-rank stage's verdicts as a shard's :class:`~stability.detectors.engine.Verdicts`.

    ``decided`` is read once per batch (:meth:`refresh`); a verdict is read only for a finding being ranked.
    """

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._client = client
        self._run_id = run_id
        self._decided = -1
        self.done = False
        """The cross-rank stage has finished the run."""

    def refresh(self) -> None:
        """Re-read the cross-rank stage's watermark."""
        decided, done = self._client.hmget(keys.crossrank(self._run_id), ["decided", "done"])  # type: ignore[misc]
        self.done = bool(done)
        self._decided = DONE_STEP if self.done else (int(decided) if decided is not None else -1)

    def decided(self) -> int:
        """Every step up to this one is decided by the cross-rank stage."""
        return self._decided

    def suspect(self, rank: int, step: int) -> Finding | None:
        """The disagreement decided on ``rank`` at ``step``, if any."""
        raw = self._client.hget(keys.verdicts(self._run_id), f"{rank}:{step}")
        if raw is None:
            return None
        return Finding.from_dict(json.loads(raw))  # type: ignore[arg-type]


def commit_phase(shard: int, period_s: float) -> float:
    """How much earlier than its first drain a shard's commit clock starts: the shards' timed commits (put off up
    to ``SnapshotPolicy.max_every_s``, 120 s, on a 1-step-per-10-s job) all fell on the same step, and the eight
    ~0.3 s commits a worker then ran back to back delayed the next step's NaN alert by 1-3 s (16,384 ranks: the
    latency tail, docs/benchmarks.md). Golden-ratio phases spread any number of shards evenly over the period;
    a recovered shard keeps its cadence from its snapshot's time."""
    return (shard * 0.6180339887498949) % 1.0 * period_s


class _Factory:
    """A shard's diagnoser factory; one object per (client, run, shard) in a process, so a drain continues the
    in-memory context of the previous drain of the shard (:meth:`Drainer._resume` compares factories)."""

    def __init__(self, verdicts: RedisVerdicts, config: DiagnoserConfig | None) -> None:
        self.verdicts = verdicts
        self.config = config

    def __call__(self) -> RunDiagnoser:
        return RunDiagnoser(self.config, verdicts=self.verdicts)


_FACTORIES: dict[tuple[int, str, int, int], _Factory] = {}
_FACTORIES_LOCK = threading.Lock()


def _factory(client: RedisClient, run_id: str, shard: int, config: DiagnoserConfig | None) -> _Factory:
    key = (id(client), run_id, shard, id(config))
    with _FACTORIES_LOCK:
        factory = _FACTORIES.get(key)
        if factory is None:
            if len(_FACTORIES) > 4096:
                _FACTORIES.clear()
            factory = _FACTORIES[key] = _Factory(RedisVerdicts(client, run_id), config)
        return factory


class ShardDrainer(Drainer):
    """Drains one shard of a sharded run (see the module docstring); the arguments are :class:`Drainer`'s plus
    ``shard`` and ``size`` (the run's ``shard_size``), the detectors' ``config`` and ``on_lease``, called once the
    shard's lease is taken (the worker routes the shard's next triggers to itself: shard affinity)."""

    def __init__(
        self,
        client: RedisClient,
        run_id: str,
        shard: int,
        size: int,
        *,
        sinks: Sequence[Sink],
        batch: int = 500,
        lease_ms: int = 30_000,
        max_seconds: float = 20.0,
        snapshot: SnapshotPolicy | None = None,
        config: DiagnoserConfig | None = None,
        on_lease: Callable[[], None] | None = None,
    ) -> None:
        if size < 1 or shard < 0:
            raise ConfigError(f"need shard >= 0 and shard_size >= 1, got shard {shard}, shard_size {size}")
        factory = _factory(client, run_id, shard, config)
        super().__init__(client, run_id, sinks=sinks, batch=batch, lease_ms=lease_ms, max_seconds=max_seconds,
                         diagnoser=factory, snapshot=snapshot)
        self.shard = shard
        self.size = size
        self._verdicts = factory.verdicts
        self._lock_key = keys.shard_lock(run_id, shard)
        self._state_key = keys.shard_state(run_id, shard)
        self._owner_key = f"{self._lock_key}:owner"
        self._context_key = f"{run_id}#{shard}"
        self._on_lease = on_lease

    # -- hooks -----------------------------------------------------------------------------------------------

    def _leased(self) -> None:
        if self._on_lease is not None:
            self._on_lease()

    def _refuse(self) -> str | None:
        return None

    def _fresh_context(self, ctx: _Context) -> None:
        if not self.client.exists(self._state_key):  # the shard's first drain: stagger its commit cadence
            ctx.committed_at -= commit_phase(self.shard, self.snapshot.max_every_s)
        raw: dict[bytes, bytes] = self.client.hgetall(keys.summary_pos(self.run_id, self.shard))  # type: ignore[assignment]
        ctx.extra["summarized"] = {int(k[1:]): id_key(v) for k, v in raw.items() if k.startswith(b"r")}
        ctx.extra["idle"] = raw.get(b"idle") == b"1"
        ctx.extra["ended"] = raw.get(b"ended") == b"1"

    def _already_drained(self) -> bool:
        if not self.client.hexists(keys.meta(self.run_id), f"shard_done:{self.shard}"):
            return False
        finalize_run(self.client, self.run_id, self.sinks, lease_ms=self.lease_ms)
        return True

    def _select(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if r // self.size == self.shard]

    def _before_batch(self, ctx: _Context) -> None:
        self._verdicts.refresh()

    def _after_batch(self, token: str, ctx: _Context, batch: _Batch, ranks: list[int]) -> None:
        self._summarize(token, ctx, batch)
        self._note_due(ctx)

    def _note_due(self, ctx: _Context) -> None:
        """A finding held for the cross-rank verdict stops waiting at ``due``: ask the sweeping worker to drain this
        shard then (``keys.DUE``; an earlier entry stays), not at whatever place the next sweep gives it."""
        due: float | None = ctx.diag.release_due()  # type: ignore[attr-defined]
        if due is not None and due != ctx.extra.get("due_noted"):
            self.client.zadd(keys.DUE, {keys.urgent_member(self.run_id, self.shard): due}, lt=True)
            ctx.extra["due_noted"] = due

    def _summarize(self, token: str, ctx: _Context, batch: _Batch) -> None:
        if not batch.acks:
            batch.findings += ctx.diag.release()  # type: ignore[attr-defined]
            idle = {} if ctx.extra.get("idle") else {"idle": "1"}
            if self._held_changed(ctx) or idle:
                with self.client.pipeline(transaction=False) as pipe:
                    self._pos_ops(pipe, idle, ctx)
                    pipe.execute()
                ctx.extra["idle"] = True
            return
        summarized: dict[int, tuple[int, int]] = ctx.extra.setdefault("summarized", {})
        items: list[list[Any]] = []
        marks: dict[str, str] = {}
        for entry in batch.entries:
            eid = id_key(entry.entry_id)
            if eid <= summarized.get(entry.rank, (-1, -1)):
                continue  # summarized before a crash: the cross-rank stage has it already
            rec = entry.record
            items.append([entry.rank, rec.step, rec.signals.get("loss"), rec.signals.get("grad_norm"), rec.host,
                          dict(rec.coords), eid[0], eid[1]])
            marks[f"r{entry.rank}"] = entry.entry_id
        full = [ids[-1] for ids in batch.acks.values() if len(ids) >= self.batch]
        lasts = [ids[-1] for ids in batch.acks.values()]
        progress = min(full, key=id_key) if full else max(lasts, key=id_key)
        packed = msgpack.packb(items, use_bin_type=True) if items else None
        self._held_changed(ctx)
        self._guarded(token, lambda pipe: self._summary_ops(pipe, packed, {**marks, "progress": progress, "idle": "0"},
                                                            ctx))
        for name, eid_text in marks.items():
            summarized[int(name[1:])] = id_key(eid_text)
        ctx.extra["idle"] = False

    def _summary_ops(self, pipe: Any, packed: bytes | None, marks: dict[str, str], ctx: _Context) -> None:
        if packed is not None:
            pipe.xadd(keys.summaries(self.run_id, self.shard), {"s": packed})
        self._pos_ops(pipe, marks, ctx)

    def _held_changed(self, ctx: _Context) -> bool:
        """Note the oldest step the shard holds a finding of (``ctx.extra["held"]``); whether it changed since the
        last :meth:`_pos_ops`."""
        held: int | None = ctx.diag.oldest_held()  # type: ignore[attr-defined]
        ctx.extra["held"] = held
        return bool(held != ctx.extra.get("held_written", -1))

    def _pos_ops(self, pipe: Any, marks: dict[str, str], ctx: _Context) -> None:
        """Write the shard's watermark ``marks`` and its ``held`` mark (the cross-rank stage triggers this shard's
        drain once that step is decided: the held findings are released then, not at the next sweep)."""
        key = keys.summary_pos(self.run_id, self.shard)
        held = ctx.extra.get("held")
        if held is None:
            if ctx.extra.get("held_written", -1) is not None:
                pipe.hdel(key, "held")
        else:
            marks = {**marks, "held": str(held)}
        if marks:
            pipe.hset(key, mapping=marks)
        ctx.extra["held_written"] = held

    def _guarded(self, token: str, ops: Any) -> None:
        """``ops(pipe)`` in MULTI/EXEC if the shard's lease is still ours (else :class:`_LeaseLost`)."""
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self._lock_key)
                if pipe.get(self._lock_key) != token.encode():
                    raise _LeaseLost
                pipe.multi()
                ops(pipe)
                pipe.execute()
            except redis.WatchError:
                raise _LeaseLost from None

    def _may_finish(self, token: str, ctx: Any, result: Any) -> bool:
        if self._verdicts.done:
            return True
        if not ctx.extra.get("ended"):
            self._guarded(token, lambda pipe: pipe.hset(keys.summary_pos(self.run_id, self.shard), "ended", "1"))
            ctx.extra["ended"] = True
            logger.info("%s shard %d: every rank ended; waiting for the cross-rank stage", self.run_id, self.shard)
        if ctx.since_commit:
            self._commit(token, ctx, result)
        return False

    def _close_sinks(self, token: str) -> None:
        self._sync_sinks()  # the run's sinks are closed once, when every shard is done (finalize_run)

    def _finished(self, pipe: Any) -> None:
        pipe.hset(keys.meta(self.run_id), f"shard_done:{self.shard}", repr(time.time()))

    def _after_finish(self) -> None:
        finalize_run(self.client, self.run_id, self.sinks, lease_ms=self.lease_ms)


def finalize_run(client: RedisClient, run_id: str, sinks: Sequence[Sink], *, lease_ms: int = 30_000) -> bool:
    """Close a sharded run once every shard is done and the cross-rank stage finished (see the module docstring).

    Runs under the run's own lease (``keys.lock``, unused otherwise by a sharded run); returns True once the run is
    drained (by this call or an earlier one).
    """
    raw: dict[bytes, bytes] = client.hgetall(keys.meta(run_id))  # type: ignore[assignment]
    meta = {k.decode(): v for k, v in raw.items()}
    if "drained" in meta:
        client.srem(keys.RUNS, run_id)
        return True
    size = _int(meta.get("shard_size"))
    if size < 1 or client.hget(keys.crossrank(run_id), "done") is None:
        return False
    if not all(f"shard_done:{s}" in meta for s in shards_of(run_ranks(client, run_id), size)):
        return False
    token, lock = secrets.token_hex(16), keys.lock(run_id)
    if not client.set(lock, token, nx=True, px=lease_ms):
        return False
    done = threading.Event()

    def keep() -> None:
        while not done.wait(lease_ms / 3000):
            try:
                client.execute_command("EVAL", _EXTEND, 1, lock, token, lease_ms)
            except redis.RedisError:
                return

    keeper = threading.Thread(target=keep, name=f"stability-finalize-{run_id}", daemon=True)
    keeper.start()
    try:
        if client.hexists(keys.meta(run_id), "drained"):
            return True
        for sink in sinks:
            sink.close(run_id)
        client.hset(keys.meta(run_id), "drained", repr(time.time()))
        client.srem(keys.RUNS, run_id)
        logger.info("%s: drained (sharded, shard_size %d)", run_id, size)
        return True
    finally:
        done.set()
        keeper.join()
        client.execute_command("EVAL", _RELEASE, 1, lock, token)
