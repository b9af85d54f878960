"""Advice for the training loop: the latest error finding's rollback step and batches to skip, in Redis.

:class:`AdviceSink` writes ``keys.advice(run_id)`` (a JSON string) whenever a batch holds an error finding; the
training side's guard (:class:`stability.hooks.guard.Guard`) polls it from a background thread. JSON fields:
``step``, ``kind``, ``rank``, ``severity``, ``message``, ``rollback_step`` (int or null), ``skip_batches`` (list of
batch ids), ``causes`` (cause ids, best first), ``updated`` (wall time).

Idempotent and monotone: the key is replaced only by a finding at a later-or-equal ``(step, rank)`` (checked in a
Lua script), so a re-delivered older batch never overwrites newer advice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import redis

from stability import keys
from stability.detectors.base import Finding, Severity
from stability.worker.sinks import Entry

__all__ = ["AdviceSink", "advice_dict"]

_SET_IF_NEWER = """
local current = redis.call('GET', KEYS[1])
if current then
  local old = cjson.decode(current)
  local step, rank = tonumber(ARGV[2]), tonumber(ARGV[3])
  if old.step > step or (old.step == step and (old.rank or 0) > rank) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


def advice_dict(finding: Finding) -> dict[str, object]:
    """The advice JSON object of ``finding``."""
    return {
        "step": finding.step,
        "kind": finding.kind,
        "rank": finding.rank,
        "severity": finding.severity.value,
        "message": finding.message,
        "rollback_step": finding.rollback_step,
        "skip_batches": list(finding.skip_batches),
        "causes": [c.cause for c in finding.causes],
        "updated": time.time(),
    }


class AdviceSink:
    """Stores the latest error finding of each run as advice at ``keys.advice(run_id)``.

    Args:
        client: Redis client of the run's data.
    """

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self._client = client
        self._script = client.register_script(_SET_IF_NEWER)

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Write the batch's latest error finding, unless newer advice is already stored."""
        _profile_incident(self._client, run_id, findings)
        errors = [f for f in findings if f.severity is Severity.ERROR]
        if not errors:
            return
        latest = max(errors, key=lambda f: (f.step, f.rank))
        self._script(keys=[keys.advice(run_id)], args=[json.dumps(advice_dict(latest)), latest.step, latest.rank])

    def close(self, run_id: str) -> None:
        """Nothing to release: the advice stays readable after the run is drained."""


PROFILE_KINDS = frozenset({"straggler", "dataloader_stall", "slowdown", "memory_leak"})
"""Performance incidents that ask the training side for a profile of its next steps (a hung process cannot)."""


def _profile_incident(client: redis.Redis[bytes], run_id: str, findings: Sequence[Finding]) -> None:
    """Ask for a 5-step profile on a performance warning/error, once an hour at most (hooks/profiler.py)."""
    perf = [f for f in findings if f.kind in PROFILE_KINDS and f.severity is not Severity.INFO]
    if perf:
        from stability.hooks.profiler import request_profile

        first = perf[0]
        request_profile(client, run_id, 5, f"{first.kind} on rank {first.rank} at step {first.step}",
                        only_if_none=True)
