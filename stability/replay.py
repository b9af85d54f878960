"""``stability replay RUN_DIR``: send a run's spool to Redis after training ended, in order (issue 14 item 3).

Why: the emitter replays its spool only while it runs; a training process that ended while Redis was down leaves
its last records in ``<run dir>/spool/spool-rank<N>.bin`` and the run unfinished in Redis. This command sends
each rank's spool with the records' original stream IDs, in file order (so resends are rejected as duplicates,
never stored twice), marks each replayed rank ended so a worker finishes the run (findings and report), and removes
a spool file only once every entry in it is in Redis.

Target: ``--redis URL`` or ``$STABILITY_REDIS_URL``; with neither, the run's embedded Redis is started again from
``<run dir>/redis`` with its local worker (:mod:`stability.supervisor`), and the command waits until the worker has
drained the run, then stops them.

An entry whose ID is not above the stream's last ID and is not already in the stream cannot be added in order
(Redis refuses it): it is counted as ``refused``, and its spool file is kept. An entry the worker already read and
trimmed away (its ID is at or below the worker group's last delivered ID) counts as already in Redis.

Nothing is skipped silently: damaged spool regions (a torn write, a bad CRC) are counted and printed, and so are the
records the emitter could not spool at all (``lost-rank<N>``, a full disk); both are added to the run's ``lost``
count, which its status shows (:class:`stability.runstate.RunStatus`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from stability import keys, runstate
from stability._files import open_private
from stability.errors import RecordError, SourceError
from stability.records import decode
from stability.redis_source import connect, redact
from stability.transport import parse_id, read_spool, scan_spool
from stability.transport._spool import lost_path

__all__ = ["ReplayResult", "replay"]

logger = logging.getLogger(__name__)

CHUNK = 200
_SPOOL = re.compile(r"^spool-rank(\d+)\.bin$")
_DUPLICATE = "equal or smaller than the target stream top item"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """What :func:`replay` did for one rank's spool file."""

    rank: int
    added: int
    already: int
    """Entries that were already in Redis (sent before, or replayed before)."""
    refused: int
    """Entries Redis could not take in order (older than the stream's last entry and not in it)."""
    removed: bool
    """The spool file was deleted (everything in it is in Redis)."""
    damaged: int = 0
    """Damaged regions of the spool file that were skipped (each held one record or more)."""
    unspooled: int = 0
    """Records the training process could not write to the spool (``lost-rank<N>``)."""


def spool_files(run_dir: Path) -> dict[int, Path]:
    """``rank -> spool file`` of a run directory: non-empty files, and ranks that left only a lost count."""
    out = {}
    for path in (run_dir / "spool").glob("spool-rank*.bin"):
        match = _SPOOL.match(path.name)
        if match and path.stat().st_size > 0:
            out[int(match.group(1))] = path
    for path in (run_dir / "spool").glob("lost-rank*"):
        rank = path.name.removeprefix("lost-rank")
        with contextlib.suppress(OSError, ValueError):
            if rank.isdigit() and int(path.read_text(encoding="ascii").strip() or 0) > 0:
                out.setdefault(int(rank), spool_path_of(run_dir, int(rank)))
    return dict(sorted(out.items()))


def spool_path_of(run_dir: Path, rank: int) -> Path:
    """``rank``'s spool file in ``run_dir`` (it may not exist)."""
    return run_dir / "spool" / f"spool-rank{rank}.bin"


def _run_id(run_dir: Path, files: dict[int, Path]) -> str:
    for path in files.values():
        if not path.exists():
            continue
        for _entry_id, payload in read_spool(path):
            with contextlib.suppress(RecordError):
                return decode(payload).run_id
    for name in ("run.json", runstate.STATUS_FILE):  # a rank that left only a lost count
        with contextlib.suppress(OSError, ValueError, AttributeError):
            run_id = json.loads((run_dir / name).read_text(encoding="utf-8")).get("run_id")
            if isinstance(run_id, str) and run_id:
                return run_id
    raise SourceError(f"{run_dir}: the spool holds no readable record")


def replay(run_dir: str | Path, redis_url: str | None = None, *, wait_s: float = 300.0,
           echo: Any = print) -> list[ReplayResult]:
    """Replay ``run_dir``'s spool files (see the module docstring); one result per rank, empty if none.

    Raises:
        SourceError: not a run directory, Redis unreachable, or the embedded Redis cannot be started.
    """
    root = Path(run_dir).resolve()
    if not root.is_dir():
        raise SourceError(f"{root}: not a run directory")
    files = spool_files(root)
    if not files:
        echo(f"{root}: nothing to replay (no spool files)")
        return []
    run_id = _run_id(root, files)
    url = redis_url or os.environ.get("STABILITY_REDIS_URL") or None
    supervisor = None
    if url is None:
        supervisor, url = _start_embedded(root, run_id)
    try:
        client = connect(url)
        try:
            _refuse_live(client, run_id)
            results = [_replay_file(client, run_id, rank, path, root) for rank, path in files.items()]
            for r in results:
                echo(f"rank {r.rank}: {r.added} records replayed, {r.already} already in Redis"
                     + (f", {r.refused} refused (out of order; spool file kept)" if r.refused else "")
                     + (f", {r.damaged} damaged spool regions skipped" if r.damaged else "")
                     + (f", {r.unspooled} records lost (could not be spooled)" if r.unspooled else "")
                     + f" -> {redact(url)} run {run_id}")
            if supervisor is not None:
                _wait_drained(client, run_id, supervisor, wait_s, echo)
        finally:
            client.close()
    finally:
        if supervisor is not None:
            _stop(supervisor)
    return results


def _refuse_live(client: redis.Redis[bytes], run_id: str) -> None:
    """A run whose training process is still alive on this host keeps its own spool (its emitter replays it)."""
    import socket

    status = runstate.read_status(client, run_id)
    if status.status == runstate.RUNNING and status.host == socket.gethostname() and status.pid is not None:
        try:
            os.kill(status.pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        raise SourceError(f"run {run_id} is still running (pid {status.pid}); its emitter replays the spool itself")


def _replay_file(client: redis.Redis[bytes], run_id: str, rank: int, path: Path, run_dir: Path) -> ReplayResult:
    stream = keys.records(run_id, rank)
    pipe = client.pipeline(transaction=False)
    pipe.sadd(keys.RUNS, run_id)
    pipe.sadd(keys.ranks(run_id), rank)
    pipe.hsetnx(keys.meta(run_id), "run_dir", str(run_dir))
    pipe.hsetnx(keys.meta(run_id), "started", f"{time.time():.3f}")
    pipe.hdel(keys.meta(run_id), "drained")
    pipe.execute()
    entries, reader = scan_spool(path) if path.exists() else ([], None)
    damaged = reader.damaged if reader is not None else 0
    lost_file = lost_path(path.parent, rank)
    try:
        unspooled = int(lost_file.read_text(encoding="ascii").strip() or 0)
    except (FileNotFoundError, ValueError):
        unspooled = 0
    delivered = _last_delivered(client, stream)
    added = already = refused = 0
    for start in range(0, len(entries), CHUNK):
        chunk = entries[start : start + CHUNK]
        pipe = client.pipeline(transaction=False)
        for entry_id, payload in chunk:
            pipe.xadd(stream, {"r": payload}, id=entry_id)
        for (entry_id, _payload), result in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(result, Exception):
                added += 1
            elif _DUPLICATE in str(result) and (parse_id(entry_id) <= delivered
                                                 or client.xrange(stream, min=entry_id, max=entry_id)):
                already += 1
            else:
                refused += 1
                logger.warning("%s rank %d: entry %s not replayed (%s)", run_id, rank, entry_id, result)
    client.hset(keys.meta(run_id), f"ended:{rank}", f"{time.time():.3f}")
    lost = unspooled + (damaged if refused == 0 else 0)  # a kept spool file is read (and its damage counted) again
    if lost:
        client.hincrby(keys.meta(run_id), "lost", lost)
        logger.error("%s rank %d: %d damaged spool regions skipped, %d records were never spooled", run_id, rank,
                     damaged, unspooled)
    lost_file.unlink(missing_ok=True)  # counted in Redis now
    if runstate.read_status(client, run_id).status in ("", runstate.RUNNING):
        # how the run ended as the training side saw it (written to status.json while Redis was down)
        local = runstate.read_status_file(run_dir)
        if local is not None and local.status in (runstate.FINISHED, runstate.DIED):
            runstate.mark(client, run_id, local.status, reason=local.reason, run_dir=run_dir)
        else:
            runstate.mark(client, run_id, runstate.DIED, reason="vanished while Redis was down", run_dir=run_dir)
    removed = refused == 0
    if removed:
        path.unlink(missing_ok=True)
    return ReplayResult(rank=rank, added=added, already=already, refused=refused, removed=removed, damaged=damaged,
                        unspooled=unspooled)


def _last_delivered(client: redis.Redis[bytes], stream: str) -> tuple[int, int]:
    """The highest ID the workers' group has read from ``stream`` (it may have been trimmed since); (0, 0): none."""
    try:
        groups: Any = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        return (0, 0)
    best = (0, 0)
    for group in groups:
        last = group.get("last-delivered-id") or group.get(b"last-delivered-id")
        if last is not None:
            with contextlib.suppress(RecordError):
                best = max(best, parse_id(last))
    return best


def _start_embedded(run_dir: Path, run_id: str) -> tuple[subprocess.Popen[bytes], str]:
    """The run's embedded Redis (its append-only file in ``<run dir>/redis``) and a local worker, for this process."""
    from stability.session import URL_FILE, _wait_for_url

    url_file = run_dir / "redis" / URL_FILE
    url_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        url_file.unlink()
    with open_private(run_dir / "worker.log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stability.supervisor", "--run-dir", str(run_dir), "--run-id", run_id,
             "--watch-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        return proc, _wait_for_url(url_file, process=proc, log_file=run_dir / "worker.log")
    except BaseException:
        _stop(proc)
        raise


def _wait_drained(client: redis.Redis[bytes], run_id: str, supervisor: subprocess.Popen[bytes], wait_s: float,
                  echo: Any) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and supervisor.poll() is None:
        if client.hexists(keys.meta(run_id), "drained"):
            report = client.hget(keys.meta(run_id), "report")
            echo(f"run {run_id} drained" + (f"; report {report.decode()}" if report else ""))
            return
        time.sleep(0.2)
    echo(f"run {run_id} not drained within {wait_s:.0f}s; the records are in {run_id}'s embedded Redis")


def _stop(proc: subprocess.Popen[bytes], timeout: float = 45.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
