"""The cross-rank stage of a sharded run: exact per-step comparison of all ranks, from the shards' summaries.

One :class:`CrossRankStage` call (Celery task ``crossrank(run_id)``) takes the stage's lease (``keys.shard_lock(R,
"x")``), continues from its in-memory context or its snapshot (``keys.shard_state(R, "x")``) and loops:

1. reads each shard's watermark (``keys.summary_pos``) and then the new entries of each shard's summary stream
   (``keys.summaries``) after the position it kept; the summaries go to a buffer;
2. feeds the buffered summaries to a :class:`~stability.detectors.crossrank.CrossRankDetector` in entry-id order,
   up to the slowest shard's ``progress`` (a shard that is idle or ended does not hold the others back; a summary
   waiting more than ``max_wait_s`` is fed anyway, so a shard that never drains cannot stall the run). This is the
   order in which the unsharded drain merges the ranks, so a step is decided with the same ranks (the detector waits
   for every rank of the run, ``SCARD keys.ranks``, or until the newest step is ``lag`` steps ahead);
3. publishes its ``rank_disagreement`` findings through the sinks (ranked: ``hardware_fault``; a rank is alerted
   again only ``cooldown_steps`` after its last alert, as the unsharded engine's incident fusion does), writes the
   verdicts of every decided step (``keys.verdicts``) and then the decided step (``keys.crossrank`` field
   ``decided``) for the shards' held findings, and hands the shards whose ``held`` mark (``keys.summary_pos``: the
   oldest step a shard holds a finding of) is now decided to ``on_release`` (the worker triggers their drains at
   once, which release the findings);
4. commits by the drainer's cadence (:func:`~stability.worker.drain.commit_due`: every snapshot period, put off
   while the last commit's cost exceeds its share of the stage's busy time): its snapshot (detector state, stream
   positions, buffer) and an ``XTRIM MINID`` of each summary stream below its position in one ``MULTI/EXEC``
   guarded by its lease. A stage killed before the commit re-reads the same summaries from the same state: the
   verdicts and findings it writes again are the same (idempotent sinks; the verdict hash is overwritten with equal
   values).

When every shard has ended and every summary is consumed it decides the remaining steps (``finish``), marks
``done`` and finalizes the run once every shard is done (:func:`~stability.worker.shards.finalize_run`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.crossrank import CrossRankDetector
from stability.detectors.engine import DiagnoserConfig
from stability.detectors.history import History
from stability.detectors.ranking import rank_causes
from stability.records import StepRecord
from stability.redis_url import RedisClient
from stability.worker._keeper import lease_kept
from stability.worker.drain import (
    _EXTEND,
    _RELEASE,
    _TAKE_OVER,
    DrainResult,
    SnapshotPolicy,
    _LeaseLost,
    commit_due,
    committed_clock,
    run_ranks,
)
from stability.worker.shards import DONE_STEP, finalize_run, id_key, shards_of
from stability.worker.sinks import Sink

__all__ = ["CrossRankStage"]

logger = logging.getLogger(__name__)

MAX_VERDICTS = 4096
"""Verdicts kept in ``keys.verdicts`` (the oldest are deleted): a shard asks for a verdict within seconds."""
_INF = (2**63, 0)


@dataclass(slots=True, kw_only=True)
class _State:
    token: str
    det: CrossRankDetector
    pos: dict[int, str] = field(default_factory=dict)
    """Per shard: the last summary stream id read."""
    buffer: list[list[Any]] = field(default_factory=list)
    """Summaries read and not fed yet: [read unix time, item]."""
    last: dict[int, int] = field(default_factory=dict)
    """Per rank: last step fed (a step going back is a resume)."""
    alerted: dict[int, int] = field(default_factory=dict)
    """Per rank: step of its last alerted disagreement."""
    verdict_keys: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_VERDICTS))
    done: bool = False
    since_commit: int = 0
    committed_at: float = field(default_factory=time.monotonic)
    commit_s: float = 0.0
    """How long the last commit took."""
    busy_s: float = 0.0
    """Time spent reading and feeding since the last commit (:func:`~stability.worker.drain.commit_due`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "det": self.det.state_dict(), "pos": [[s, p] for s, p in self.pos.items()],
                "buffer": self.buffer, "last": [[r, s] for r, s in self.last.items()],
                "alerted": [[r, s] for r, s in self.alerted.items()], "verdict_keys": list(self.verdict_keys),
                "done": self.done, "at": time.time()}

    def load(self, state: dict[str, Any]) -> None:
        self.det.load_state_dict(state["det"])
        self.pos = {int(s): str(p) for s, p in state["pos"]}
        self.buffer = [list(b) for b in state["buffer"]]
        self.last = {int(r): int(s) for r, s in state["last"]}
        self.alerted = {int(r): int(s) for r, s in state["alerted"]}
        self.verdict_keys.extend(str(k) for k in state["verdict_keys"])
        self.done = bool(state["done"])
        if "at" in state:  # keep the commit cadence of the snapshot (as the drainer does: its AT_FIELD)
            self.committed_at = committed_clock(float(state["at"]))


_STATES: dict[str, _State] = {}
_STATES_LOCK = threading.Lock()


class CrossRankStage:
    """The cross-rank stage of one sharded run (see the module docstring).

    Args:
        client: Redis client of the run's data (bytes responses; a ``RedisCluster`` works too).
        run_id: The run.
        size: The run's ``shard_size``.
        sinks: Receivers of the stage's findings (no records).
        lease_ms: The stage's lease.
        max_seconds: Time budget of one call.
        snapshot: Commit cadence.
        config: Detector settings (its ``crossrank`` and ``cooldown_steps`` are used).
        max_wait_s: A summary waits at most this long for the slower shards before it is fed.
        read_count: Summary entries read per shard and loop.
        on_lease: Called once the stage's lease is taken (shard affinity of the stage).
        on_release: Called with the shards whose held findings became decidable, right when the stage decided
            their step (the worker triggers their drains).
    """

    def __init__(self, client: RedisClient, run_id: str, size: int, *, sinks: Sequence[Sink], lease_ms: int = 30_000,
                 max_seconds: float = 20.0, snapshot: SnapshotPolicy | None = None,
                 config: DiagnoserConfig | None = None, max_wait_s: float = 60.0, read_count: int = 200,
                 on_lease: Callable[[], None] | None = None,
                 on_release: Callable[[list[int]], None] | None = None) -> None:
        self.client = client
        self.run_id = run_id
        self.size = size
        self.sinks = list(sinks)
        self.lease_ms = lease_ms
        self.max_seconds = max_seconds
        self.snapshot = snapshot or SnapshotPolicy()
        self.config = config or DiagnoserConfig()
        self.max_wait_s = max_wait_s
        self.read_count = read_count
        self._lock = keys.shard_lock(run_id, keys.CROSSRANK)
        self._state_key = keys.shard_state(run_id, keys.CROSSRANK)
        self._owner = f"{self._lock}:owner"
        self._on_lease = on_lease
        self._on_release = on_release

    def run(self) -> DrainResult:
        """Consume the summaries until caught up, finished or out of time; return at once if the lease is busy."""
        token = secrets.token_hex(16)
        if not self.client.set(self._lock, token, nx=True, px=self.lease_ms):
            return DrainResult(status="busy")
        if self._on_lease is not None:
            self._on_lease()
        try:
            # a slow loop (busy CPU, a big finish) must not lose the lease midway
            with lease_kept(functools.partial(self._renew, token), self.lease_ms / 3000):
                st = self._resume()
                result = self._loop(token, st)
            with _STATES_LOCK:
                _STATES[self.run_id] = st
                while len(_STATES) > 256:
                    del _STATES[next(iter(_STATES))]
            return result
        except _LeaseLost:
            logger.warning("%s: cross-rank lease lost; the next call resumes from the snapshot", self.run_id)
            return DrainResult(status="lease_lost")
        finally:
            self.client.execute_command("EVAL", _RELEASE, 1, self._lock, token)

    def _renew(self, token: str) -> None:
        if not self.client.execute_command("EVAL", _EXTEND, 1, self._lock, token, self.lease_ms):
            raise _LeaseLost

    def _resume(self) -> _State:
        with _STATES_LOCK:
            kept = _STATES.pop(self.run_id, None)
        fresh = secrets.token_hex(16)
        if self.client.execute_command("EVAL", _TAKE_OVER, 1, self._owner, kept.token if kept else "", fresh) and kept:
            return kept
        st = _State(token=fresh, det=CrossRankDetector(self.config.crossrank))
        raw = self.client.get(self._state_key)
        if raw is not None:
            st.load(msgpack.unpackb(raw, raw=False, strict_map_key=False))  # type: ignore[arg-type]
        return st

    # -- main loop -------------------------------------------------------------------------------------------

    def _loop(self, token: str, st: _State) -> DrainResult:
        result = DrainResult(status="idle")
        if st.done:
            self._publish(st, [], done=True)  # again: a stage killed between its last commit and this write
            if finalize_run(self.client, self.run_id, self.sinks, lease_ms=self.lease_ms):
                result.status = "drained"
            return result
        deadline = time.monotonic() + self.max_seconds
        while True:
            started = time.monotonic()
            self._renew(token)
            ranks = run_ranks(self.client, self.run_id)
            shards = shards_of(ranks, self.size)
            marks = self._watermarks(shards)  # before reading: a shard writes its summaries before its marks
            read = self._read(st, shards)
            limit = min((m[0] for m in marks.values()), default=_INF)
            ended = bool(shards) and all(m[1] for m in marks.values())
            decided = st.det.decided
            fed, found, verdicts = self._feed(st, limit, len(ranks), everything=ended and not read)
            if found:
                for sink in self.sinks:
                    sink.emit(self.run_id, found, [])
            if fed or verdicts:
                self._publish(st, verdicts)
                self._release_held(shards, decided, st.det.decided)
            st.since_commit += read + fed
            st.busy_s += time.monotonic() - started
            result.processed += fed
            result.findings += found
            if not read and not fed:
                if ended and not st.buffer:
                    self._finish(token, st, result)
                    return result
                if self._due(st, idle=True):
                    self._commit(token, st)
                return result
            if self._due(st):
                self._commit(token, st)
            if time.monotonic() >= deadline:
                result.status = "timeout"
                return result

    def _watermarks(self, shards: list[int]) -> dict[int, tuple[tuple[int, int], bool]]:
        """Per shard: (entry id up to which it has summarized everything, whether it ended)."""
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:  # not HGETALL: the hash also holds a watermark per rank (1,024 fields per shard)
            pipe.hmget(keys.summary_pos(self.run_id, shard), ["ended", "idle", "progress"])
        out = {}
        for shard, (ended, idle, progress) in zip(shards, pipe.execute(), strict=True):
            if ended == b"1" or idle == b"1":
                out[shard] = (_INF, ended == b"1")
            elif progress is not None:
                out[shard] = (id_key(progress), False)
            else:
                out[shard] = ((-1, -1), False)  # never drained yet
        return out

    def _read(self, st: _State, shards: list[int]) -> int:
        streams = {keys.summaries(self.run_id, s): st.pos.get(s, "0-0") for s in shards}
        reply = self.client.xread(streams, count=self.read_count)  # type: ignore[arg-type]
        now = time.time()
        count = 0
        by_name = {keys.summaries(self.run_id, s): s for s in shards}
        for name, entries in reply or []:  # type: ignore[union-attr]
            shard = by_name[name.decode() if isinstance(name, bytes) else name]
            for eid, fields in entries:
                items = msgpack.unpackb(fields[b"s"], raw=False, strict_map_key=False)
                st.buffer += [[now, item] for item in items]
                count += len(items)
                st.pos[shard] = eid.decode() if isinstance(eid, bytes) else eid
        return count

    def _feed(self, st: _State, limit: tuple[int, int], world: int,
              everything: bool) -> tuple[int, list[Finding], list[Finding]]:
        """Feed the buffered summaries up to ``limit`` (all of them with ``everything``) in entry-id order."""
        if not st.buffer:
            return 0, [], []
        old = time.time() - self.max_wait_s
        st.buffer.sort(key=lambda b: (b[1][6], b[1][7], b[1][0]))
        ready = [b for b in st.buffer if everything or (b[1][6], b[1][7]) <= limit or b[0] <= old]
        if not ready:
            return 0, [], []
        st.buffer = [b for b in st.buffer if not (everything or (b[1][6], b[1][7]) <= limit or b[0] <= old)]
        found: list[Finding] = []
        verdicts: list[Finding] = []
        for _, item in ready:
            rank, step, loss, grad_norm, host, coords = item[:6]
            if step < st.last.get(rank, -1):
                logger.info("%s rank %d resumed: step %d after step %d", self.run_id, rank, step, st.last[rank])
                st.det.reset(step)
                st.alerted.pop(rank, None)
            st.last[rank] = step
            signals = {k: float(v) for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None}
            coords = {str(k): int(v) for k, v in dict(coords).items()}
            coords["world_size"] = max(coords.get("world_size", 0), world)
            record = StepRecord(run_id=self.run_id, step=int(step), signals=signals, rank=int(rank), host=str(host),
                                coords=coords)
            found += self._alerts(st, st.det.update(record))
            verdicts += st.det.verdicts()
        return len(ready), found, verdicts

    def _alerts(self, st: _State, decided: list[Finding]) -> list[Finding]:
        """Rank the decided disagreements and drop a rank's repeat within ``cooldown_steps``."""
        out = []
        for raw in decided:
            last = st.alerted.get(raw.rank)
            if last is not None and 0 <= raw.step - last < self.config.cooldown_steps:
                continue
            st.alerted[raw.rank] = raw.step
            ranking = rank_causes(raw, History(), [])
            out.append(dataclasses.replace(raw, causes=ranking.causes, rollback_step=ranking.rollback_step,
                                           skip_batches=ranking.skip_batches))
        return out

    def _publish(self, st: _State, verdicts: list[Finding], *, done: bool = False) -> None:
        """Write the verdicts, then the decided step (a shard that sees the step decided finds its verdict)."""
        pipe = self.client.pipeline(transaction=False)
        if verdicts:
            mapping = {f"{v.rank}:{v.step}": json.dumps(v.to_dict()) for v in verdicts}
            evicted = list(st.verdict_keys)[: max(0, len(st.verdict_keys) + len(mapping) - MAX_VERDICTS)]
            st.verdict_keys.extend(mapping)
            pipe.hset(keys.verdicts(self.run_id), mapping=mapping)  # type: ignore[arg-type]
            if evicted:
                pipe.hdel(keys.verdicts(self.run_id), *evicted)
        fields = {"decided": str(DONE_STEP if done else st.det.decided)}
        if done:
            fields["done"] = "1"
        pipe.hset(keys.crossrank(self.run_id), mapping=fields)  # type: ignore[arg-type]
        pipe.execute()

    def _release_held(self, shards: list[int], before: int, decided: int) -> None:
        """If the decided step moved from ``before`` to ``decided``: hand the shards whose held findings wait for a
        step up to ``decided`` (their ``held`` mark) to ``on_release``, right after the decision is published."""
        if self._on_release is None or decided <= before:
            return
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:
            pipe.hget(keys.summary_pos(self.run_id, shard), "held")
        ready = [s for s, held in zip(shards, pipe.execute(), strict=True) if held is not None and int(held) <= decided]
        if ready:
            self._on_release(ready)

    def _finish(self, token: str, st: _State, result: DrainResult) -> None:
        found = self._alerts(st, st.det.finish())
        verdicts = st.det.verdicts()
        if found:
            for sink in self.sinks:
                sink.emit(self.run_id, found, [])
        result.findings += found
        st.done = True
        self._commit(token, st)
        self._publish(st, verdicts, done=True)  # after the commit: a crash in between redoes the finish
        logger.info("%s: cross-rank stage finished (%d findings at finish)", self.run_id, len(found))
        if finalize_run(self.client, self.run_id, self.sinks, lease_ms=self.lease_ms):
            result.status = "drained"

    # -- committing ------------------------------------------------------------------------------------------

    def _due(self, st: _State, *, idle: bool = False) -> bool:
        # the drainer's cadence: a commit packs every rank's cross-rank state (~0.5 s at 16,384 ranks), so with a
        # large run the next one waits for its share of busy time, not every 5,000 summaries (3 per step there)
        return commit_due(self.snapshot, since=st.since_commit, units=len(st.last), committed_at=st.committed_at,
                          busy_s=st.busy_s, commit_s=st.commit_s, idle=idle)

    def _commit(self, token: str, st: _State) -> None:
        """Snapshot + trim of the consumed summary entries in one transaction, if the lease is still ours."""
        started = time.monotonic()
        state = msgpack.packb(st.state_dict(), use_bin_type=True)
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self._lock)
                if pipe.get(self._lock) != token.encode():
                    raise _LeaseLost
                pipe.multi()
                pipe.set(self._state_key, state)
                for shard, pos in st.pos.items():
                    ms, seq = id_key(pos)
                    pipe.xtrim(keys.summaries(self.run_id, shard), minid=f"{ms}-{seq + 1}")
                pipe.pexpire(self._lock, self.lease_ms)
                pipe.execute()
            except redis.WatchError:
                raise _LeaseLost from None
        st.since_commit = 0
        st.committed_at = time.monotonic()
        st.commit_s, st.busy_s = st.committed_at - started, 0.0
