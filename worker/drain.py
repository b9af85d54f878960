"""Drain one run's record streams in order, run the detectors, hand findings to the sinks.

Redis Streams are the source of truth; a Celery ``drain(run_id)`` task is only a trigger. One :class:`Drainer`
call:

1. takes the run's lease (``SET keys.lock(run) <token> NX PX lease_ms``); if another worker holds it, returns at
   once (status ``busy``);
2. creates the consumer group on every rank stream, loads the detector state saved by the previous drain, and
   claims entries left pending by consumers of other names (``XAUTOCLAIM``, idle >= one lease);
3. loops: reads a batch per rank, its own pending entries first (a previous drain that died before acking),
   else new ones; feeds them to the detectors merged in stream-id order (each rank stays in step order); sends
   findings and records to the sinks (a background thread renews the lease meanwhile, so a batch slower than one
   lease is not given up and re-done forever); then in ONE ``MULTI/EXEC`` (guarded by ``WATCH`` on the lease) saves the
   detector state, XACKs the batch and records rejected entries. A worker killed anywhere before ``EXEC`` leaves
   the entries pending and the old state, so the next drain re-processes the batch from the same state and the
   idempotent sinks absorb the repeat;
4. when every rank has ``ended:<rank>`` in the metadata and nothing is left, calls ``finish()``, closes the
   sinks for the run (the report sink writes ``findings.json`` and ``report.html`` then; a background thread
   renews the lease meanwhile, since a long run's report can take longer than one lease), marks the metadata
   ``drained`` and removes the run from ``keys.RUNS``.

Malformed entries (not decodable, missing field ``r``, wrong run) are never retried: they go to
``keys.errors(run)`` with the reason, count in the metadata field ``errors`` and are acked with the batch.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import redis

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.errors import ConfigError, RecordError
from stability.records import decode
from stability.redis_url import RedisClient
from stability.worker.sinks import Entry, Sink

__all__ = ["CONSUMER", "DrainResult", "Drainer", "Diagnoser"]

logger = logging.getLogger(__name__)

CONSUMER = "drainer"
"""Consumer name in the group: stable, since only the lease holder reads."""

ERRORS_MAXLEN = 10_000
"""The errors stream keeps about this many rejected entries."""

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Diagnoser(Protocol):
    """What the drainer needs of :class:`~stability.detectors.engine.RunDiagnoser`."""

    def update(self, record: Any) -> list[Finding]: ...
    def finish(self) -> list[Finding]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(slots=True, kw_only=True)
class DrainResult:
    """What one :meth:`Drainer.run` did."""

    status: str
    """``busy`` (lease held elsewhere), ``idle`` (caught up), ``timeout`` (time budget spent, more may remain),
    ``drained`` (run finished and fully processed), ``lease_lost`` (stopped without committing the batch)."""
    processed: int = 0
    """Entries acked (records and rejected entries)."""
    rejected: int = 0
    findings: list[Finding] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    entries: list[Entry] = field(default_factory=list)
    acks: dict[int, list[str]] = field(default_factory=dict)
    rejects: list[tuple[int, str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


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
        self._new_diagnoser = diagnoser
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)
        self._grouped: set[int] = set()
        self._logged_reject = False

    # -- lease -----------------------------------------------------------------------------------------------

    def run(self) -> DrainResult:
        """Drain until caught up, finished or out of time; return at once if the lease is held elsewhere."""
        token = secrets.token_hex(16)
        lock = keys.lock(self.run_id)
        if not self.client.set(lock, token, nx=True, px=self.lease_ms):
            logger.debug("%s: lease busy, skipping", self.run_id)
            return DrainResult(status="busy")
        try:
            return self._drain(token)
        except _LeaseLost:
            logger.warning("%s: lease lost; the batch stays pending for the next drain", self.run_id)
            return DrainResult(status="lease_lost")
        finally:
            self._release(keys=[lock], args=[token])

    def _renew(self, token: str) -> None:
        if not self._extend(keys=[keys.lock(self.run_id)], args=[token, self.lease_ms]):
            raise _LeaseLost

    # -- main loop -------------------------------------------------------------------------------------------

    def _drain(self, token: str) -> DrainResult:
        meta = keys.meta(self.run_id)
        if self.client.hexists(meta, "drained"):
            self.client.srem(keys.RUNS, self.run_id)
            return DrainResult(status="drained")
        diag = self._load_diagnoser()
        result = DrainResult(status="idle")
        deadline = time.monotonic() + self.max_seconds
        while True:
            self._renew(token)
            ranks = self._ranks()
            ended = self._all_ended(ranks)  # read before the batch: an emitter marks the end after its last XADD
            with self._lease_kept(token):  # a slow batch (busy CPU, many signals) must not lose the lease midway
                batch = self._read_batch(ranks, diag)
                if batch.acks:
                    for sink in self.sinks:
                        sink.emit(self.run_id, batch.findings, batch.entries)
            if not batch.acks:
                if ended:
                    result.findings += self._finish(token, diag)
                    result.status = "drained"
                return result
            self._commit(token, diag, batch)
            result.processed += sum(len(ids) for ids in batch.acks.values())
            result.rejected += len(batch.rejects)
            result.findings += batch.findings
            if time.monotonic() >= deadline:
                result.status = "timeout"
                return result

    def _ranks(self) -> list[int]:
        members: Iterable[bytes] = self.client.smembers(keys.ranks(self.run_id))  # type: ignore[assignment]
        ranks = sorted(int(m) for m in members)
        for rank in ranks:
            if rank not in self._grouped:
                self._create_group(rank)
                self._claim_abandoned(rank)
                self._grouped.add(rank)
        return ranks

    def _all_ended(self, ranks: list[int]) -> bool:
        if not ranks:
            return False
        flags = self.client.hmget(keys.meta(self.run_id), [f"ended:{r}" for r in ranks])
        return all(flags)  # type: ignore[arg-type]

    def _load_diagnoser(self) -> Diagnoser:
        diag = self._new_diagnoser()
        raw = self.client.get(keys.state(self.run_id))
        if raw is not None:
            diag.load_state_dict(msgpack.unpackb(raw, raw=False, strict_map_key=False))  # type: ignore[arg-type]
        return diag

    # -- reading ---------------------------------------------------------------------------------------------

    def _create_group(self, rank: int) -> None:
        try:
            self.client.xgroup_create(keys.records(self.run_id, rank), keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _claim_abandoned(self, rank: int) -> None:
        """Move entries pending on other consumers (idle for a lease or more) to ours."""
        stream, start = keys.records(self.run_id, rank), "0-0"
        while True:
            reply = self.client.xautoclaim(
                stream, keys.GROUP, CONSUMER, min_idle_time=self.lease_ms, start_id=start, count=self.batch
            )
            start = _text(reply[0])  # type: ignore[index]
            if reply[1]:  # type: ignore[index]
                logger.info("%s rank %d: claimed %d abandoned entries", self.run_id, rank, len(reply[1]))  # type: ignore[index]
            if start == "0-0":
                return

    def _read(self, ranks: list[int], last_id: str) -> dict[int, list[tuple[bytes, dict[bytes, bytes]]]]:
        if not ranks:
            return {}
        streams = {keys.records(self.run_id, r): last_id for r in ranks}
        reply = self.client.xreadgroup(keys.GROUP, CONSUMER, streams, count=self.batch)  # type: ignore[arg-type]
        by_stream = {_text(name): entries for name, entries in (reply or [])}  # type: ignore[union-attr]
        out = {}
        for rank in ranks:
            entries = by_stream.get(keys.records(self.run_id, rank))
            if entries:
                out[rank] = entries
        return out

    def _read_batch(self, ranks: list[int], diag: Diagnoser) -> _Batch:
        """Pending entries of each rank first; ranks with none pending read new entries."""
        raw = self._read(ranks, "0")
        raw.update(self._read([r for r in ranks if r not in raw], ">"))
        batch = _Batch()
        merged = heapq.merge(
            *([(_id_key(eid), rank, eid, fields) for eid, fields in entries] for rank, entries in raw.items())
        )
        for _, rank, eid, fields in merged:
            entry_id = _text(eid)
            batch.acks.setdefault(rank, []).append(entry_id)
            try:
                entry = self._decode(rank, entry_id, fields)
            except RecordError as exc:
                self._reject(batch, rank, entry_id, str(exc))
                continue
            batch.entries.append(entry)
            batch.findings += diag.update(entry.record)
        return batch

    def _decode(self, rank: int, entry_id: str, fields: dict[bytes, bytes] | None) -> Entry:
        payload = (fields or {}).get(b"r")
        if payload is None:
            raise RecordError("entry has no field 'r' (or was deleted before it was processed)")
        record = decode(payload)
        if record.run_id != self.run_id or record.rank != rank:
            raise RecordError(
                f"record of run {record.run_id!r} rank {record.rank} found in the stream of run {self.run_id!r} "
                f"rank {rank}"
            )
        return Entry(entry_id=entry_id, rank=rank, record=record)

    def _reject(self, batch: _Batch, rank: int, entry_id: str, reason: str) -> None:
        batch.rejects.append((rank, entry_id, reason))
        level = logging.DEBUG if self._logged_reject else logging.WARNING
        self._logged_reject = True
        logger.log(level, "%s rank %d: rejected entry %s: %s", self.run_id, rank, entry_id, reason)

    # -- committing ------------------------------------------------------------------------------------------

    def _commit(self, token: str, diag: Diagnoser, batch: _Batch) -> None:
        """Save the detector state, ack the batch and record rejects in one transaction, if we hold the lease."""

        def ops(pipe: Any) -> None:
            for rank, ids in batch.acks.items():
                pipe.xack(keys.records(self.run_id, rank), keys.GROUP, *ids)
            for rank, entry_id, reason in batch.rejects:
                pipe.xadd(
                    keys.errors(self.run_id),
                    {"rank": rank, "entry": entry_id, "reason": reason[:1000]},
                    maxlen=ERRORS_MAXLEN,
                    approximate=True,
                )
            if batch.rejects:
                pipe.hincrby(keys.meta(self.run_id), "errors", len(batch.rejects))

        self._transaction(token, diag, ops)

    def _finish(self, token: str, diag: Diagnoser) -> list[Finding]:
        findings = diag.finish()
        for sink in self.sinks:
            sink.emit(self.run_id, findings, [])
        with self._lease_kept(token):
            for sink in self.sinks:
                sink.close(self.run_id)

        def ops(pipe: Any) -> None:
            pipe.hset(keys.meta(self.run_id), "drained", repr(time.time()))

        self._transaction(token, diag, ops)
        # not in the transaction: keys.RUNS is global (another hash slot on a Redis Cluster); a crash here leaves a
        # drained run in RUNS, which the next drain removes (see _drain)
        self.client.srem(keys.RUNS, self.run_id)
        logger.info("%s: drained (%d findings at finish)", self.run_id, len(findings))
        return findings

    @contextlib.contextmanager
    def _lease_kept(self, token: str) -> Any:
        """Renew the lease every third of its time on a background thread while the body runs."""
        done = threading.Event()

        def keep() -> None:
            while not done.wait(self.lease_ms / 3000):
                try:
                    self._renew(token)
                except (_LeaseLost, redis.RedisError):
                    return

        thread = threading.Thread(target=keep, name=f"stability-lease-{self.run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _transaction(self, token: str, diag: Diagnoser, ops: Callable[[Any], None]) -> None:
        lock = keys.lock(self.run_id)
        state = msgpack.packb(diag.state_dict(), use_bin_type=True)
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(lock)
                current: Any = pipe.get(lock)  # immediate: the pipeline is not buffering until multi()
                if current != token.encode():
                    raise _LeaseLost
                pipe.multi()
                pipe.set(keys.state(self.run_id), state)
                ops(pipe)
                pipe.pexpire(lock, self.lease_ms)
                pipe.execute()
            except redis.WatchError:
                raise _LeaseLost from None


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
