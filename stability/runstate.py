"""A run's lifecycle status: ``running``, ``finished`` or ``died`` at step N, in Redis and in the run directory.

Why: a run that ends by SIGTERM (a ``timeout``, a scheduler's preemption), SIGKILL or an exception must not look
like a run that is still going, and an operator listing runs (``stability runs``) needs to see which ones ended and
where. The status lives in the hash :func:`stability.keys.status` (fields ``status``, ``step``, ``reason``,
``time``, ``host``, ``pid``); the bare status is also the field ``status`` of the run's meta hash, and the whole
record is mirrored to ``<run dir>/status.json``.

Who writes it:

* ``running``: every rank's :class:`~stability.session.Session` when it opens.
* ``finished``: the last rank to close cleanly (every rank with a stream has ``ended:<rank>`` in the meta hash).
* ``died``: the training process itself on SIGTERM or an uncaught exception, or, when it vanished without a word
  (SIGKILL, OOM killer), the local supervisor that watches it (:mod:`stability.supervisor`).

A ``died`` status is never overwritten by ``finished``, and a ``finished`` one never by ``died`` (one Lua script
checks and sets), so the first detector of the end wins.

The step of a death is the last step that reached Redis: the highest step of the last-generated stream IDs
(``<wall ms>-<step>``), which survive trimming of the stream.

Training-side module: stdlib and redis only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from stability import keys

__all__ = ["DIED", "FINISHED", "RUNNING", "RunStatus", "last_ids", "mark", "read_status", "write_status_file"]

RUNNING = "running"
FINISHED = "finished"
DIED = "died"
STATUS_FILE = "status.json"
"""Mirror of the status in the run directory."""

# KEYS[1] status hash, KEYS[2] meta hash (gets the bare status too); ARGV: new status, then field/value pairs.
# "running" always wins (a (re)started run);
# an ended status (finished/died) is set only over "running" or nothing, so the first end that is seen stays.
_SET = """
local current = redis.call('HGET', KEYS[1], 'status')
if ARGV[1] ~= 'running' and current and current ~= 'running' then return current end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 2))
redis.call('HSET', KEYS[2], 'status', ARGV[1])
return ARGV[1]
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStatus:
    """One run's status as recorded (``status`` is empty for runs that predate status recording)."""

    status: str
    step: int | None = None
    """Last step that reached Redis when the status was set (None: no record yet, or unknown)."""
    reason: str = ""
    time: float | None = None
    host: str = ""
    pid: int | None = None
    lost: int = 0
    """Records the training side could not deliver or keep (spool writes that failed, damaged spool regions): the
    ``lost`` field of the run's meta hash, which emitters and ``stability replay`` increment."""

    def describe(self) -> str:
        """``running``, ``finished at step 120``, ``died at step 57 (SIGTERM)``."""
        text = self.status or "unknown"
        if self.status != RUNNING and self.step is not None:
            text += f" at step {self.step}"
        if self.status == DIED and self.reason:
            text += f" ({self.reason})"
        if self.lost:
            text += f"; {self.lost} records lost"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"status": self.status, "step": self.step, "reason": self.reason, "time": self.time,
                "host": self.host, "pid": self.pid, "lost": self.lost}


def last_ids(client: redis.Redis[bytes], run_id: str) -> dict[int, tuple[int, int]]:
    """``rank -> (wall ms, step)`` of the last entry ever added to each rank's stream (even if trimmed since)."""
    members: Any = client.smembers(keys.ranks(run_id))
    out: dict[int, tuple[int, int]] = {}
    for raw in members:
        rank = int(raw)
        try:
            info: Any = client.xinfo_stream(keys.records(run_id, rank))
        except redis.ResponseError:  # no such stream (yet)
            continue
        last = info.get("last-generated-id") or info.get(b"last-generated-id")
        if last is None:
            continue
        text = last.decode() if isinstance(last, bytes) else str(last)
        ms, _, seq = text.partition("-")
        if ms.isdigit() and seq.isdigit() and (int(ms), int(seq)) != (0, 0):
            out[rank] = (int(ms), int(seq))
    return out


def last_step(client: redis.Redis[bytes], run_id: str) -> int | None:
    """Highest step any rank has written to Redis (None: no record yet)."""
    steps = [step for _ms, step in last_ids(client, run_id).values()]
    return max(steps) if steps else None


def mark(client: redis.Redis[bytes], run_id: str, status: str, *, reason: str = "", step: int | None = None,
         run_dir: str | Path | None = None) -> RunStatus:
    """Record ``status`` for ``run_id`` (see the module docstring for which transitions win); the resulting status.

    ``step`` defaults to the last step in Redis. With ``run_dir`` the result is also written to ``status.json``.
    """
    if step is None and status != RUNNING:
        step = last_step(client, run_id)
    fields: dict[str, str] = {"time": f"{time.time():.3f}", "host": socket.gethostname(), "pid": str(os.getpid())}
    if reason:
        fields["reason"] = reason[:500]
    if step is not None:
        fields["step"] = str(step)
    args = [status] + [item for pair in fields.items() for item in pair]
    client.eval(_SET, 2, keys.status(run_id), keys.meta(run_id), *args)
    result = read_status(client, run_id)
    if run_dir is not None:
        write_status_file(run_dir, run_id, result)
    return result


def read_status(client: redis.Redis[bytes], run_id: str) -> RunStatus:
    """The recorded status of ``run_id`` (``status=""`` when none was recorded)."""
    raw: Any = client.hgetall(keys.status(run_id))
    fields = {_text(k): _text(v) for k, v in raw.items()}
    lost: Any = client.hget(keys.meta(run_id), "lost")
    if lost is not None:
        fields["lost"] = _text(lost)
    return from_mapping(fields)


def from_mapping(fields: Mapping[str, str]) -> RunStatus:
    """A :class:`RunStatus` from the status hash's (or ``status.json``'s) fields."""

    def number(name: str) -> float | None:
        try:
            return float(fields[name])
        except (KeyError, TypeError, ValueError):
            return None

    step, pid, lost = number("step"), number("pid"), number("lost")
    return RunStatus(status=str(fields.get("status") or ""), step=None if step is None else int(step),
                     reason=str(fields.get("reason") or ""), time=number("time"), host=str(fields.get("host") or ""),
                     pid=None if pid is None else int(pid), lost=0 if lost is None else int(lost))


def write_status_file(run_dir: str | Path, run_id: str, status: RunStatus) -> None:
    """Write ``<run_dir>/status.json`` atomically, 0600 (an unwritable run directory is not an error)."""
    from stability._files import write_private_text

    with contextlib.suppress(OSError):
        write_private_text(Path(run_dir) / STATUS_FILE, json.dumps({"run_id": run_id, **status.to_dict()}, indent=2)
                           + "\n")


def read_status_file(run_dir: str | Path) -> RunStatus | None:
    """The status in ``<run_dir>/status.json`` (None when absent or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return from_mapping(data) if isinstance(data, dict) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
