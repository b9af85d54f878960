"""Alerts in the training terminal: a background reader of the run's findings stream.

:class:`ConsoleReporter` runs on its own daemon thread in local rank 0 of each node (started by
:class:`stability.session.Session`) and prints, on standard error:

* one line when the session starts: ``stability: run <id> -> <run dir> · embedded Redis · local worker · W&B off``;
* one line per warning/error finding as the worker decides it (severity, kind, step, rank/host, top cause,
  remedy, rollback step, batches to skip), de-duplicated by ``(rank, kind, onset)`` and rate-limited (a burst of
  :data:`BURST` lines, then one per :data:`REFILL_S` seconds; suppressed alerts are counted and announced);
* one summary line at the end: counts per severity and where the report is.

Lines are coloured when standard error is a terminal (``rich``, imported on the reporter thread), plain text
otherwise. The reader never touches the training thread: it owns its Redis client, blocks only in ``XREAD`` with
a short timeout, and swallows every error (logged once). ``STABILITY_QUIET=1`` turns it off.

Training-side module: stdlib and redis only at import time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from stability import keys

__all__ = ["BURST", "REFILL_S", "ConsoleReporter", "alert_line", "display_remedy", "summary_line"]

log = logging.getLogger(__name__)

BURST = 5
"""Alert lines printed back to back before the rate limit applies."""
REFILL_S = 6.0
"""Then at most one alert line per this many seconds (suppressed alerts are counted, never silently lost)."""
READ_BLOCK_MS = 200
"""``XREAD`` blocking time: the reader notices a stop request within this long."""
SEVERITIES = ("error", "warning", "info")
_STYLES = {"error": "bold red", "warning": "yellow", "info": "dim", "summary": "bold", "start": "cyan"}
_SKIP_LISTED = "Skip the listed batches"


def display_remedy(remedy: str, skip_batches: list[str] | tuple[str, ...]) -> str:
    """``remedy`` as shown to a person: a remedy that says to skip "the listed batches" when no batch id was recorded
    says instead that none was (and how to record them)."""
    if remedy.startswith(_SKIP_LISTED) and not skip_batches:
        return ("Skip the batches of the anomalous steps (no batch ids were recorded: call handle.set_batch(id) "
                "to get a skip list)" + remedy[len(_SKIP_LISTED):])
    return remedy


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def alert_line(finding: Mapping[str, Any], *, label: str | None = None) -> str:
    """The one-line form of a finding (a :meth:`~stability.detectors.base.Finding.to_dict` dict); ``label``
    replaces the upper-cased severity at its start (``UPDATE info``)."""
    where = f"rank {finding.get('rank', 0)}" + (f" on {finding['host']}" if finding.get("host") else "")
    head = label or str(finding.get("severity", "")).upper()
    parts = [f"stability: {head} {finding.get('kind')} at step "
             f"{finding.get('step')} ({where})"]
    causes = finding.get("causes") or []
    if causes:
        top = causes[0]
        parts.append(f"likely {top.get('cause')}: {_short(str(top.get('evidence', '')), 140)}")
        remedy = str(top.get("remedy") or "")
    else:
        remedy = ""
    skip = list(finding.get("skip_batches") or [])
    if remedy:
        parts.append(f"remedy: {_short(display_remedy(remedy, skip), 200)}")
    if finding.get("rollback_step") is not None:
        parts.append(f"rollback to step {finding['rollback_step']}")
    if skip:
        shown = ", ".join(map(str, skip[:5])) + (f" (+{len(skip) - 5})" if len(skip) > 5 else "")
        parts.append(f"skip batches {shown}")
    return " · ".join(parts)


def _first_cause(finding: Mapping[str, Any]) -> str | None:
    causes = finding.get("causes") or []
    return str(causes[0].get("cause")) if causes else None


def summary_line(run_id: str, counts: Mapping[str, int], report: str | None, *, what: str = "incidents",
                 suppressed: int = 0, wandb_url: str | None = None, died: str | None = None) -> str:
    """The end-of-run line: how the run ended (``died``: why the training process is dying, e.g. its uncaught
    exception), counts per severity and the report's location."""
    total = sum(counts.get(s, 0) for s in SEVERITIES)
    counted = ", ".join(f"{counts.get(s, 0)} {s}" for s in SEVERITIES)
    noun = what if total != 1 else what[:-1]
    ended = "done" if died is None else f"died ({_short(died, 160)})"
    line = f"stability: run {run_id} {ended} · {total} {noun} ({counted})"
    if suppressed:
        line += f" · {suppressed} alert lines suppressed by the rate limit"
    line += f" · report {report}" if report else " · no report (see the worker log)"
    if wandb_url:
        line += f" · W&B {wandb_url}"
    return line


class _Printer:
    """Prints lines on ``stream`` (default standard error), coloured through rich when it is a terminal."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._console: Any = None

    def __call__(self, text: str, style: str) -> None:
        if self._console is None:
            import sys

            from rich.console import Console  # imported on the reporter thread, never by the training thread

            self._console = Console(file=self._stream or sys.stderr, highlight=False, soft_wrap=True, emoji=False)
        from rich.text import Text

        self._console.print(Text(text, style=_STYLES.get(style, "")))
        self._console.file.flush()


class ConsoleReporter:
    """Prints the start line, the run's alerts as they arrive, and a summary at :meth:`stop` (see the module).

    Args:
        redis_url: the Redis holding ``keys.findings(run_id)``.
        run_id: the run.
        run_dir: the run directory (named in the lines; the report is expected there).
        start_line: the first line to print (see :func:`start_line`).
        stream: where to print (default: standard error).
        on_line: called with ``(finding dict, monotonic time printed)`` after each alert line (benchmarks, tests).
        burst, refill_s: the rate limit (default :data:`BURST` lines, then one per :data:`REFILL_S` seconds).
    """

    def __init__(self, redis_url: str, run_id: str, run_dir: Path, start_line: str, *, stream: TextIO | None = None,
                 on_line: Callable[[Mapping[str, Any], float], None] | None = None, burst: int = BURST,
                 refill_s: float = REFILL_S) -> None:
        self.redis_url, self.run_id, self.run_dir = redis_url, run_id, run_dir
        self._start_line = start_line
        self._print = _Printer(stream)
        self._on_line = on_line
        self._halt = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = "0-0"
        self._seen: set[tuple[int, str, int]] = set()
        self._printed: dict[tuple[int, str, int], tuple[str, str | None]] = {}
        """Alert lines printed: (rank, kind, onset) -> (severity, first cause), what a revision is compared with."""
        self.counts = {s: 0 for s in SEVERITIES}
        """Findings seen per severity (de-duplicated)."""
        self.suppressed = 0
        """Alert lines not printed because of the rate limit."""
        self._pending_note = 0
        self._burst, self._refill_s = float(burst), refill_s
        self._tokens = float(burst)
        self._refilled = time.monotonic()
        self._logged_error = False
        self._client: Any = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> ConsoleReporter:
        """Remember where the findings stream ends now (older findings of a resumed run are not repeated) and
        start the reader thread. Never raises."""
        try:
            from stability.redis_url import connect  # plain or Redis Cluster client

            self._client = connect(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            newest = self._client.xrevrange(keys.findings(self.run_id), count=1)
            if newest:
                self._last = _text(newest[0][0])
        except Exception as exc:
            self._log_once(exc)
        self._thread = threading.Thread(target=self._run, name="stability-console", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, final: bool = True, drained: bool = True, timeout: float = 10.0, offline: bool = False,
             died: str | None = None) -> None:
        """Read what is left of the stream, print the summary line (``final``), stop the thread. Never raises.

        ``drained``: the worker has finished the run (its report exists); False with an external worker that may
        still be catching up (the summary then says where the report will be). ``offline``: Redis is not answering
        (the exit spooled records): read nothing more, summarise what was read. ``died``: the training process is
        dying (the reason: its uncaught exception, a signal), which the summary line says instead of "done"."""
        self._halt.set()
        if self._thread is not None:  # offline: it may be blocked on a hung Redis for its socket timeout
            self._thread.join(min(timeout, 0.1) if offline else timeout)
        try:
            if offline:
                self._client, client = None, self._client
                if client is not None:
                    client.close()
            self._read(block_ms=None)
            if final:
                self._summary(drained, died)
        except Exception as exc:
            self._log_once(exc)
        finally:
            if self._client is not None:
                self._client.close()
            self._done.set()

    # -- thread ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        self._safe_print(self._start_line, "start")
        while not self._halt.is_set():
            try:
                if self._client is None:
                    raise ConnectionError("no Redis client")
                self._read(block_ms=READ_BLOCK_MS)
            except Exception as exc:
                self._log_once(exc)
                self._halt.wait(1.0)

    def _read(self, block_ms: int | None) -> None:
        """Handle new findings; ``block_ms`` None reads until the stream is exhausted without waiting."""
        while self._client is not None:
            reply = self._client.xread({keys.findings(self.run_id): self._last}, block=block_ms, count=100)
            entries = [e for _stream, batch in (reply or []) for e in batch]
            for entry_id, fields in entries:
                self._last = _text(entry_id)
                raw = fields.get(b"f") if isinstance(fields, dict) else None
                if raw is not None:
                    self._handle(json.loads(raw), time.monotonic())
            if block_ms is not None or not entries:
                return

    def _handle(self, finding: Mapping[str, Any], now: float) -> None:
        severity = str(finding.get("severity", "info"))
        key = (int(finding.get("rank", 0)), str(finding.get("kind")), int(finding.get("onset", finding.get("step", 0))))
        if (finding.get("evidence") or {}).get("revised"):
            self._revision(key, finding, severity)
            return
        if key in self._seen:
            return
        self._seen.add(key)
        self.counts[severity] = self.counts.get(severity, 0) + 1
        if severity not in ("warning", "error"):
            return
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) / self._refill_s)
        self._refilled = now
        if self._tokens < 1.0:
            self.suppressed += 1
            self._pending_note += 1
            return
        self._tokens -= 1.0
        line = alert_line(finding)
        if self._pending_note:
            line += f" · ({self._pending_note} more alerts suppressed; all are in the report)"
            self._pending_note = 0
        self._safe_print(line, severity)
        self._printed[key] = (severity, _first_cause(finding))
        if self._on_line is not None:
            self._on_line(finding, time.monotonic())

    def _revision(self, key: tuple[int, str, int], finding: Mapping[str, Any], severity: str) -> None:
        """A printed alert whose diagnosis changed (the engine's revision): one UPDATE line saying what it is now;
        not counted again, and nothing for alerts that were not printed."""
        printed = self._printed.get(key)
        cause = _first_cause(finding)
        if printed is None or printed == (severity, cause):
            return
        self._printed[key] = (severity, cause)
        if printed[0] != severity:
            self.counts[printed[0]] = max(0, self.counts.get(printed[0], 0) - 1)
            self.counts[severity] = self.counts.get(severity, 0) + 1
        was = f"was {printed[0]}" if printed[1] == cause else f"was likely {printed[1]}"
        signed = (finding.get("evidence") or {}).get("signed_loss")
        if signed is not None:
            was = f"the loss turned negative at step {int(signed)}: a signed objective, not judged; {was}"
        line = alert_line(finding, label=f"UPDATE {severity}")
        self._safe_print(f"{line} · ({was})", severity if severity != "info" else "warning")

    def _summary(self, drained: bool, died: str | None = None) -> None:
        report: str | None = None
        wandb_url: str | None = None
        counts: Mapping[str, int] = self.counts
        what = "findings"
        if self._client is not None:
            meta = {_text(k): _text(v) for k, v in (self._client.hgetall(keys.meta(self.run_id)) or {}).items()}
            wandb_url = meta.get("wandb_url")
            if meta.get("report") and Path(meta["report"]).exists():
                report = meta["report"]
                incidents = _counts_of(meta.get("findings"))
                if incidents is not None:
                    counts, what = incidents, "incidents"
        if report is None and (self.run_dir / "report.html").exists():
            report = str(self.run_dir / "report.html")
        if report is None and not drained:
            report = f"{self.run_dir / 'report.html'} (written by the worker once it has drained the run)"
        self._safe_print(summary_line(self.run_id, counts, report, what=what, suppressed=self.suppressed,
                                      wandb_url=wandb_url, died=died), "summary")

    # -- helpers ---------------------------------------------------------------------------------------------

    def _safe_print(self, text: str, style: str) -> None:
        try:
            self._print(text, style)
        except Exception as exc:  # a closed or broken stream must not kill the reader
            self._log_once(exc)

    def _log_once(self, exc: BaseException) -> None:
        level = logging.DEBUG if self._logged_error else logging.WARNING
        self._logged_error = True
        log.log(level, "stability: console alerts: %s: %s", type(exc).__name__, exc)


def _counts_of(path: str | None) -> dict[str, int] | None:
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return {s: int(data["counts"][s]) for s in SEVERITIES}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
