"""Redis as a post-mortem source: a run's records from its streams plus its archive, and the list of runs.

Why: an operator of a long job wants ``stability postmortem redis://HOST:PORT/DB --run ID`` while the run is live or
after it died, without finding its run directory first, and ``stability runs redis://...`` to see which runs
exist, how they ended (:mod:`stability.runstate`) and where their files are, with no worker running.

* :func:`load_run`: every record still in ``keys.records(run, rank)`` plus the run's Parquet archive (found through
  the run metadata: ``archive_dir``, else ``<run_dir>/archive``, else ``$STABILITY_ARCHIVE_DIR/<run>``, read with
  :func:`stability.postmortem.load_archive`), de-duplicated by (rank, step).
* :func:`list_runs`: one :class:`RunRow` per run (runs in ``keys.RUNS`` plus every run whose meta hash exists).

Errors are :class:`~stability.errors.SourceError` with one line naming the Redis (password redacted) and what went
wrong: unreachable, authentication failed, unknown run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from stability import keys, runstate
from stability.errors import RecordError, SourceError
from stability.records import StepRecord, decode

__all__ = ["RunRow", "archive_dir", "connect", "is_redis_url", "list_runs", "load_run", "redact", "run_ids"]

logger = logging.getLogger(__name__)

SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://")
PAGE = 1000
FINDINGS_READ_MAX = 10_000
"""At most this many findings are read per run for the runs table."""


def is_redis_url(text: str | os.PathLike[str]) -> bool:
    """True for ``redis://``, ``rediss://``, ``unix://`` and ``redis+socket://`` URLs."""
    return str(text).startswith(SCHEMES)


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (also in malformed URLs: everything up to ``@`` goes)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>" if "@" in url else url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        user = netloc.rsplit("@", 1)[0].partition(":")[0]
        netloc = f"{user}:***@" + netloc.rsplit("@", 1)[1] if user else "***@" + netloc.rsplit("@", 1)[1]
    query = ""
    if "?" in path:
        path, _, query = path.partition("?")
        query = "?" + "&".join(p if not p.lower().startswith("password=") else "password=***"
                               for p in query.split("&"))
    return f"{scheme}://{netloc}{slash}{path}{query}"


def connect(url: str, *, timeout: float = 5.0) -> redis.Redis[bytes]:
    """A client of ``url`` that has answered PING.

    Raises:
        SourceError: bad URL, unreachable server, failed authentication (one line, password redacted).
    """
    from stability.errors import ConfigError
    from stability.redis_url import connect as connect_url
    from stability.redis_url import down_errors

    try:
        client: redis.Redis[bytes] = connect_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                 retry=Retry(ExponentialBackoff(cap=1.0), 2))
    except ConfigError as exc:
        raise SourceError(_scrub(str(exc), url)) from None
    except (*down_errors(), ValueError) as exc:  # type: ignore[misc]
        raise SourceError(f"cannot reach Redis at {redact(url)} ({_scrub(str(exc), url)})") from None
    try:
        client.ping()
    except redis.AuthenticationError:
        raise SourceError(f"Redis at {redact(url)}: authentication failed (check the user name and password)") from None
    except redis.ResponseError as exc:
        message = str(exc)
        if "NOAUTH" in message or "WRONGPASS" in message:
            raise SourceError(f"Redis at {redact(url)}: authentication failed ({message})") from None
        raise SourceError(f"Redis at {redact(url)}: {_scrub(message, url)}") from None
    except (redis.RedisError, OSError) as exc:
        raise SourceError(f"cannot reach Redis at {redact(url)} ({_scrub(str(exc), url)})") from None
    return client


def _scrub(message: str, url: str) -> str:
    """``message`` without the URL's password (redis-py error texts may quote the URL)."""
    from stability.redis_url import scrub

    return scrub(message, url)


def run_ids(client: redis.Redis[bytes]) -> list[str]:
    """Every run known to this Redis: active ones (``keys.RUNS``) and any with a meta hash, sorted."""
    members: Any = client.smembers(keys.RUNS)
    runs = {_text(m) for m in members}
    for key in client.scan_iter(match=keys.META_PATTERN, count=1000):
        run = keys.run_of_meta(key)
        if run is not None:
            runs.add(run)
    return sorted(runs)


def _meta(client: redis.Redis[bytes], run_id: str) -> dict[str, str]:
    raw: Any = client.hgetall(keys.meta(run_id))
    return {_text(k): _text(v) for k, v in raw.items()}


def _ranks(client: redis.Redis[bytes], run_id: str) -> list[int]:
    members: Any = client.smembers(keys.ranks(run_id))
    return sorted(int(m) for m in members)


def _require_run(client: redis.Redis[bytes], url: str, run_id: str) -> dict[str, str]:
    meta = _meta(client, run_id)
    if meta or client.exists(keys.ranks(run_id)):
        return meta
    known = run_ids(client)
    hint = f"runs there: {', '.join(known[:10])}{' ...' if len(known) > 10 else ''}" if known else "it has no runs"
    raise SourceError(f"no run {run_id!r} in Redis at {redact(url)} ({hint})")


def resolve_run_id(client: redis.Redis[bytes], url: str, run_id: str | None) -> str:
    """``run_id``, or the only run in this Redis when None (several: an error listing them)."""
    if run_id is not None:
        _require_run(client, url, run_id)
        return run_id
    known = run_ids(client)
    if len(known) == 1:
        return known[0]
    if not known:
        raise SourceError(f"no runs in Redis at {redact(url)}")
    raise SourceError(f"{len(known)} runs in Redis at {redact(url)}; pass --run ID (see 'stability runs URL')")


def archive_dir(meta: dict[str, str], run_id: str) -> Path | None:
    """The run's archive directory on this host (meta ``archive_dir``, ``<run_dir>/archive``, then
    ``$STABILITY_ARCHIVE_DIR/<run>``); None when none of them exists here."""
    candidates = []
    if meta.get("archive_dir"):
        candidates.append(Path(meta["archive_dir"]))
    if meta.get("run_dir"):
        candidates.append(Path(meta["run_dir"]) / "archive")
    base = os.environ.get("STABILITY_ARCHIVE_DIR")
    if base:
        candidates.append(Path(base) / run_id)
    return next((c for c in candidates if c.is_dir()), None)


def stream_records(client: redis.Redis[bytes], run_id: str) -> Iterator[StepRecord]:
    """Every decodable record still in the run's streams (undecodable entries are logged and skipped)."""
    skipped = 0
    for rank in _ranks(client, run_id):
        stream, start = keys.records(run_id, rank), "-"
        while True:
            page: Any = client.xrange(stream, min=start, max="+", count=PAGE)
            for entry_id, fields in page:
                payload = fields.get(b"r")
                try:
                    if payload is None:
                        raise RecordError("no field 'r'")
                    yield decode(payload)
                except RecordError as exc:
                    skipped += 1
                    logger.debug("%s rank %d entry %s skipped: %s", run_id, rank, _text(entry_id), exc)
            if len(page) < PAGE:
                break
            start = "(" + _text(page[-1][0])
    if skipped:
        logger.warning("%s: %d stream entries could not be decoded and were skipped", run_id, skipped)


def load_run(url: str, run_id: str | None = None) -> tuple[str, list[StepRecord], dict[str, str]]:
    """``(run id, records sorted by (rank, step), metadata)`` of a run in the Redis at ``url``.

    Raises:
        SourceError: unreachable Redis, unknown run, or no records in the streams nor the archive.
    """
    from stability import postmortem

    client = connect(url)
    try:
        run_id = resolve_run_id(client, url, run_id)
        meta = _meta(client, run_id)
        records: dict[tuple[int, int], StepRecord] = {}
        directory = archive_dir(meta, run_id)
        if directory is not None:
            try:
                for record in postmortem.load_archive(directory):
                    records.setdefault((record.rank, record.step), record)
            except SourceError as exc:
                logger.info("%s: archive not used (%s)", run_id, exc)
        from_archive = len(records)
        for record in stream_records(client, run_id):
            records.setdefault((record.rank, record.step), record)
        status = runstate.read_status(client, run_id)
    finally:
        client.close()
    if not records:
        where = f"archive {directory}" if directory is not None else "no archive on this host"
        raise SourceError(f"run {run_id!r} in Redis at {redact(url)}: no records (streams empty, {where})")
    logger.info("%s: %d records (%d from the archive)", run_id, len(records), from_archive)
    if meta.get("run_dir") and Path(meta["run_dir"]).is_dir():
        meta = {**postmortem.load_run_meta(meta["run_dir"]), **meta}
    meta = {k: v for k, v in meta.items() if not k.startswith("ended:")}
    if status.status:
        meta["status"] = status.describe()
    meta["source"] = f"{redact(url)} run {run_id}"
    return run_id, sorted(records.values(), key=lambda r: (r.rank, r.step)), meta


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRow:
    """One line of ``stability runs``."""

    run_id: str
    status: str
    """``running``, ``finished at step N``, ``died at step N (reason)``; for runs without a recorded status:
    ``finished`` once drained, else ``running?``."""
    ranks: int
    last_step: int | None
    age_s: float | None
    """Seconds since the last record reached Redis (or since the run started when it has none)."""
    incidents: int
    """Distinct (rank, kind, onset) warning/error findings that have not recovered (no ``end``)."""
    worst: str
    """Worst severity among all findings (``""``: none)."""
    run_dir: str


def list_runs(url: str) -> list[RunRow]:
    """A :class:`RunRow` per run in the Redis at ``url``, most recently active first.

    Raises:
        SourceError: unreachable Redis or failed authentication.
    """
    client = connect(url)
    try:
        rows = [_row(client, run_id) for run_id in run_ids(client)]
    except redis.RedisError as exc:
        raise SourceError(f"Redis at {redact(url)}: {_scrub(str(exc), url)}") from None
    finally:
        client.close()
    return sorted(rows, key=lambda r: (r.age_s is None, r.age_s if r.age_s is not None else 0.0, r.run_id))


def _row(client: redis.Redis[bytes], run_id: str) -> RunRow:
    meta = _meta(client, run_id)
    ids = runstate.last_ids(client, run_id)
    status = runstate.read_status(client, run_id)
    if status.status:
        text = status.describe()
    else:
        text = "finished" if "drained" in meta else "running?"
    last_ms = max((ms for ms, _ in ids.values()), default=None)
    started = _float(meta.get("started"))
    now = time.time()
    age = now - last_ms / 1000 if last_ms is not None else (now - started if started is not None else None)
    incidents, worst = _incidents(client, run_id)
    return RunRow(run_id=run_id, status=text, ranks=len(_ranks(client, run_id)),
                  last_step=max((step for _, step in ids.values()), default=None), age_s=age,
                  incidents=incidents, worst=worst, run_dir=meta.get("run_dir", ""))


_ORDER = ("info", "warning", "error")


def _incidents(client: redis.Redis[bytes], run_id: str) -> tuple[int, str]:
    entries: Any = client.xrange(keys.findings(run_id), count=FINDINGS_READ_MAX)
    open_: set[tuple[Any, Any, Any]] = set()
    worst = ""
    for _id, fields in entries:
        try:
            data = json.loads(fields.get(b"f", b"{}"))
        except ValueError:
            continue
        severity = str(data.get("severity", ""))
        if severity in _ORDER and (not worst or _ORDER.index(severity) > _ORDER.index(worst)):
            worst = severity
        if severity in ("warning", "error") and data.get("end") is None:
            open_.add((data.get("rank"), data.get("kind"), data.get("onset")))
    return len(open_), worst


def format_table(rows: list[RunRow]) -> str:
    """The runs as an aligned text table."""
    header = ("RUN", "STATUS", "RANKS", "LAST STEP", "AGE", "INCIDENTS", "RUN DIR")
    lines = [header]
    for r in rows:
        incidents = f"{r.incidents} open" + (f", worst {r.worst}" if r.worst else "")
        lines.append((r.run_id, r.status, str(r.ranks), "-" if r.last_step is None else str(r.last_step),
                      _age(r.age_s), incidents, r.run_dir or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
