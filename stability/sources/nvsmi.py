"""``nvidia-smi -q`` dumps next to a training log (``stability postmortem --system-log``) as system events.

A dump is one ``==============NVSMI LOG==============`` block per call (a file may hold several, e.g. from a cron
job): a ``Timestamp`` line, then one indented block per GPU (``GPU 00000000:07:00.0``). Read per GPU:

* ``ECC Errors`` / ``Volatile``: uncorrectable errors since the driver loaded (``SRAM Uncorrectable`` /
  ``DRAM Uncorrectable`` on Ampere and later, ``Double Bit`` / ``Total`` before) -> ``ecc`` (value = the count).
  ``Aggregate`` (lifetime) counts alone are history, not this run's fault, and give no event;
* ``Retired Pages`` ``Pending Page Blacklist: Yes`` (a page waits for retirement: reset needed) -> ``ecc``;
* ``Remapped Rows`` ``Pending: Yes`` or ``Remapping Failure Occurred: Yes`` -> ``ecc``;
* ``Clocks Event Reasons`` (``Clocks Throttle Reasons`` before R535) ``HW Slowdown``, ``HW Thermal Slowdown``,
  ``HW Power Brake Slowdown`` or ``SW Thermal Slowdown`` ``Active`` -> ``gpu_throttle`` (the GPU slowed itself:
  overheating, power brake); idle, power cap and application clocks are routine and ignored.

Each event names the GPU (minor number and PCI bus id); the timestamp (read as UTC, like the other logs) places it
on the run's timeline. ``ecc`` feeds the ``hardware_error`` finding (``hardware_fault``), ``gpu_throttle`` too at
warning severity (:mod:`stability.sources.analysis`).
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from stability.errors import SourceError
from stability.sources._model import LogEvent

__all__ = ["is_nvsmi", "parse_nvsmi", "read_nvsmi"]

_HEADER = "NVSMI LOG"
_GPU = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_THROTTLE_SECTIONS = ("Clocks Event Reasons", "Clocks Throttle Reasons")
_HW_THROTTLES = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW Thermal Slowdown")


def is_nvsmi(lines: Iterable[str]) -> bool:
    """The first lines of a file are an ``nvidia-smi -q`` dump."""
    return any(_HEADER in line for line in lines)


@dataclass(slots=True)
class _Gpu:
    bus: str
    line: int
    stamp: float | None
    minor: str = "?"
    volatile_ue: int = 0
    ue_names: list[str] = field(default_factory=list)
    pending_retire: bool = False
    retired_dbe: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    remapped_ue: int = 0
    throttles: list[str] = field(default_factory=list)


def _count(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0  # N/A


def parse_nvsmi(lines: Iterable[str], source: str) -> list[LogEvent]:
    """The events of ``nvidia-smi -q`` text (see the module docstring); ``source`` names the file."""
    gpus: list[_Gpu] = []
    stamp: float | None = None
    gpu: _Gpu | None = None
    path: list[tuple[int, str]] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\n")
        text = line.strip()
        if not text:
            continue
        if _HEADER in text:
            gpu, stamp, path = None, None, []
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, sep, value = (part.strip() for part in text.partition(":"))
        if indent == 0:
            match = _GPU.match(text)
            if match:
                gpu, path = _Gpu(bus=match.group(1), line=number, stamp=stamp), []
                gpus.append(gpu)
            elif key == "Timestamp" and sep:
                stamp = _stamp(value)
            continue
        if gpu is None:
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        if not value:
            path.append((indent, key))
        else:
            _read(gpu, [name for _, name in path], key, value)
    return [event for g in gpus for event in _gpu_events(g, source)]


def _read(gpu: _Gpu, where: list[str], key: str, value: str) -> None:
    if not where and key == "Minor Number":
        gpu.minor = value
    elif where[:2] == ["ECC Errors", "Volatile"]:
        # Ampere+: "DRAM Uncorrectable : 2"; before: "Double Bit" / "Total : 2"
        uncorrectable = "Uncorrectable" in key or (len(where) >= 3 and where[2] == "Double Bit" and key == "Total")
        if uncorrectable and _count(value) > 0:
            gpu.volatile_ue += _count(value)
            gpu.ue_names.append(key if key != "Total" else "Double Bit")
    elif where[:1] == ["Retired Pages"]:
        if key == "Pending Page Blacklist" or key == "Pending Page Retirement":
            gpu.pending_retire = value == "Yes"
        elif key.startswith("Double Bit"):
            gpu.retired_dbe = _count(value.split()[0]) if value.split() else 0
    elif where[:1] == ["Remapped Rows"] and len(where) == 1:
        if key == "Pending":
            gpu.remap_pending = value == "Yes"
        elif key == "Remapping Failure Occurred":
            gpu.remap_failed = value == "Yes"
        elif key == "Uncorrectable Error":
            gpu.remapped_ue = _count(value)
    elif where[:1] and where[0] in _THROTTLE_SECTIONS and key in _HW_THROTTLES and value == "Active":
        gpu.throttles.append(key)


def _gpu_events(gpu: _Gpu, source: str) -> list[LogEvent]:
    stamp = gpu.stamp
    name = f"nvidia-smi: GPU {gpu.minor} ({gpu.bus})"
    where = f"{source}:{gpu.line}"
    out = []
    if gpu.volatile_ue:
        out.append(LogEvent(kind="ecc", source=where, wall_time=stamp, value=float(gpu.volatile_ue),
                            message=f"{name}: {gpu.volatile_ue} volatile uncorrectable ECC errors "
                                    f"({', '.join(gpu.ue_names)})"))
    if gpu.pending_retire:
        out.append(LogEvent(kind="ecc", source=where, wall_time=stamp, value=float(gpu.retired_dbe),
                            message=f"{name}: retired pages pending ({gpu.retired_dbe} double-bit ECC pages); "
                                    f"reset the GPU"))
    if gpu.remap_pending or gpu.remap_failed:
        what = "row remapping failed" if gpu.remap_failed else "row remapping pending (reset the GPU)"
        out.append(LogEvent(kind="ecc", source=where, wall_time=stamp, value=float(gpu.remapped_ue),
                            message=f"{name}: {what}; {gpu.remapped_ue} rows remapped for uncorrectable errors"))
    if gpu.throttles:
        out.append(LogEvent(kind="gpu_throttle", source=where, wall_time=stamp, value=float(len(gpu.throttles)),
                            message=f"{name}: clocks slowed by {', '.join(gpu.throttles)}"))
    return out


def _stamp(value: str) -> float | None:
    """``Mon May 13 11:01:30 2024`` (nvidia-smi's ctime) as Unix time, UTC assumed."""
    try:
        return float(calendar.timegm(time.strptime(value, "%a %b %d %H:%M:%S %Y")))
    except ValueError:
        return None


def read_nvsmi(path: Path) -> list[LogEvent]:
    """:func:`parse_nvsmi` of a file.

    Raises:
        SourceError: unreadable.
    """
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return parse_nvsmi(handle, str(path))
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None
