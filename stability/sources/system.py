"""System-log lines (dmesg, journal, NCCL watchdog) as :class:`~stability.sources.LogEvent` kinds.

Recognised (anywhere: in a kernel log next to the training log or inside the training log itself):

* ``NVRM: Xid (PCI:0000:3b:00): 79, ...`` -> ``xid`` (value = the Xid code; 48, 63, 64, 92, 94, 95 are ECC/row
  remapping events and also count as ``ecc``);
* ``uncorrectable ECC`` / ``double bit error`` / ``DBE`` / ``Machine Check`` memory errors -> ``ecc``;
* ``INFO: task python:1234 blocked for more than 120 seconds.`` -> ``hung_task`` (value = seconds);
* ``Out of memory: Killed process`` / ``invoked oom-killer`` / ``oom-kill:`` -> ``oom``;
* ``Watchdog caught collective operation timeout ... ran for N milliseconds`` -> ``nccl_timeout`` (rank from
  ``[Rank N]``; value = seconds);
* ``NCCL error`` / ``ncclSystemError`` / ``ncclRemoteError`` / ``Some NCCL operations have failed or timed out``
  -> ``nccl_error``.

Dates: ISO (``2023-06-07 22:16:00,018``, ``2024-01-02T03:04:05``) and syslog (``Dec 03 10:00:00 host kernel:``,
year taken from ``year``) and PyTorch's C++ glog (``[rank3]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607]``,
same) prefixes give ``wall_time``; dmesg's seconds-since-boot do not.
"""

from __future__ import annotations

import calendar
import re
import time

__all__ = ["ECC_XIDS", "classify", "line_year", "parse_time"]

ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95})
"""Xid codes that report memory (ECC / row-remapping) errors."""

_XID = re.compile(r"\bXid\b\s*(?:\([^)]*\))?:?\s*(\d+)")
_ECC = re.compile(r"uncorrectable (?:ECC|memory)|double bit error|\bDBE\b|Machine Check Event|EDAC .*\bUE\b",
                  re.IGNORECASE)
_HUNG = re.compile(r"blocked for more than (\d+) seconds")
_OOM = re.compile(r"Out of memory: Kill(?:ed)? process|invoked oom-killer|\boom-kill:|oom_reaper: reaped")
_NCCL_TIMEOUT = re.compile(r"(?:Watchdog caught collective operation timeout|collective operation timeout)"
                           r"(?:.*?ran for (\d+) milliseconds)?")
_NCCL_ERROR = re.compile(r"NCCL error|ncclSystemError|ncclRemoteError|ncclInternalError|ncclUnhandledCudaError|"
                         r"Some NCCL operations have failed or timed out|NCCL communicator was aborted")
_RANK = re.compile(r"\[(?:Rank|rank)\s*(\d+)\]|\brank\s*[:=]?\s*(\d+)\b")

_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?")
_SYSLOG = re.compile(r"^(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\s+(\d{1,2})\s+(\d\d):(\d\d):(\d\d)\s+(\S+)")
_GLOG = re.compile(r"(?:^|[\[\s])[IWEF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)\s")
"""glog / c10 prefix of PyTorch's C++ log lines (``[E1204 14:40:32.295000 12040 file.cpp:632]``; recent versions
``[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607]``: month not zero-padded, no thread id): no year."""
_CLOCK = re.compile(r"\d\d:\d\d:\d\d")
"""The clock time that an ISO (within 64 characters) or glog (within 80) date prefix holds."""
_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}


def parse_time(line: str, year: int | None = None) -> tuple[float | None, str]:
    """``(unix time or None, host or "")`` of a line's date prefix (UTC assumed; syslog lines name the host)."""
    if _CLOCK.search(line, 0, 80) is None:  # no ISO or glog time in reach (most log lines): one search, not two
        match = _SYSLOG.match(line)
        if match is None:
            return None, ""
    match = _ISO.search(line, 0, 64)
    if match:
        y, mo, d, h, mi, s = (int(g) for g in match.groups()[:6])
        frac = float(f"0.{match.group(7)}") if match.group(7) else 0.0
        return calendar.timegm((y, mo, d, h, mi, s)) + frac, ""
    match = _SYSLOG.match(line)
    if match:
        mon, day, hh, mm, ss, host = match.groups()
        y = year if year is not None else time.gmtime().tm_year
        return float(calendar.timegm((y, _MONTHS[mon], int(day), int(hh), int(mm), int(ss)))), host
    match = _GLOG.search(line, 0, 80)
    if match:
        mo, d, h, mi, s = (int(g) for g in match.groups()[:5])
        if 1 <= mo <= 12 and 1 <= d <= 31:
            y = year if year is not None else time.gmtime().tm_year
            return calendar.timegm((y, mo, d, h, mi, s)) + float(f"0.{match.group(6)}"), ""
    return None, ""


def line_year(line: str) -> int | None:
    """The year of a line's ISO date prefix (None without one): the year of the log's glog / syslog dates."""
    match = _ISO.search(line, 0, 64)
    return int(match.group(1)) if match else None


def classify(line: str) -> tuple[str, float | None, int | None] | None:
    """``(event kind, value, rank)`` of a system-log line, or None when it is not one (see the module docstring)."""
    if "Xid" in line:
        match = _XID.search(line)
        if match:
            return "xid", float(match.group(1)), None
    if "blocked for more than" in line:
        match = _HUNG.search(line)
        if match:
            return "hung_task", float(match.group(1)), None
    if "oom" in line or "Out of memory" in line:
        if _OOM.search(line):
            return "oom", None, None
    if "ollective" in line and "timeout" in line:
        match = _NCCL_TIMEOUT.search(line)
        if match:
            seconds = float(match.group(1)) / 1000.0 if match.group(1) else None
            return "nccl_timeout", seconds, _rank(line)
    if "NCCL" in line or "nccl" in line:
        if _NCCL_ERROR.search(line):
            return "nccl_error", None, _rank(line)
    if _ECC.search(line):
        return "ecc", None, None
    return None


def _rank(line: str) -> int | None:
    match = _RANK.search(line)
    if not match:
        return None
    return int(match.group(1) or match.group(2))
