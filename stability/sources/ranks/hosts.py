"""System logs matched to ranks by host.

A run's hosts (rank -> host) come from the multi-rank logs (:mod:`~stability.sources.ranks.reader`) or the hosts of
its records. A ``--system-log`` file (a kernel log or an ``nvidia-smi -q`` dump, one per node or all in one) names
its host in its syslog lines, else in its file name (:func:`host_from_name`); hosts are compared by their short
name (``node-b.cluster`` is ``node-b``), so an event lands on every rank that ran there (:func:`attribute_hosts`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterable
from dataclasses import replace
from pathlib import Path

from stability.sources._model import LoadedLog, LogEvent
from stability.sources.ranks.hangs import span

_FILE_WORDS = frozenset({"dmesg", "kern", "kernel", "journal", "journalctl", "syslog", "messages", "log", "txt", "out",
                         "nvsmi", "nvidia", "smi", "q"})
"""Words of system-log file names that are not a host."""


def describe_hosts(hosts: dict[int, str]) -> str:
    """``node-a: ranks 0-3; node-b: ranks 4-7`` (the report's metadata)."""
    return "; ".join(f"{host}: rank{'s' if len(r) > 1 else ''} {span(r)}" for host, r in _by_host(hosts).items())


def host_from_name(path: Path, known: Collection[str] = ()) -> str:
    """The host a system-log file belongs to by its name: a known host of the run that the name contains (the
    longest), else the name without words like ``dmesg`` / ``kern`` / ``log``; ``""`` when nothing is left."""
    name = path.name.lower()
    found = sorted((h for h in known if h and _short(h) in name), key=len, reverse=True)
    if found:
        return found[0]
    tokens = [t for t in re.split(r"[._]", path.name) if t and t.lower() not in _FILE_WORDS]
    return tokens[0] if len(tokens) == 1 and re.search(r"[A-Za-z]", tokens[0]) else ""


def add_system_logs(log: LoadedLog, paths: Iterable[str | Path]) -> LoadedLog:
    """``log`` with the events of kernel logs / ``nvidia-smi -q`` dumps (one per node or all in one), matched to
    the ranks of their host (``log.hosts``, and the hosts of its records); syslog dates get the year of the
    records."""
    from stability.sources import load_system_log

    dated = [r.wall_time for r in log.records if r.wall_time > 0]
    year = time.gmtime(max(dated)).tm_year if dated else None
    hosts = {**{r.rank: r.host for r in log.records if r.host}, **log.hosts}
    for path in paths:
        log.events.extend(attribute_hosts(load_system_log(path, year=year, hosts=set(hosts.values())), hosts))
    return log


def attribute_hosts(events: Iterable[LogEvent], hosts: dict[int, str], default_host: str = "") -> list[LogEvent]:
    """System-log events matched to the ranks that ran on their host (``hosts``: rank -> host): ``ranks`` lists
    them and ``rank`` is the first when the line named none; ``default_host`` is given to events with no host."""
    by_host = _by_host(hosts, short=True)
    out = []
    for event in events:
        host = event.host or default_host
        mine = sorted(by_host.get(_short(host), [])) if host else []
        out.append(replace(event, host=host, rank=event.rank if event.rank is not None else (mine[0] if mine else None),
                           ranks=tuple(mine) or event.ranks))
    return out


def _short(host: str) -> str:
    return host.split(".", 1)[0].lower()


def _by_host(hosts: dict[int, str], *, short: bool = False) -> dict[str, list[int]]:
    """Host (its short name with ``short``) -> its ranks, in the order of ``hosts``."""
    by_host: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        by_host.setdefault(_short(host) if short else host, []).append(rank)
    return by_host
