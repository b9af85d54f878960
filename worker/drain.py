"""Drain one run's record streams in order, run the detectors, hand findings to the sinks, keep Redis bounded.

Redis Streams are the source of truth; a Celery ``drain(run_id)`` task is only a trigger. One :class:`Drainer`
call:

1. takes the run's lease (``SET keys.lock(run) <token> NX PX lease_ms``); if another worker holds it, returns at
   once (status ``busy``);
2. resumes the run: if this process drained the run last (an owner token next to the lease says so), it continues
   with the detectors and read positions it kept in memory; otherwise it creates the consumer group on every rank
   stream, loads the detector *snapshot* saved by the last commit, claims entries left pending by consumers of
   other names (``XAUTOCLAIM``, idle >= one lease) and *recovers*: it re-reads its own pending entries (the
   entries processed since that snapshot and never acknowledged) before any new one;
3. loops: reads a batch per rank (pending entries while recovering, then new ones, positions tracked in
   memory); feeds them to the detectors merged in stream-id order (each rank stays in step order); sends findings
   and records to the sinks at once (a background thread renews the lease meanwhile, so a batch slower than one
   lease is not given up and re-done forever). The entries stay pending;
4. *commits* at most every :attr:`SnapshotPolicy.every_s` seconds or :attr:`SnapshotPolicy.every_records`
   entries (and always at the end of the run): asks the sinks to make what they wrote durable
   (``sync(run_id)``, e.g. the archive's fsync), then in ONE ``MULTI/EXEC`` (guarded by ``WATCH`` on the lease)
   saves the detector snapshot, XACKs every entry processed since the last commit, records rejected entries and,
   when the run's records are archived, trims each rank stream with ``XTRIM MINID`` below the oldest entry any
   consumer group still has pending or has not read yet. A worker killed anywhere before ``EXEC`` leaves the
   entries pending and the old snapshot, so the next drain re-processes exactly those entries from the same state
   and the idempotent sinks absorb the repeat (exactly-once for the detector state, at-least-once for sinks);
5. when every rank has ``ended:<rank>`` in the metadata and nothing is left, calls ``finish()``, closes the
   sinks for the run (the report sink writes ``findings.json`` and ``report.html`` then; a background thread
   renews the lease meanwhile, since a long run's report can take longer than one lease), commits, marks the
   metadata ``drained`` and removes the run from ``keys.RUNS``.

Why snapshots and not a state SET per batch: the detector state of a run is tens to hundreds of KB; re-saving it
with every batch made the append-only file grow by that much several times a second. With a snapshot every few
seconds Redis holds, per run, one state, the entries since the last commit and the not-yet-drained backlog.

A sharded run (metadata ``shard_size`` > 0) is refused here (status ``sharded``); its shards are drained by
:class:`~stability.worker.shards.ShardDrainer`, this class with hooks (``_select``, ``_after_batch``,
``_may_finish``, ...) for the shard's keys, summaries and end of run.

Malformed entries (not decodable, missing field ``r``, wrong run) are never retried: they go to
``keys.errors(run)`` with the reason, count in the metadata field ``errors`` and are acked with the next commit.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgpack
import redis

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.errors import ConfigError, RecordError
from stability.records import decode_packed
from stability.redis_url import RedisClient
from stability.worker._keeper import lease_kept
from stability.worker._packed import PackedCommand
from stability.worker.sinks import Entry, Sink

__all__ = ["CONSUMER", "DrainResult", "Drainer", "Diagnoser", "SnapshotPolicy", "commit_due", "committed_clock",
           "owner_key", "run_ranks"]

logger = logging.getLogger(__name__)

CONSUMER = "drainer"
"""Consumer name in the group: stable, since only the lease holder reads."""

ERRORS_MAXLEN = 10_000
"""The errors stream keeps about this many rejected entries."""

RUN_FIELD = "_run"
"""Field of a per-rank snapshot hash holding the run part (the ranks are ``r<rank>``)."""
AT_FIELD = "_at"
"""Field of a per-rank snapshot hash: the wall time of the commit that wrote it (a drain that recovers from the
snapshot keeps the commit cadence: otherwise a run whose drains alternate between processes, each replaying the
entries since the snapshot on a fresh clock, might never commit)."""

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end
redis.call('SET', KEYS[1], ARGV[2])
return 0
"""
# Trim a stream below the oldest entry any group still needs: its oldest pending entry, or the entry after its
# last delivered one (not yet read). Entries are acked in the same transaction, just before this script.
_TRIM = """
local function id_less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local minid = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local keep = info['last-delivered-id']
  if tonumber(info['pending']) > 0 then
    local p = redis.call('XPENDING', KEYS[1], info['name'])
    if id_less(p[2], keep) then keep = p[2] end
  end
  if minid == nil or id_less(keep, minid) then minid = keep end
end
if minid == nil or minid == '0-0' then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""


def owner_key(run_id: str) -> str:
    """Token of the drainer context that last held the run's lease (same hash slot as the lease)."""
    return f"{keys.lock(run_id)}:owner"


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotPolicy:
    """How often a drainer commits: detector snapshot + acks + stream trim (see the module docstring)."""

    every_s: float = 5.0
    """Commit once this long has passed since the last commit (checked after each batch and when caught up)."""
    every_records: int = 5_000
    """Commit once this many entries were processed since the last commit."""
    trim_unarchived: bool = False
    """Trim acked entries even when no sink archived them (then Redis holds no copy of old records)."""
    idle_s: float | None = None
    """When a drain has caught up (its last read found nothing new), commit once this long has passed since the last
    commit (None: only by ``every_s`` / ``every_records``). With several workers a run's (shard's) next drain often
    runs in another process, which re-processes every entry since the last commit: a short idle commit keeps that
    small, and with per-rank snapshots it costs only the ranks that changed."""
    max_share: float = 0.1
    """Timed commits take at most about this share of a drain's time: with ``every_s`` > 0, a commit is put off until
    the drain has spent ``1 / max_share - 1`` times the last commit's duration reading and processing batches since
    it (its busy time, not wall time; at most ``max_every_s`` of wall time;
    ``every_records`` still commits, and ``every_s`` = 0 commits after every batch). A shard of 1,024 ranks at one
    step per 10 s re-saved half its ranks' detector state every 5 s, one rank state per record: ~40 % of the
    worker's time (16,384-rank load test, py-spy). Waiting longer saves each changed rank once for more of its
    records. 1: off."""
    max_every_s: float = 120.0
    """The longest ``max_share`` or ``rank_records`` may put a commit off (it bounds the entries a recovering drain
    re-processes)."""
    rank_records: int = 1
    """A commit by ``every_records`` also waits until this many entries per rank that moved were processed since the
    last commit (a commit packs the state of every rank that moved: a shard of 1,024 ranks at one step per 10 s
    packed a rank state for every 5 records with ``every_records`` 5,000). 1: ``every_records`` alone."""

    def __post_init__(self) -> None:
        if self.every_s < 0:
            raise ConfigError(f"every_s must be >= 0, got {self.every_s}")
        if self.every_records < 1:
            raise ConfigError(f"every_records must be >= 1, got {self.every_records}")
        if self.idle_s is not None and self.idle_s < 0:
            raise ConfigError(f"idle_s must be >= 0 or None, got {self.idle_s}")
        if not 0 < self.max_share <= 1:
            raise ConfigError(f"max_share must be in (0, 1], got {self.max_share}")
        if self.max_every_s < 0:
            raise ConfigError(f"max_every_s must be >= 0, got {self.max_every_s}")
        if self.rank_records < 1:
            raise ConfigError(f"rank_records must be >= 1, got {self.rank_records}")


class Diagnoser(Protocol):
    """What the drainer needs of :class:`~stability.detectors.engine.RunDiagnoser`."""

    def update(self, record: Any) -> list[Finding]: ...
    def finish(self) -> list[Finding]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class PartedDiagnoser(Diagnoser, Protocol):
    """A diagnoser whose state is saved incrementally, one hash field per rank (``RunDiagnoser``; see
    :meth:`~stability.detectors.engine.RunDiagnoser.state_parts`)."""

    def state_parts(self, *, changed_only: bool = True) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]: ...
    def load_state_parts(self, run: dict[str, Any], fetch: Callable[[int], dict[str, Any] | None]) -> None: ...


_Parted = PartedDiagnoser


@dataclass(slots=True, kw_only=True)
class DrainResult:
    """What one :meth:`Drainer.run` did."""

    status: str
    """``busy`` (lease held elsewhere), ``idle`` (caught up), ``timeout`` (time budget spent, more may remain),
    ``drained`` (run finished and fully processed), ``lease_lost`` (stopped without committing), ``sharded`` (the run
    is sharded: its shards and cross-rank stage drain it, see :mod:`stability.worker.shards`)."""
    processed: int = 0
    """Entries processed (records and rejected entries), committed or still pending until the next commit."""
    rejected: int = 0
    committed: int = 0
    """Entries acknowledged by this call's commits (may include entries processed by an earlier call)."""
    trimmed: int = 0
    """Stream entries deleted by ``XTRIM`` in this call's commits."""
    findings: list[Finding] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    entries: list[Entry] = field(default_factory=list)
    acks: dict[int, list[str]] = field(default_factory=dict)
    rejects: list[tuple[int, str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class _Context:
    """A run's drain as kept in this process between commits (valid while its token owns the run)."""

    token: str
    factory: Callable[[], Diagnoser]
    diag: Diagnoser
    cursors: dict[int, str | None] = field(default_factory=dict)
    """Per rank: next pending id to re-read while recovering; None once reading new entries."""
    unacked: dict[int, list[str]] = field(default_factory=dict)
    rejects: list[tuple[int, str, str]] = field(default_factory=list)
    since_commit: int = 0
    committed_at: float = field(default_factory=time.monotonic)
    commit_s: float = 0.0
    """How long this context's last commit took (``SnapshotPolicy.max_share``; 0 until it committed once)."""
    busy_s: float = 0.0
    """Time spent reading and processing batches since the last commit (``SnapshotPolicy.max_share``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What a subclass keeps with the context (a shard's summary watermark)."""
    ranks: list[int] | None = None
    """Every rank of the run (sorted), as of the last read of the rank set (ranks are only ever added)."""
    selected: list[int] = field(default_factory=list)
    """The ranks of ``ranks`` this drain reads (:meth:`Drainer._select`)."""
    rewrite_state: bool = False
    """The next commit replaces the whole snapshot key (it held a snapshot of the former one-string format)."""
    read_new: tuple[list[int], int, PackedCommand] | None = None
    """The ``XREADGROUP`` of new entries of every rank of ``selected`` (that list, that batch size), packed once."""


_RANK_COMMIT_S = [0.0]
"""Seconds per rank the last commit in this process took (what a context's first commit is expected to cost)."""

_CONTEXTS: dict[str, _Context] = {}
"""Runs this process drained last, by run id, least recently used first (a run that never finishes is evicted)."""
_CONTEXTS_LOCK = threading.Lock()
MAX_KEPT_CONTEXTS = 256
"""Most runs whose drain context a process keeps in memory; an evicted run recovers from its snapshot."""


class _LeaseLost(Exception):
    pass


class Drainer:
    """Drains the record streams of one run (see the module docstring).

    Args:
        client: Redis client of the run's data (bytes responses, i.e. ``decode_responses=False``); a
            ``RedisCluster`` works too: every transaction and script touches the run's hash slot only.
        run_id: The run to drain.
        sinks: Receivers of each batch's findings and records.
        batch: Entries read per rank and batch.
        lease_ms: Lease time; also the idle time after which another consumer's pending entries are claimed.
        max_seconds: Stop after this long (status ``timeout``) so other runs get served; the sweep re-triggers.
        diagnoser: Factory of the detector suite (default :class:`RunDiagnoser`).
        snapshot: Commit cadence (default :class:`SnapshotPolicy`).
    """

    def __init__(
        self,
        client: RedisClient,
        run_id: str,
        *,
        sinks: Sequence[Sink],
        batch: int = 500,
        lease_ms: int = 30_000,
        max_seconds: float = 20.0,
        diagnoser: Callable[[], Diagnoser] = RunDiagnoser,
        snapshot: SnapshotPolicy | None = None,
    ) -> None:
        if batch < 1:
            raise ConfigError(f"batch must be >= 1, got {batch}")
        if lease_ms < 100:
            raise ConfigError(f"lease_ms must be >= 100, got {lease_ms}")
        self.client = client
        self.run_id = run_id
        self.sinks = list(sinks)
        self.batch = batch
        self.lease_ms = lease_ms
        self.max_seconds = max_seconds
        self.snapshot = snapshot or SnapshotPolicy()
        self._new_diagnoser = diagnoser
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._logged_reject = False
        self._lock_key = keys.lock(run_id)
        self._state_key = keys.state(run_id)
        self._owner_key = owner_key(run_id)
        self._context_key = run_id
        """Key of this drain's continuation in ``_CONTEXTS`` (a shard of a run has its own)."""
        self._stream_names = _stream_names(run_id)

    # -- lease -----------------------------------------------------------------------------------------------

    def run(self) -> DrainResult:
        """Drain until caught up, finished or out of time; return at once if the lease is held elsewhere."""
        token = secrets.token_hex(16)
        lock = self._lock_key
        if not self.client.set(lock, token, nx=True, px=self.lease_ms):
            logger.debug("%s: lease busy, skipping", self.run_id)
            return DrainResult(status="busy")
        ctx: _Context | None = None
        try:
            self._leased()
            refused = self._refuse()
            if refused is not None:
                return DrainResult(status=refused)
            ctx = self._resume()
            result = self._drain(token, ctx)
            if result.status != "drained":
                with _CONTEXTS_LOCK:
                    _CONTEXTS[self._context_key] = ctx  # only a clean return keeps the in-memory continuation
                    while len(_CONTEXTS) > MAX_KEPT_CONTEXTS:
                        del _CONTEXTS[next(iter(_CONTEXTS))]
            return result
        except _LeaseLost:
            logger.warning("%s: lease lost; uncommitted entries stay pending for the next drain", self.run_id)
            return DrainResult(status="lease_lost")
        finally:
            self._release(keys=[lock], args=[token])

    def _renew(self, token: str) -> None:
        if not self._extend(keys=[self._lock_key], args=[token, self.lease_ms]):
            raise _LeaseLost

    def _resume(self) -> _Context:
        """This process's continuation of the run if it still owns it, else a fresh one from the snapshot."""
        with _CONTEXTS_LOCK:
            kept = _CONTEXTS.pop(self._context_key, None)
        fresh = secrets.token_hex(16)
        mine = kept is not None and kept.factory is self._new_diagnoser
        if self._take_over(keys=[self._owner_key], args=[kept.token if mine and kept else "", fresh]) and kept:
            return kept
        diag, legacy, saved_at = self._load_diagnoser()
        ctx = _Context(token=fresh, factory=self._new_diagnoser, diag=diag, rewrite_state=legacy)
        if saved_at is not None:
            ctx.committed_at = committed_clock(saved_at)
        self._fresh_context(ctx)
        return ctx

    # -- hooks of a sharded run's shard drain (worker.shards.ShardDrainer) ------------------------------------

    def _leased(self) -> None:
        """The lease was just taken (a shard drain routes the shard's next triggers to this worker)."""

    def _refuse(self) -> str | None:
        """A status when this drainer must not drain the run: ``sharded`` for a run whose metadata has
        ``shard_size`` > 0 (its shards and cross-rank stage drain it, see :mod:`stability.worker.shards`)."""
        raw = self.client.hget(keys.meta(self.run_id), "shard_size")
        return "sharded" if raw is not None and raw not in (b"0", "0") else None

    def _fresh_context(self, ctx: _Context) -> None:
        """A context was loaded from the snapshot (not continued in memory)."""

    def _already_drained(self) -> bool:
        """Whether this unit of work was finished by an earlier drain."""
        if self.client.hexists(keys.meta(self.run_id), "drained"):
            self.client.srem(keys.RUNS, self.run_id)
            return True
        return False

    def _select(self, ranks: list[int]) -> list[int]:
        """The ranks this drain reads (all of them: a shard drain reads its shard's)."""
        return ranks

    def _before_batch(self, ctx: _Context) -> None:
        """Called before each batch is read."""

    def _after_batch(self, token: str, ctx: _Context, batch: _Batch, ranks: list[int]) -> None:
        """Called after each batch was processed and before it is emitted (``batch.acks`` empty: nothing new)."""

    def _may_finish(self, token: str, ctx: _Context, result: DrainResult) -> bool:
        """Whether the run may be finished now that every rank ended and nothing is left."""
        return True

    def _close_sinks(self, token: str) -> None:
        """The end of the drained unit: close the sinks for the run."""
        with self._lease_kept(token):
            for sink in self.sinks:
                sink.close(self.run_id)

    def _finished(self, pipe: Any) -> None:
        """Commands added to the final commit (mark the run drained)."""
        pipe.hset(keys.meta(self.run_id), "drained", repr(time.time()))

    def _after_finish(self) -> None:
        """After the final commit: the run is no longer active."""
        # not in the transaction: keys.RUNS is global (another hash slot on a Redis Cluster); a crash here leaves a
        # drained run in RUNS, which the next drain removes (see _already_drained)
        self.client.srem(keys.RUNS, self.run_id)

    # -- main loop -------------------------------------------------------------------------------------------

    def _drain(self, token: str, ctx: _Context) -> DrainResult:
        if self._already_drained():
            return DrainResult(status="drained")
        result = DrainResult(status="idle")
        deadline = time.monotonic() + self.max_seconds
        ended = False
        """Every rank had ended before the last batch was read (an emitter marks the end after its last XADD)."""
        while True:
            started = time.monotonic()
            self._renew(token)
            ranks = self._ranks(ctx)
            self._before_batch(ctx)
            with self._lease_kept(token):  # a slow batch (busy CPU, many signals) must not lose the lease midway
                batch = self._read_batch(ranks, ctx)
                self._after_batch(token, ctx, batch, ranks)
                if batch.acks or batch.findings:
                    for sink in self.sinks:
                        sink.emit(self.run_id, batch.findings, batch.entries)
            ctx.busy_s += time.monotonic() - started
            if not batch.acks:
                result.findings += batch.findings
                if not ended and self._all_ended(ranks):
                    ended = True  # read after an empty batch only (a per-batch HMGET of every rank costs)
                    continue  # one more read: it finds whatever was written before the last end
                if ended and self._may_finish(token, ctx, result):
                    result.findings += self._finish(token, ctx, result)
                    result.status = "drained"
                elif self._due(ctx, idle=True):
                    self._commit(token, ctx, result)
                return result
            for rank, ids in batch.acks.items():
                ctx.unacked.setdefault(rank, []).extend(ids)
            ctx.rejects += batch.rejects
            count = sum(len(ids) for ids in batch.acks.values())
            ctx.since_commit += count
            result.processed += count
            result.rejected += len(batch.rejects)
            result.findings += batch.findings
            if self._due(ctx):
                self._commit(token, ctx, result)
            if time.monotonic() >= deadline:
                result.status = "timeout"
                return result

    def _due(self, ctx: _Context, *, idle: bool = False) -> bool:
        # a context that never committed expects what commits cost per rank in this process (else the 16 shards of a
        # 16,384-rank run all packed their first snapshot 5 s in: 16 x ~0.6 s in the next step's window)
        commit_s = ctx.commit_s or _RANK_COMMIT_S[0] * len(ctx.unacked)
        return commit_due(self.snapshot, since=ctx.since_commit, units=len(ctx.unacked), committed_at=ctx.committed_at,
                          busy_s=ctx.busy_s, commit_s=commit_s, idle=idle)

    def _ranks(self, ctx: _Context) -> list[int]:
        """The ranks this drain reads (:func:`run_ranks`, selected again only when the rank set changed)."""
        every = run_ranks(self.client, self.run_id)
        if every is not ctx.ranks:
            ctx.ranks, ctx.selected = every, self._select(every)
        ranks = ctx.selected
        new = [rank for rank in ranks if rank not in ctx.cursors]
        if new:
            self._create_groups(new)
            self._claim_abandoned(new)
            for rank in new:
                ctx.cursors[rank] = "0"  # first re-read what this consumer has pending
        return ranks

    def _all_ended(self, ranks: list[int]) -> bool:
        if not ranks:
            return False
        meta = keys.meta(self.run_id)
        if not self.client.hexists(meta, f"ended:{ranks[0]}"):
            return False  # the common case, in one field (a shard of 1,024 ranks: not 1,024)
        flags = self.client.hmget(meta, [f"ended:{r}" for r in ranks])
        return all(flags)  # type: ignore[arg-type]

    def _load_diagnoser(self) -> tuple[Diagnoser, bool, float | None]:
        """A diagnoser from the snapshot, whether the snapshot is a whole state in one string, and the wall time of
        the commit that wrote it (when known).

        A parted diagnoser's snapshot is a hash (:data:`RUN_FIELD` and ``r<rank>`` per rank): only the run part is
        read here; each rank's field is read when the rank is first needed. A snapshot in one string (a diagnoser
        without parts, or one saved before the parted format) is loaded whole.
        """
        diag = self._new_diagnoser()
        key = self._state_key
        kind = _text(self.client.type(key))  # type: ignore[arg-type]
        if kind == "string":
            diag.load_state_dict(_unpack(self.client.get(key)))  # type: ignore[arg-type]
            return diag, True, None
        if kind == "hash":
            run, at = self.client.hmget(key, [RUN_FIELD, AT_FIELD])  # type: ignore[misc]
            if not isinstance(diag, _Parted) or run is None:
                raise ConfigError(f"{key}: a per-rank snapshot that this drain's diagnoser cannot read")

            def fetch(rank: int) -> dict[str, Any] | None:
                raw = self.client.hget(key, f"r{rank}")
                return None if raw is None else _unpack(raw)  # type: ignore[arg-type]

            diag.load_state_parts(_unpack(run), fetch)
            return diag, False, None if at is None else float(at)
        return diag, False, None

    # -- reading ---------------------------------------------------------------------------------------------

    def _create_groups(self, ranks: list[int]) -> None:
        """The consumer group on each rank's stream (one pipelined round trip for a shard's new ranks)."""
        with self.client.pipeline(transaction=False) as pipe:
            for rank in ranks:
                pipe.xgroup_create(keys.records(self.run_id, rank), keys.GROUP, id="0", mkstream=True)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
                raise reply

    def _claim_abandoned(self, ranks: list[int]) -> None:
        """Move entries pending on other consumers (idle for a lease or more) to ours (one pipelined round trip per
        page, over every rank that has more)."""
        starts = {rank: "0-0" for rank in ranks}
        while starts:
            with self.client.pipeline(transaction=False) as pipe:
                for rank, start in starts.items():
                    pipe.xautoclaim(keys.records(self.run_id, rank), keys.GROUP, CONSUMER,
                                    min_idle_time=self.lease_ms, start_id=start, count=self.batch)
                replies = pipe.execute()
            more = {}
            for rank, reply in zip(starts, replies, strict=True):
                if reply[1]:
                    logger.info("%s rank %d: claimed %d abandoned entries", self.run_id, rank, len(reply[1]))
                start = _text(reply[0])
                if start != "0-0":
                    more[rank] = start
            starts = more

    def _stream_name(self, rank: int) -> bytes:
        """The rank's record stream name as bytes, built once per process (a shard reads 1,024 per batch)."""
        name = self._stream_names.get(rank)
        if name is None:
            name = self._stream_names[rank] = keys.records(self.run_id, rank).encode()
        return name

    def _read(self, positions: dict[int, str]) -> dict[int, list[tuple[bytes, dict[bytes, bytes]]]]:
        if not positions:
            return {}
        names = {r: self._stream_name(r) for r in positions}
        streams = {names[r]: pos for r, pos in positions.items()}
        reply = self.client.xreadgroup(keys.GROUP, CONSUMER, streams, count=self.batch)  # type: ignore[arg-type]
        by_stream = dict(reply or [])  # type: ignore[arg-type]
        out = {}
        for rank in positions:
            entries = by_stream.get(names[rank])
            if entries:
                out[rank] = entries
        return out

    def _read_new(self, ranks: list[int], ctx: _Context) -> dict[int, list[tuple[bytes, dict[bytes, bytes]]]]:
        """New entries of every rank in ``ranks`` (the drain's rank list): the same command on every batch, so it is
        packed once per rank list (:class:`PackedCommand`)."""
        if not ranks:
            return {}
        if ctx.read_new is None or ctx.read_new[0] is not ranks or ctx.read_new[1] != self.batch:
            names = [self._stream_name(r) for r in ranks]
            ctx.read_new = ranks, self.batch, PackedCommand("XREADGROUP", "GROUP", keys.GROUP, CONSUMER, "COUNT",
                                                            self.batch, "STREAMS", *names, *[">"] * len(ranks))
        by_stream = dict(ctx.read_new[2](self.client) or [])
        out = {}
        for rank in ranks:
            entries = by_stream.get(self._stream_name(rank))
            if entries:
                out[rank] = entries
        return out

    def _read_batch(self, ranks: list[int], ctx: _Context) -> _Batch:
        """Recovering ranks re-read their pending entries (from their cursor); the others read new entries."""
        recovering = {r: pos for r in ranks if (pos := ctx.cursors.get(r)) is not None}
        raw = self._read(recovering)
        for rank in recovering:
            entries = raw.get(rank)
            ctx.cursors[rank] = _text(entries[-1][0]) if entries else None
        raw.update(self._read_new(ranks, ctx) if not raw else self._read({r: ">" for r in ranks if r not in raw}))
        batch = _Batch()
        merged = heapq.merge(
            *([(_id_key(eid), rank, eid, fields) for eid, fields in entries] for rank, entries in raw.items())
        )
        for _, rank, eid, fields in merged:
            entry_id = _text(eid)
            batch.acks.setdefault(rank, []).append(entry_id)
            try:
                batch.entries.append(self._decode(rank, entry_id, fields))
            except RecordError as exc:
                self._reject(batch, rank, entry_id, str(exc))
        update = ctx.diag.update
        for entry in batch.entries:  # all decoded first: decoding between detector updates runs on cold caches
            batch.findings += update(entry.record)
        return batch

    def _decode(self, rank: int, entry_id: str, fields: dict[bytes, bytes] | None) -> Entry:
        payload = (fields or {}).get(b"r")
        if payload is None:
            raise RecordError("entry has no field 'r' (or was deleted before it was processed)")
        record, packed = decode_packed(payload)
        if record.run_id != self.run_id or record.rank != rank:
            raise RecordError(
                f"record of run {record.run_id!r} rank {record.rank} found in the stream of run {self.run_id!r} "
                f"rank {rank}"
            )
        return Entry(entry_id=entry_id, rank=rank, record=record, packed=packed)

    def _reject(self, batch: _Batch, rank: int, entry_id: str, reason: str) -> None:
        batch.rejects.append((rank, entry_id, reason))
        level = logging.DEBUG if self._logged_reject else logging.WARNING
        self._logged_reject = True
        logger.log(level, "%s rank %d: rejected entry %s: %s", self.run_id, rank, entry_id, reason)

    # -- committing ------------------------------------------------------------------------------------------

    def _sync_sinks(self) -> bool:
        """Ask every sink that can to make this run's output durable; True if one archived the records."""
        archived = False
        for sink in self.sinks:
            sync = getattr(sink, "sync", None)
            if sync is not None and sync(self.run_id):
                archived = True
        return archived

    def _commit(self, token: str, ctx: _Context, result: DrainResult, extra: Callable[[Any], None] | None = None,
                ) -> None:
        """Snapshot, ack, record rejects and trim in one transaction, if we hold the lease (module docstring)."""
        started = time.monotonic()
        trim = self._sync_sinks() or self.snapshot.trim_unarchived
        unacked, rejects = ctx.unacked, ctx.rejects

        def ops(pipe: Any) -> None:
            for rank, ids in unacked.items():
                pipe.xack(keys.records(self.run_id, rank), keys.GROUP, *ids)
            for rank, entry_id, reason in rejects:
                pipe.xadd(
                    keys.errors(self.run_id),
                    {"rank": rank, "entry": entry_id, "reason": reason[:1000]},
                    maxlen=ERRORS_MAXLEN,
                    approximate=True,
                )
            if rejects:
                pipe.hincrby(keys.meta(self.run_id), "errors", len(rejects))
            if trim:
                for rank in unacked:
                    # execute_command: redis-py's ClusterPipeline has no eval(); EVAL itself is fine in a cluster
                    # transaction (one key, the run's slot)
                    pipe.execute_command("EVAL", _TRIM, 1, keys.records(self.run_id, rank))
            if extra is not None:
                extra(pipe)

        replies = self._transaction(token, ctx, ops)
        acked = sum(len(ids) for ids in unacked.values())
        result.committed += acked
        if trim:
            n_ack, n_rej = len(unacked), len(rejects)
            trims = replies[n_ack + n_rej + (1 if rejects else 0):][:n_ack]
            result.trimmed += sum(int(t) for t in trims)
        ctx.unacked, ctx.rejects, ctx.since_commit = {}, [], 0
        ctx.committed_at = time.monotonic()
        ctx.commit_s, ctx.busy_s = ctx.committed_at - started, 0.0
        if unacked:
            _RANK_COMMIT_S[0] = ctx.commit_s / len(unacked)

    def _finish(self, token: str, ctx: _Context, result: DrainResult) -> list[Finding]:
        findings = ctx.diag.finish()
        for sink in self.sinks:
            sink.emit(self.run_id, findings, [])
        self._close_sinks(token)
        self._commit(token, ctx, result, self._finished)
        self._after_finish()
        logger.info("%s: drained (%d findings at finish)", self._context_key, len(findings))
        return findings

    def _lease_kept(self, token: str) -> contextlib.AbstractContextManager[None]:
        """Renew the lease every third of its time on the process's lease keeper thread while the body runs."""
        return lease_kept(functools.partial(self._renew, token), self.lease_ms / 3000)

    def _transaction(self, token: str, ctx: _Context, ops: Callable[[Any], None]) -> list[Any]:
        """Save the snapshot + ``ops`` in MULTI/EXEC if the lease is still ours; returns the replies of ``ops``.

        A parted diagnoser writes the run part and the parts of the ranks that changed since the last commit into
        the snapshot hash (the other ranks' fields are still their current state); any other one ``SET``s its
        whole state. A failed commit drops the context (its changed ranks are forgotten with it), so the next drain
        starts from the last snapshot.
        """
        lock = self._lock_key
        diag = ctx.diag
        with self._lease_kept(token):  # packing many ranks may take longer than a lease (not in WATCH: PEXPIRE)
            if isinstance(diag, _Parted):
                run, parts = diag.state_parts(changed_only=not ctx.rewrite_state)
                fields = {RUN_FIELD: _pack(run), AT_FIELD: repr(time.time()),
                          **{f"r{rank}": _pack(part) for rank, part in parts.items()}}
            else:
                state = _pack(diag.state_dict())
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(lock)
                current: Any = pipe.get(lock)  # immediate: the pipeline is not buffering until multi()
                if current != token.encode():
                    raise _LeaseLost
                pipe.multi()
                lead = 1
                if not isinstance(diag, _Parted):
                    pipe.set(self._state_key, state)
                else:
                    if ctx.rewrite_state:
                        pipe.delete(self._state_key)
                        lead = 2
                    pipe.hset(self._state_key, mapping=fields)
                ops(pipe)
                pipe.pexpire(lock, self.lease_ms)
                replies: list[Any] = pipe.execute()
            except redis.WatchError:
                raise _LeaseLost from None
        ctx.rewrite_state = False
        return replies[lead:-1]


_RUN_RANKS: dict[tuple[int, str], tuple[RedisClient, list[int]]] = {}


def run_ranks(client: RedisClient, run_id: str) -> list[int]:
    """Every rank that registered a record stream for the run (sorted; do not modify the list).

    Ranks are only ever added to the set, so the members are re-read only when ``SCARD`` changed: the sweep, the
    cross-rank stage and the quiet check ask every period, and 16,384 members cost ~50 ms to parse each time.
    """
    key = keys.ranks(run_id)
    cached = _RUN_RANKS.get((id(client), run_id))
    if cached is not None and cached[0] is client and int(client.scard(key)) == len(cached[1]):  # type: ignore[arg-type]
        return cached[1]
    members: Iterable[bytes] = client.smembers(key)  # type: ignore[assignment]
    ranks = sorted(int(m) for m in members)
    if len(_RUN_RANKS) > 4096:
        _RUN_RANKS.clear()
    _RUN_RANKS[(id(client), run_id)] = (client, ranks)
    return ranks


_STREAM_NAMES: dict[str, dict[int, bytes]] = {}


def _stream_names(run_id: str) -> dict[int, bytes]:
    """Rank -> record stream name (bytes) of a run, kept per process."""
    names = _STREAM_NAMES.get(run_id)
    if names is None:
        if len(_STREAM_NAMES) >= MAX_KEPT_CONTEXTS:
            _STREAM_NAMES.clear()
        names = _STREAM_NAMES[run_id] = {}
    return names


def commit_due(policy: SnapshotPolicy, *, since: int, units: int, committed_at: float, busy_s: float, commit_s: float,
               idle: bool = False) -> bool:
    """Whether a commit is due by ``policy``: ``since`` entries processed over ``units`` ranks (or other units) since
    the commit at monotonic time ``committed_at``, which took ``commit_s``; ``busy_s`` spent working since; ``idle``:
    the last read found nothing new."""
    if not since:
        return False
    elapsed = time.monotonic() - committed_at
    if since >= policy.every_records and (since >= policy.rank_records * units or elapsed >= policy.max_every_s):
        return True
    every_s = policy.every_s
    if idle and policy.idle_s is not None:
        every_s = min(every_s, policy.idle_s)
    if every_s > 0 and policy.max_share < 1:
        # a long last commit puts the next timed one off, measured in this drain's own busy time (a worker that
        # drains many shards gives each a slice of its time: in wall time a shard's commits could take most of its
        # slice); each changed rank is then saved for more of its records
        return elapsed >= every_s and (busy_s >= commit_s * (1 / policy.max_share - 1) or elapsed >= policy.max_every_s)
    return elapsed >= every_s


def committed_clock(wall: float) -> float:
    """The monotonic time of a commit made at wall time ``wall`` (in this or another process): a drain that recovers
    from a snapshot keeps its commit cadence."""
    return time.monotonic() - max(0.0, time.time() - wall)


def _pack(state: Any) -> bytes:
    return msgpack.packb(state, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
