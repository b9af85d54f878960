"""The training-side emitter: a bounded queue and one daemon thread that pipelines records into Redis Streams.

``put`` only encodes and ``put_nowait``\\ s. The emitter thread batches up to ``batch_max`` records into one
pipelined XADD round trip to the rank's stream. Each record gets its stream ID ``"<ms>-<step>"`` once, when it is
queued, so resending it is harmless: Redis rejects an ID that is not above the stream top, which is counted as a
duplicate. When a round trip fails, the batch and everything after it goes to the spool file; when Redis answers
again (tried at most once per second, backing off to 5 s) the whole spool is replayed first, then removed.

Nothing is lost at exit either: :meth:`Emitter.close` waits at most its ``timeout`` for the thread; the records it
has not handled by then (the batch in flight and everything queued: Redis hung, or slower than the bound) are
written to the spool by the closing thread itself, and the emitter thread, still blocked on Redis, no longer
touches the spool. A batch in flight that Redis did take after all is then in both places: its IDs make the
replay (``stability replay RUN_DIR``) count it as already there.

Nothing is lost silently (issue 14): a batch the spool cannot take (disk full) is counted in ``unspooled``, logged
with the running total, kept in ``lost-rank<rank>`` beside the spool (reserved before the first spool write and
rewritten in place, so a full disk can still take it) and added to the run's ``lost`` count in Redis once it answers
(shown by ``stability runs`` and the run's status); ``stability replay`` or the next session of the run reports a
count left there. A wrong password or TLS setting is reported once as such, not as "Redis unavailable".

With a Redis Cluster URL (``redis+cluster://``, :mod:`stability.redis_url`) the client is made on the emitter
thread at the first connection attempt, since a cluster client contacts a node when it is created: Redis being down
at start then means spooling, as with one server. A rank's stream is one key, so each batch goes to one node.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis import exceptions as redis_errors
from redis.backoff import NoBackoff
from redis.retry import Retry

from stability import keys
from stability.errors import ConfigError, RecordError
from stability.records import StepRecord, check_run_id, encode, is_urgent
from stability.redis_url import RedisClient, check_url, classify_error, connect, is_cluster_url, safe_url
from stability.transport._ids import IdClock
from stability.transport._spool import Entry, Spool, lost_path, spool_path

__all__ = ["Emitter", "EmitterStats", "push_urgent"]

logger = logging.getLogger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 5.0
RETRY_MISCONFIGURED_S = 30.0
RETRY_CLOSING_S = 0.5
"""While closing, the longest wait between tries at a Redis that timed out."""
RETRY_CLOSING_FOR_S = 10.0
"""While closing, how long to keep trying a Redis that timed out (within the close's own timeout)."""
RETRY_MARGIN_S = 0.2
"""Retry interval after an authentication or TLS failure (a fixed ACL may let a later attempt in)."""
_LOG_EVERY_S = 60.0
_DUPLICATE = "equal or smaller than the target stream top item"
_DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, redis_errors.RedisClusterException)
"""Round-trip failures after which Redis is treated as down (a timeout means "maybe written"); a cluster client
raises ``RedisClusterException`` (not a ``RedisError``) when no node answers or a slot is not served."""
_RETRY_LATER_ERRORS: tuple[type[Exception], ...] = (
    redis_errors.OutOfMemoryError,  # type: ignore[attr-defined]  # missing from the installed types-redis 4.6
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
)
"""Per-command replies that mean "not now" rather than "never": the record is spooled and retried."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EmitterStats:
    """Counters of one emitter (a consistent snapshot).

    Every accepted record (``queued``) ends up ``sent``, ``spooled``, a duplicate or an error; every spooled record
    is later ``replayed``, a duplicate or an error (or stays in the spool if Redis never comes back).
    """

    queued: int
    """Records accepted by ``put``."""
    sent: int
    """Records added to Redis directly."""
    spooled: int
    """Records written to the spool file."""
    replayed: int
    """Spooled records added to Redis by a replay."""
    dropped: int
    """Records refused by ``put``: queue full, emitter closed, or not encodable."""
    errors: int
    """Records lost: refused by Redis for good, damaged spool regions, spool writes that failed."""
    duplicates: int
    """XADDs rejected because Redis already had the entry (a resend after a timeout or a repeated replay)."""
    unspooled: int = 0
    """Records that Redis did not take and the spool could not hold either (disk full): lost, also in ``errors``."""
    left_at_close: int = 0
    """Records :meth:`Emitter.close` found unsent after its timeout and wrote to the spool (also in ``spooled``)."""


class _Outcome:
    """Result of one pipelined XADD batch."""

    def __init__(self) -> None:
        self.added = 0
        self.duplicates = 0
        self.rejected = 0
        self.retry_from: int | None = None
        """Index of the first entry to spool and retry later (Redis said "not now"), or None."""


class Emitter:
    """Background emitter of one rank's step records to Redis Streams, with a local spool for outages.

    Args:
        redis_url: ``redis://``, ``rediss://``, ``unix://`` (or kombu's ``redis+socket://``) URL, or
            ``redis+cluster://host:port[,host:port...]`` for a Redis Cluster.
        run_id: Id of the training run.
        spool_dir: Directory of the spool file ``spool-rank<rank>.bin`` (created when first needed). A spool left
            there by an earlier process is replayed on the first connection.
        rank: Global rank of this process.
        queue_size: Bound of the queue; ``put`` drops records beyond it.
        timeout_s: Socket (connect and read) timeout of every Redis call.
        batch_max: Most records per pipelined round trip.
        meta: Run metadata written to the run's meta hash on the first connection.

    Raises:
        ConfigError: an argument is out of range or the URL cannot be parsed.
    """

    def __init__(
        self,
        *,
        redis_url: str,
        run_id: str,
        spool_dir: Path,
        rank: int = 0,
        queue_size: int = 10_000,
        timeout_s: float = 0.5,
        batch_max: int = 100,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        try:
            check_run_id(run_id)
        except RecordError as exc:
            raise ConfigError(str(exc)) from None
        _check_ranges(rank=rank, queue_size=queue_size, timeout_s=timeout_s, batch_max=batch_max)
        check_url(redis_url)
        self._redis_url = redis_url
        self._timeout_s = timeout_s
        # a single-server client connects on its first command; a cluster client at creation (on the thread)
        self._client: RedisClient | None = None if is_cluster_url(redis_url) else self._new_client()
        self.run_id = run_id
        self.rank = rank
        self._url = safe_url(redis_url)
        self._stream_key = keys.records(run_id, rank)
        self._urgent_ids: set[str] = set()
        """Entry ids of queued records with a non-finite loss or gradient: their XADD also pushes this rank to
        ``keys.URGENT`` (the sweeping worker queues the rank's drain at once, ahead of the others)."""
        self._meta: dict[str | bytes, str | bytes | int | float] = {k: v for k, v in (meta or {}).items()}
        self._started = f"{time.time():.3f}"
        self._batch_max = batch_max
        self._spool = Spool(spool_path(spool_dir, rank))
        self._lost_file = lost_path(spool_dir, rank)
        self._lost_pending = 0
        """Records known lost (unspooled, damaged spool regions) not yet added to the run's ``lost`` count."""
        self._misconfigured = ""
        self._lost_reserved = False
        self._queue: collections.deque[Entry] = collections.deque()
        self._queue_size = queue_size
        self._lock = threading.Lock()
        self._done_cond = threading.Condition(self._lock)
        self._ready = threading.Condition(self._lock)
        self._in_flight: list[Entry] = []
        """The batch the emitter thread took from the queue and has not finished handling (under ``_lock``)."""
        self._spool_lock = threading.Lock()
        """Held for every spool write or removal: the emitter thread's, and :meth:`close`'s for what is left."""
        self._abandoned = False
        """:meth:`close` timed out and took over the unsent records: the emitter thread must not spool any more."""
        self._ids = IdClock()
        names = ("queued", "sent", "spooled", "replayed", "dropped", "errors", "unspooled", "duplicates",
                 "left_at_close")
        self._counts = dict.fromkeys(names, 0)
        self._handled = 0
        self._closed = False
        self._stop = threading.Event()
        self._close_by = math.inf
        """When :meth:`close` will stop waiting for the emitter thread (monotonic): the thread's last tries at Redis
        must end before it."""
        self._up = False
        self._timed_out = False
        """The last failure was a timeout (Redis hung or overloaded), not a refusal."""
        self._was_down = False
        self._registered = False
        self._retry_at = 0.0
        self._backoff = RETRY_MIN_S
        self._log_state: dict[str, tuple[float, int]] = {}
        self._thread = threading.Thread(target=self._run, name=f"stability-emitter-rank{rank}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------- any thread

    @property
    def spool_path(self) -> Path:
        """The spool file of this emitter."""
        return self._spool.path

    @property
    def stats(self) -> EmitterStats:
        """A snapshot of the counters."""
        with self._lock:
            return EmitterStats(**self._counts)

    def put(self, record: StepRecord) -> bool:
        """Queue ``record`` for sending. Never blocks, never raises.

        Returns:
            False if the record was dropped (queue full, emitter closed, or the record cannot be encoded).
        """
        try:
            payload = encode(record)
            with self._lock:
                if self._closed:
                    self._counts["dropped"] += 1
                    return False
                if len(self._queue) >= self._queue_size:
                    self._counts["dropped"] += 1
                    return False
                entry_id = self._ids.next(record.wall_time, record.step)
                self._queue.append((entry_id, payload))
                if is_urgent(record) and len(self._urgent_ids) < 1000:
                    self._urgent_ids.add(entry_id)
                self._counts["queued"] += 1
                self._ready.notify()
                return True
        except Exception as exc:  # a bad record must never reach into training
            with self._lock:
                self._counts["dropped"] += 1
            self._log_limited("encode", logging.WARNING, "record dropped, cannot be encoded: %s", exc)
            return False

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record queued so far is in Redis or in the spool.

        Returns:
            False if that did not happen within ``timeout`` seconds.
        """
        with self._done_cond:
            target = self._counts["queued"]
            return self._done_cond.wait_for(lambda: self._handled >= target, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Flush, replay the spool if Redis is up, mark this rank ended in the run's meta hash. Idempotent.

        Records ``put`` after ``close`` are dropped. If Redis is down, the spool file stays for a later replay
        (or the post-mortem). If the emitter thread has not finished within ``timeout`` seconds (Redis hung or
        slow), the records it has not handled are written to the spool here, in order, and the rank is not marked
        ended (``stability replay`` does that once it has sent them).
        """
        with self._lock:
            self._closed = True
            self._close_by = time.monotonic() + timeout
            self._ready.notify_all()
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._take_over()

    def _take_over(self) -> None:
        """Write every record the emitter thread has not handled to the spool (after a timed-out close)."""
        with self._spool_lock:
            with self._lock:
                if self._abandoned:
                    return
                self._abandoned = True
                left = [*self._in_flight, *self._queue]
                self._in_flight = []
                self._queue.clear()
            if left:
                self._to_spool(left, taken_over=True)
        with self._done_cond:
            self._counts["left_at_close"] += len(left)
            self._handled += len(left)
            self._done_cond.notify_all()
        if left:
            logger.warning(
                "rank %d: Redis at %s did not take the last %d records in time; they are in the spool %s "
                "('stability replay <run dir>' sends them)", self.rank, self._url, len(left), self._spool.path,
            )

    @property
    def reachable(self) -> bool:
        """Whether Redis answered the emitter last (after :meth:`close`: False when the records went to the spool
        because Redis was down or hung)."""
        with self._lock:
            return self._up and not self._abandoned

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- emitter thread

    def _run(self) -> None:
        self._guarded(self._adopt_lost_file)
        self._guarded(self._connect)
        while True:
            with self._lock:
                if self._abandoned or (self._stop.is_set() and not self._queue):
                    break
            batch = self._next_batch()
            if not self._up and time.monotonic() >= self._retry_at:
                self._guarded(self._connect)
            if batch:
                self._deliver(batch)
        with self._lock:
            if self._abandoned:  # close() took the rest over; Redis is not answering: leave it alone
                return
        if not self._up and (not self._timed_out or time.monotonic() >= self._retry_at):
            self._guarded(self._connect)  # at once, unless Redis just let a call time out (hung): exit promptly
        self._retry_until_close_by()
        self._guarded(self._mark_ended)
        self._guarded(self._keep_lost_count)
        if self._client is not None:
            self._guarded(self._client.close)

    def _retry_until_close_by(self) -> None:
        """Closing after Redis let a call time out: keep trying it (spool replay, then the rank's end) for up to
        :data:`RETRY_CLOSING_FOR_S`, while a try can still end before :meth:`close` stops waiting. A Redis that
        stalled for a moment under load (an embedded server's fsync on a busy machine) must not turn the end of a
        run into an offline one. A refused connection (nothing listening) is not retried, and a short exit flush
        (1 s) leaves no room for another try: both exits stay prompt."""
        give_up = min(self._close_by - 2 * self._timeout_s - RETRY_MARGIN_S, time.monotonic() + RETRY_CLOSING_FOR_S)
        while not self._up and self._timed_out:
            with self._lock:
                if self._abandoned:
                    return
            now = time.monotonic()
            start = max(now, min(self._retry_at, now + RETRY_CLOSING_S))
            if start > give_up:
                return
            time.sleep(start - now)
            self._guarded(self._connect)

    def _new_client(self) -> RedisClient:
        """A client that fails fast (no retries, short timeouts): a failed round trip means "spool"."""
        return connect(
            self._redis_url,
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run ``step``; an unexpected exception is logged (rate-limited), never raised out of the thread."""
        try:
            step()
        except Exception as exc:
            self._log_limited("bug", logging.ERROR, "emitter of rank %d: unexpected %r", self.rank, exc)

    def _next_batch(self) -> list[Entry]:
        """Take up to ``batch_max`` queued records (waiting a little for the first); they are in flight until
        :meth:`_deliver` has handled them."""
        with self._ready:
            if not self._queue and not self._abandoned:
                self._ready.wait(0.05 if self._stop.is_set() else 0.2)
            if self._abandoned:
                return []
            batch = [self._queue.popleft() for _ in range(min(self._batch_max, len(self._queue)))]
            self._in_flight = batch
            return batch

    def _deliver(self, batch: list[Entry]) -> None:
        try:
            if self._up:
                self._send_live(batch)
            else:
                self._to_spool(batch)
        except Exception as exc:  # a bug here must not lose the batch silently
            self._log_limited("bug", logging.ERROR, "emitter of rank %d: unexpected %r; batch spooled", self.rank, exc)
            self._guarded(lambda: self._to_spool(batch))
        finally:
            with self._done_cond:
                if self._in_flight is batch:  # else close() took it over (and counts it)
                    self._in_flight = []
                    self._handled += len(batch)
                    self._done_cond.notify_all()

    def _send_live(self, batch: list[Entry]) -> None:
        try:
            outcome = self._xadd(batch)
        except _DOWN_ERRORS as exc:
            self._went_down(exc)
            self._to_spool(batch)
            return
        self._count(sent=outcome.added, duplicates=outcome.duplicates, errors=outcome.rejected)
        if outcome.duplicates:  # live records are new: the stream top is ahead of this emitter's clock
            self._log_limited(
                "ahead",
                logging.WARNING,
                "stream %s already has entries after %s (an earlier process, or a clock behind it); %d records "
                "were rejected as duplicates",
                self._stream_key,
                batch[0][0],
                outcome.duplicates,
            )
        if outcome.retry_from is not None:
            self._went_down(RuntimeError("Redis refused writes for now"))
            self._to_spool(batch[outcome.retry_from :])

    def _xadd(self, entries: Sequence[Entry]) -> _Outcome:
        """One pipelined round trip of XADDs; raises the ``_DOWN_ERRORS`` of a failed round trip."""
        assert self._client is not None  # only called once connected
        pipe = self._client.pipeline(transaction=False)
        for entry_id, payload in entries:
            pipe.xadd(self._stream_key, {"r": payload}, id=entry_id)
        urgent = self._take_urgent(entries)
        if urgent:  # after the records: the worker that pops it reads them
            push_urgent(pipe, self.run_id, self.rank)
        results = pipe.execute(raise_on_error=False)
        outcome = _Outcome()
        for index, result in enumerate(results[: len(entries)]):
            if not isinstance(result, Exception):
                outcome.added += 1
            elif _DUPLICATE in str(result):
                outcome.duplicates += 1
            elif isinstance(result, _RETRY_LATER_ERRORS):
                outcome.retry_from = index
                break
            else:
                outcome.rejected += 1
                hint = " (a Redis Cluster node: use a redis+cluster:// URL)" if "MOVED" in str(result) else ""
                self._log_limited(
                    "rejected", logging.ERROR, "Redis rejected record %s: %s%s", entries[index][0], result, hint
                )
        return outcome

    def _take_urgent(self, entries: Sequence[Entry]) -> bool:
        """Whether ``entries`` hold an urgent record (forgotten here: a batch that fails goes to the spool, and
        its replay is not urgent any more)."""
        with self._lock:
            if not self._urgent_ids:
                return False
            found = [entry_id for entry_id, _ in entries if entry_id in self._urgent_ids]
            self._urgent_ids.difference_update(found)
            return bool(found)

    def _to_spool(self, batch: Sequence[Entry], *, taken_over: bool = False) -> None:
        if taken_over:  # close() itself, holding the spool lock
            self._append_to_spool(batch)
            return
        with self._spool_lock:
            with self._lock:
                if self._abandoned:  # close() has put this batch in the spool already
                    return
            self._append_to_spool(batch)
            with self._lock:
                if self._in_flight is batch:  # spooled: close() must not take it over again
                    self._in_flight = []
                    self._handled += len(batch)
                    self._done_cond.notify_all()  # the same lock

    def _append_to_spool(self, batch: Sequence[Entry]) -> None:
        if not self._lost_reserved:  # while the disk has room: a later count is then written in place
            self._lost_reserved = self._write_lost_file()
        try:
            self._spool.append(batch)
        except OSError as exc:
            self._count_cut_tails()
            with self._lock:
                self._counts["errors"] += len(batch)
                self._counts["unspooled"] += len(batch)
                total = self._counts["unspooled"]
                self._lost_pending += len(batch)
            self._log_limited(
                "spool", logging.ERROR, "rank %d: cannot write spool %s (%s): %d records lost so far (entries %s to %s "
                "in this batch)", self.rank, self._spool.path, exc, total, batch[0][0], batch[-1][0],
            )
            self._write_lost_file()
            return
        self._count_cut_tails()
        self._count(spooled=len(batch))

    def _count_cut_tails(self) -> None:
        """A torn tail the spool cut (a crash of an earlier process mid-write) held a lost record or more."""
        cut, self._spool.tails_cut = self._spool.tails_cut, 0
        if cut:
            with self._lock:
                self._counts["errors"] += cut
                self._lost_pending += cut

    def _connect(self) -> None:
        """Try Redis now: register the run once, replay the spool, then mark Redis up."""
        try:
            if self._client is None:
                self._client = self._new_client()
            # not PING: on a cluster that goes to any node; this reaches the node that holds this rank's stream
            self._client.exists(self._stream_key)
            if not self._registered:
                self._register()
            if self._spool.has_data() and not self._replay():
                return
            self._report_lost()
        except (*_DOWN_ERRORS, redis.RedisError) as exc:
            self._went_down(exc)
            return
        if self._was_down or self._misconfigured:
            logger.info("Redis at %s reachable again; rank %d sends live", self._url, self.rank)
        self._misconfigured = ""
        self._up = True
        self._was_down = False
        self._backoff = RETRY_MIN_S

    def _register(self) -> None:
        # not a transaction: keys.RUNS is a global key, in another hash slot than the run's keys on a cluster
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        pipe.sadd(keys.RUNS, self.run_id)
        pipe.sadd(keys.ranks(self.run_id), self.rank)
        if self._meta:
            pipe.hset(keys.meta(self.run_id), mapping=self._meta)
        pipe.hsetnx(keys.meta(self.run_id), "started", self._started)
        # a rank that (re)starts un-ends itself: a resumed run must not look finished to the worker
        pipe.hdel(keys.meta(self.run_id), f"ended:{self.rank}", "drained")
        pipe.execute()
        self._registered = True

    def _replay(self) -> bool:
        """Send the whole spool in order, then remove it. False if Redis said "not now" part-way."""
        stream, reader = self._spool.open_reader()
        with stream:
            chunk: list[Entry] = []
            for entry in reader:
                chunk.append(entry)
                if len(chunk) >= self._batch_max and not self._replay_chunk(chunk):
                    return False
            if chunk and not self._replay_chunk(chunk):
                return False
        with self._lock:
            self._counts["errors"] += reader.damaged
            self._lost_pending += reader.damaged
        with self._spool_lock, self._lock:
            if self._abandoned:  # close() appended what was left: the file stays for ``stability replay``
                return False
            self._spool.remove()
        skipped = f"; {reader.damaged} damaged regions skipped" if reader.damaged else ""
        level = logging.ERROR if reader.damaged else logging.INFO
        logger.log(level, "rank %d: spool %s replayed%s", self.rank, self._spool.path, skipped)
        return True

    def _replay_chunk(self, chunk: list[Entry]) -> bool:
        outcome = self._xadd(chunk)
        self._count(replayed=outcome.added, duplicates=outcome.duplicates, errors=outcome.rejected)
        chunk.clear()
        if outcome.retry_from is not None:
            self._went_down(RuntimeError("Redis refused writes for now"))
            return False
        return True

    def _went_down(self, exc: BaseException) -> None:
        self._up = False
        self._timed_out = isinstance(exc, (redis.TimeoutError, TimeoutError))
        self._was_down = True
        kind = classify_error(exc)
        if kind != "down":  # retrying will not help: say what is wrong, once
            self._retry_at = time.monotonic() + RETRY_MISCONFIGURED_S
            if self._misconfigured != kind:
                self._misconfigured = kind
                what = {"auth": "authentication failed", "tls": "TLS setup failed"}.get(kind, "client setup failed")
                logger.error(
                    "Redis at %s: %s (%s: %s); rank %d keeps its records in %s: fix the setting, then "
                    "'stability replay <run dir> --redis URL' sends them", self._url, what, type(exc).__name__, exc,
                    self.rank, self._spool.path,
                )
            return
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, RETRY_MAX_S)
        self._log_limited(
            "down",
            logging.WARNING,
            "Redis at %s unavailable (%s: %s); spooling to %s",
            self._url,
            type(exc).__name__,
            exc,
            self._spool.path,
        )

    def _mark_ended(self) -> None:
        if not self._up or self._client is None:
            return
        try:
            self._client.hset(keys.meta(self.run_id), f"ended:{self.rank}", f"{time.time():.3f}")
        except (*_DOWN_ERRORS, redis.RedisError) as exc:
            self._log_limited("ended", logging.WARNING, "could not mark rank %d ended: %s", self.rank, exc)

    def _adopt_lost_file(self) -> None:
        """Take over the lost count an earlier process of this rank left (reported with this one's)."""
        try:
            text = self._lost_file.read_text(encoding="ascii").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return
        self._lost_reserved = True
        if text.isdigit():
            with self._lock:
                self._lost_pending += int(text)

    def _write_lost_file(self) -> bool:
        """Write the unreported lost count to ``lost-rank<rank>``, in place (fixed width: no new disk blocks)."""
        with self._lock:
            pending = self._lost_pending
        try:
            self._lost_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self._lost_file, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.pwrite(fd, f"{pending:>20}\n".encode("ascii"), 0)
            finally:
                os.close(fd)
        except OSError as exc:
            self._log_limited("lostfile", logging.ERROR, "rank %d: cannot write %s (%s)", self.rank,
                              self._lost_file, exc)
            return False
        return True

    def _report_lost(self) -> None:
        """Add the records known lost to the run's ``lost`` count in Redis (shown in its status)."""
        with self._lock:
            pending = self._lost_pending
        if pending and self._client is not None:
            self._client.hincrby(keys.meta(self.run_id), "lost", pending)
            with self._lock:
                self._lost_pending -= pending
            logger.error("rank %d: %d records lost on the training side (see earlier errors); recorded in run %s",
                         self.rank, pending, self.run_id)
        if self._lost_reserved and not self._spool.has_data():  # nothing left to account for
            self._lost_file.unlink(missing_ok=True)
            self._lost_reserved = False
        elif pending and self._lost_reserved:
            self._write_lost_file()

    def _keep_lost_count(self) -> None:
        """At the end: report the lost count, or leave it beside the spool when Redis cannot take it."""
        if self._up:
            with contextlib.suppress(*_DOWN_ERRORS, redis.RedisError):
                self._report_lost()
        with self._lock:
            pending = self._lost_pending
        if pending:
            logger.error("rank %d: %d records lost (not spooled, or damaged in the spool); count kept in %s",
                         self.rank, pending, self._lost_file)
            self._write_lost_file()
        elif self._lost_reserved and not self._spool.has_data():
            self._lost_file.unlink(missing_ok=True)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _log_limited(self, kind: str, level: int, msg: str, *args: Any) -> None:
        """Log the first event of ``kind``, then at most one per minute with the number suppressed."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._log_state.get(kind, (-math.inf, 0))
            if now - last < _LOG_EVERY_S:
                self._log_state[kind] = (last, suppressed + 1)
                return
            self._log_state[kind] = (now, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed)"
        logger.log(level, msg, *args)


def push_urgent(pipe: Any, run_id: str, rank: int) -> None:
    """Queue, on ``pipe``, the push of ``rank`` of ``run_id`` to ``keys.URGENT`` (kept to ``keys.URGENT_MAX``
    entries); emitters, and the load generator that stands in for them, send it with the records' XADDs."""
    pipe.rpush(keys.URGENT, keys.urgent_member(run_id, rank))
    pipe.ltrim(keys.URGENT, -keys.URGENT_MAX, -1)


def _check_ranges(*, rank: int, queue_size: int, timeout_s: float, batch_max: int) -> None:
    if rank < 0:
        raise ConfigError(f"rank must be >= 0, got {rank}")
    if queue_size < 1:
        raise ConfigError(f"queue_size must be >= 1, got {queue_size}")
    if not 0 < timeout_s <= 10:
        raise ConfigError(f"timeout_s must be in (0, 10], got {timeout_s}")
    if batch_max < 1:
        raise ConfigError(f"batch_max must be >= 1, got {batch_max}")
