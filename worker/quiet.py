"""Quiet runs: every rank's records stopped while the run's status is still ``running`` -> one ``hang`` finding.

Why here: :class:`~stability.detectors.hang.HangDetector` judges a rank's silence when another rank's record
arrives, so when *all* ranks stop nothing arrives and it never runs; the training side's watchdog reports such a
stall only while its own thread can run and reach Redis. The worker's sweep (one sweeper at a time, under the sweep
lease) calls :meth:`QuietCheck.sweep` over the active runs.

Per run, at most every :attr:`QuietConfig.every_s`:

1. the status (:mod:`stability.runstate`) must be ``running`` (a finished or dead run is not hung);
2. the last-generated stream id of every rank (``XINFO STREAM``, pipelined in chunks; ids are ``<wall ms>-<step>``,
   so the newest write time and step survive trimming); a rank written within the floor ends the check at once,
   so a healthy run costs about one round trip;
3. the usual step time: the larger of the median ``step_time`` signal and the median interval between the entries
   still in the newest rank's stream (``XREVRANGE``, a drained stream keeps at least its last entry);
4. silence = now - newest write; when it reaches ``max(factor x usual, floor_s)`` one ``hang`` ERROR finding is
   published through the sinks given (the worker passes the console, Redis findings and advice sinks: the drainer's
   findings path; not the W&B sink, whose diagnosis run lives in the draining processes). It names the rank that
   stopped first (its host, its last step) and every rank's last step; its step is that rank's last step + 1, so
   the findings stream's ``(rank, kind, step)`` dedupe merges it with the watchdog's finding of the same stall.

Once per silence episode: ``keys.quiet(run)`` holds the newest entry id of the episode reported (set in one Lua
script that checks it first); a new record starts a new episode. A run whose newest record is the watchdog's
``hang_s`` record was reported already (with its stacks) and is skipped.

Pauses of the whole job (a long checkpoint save or evaluation that writes no record): while no step ends, each
rank's watchdog writes a heartbeat (``keys.alive``, every 10 s, 30 s TTL; nothing while steps end) saying its process
lives and what its training thread is doing. While a heartbeat is fresh the run is left alone up to
:attr:`QuietConfig.busy_s` (10 minutes) of silence: a live process's watchdog reports a real stall itself, with its
stacks, and tells checkpoint saves apart. Past ``busy_s`` the hang is reported with what the heartbeat said (a
checkpoint save to a dead filesystem is a hang too). Without a heartbeat (a frozen or unreachable process, or
``STABILITY_WATCHDOG=0``) the floor applies. ``STABILITY_QUIET_S=0`` turns the check off.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from stability import keys
from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy
from stability.errors import ConfigError, RecordError
from stability.records import StepRecord, decode
from stability.runstate import RUNNING, read_status
from stability.worker.drain import run_ranks
from stability.worker.sinks import Sink

__all__ = ["QuietCheck", "QuietConfig"]

logger = logging.getLogger(__name__)

_MARK_EPISODE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
EPISODE_TTL_MS = 7 * 24 * 3600 * 1000
"""``keys.quiet`` expires a week after the episode it names (a run abandoned in Redis leaves nothing forever)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QuietConfig:
    """Settings of :class:`QuietCheck`."""

    floor_s: float = 30.0
    """Never a hang below this much silence (records reach Redis in batches; short pauses of the loop). 0: off."""
    factor: float = 2.0
    """A hang is this many usual step times of silence (when more than the floor)."""
    busy_s: float = 600.0
    """Silence tolerated while a heartbeat says the processes live (a long checkpoint save or evaluation)."""
    every_s: float = 5.0
    """Each run is checked at most this often."""
    history: int = 16
    """Entries of the newest rank read to learn the usual step time."""
    chunk: int = 64
    """Ranks per pipelined ``XINFO STREAM`` round trip."""

    def __post_init__(self) -> None:
        if not (self.floor_s >= 0 and self.factor > 0 and self.busy_s >= 0 and self.every_s >= 0 and self.history >= 2
                and self.chunk >= 1):
            raise ConfigError(f"invalid quiet-run check settings: {self}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> QuietConfig:
        """``STABILITY_QUIET_S`` (the floor, default 30; 0 turns the check off), ``STABILITY_QUIET_BUSY_S`` (silence
        tolerated while the processes' heartbeat is fresh, default 600); checks every min(5, floor / 4) s."""
        env = os.environ if env is None else env
        floor = _seconds(env, "STABILITY_QUIET_S", 30.0)
        busy = _seconds(env, "STABILITY_QUIET_BUSY_S", 600.0)
        return cls(floor_s=floor, busy_s=busy, every_s=min(5.0, floor / 4))


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name) or str(default)
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be >= 0, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Last:
    rank: int
    ms: int
    step: int
    record: StepRecord | None


class QuietCheck:
    """The sweep's check for runs whose ranks all stopped (see the module docstring)."""

    def __init__(self, config: QuietConfig | None = None) -> None:
        self.config = config or QuietConfig()
        self._checked: dict[str, float] = {}

    def sweep(self, client: Any, run_ids: Iterable[str], sinks: Sequence[Sink], now: float | None = None) -> int:
        """Check each run (rate-limited per run); publish through ``sinks``; return the hang findings published.

        A run whose check fails (Redis error, a damaged last entry) is logged and skipped, never stops the sweep."""
        if self.config.floor_s <= 0:
            return 0
        now = time.time() if now is None else now
        clock = time.monotonic()
        published = 0
        active = set()
        for run_id in run_ids:
            active.add(run_id)
            if clock - self._checked.get(run_id, -math.inf) < self.config.every_s:
                continue
            self._checked[run_id] = clock
            try:
                finding = self.check(client, run_id, now)
            except (redis.RedisError, RecordError) as exc:
                logger.info("%s: quiet-run check failed (%s: %s)", run_id, type(exc).__name__, exc)
                continue
            if finding is not None:
                for sink in sinks:
                    sink.emit(run_id, [finding], [])
                published += 1
        for gone in set(self._checked) - active:
            del self._checked[gone]
        return published

    def check(self, client: Any, run_id: str, now: float) -> Finding | None:
        """The hang finding of ``run_id`` at wall time ``now`` if all its ranks are silent past the limit and this
        silence was not reported yet (the episode is marked reported then); else None."""
        if read_status(client, run_id).status != RUNNING:
            return None
        floor_ms = self.config.floor_s * 1000.0
        now_ms = now * 1000.0
        ranks = run_ranks(client, run_id)
        last: list[_Last] = []
        for start in range(0, len(ranks), self.config.chunk):
            chunk = ranks[start:start + self.config.chunk]
            pipe = client.pipeline(transaction=False)
            for rank in chunk:
                pipe.xinfo_stream(keys.records(run_id, rank))
            for rank, info in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
                entry = _last(rank, info)
                if entry is None:
                    continue
                if now_ms - entry.ms < floor_ms:
                    return None  # a rank wrote recently: not quiet (a single silent rank is the drainer's)
                last.append(entry)
        if not last:
            return None
        if any(e.record is not None and "hang_s" in e.record.signals for e in last):
            return None  # the watchdog's record: this stall is reported with its stacks
        newest = max(last, key=lambda e: (e.ms, e.step))
        usual = self._usual(client, run_id, newest.rank)
        limit_s = max(self.config.floor_s, self.config.factor * usual) if usual else self.config.floor_s
        silent_s = now - newest.ms / 1000.0
        if silent_s < limit_s:
            return None
        alive = _alive(client, run_id, now)
        if alive is not None and silent_s < max(limit_s, self.config.busy_s):
            return None  # the processes live: their watchdogs judge the pause
        episode = f"{newest.ms}-{newest.step}"
        if not client.eval(_MARK_EPISODE, 1, keys.quiet(run_id), episode, EPISODE_TTL_MS):
            return None
        return _finding(last, silent_s, limit_s, usual, alive)

    def _usual(self, client: Any, run_id: str, rank: int) -> float | None:
        """Usual step time of ``rank`` from the entries its stream still holds (None: nothing to go by)."""
        raw: Any = client.xrevrange(keys.records(run_id, rank), count=self.config.history)
        ids, times = [], []
        for entry_id, fields in raw:
            ms, _, step = _text(entry_id).partition("-")
            ids.append((int(ms), int(step)))
            record = _decode(fields)
            if record is not None:
                value = record.signals.get("step_time")
                if value is not None and math.isfinite(value) and value > 0:
                    times.append(value)
        ids.sort()
        intervals = [(b[0] - a[0]) / 1000.0 for a, b in itertools.pairwise(ids) if b[0] > a[0]]
        estimates = [statistics.median(times)] if times else []
        if len(intervals) >= 2:
            estimates.append(statistics.median(intervals))
        return max(estimates) if estimates else None


HEARTBEAT_STALE_S = 30.0
"""A heartbeat older than this (by its own time) is no sign of life (its key also expires then)."""


def _alive(client: Any, run_id: str, now: float) -> dict[str, Any] | None:
    """The run's fresh heartbeat (see the module docstring), or None."""
    raw: Any = client.get(keys.alive(run_id))
    if raw is None:
        return None
    try:
        beat = json.loads(raw)
        fresh = now - float(beat["t"]) < HEARTBEAT_STALE_S
    except (ValueError, KeyError, TypeError):
        return None
    return beat if fresh and isinstance(beat, dict) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(fields: Any) -> StepRecord | None:
    payload = fields.get(b"r") if isinstance(fields, dict) else None
    if payload is None:
        return None
    try:
        return decode(payload)
    except RecordError:
        return None


def _last(rank: int, info: Any) -> _Last | None:
    """The last-generated id (and last entry, when the stream still holds it) of ``rank``'s stream."""
    if isinstance(info, Exception) or not isinstance(info, dict):
        return None  # no such stream (yet)
    generated = info.get("last-generated-id") or info.get(b"last-generated-id")
    if generated is None:
        return None
    ms, _, seq = _text(generated).partition("-")
    if not (ms.isdigit() and seq.isdigit()) or (int(ms), int(seq)) == (0, 0):
        return None
    entry = info.get("last-entry") or info.get(b"last-entry")
    record = None
    if entry and _text(entry[0]) == _text(generated):
        record = _decode(entry[1])
    return _Last(rank, int(ms), int(seq), record)


def _finding(last: Sequence[_Last], silent_s: float, limit_s: float, usual: float | None,
             alive: dict[str, Any] | None = None) -> Finding:
    """The one finding of a quiet run: the rank that stopped first, every rank's last step."""
    first = min(last, key=lambda e: (e.ms, e.step, e.rank))
    host = first.record.host if first.record is not None else ""
    where = f"rank {first.rank}" + (f" on {host}" if host else "")
    steps = ", ".join(f"rank {e.rank} step {e.step}" for e in sorted(last, key=lambda e: e.rank)[:16])
    more = f" (+{len(last) - 16} ranks)" if len(last) > 16 else ""
    usual_text = f"usual step {usual:.3g} s" if usual else "usual step unknown"
    message = (f"all {len(last)} rank(s) silent while the run is still running: no record for {silent_s:.1f} s "
               f"({usual_text}, limit {limit_s:.3g} s); {where} stopped first, after step {first.step}; "
               f"last steps: {steps}{more}")
    if alive is not None:
        message += (f"; the processes still live (rank {alive.get('rank')}: {alive.get('state')}) but no step ended "
                    f"in {silent_s:.0f} s")
    evidence = {"silent_s": silent_s, "limit_s": limit_s, "last_step": float(first.step), "ranks": float(len(last))}
    if usual:
        evidence["usual_s"] = usual
    return Finding(kind="hang", step=first.step + 1, onset=first.step + 1, severity=Severity.ERROR,
                   signal="step_time", value=silent_s, score=silent_s / limit_s, detector="quiet", rank=first.rank,
                   host=host, evidence=evidence, message=message,
                   causes=(CauseHint(cause="hang", score=0.95, evidence=message, remedy=remedy("hang")),))
