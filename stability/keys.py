"""Redis key names: the one place that knows how stability lays out its data in Redis.

Per run ``R`` (all keys share the ``stability:{R}`` hash tag, so a Redis Cluster keeps a run on one slot):

* ``stability:{R}:rec:<rank>``   stream of encoded step records of one rank (ID = ``<wall ms>-<step>``)
* ``stability:{R}:ranks``        set of ranks that have written records
* ``stability:{R}:meta``         hash: run metadata (run dir, host, W&B project/group, started, ended)
* ``stability:{R}:findings``     stream of findings (JSON), written by the worker
* ``stability:{R}:state``        detector state (msgpack), written atomically with the XACKs
* ``stability:{R}:lock``         per-run lease held by the worker that drains the run
* ``stability:{R}:errors``       stream of rejected (malformed) entries with the reason
* ``stability:{R}:findings:seen`` set of finding keys ``rank:kind:step`` already published (dedupe on reprocessing)
* ``stability:{R}:trigger``      marker: a drain task for the run is already queued (``…:urgent``: an urgent one)
* ``stability:{R}:advice``       JSON: the worker's latest advice (rollback step, batches to skip), read by the guard
* ``stability:{R}:profile``      JSON: a profile request (steps, id), polled by the training side
* ``stability:{R}:quiet``        the newest entry id of the silence episode (all ranks quiet while running) the
  sweep already reported as a hang (:mod:`stability.worker.quiet`)
* ``stability:{R}:status``       hash: the run's lifecycle status (``status`` running / finished / died, ``step``,
  ``reason``, ``time``, ``host``, ``pid``), see :mod:`stability.runstate`

Sharded runs (meta field ``shard_size`` > 0; see :mod:`stability.worker.shards`), per shard ``S`` (a number, or
``x`` for the cross-rank stage):

* ``stability:{R}:lock:<S>``     the shard's drain lease (``lock:x``: the cross-rank stage's)
* ``stability:{R}:state:<S>``    the shard's detector snapshot (``state:x``: the cross-rank stage's)
* ``stability:{R}:trigger:<S>``  marker: a drain task for the shard is queued (``…:urgent``: an urgent one)
* ``stability:{R}:sum:<S>``      stream of the shard's per-step summaries (msgpack lists), read by the cross-rank stage
* ``stability:{R}:sumpos:<S>``   hash: the shard's summary watermark (``r<rank>`` last summarized entry id,
  ``progress``, ``idle``, ``ended``)
* ``stability:{R}:xrank``        hash: the cross-rank stage's output for the shards (``decided`` step, ``done``)
* ``stability:{R}:verdicts``     hash ``<rank>:<step>`` -> the cross-rank verdict (finding JSON) on that rank's step

Global: ``stability:sweeper`` (lease of the worker that currently runs the sweep).

Global: ``stability:urgent`` (list of ``<run>\n<rank>``: a rank wrote a record with a non-finite loss or gradient,
pushed by its emitter; the sweeping worker pops it at once and queues that rank's drain ahead of the others) and
``stability:due`` (sorted set of ``<run>\n<shard>`` by the unix time a finding the shard holds for the cross-rank
verdict is due for release: the sweeping worker queues that shard's drain then, ahead of the others).

Global: ``stability:runs`` (set of active run ids). Runs no longer active are found by their meta hash
(``SCAN MATCH`` :data:`META_PATTERN`).
"""

from __future__ import annotations

PREFIX = "stability"
RUNS = f"{PREFIX}:runs"
URGENT = f"{PREFIX}:urgent"
DUE = f"{PREFIX}:due"
URGENT_MAX = 10_000
"""Most entries kept in :data:`URGENT` (trimmed by the emitters: no worker may be sweeping)."""
GROUP = "stability-workers"
"""Consumer group name on every record stream."""


def _run(run_id: str) -> str:
    return f"{PREFIX}:{{{run_id}}}"


def records(run_id: str, rank: int) -> str:
    """Stream of one rank's records."""
    return f"{_run(run_id)}:rec:{rank}"


def ranks(run_id: str) -> str:
    """Set of ranks with a record stream."""
    return f"{_run(run_id)}:ranks"


def meta(run_id: str) -> str:
    """Hash of run metadata."""
    return f"{_run(run_id)}:meta"


def findings(run_id: str) -> str:
    """Stream of findings."""
    return f"{_run(run_id)}:findings"


def state(run_id: str) -> str:
    """Detector state."""
    return f"{_run(run_id)}:state"


def lock(run_id: str) -> str:
    """Per-run drain lease."""
    return f"{_run(run_id)}:lock"


def errors(run_id: str) -> str:
    """Stream of rejected entries."""
    return f"{_run(run_id)}:errors"


def findings_seen(run_id: str) -> str:
    """Set of finding keys already published (reprocessing after a crash adds nothing twice)."""
    return f"{findings(run_id)}:seen"


def trigger(run_id: str) -> str:
    """Marker that a drain task for the run is queued (at most one at a time)."""
    return f"{_run(run_id)}:trigger"


def advice(run_id: str) -> str:
    """The worker's latest advice for the run (JSON), polled by the training side's guard."""
    return f"{_run(run_id)}:advice"


def profile(run_id: str) -> str:
    """A profile request for the run (JSON), polled by the training side (:mod:`stability.hooks.profiler`)."""
    return f"{_run(run_id)}:profile"


def status(run_id: str) -> str:
    """Hash of the run's lifecycle status (running / finished / died at a step), see :mod:`stability.runstate`."""
    return f"{_run(run_id)}:status"


def alive(run_id: str) -> str:
    """A paused run's heartbeat (JSON, short TTL): a rank's watchdog saw no step for a while but its process lives
    (saving a checkpoint, evaluating, or stalled: the watchdog reports that itself). Read by the quiet-run check."""
    return f"{_run(run_id)}:alive"


def quiet(run_id: str) -> str:
    """The silence episode (newest entry id) already reported as a hang by the sweep's quiet-run check."""
    return f"{_run(run_id)}:quiet"


SWEEPER = f"{PREFIX}:sweeper"
"""Lease of the worker process that currently sweeps (any worker may take it over, see ``worker.tasks``)."""
CROSSRANK = "x"
"""Shard name of a sharded run's cross-rank stage (:func:`shard_lock`, :func:`shard_state`, :func:`shard_trigger`)."""


def shard_lock(run_id: str, shard: int | str) -> str:
    """Drain lease of one shard of a sharded run (``shard`` = :data:`CROSSRANK`: the cross-rank stage's)."""
    return f"{lock(run_id)}:{shard}"


def shard_affinity(run_id: str, shard: int | str) -> str:
    """The worker queue a shard's drains (``shard`` = :data:`CROSSRANK`: the cross-rank stage's runs) go to while
    set (:mod:`stability.worker.tasks`, shard affinity)."""
    return f"{shard_lock(run_id, shard)}:affinity"


def shard_state(run_id: str, shard: int | str) -> str:
    """Detector snapshot of one shard (or of the cross-rank stage)."""
    return f"{state(run_id)}:{shard}"


def shard_trigger(run_id: str, shard: int | str) -> str:
    """Marker that a drain task for the shard (or the cross-rank stage) is queued."""
    return f"{trigger(run_id)}:{shard}"


def urgent_trigger(run_id: str, shard: int | None = None) -> str:
    """Marker that an urgent (priority) drain of the run, or of one shard, is queued."""
    return f"{trigger(run_id) if shard is None else shard_trigger(run_id, shard)}:urgent"


def summaries(run_id: str, shard: int) -> str:
    """Stream of one shard's per-step summaries (read by the cross-rank stage)."""
    return f"{_run(run_id)}:sum:{shard}"


def summary_pos(run_id: str, shard: int) -> str:
    """Hash: how far one shard has summarized its ranks (per-rank entry ids, progress, idle, ended)."""
    return f"{_run(run_id)}:sumpos:{shard}"


def crossrank(run_id: str) -> str:
    """Hash: the cross-rank stage's watermark for the shards (``decided``, ``done``)."""
    return f"{_run(run_id)}:xrank"


def verdicts(run_id: str) -> str:
    """Hash ``<rank>:<step>`` -> cross-rank verdict (finding JSON) of that step on that rank."""
    return f"{_run(run_id)}:verdicts"


META_PATTERN = f"{PREFIX}:{{*}}:meta"
"""``SCAN MATCH`` pattern of every run's meta hash (listing runs that are no longer in :data:`RUNS`)."""


def run_of_meta(key: str | bytes) -> str | None:
    """The run id of a meta hash key (``stability:{R}:meta`` -> ``R``); None for any other key."""
    text = key.decode() if isinstance(key, bytes) else key
    head, tail = f"{PREFIX}:{{", "}:meta"
    if text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail):
        return text[len(head) : -len(tail)]
    return None


def urgent_member(run_id: str, rank_or_shard: int | str) -> str:
    """An entry of :data:`URGENT` (a rank) or :data:`DUE` (a shard)."""
    return f"{run_id}\n{rank_or_shard}"


def parse_urgent(member: bytes | str) -> tuple[str, int] | None:
    """``(run_id, number)`` of an :data:`URGENT` / :data:`DUE` entry (None: not one)."""
    text = member.decode(errors="replace") if isinstance(member, bytes) else member
    run_id, sep, number = text.rpartition("\n")
    if not sep or not run_id or not number.isdigit():
        return None
    return run_id, int(number)
