"""Multi-rank logs: per-rank files, or one file whose lines carry rank / host prefixes, read as one multi-rank run.

Layouts (a directory is searched by :func:`discover`; several files or one prefixed file go to :func:`load_ranked`):

* **torchrun** ``--log-dir D --redirects 3`` (or ``--tee 3``): ``D/<rdzv_run_id>_<random>/attempt_<k>/<local_rank>/
  stdout.log`` and ``stderr.log`` (PyTorch's ``DefaultLogsSpecs``; each node's agent makes its own
  ``<rdzv_run_id>_<random>`` directory, so one such directory is one node; ``attempt_<k>`` is the k-th restart of
  the worker group: a new segment; ``filtered_*.log`` copies are skipped). ``--local-ranks-filter`` only filters
  what is copied to the console: the files hold every local rank, a console capture only the filtered ones.
* **one combined console file**: torchrun ``--tee`` prefixes ``[default3]:`` (``[${role_name}${local_rank}]:``: a
  local rank); PyTorch >= 2.2 prefixes worker exceptions and C++ log lines with ``[rank3]:`` (the global rank), a
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` of ``[${rank}]:`` gives ``[3]:`` (global); ``srun --label`` prefixes
  ``3: `` (the task id) and pdsh / clush ``host-12: `` (the host), the latter two when >= 90 % of the lines have one.
  Prefixes nest (``0: [default3]:[rank3]: ...``).
* **per-task files**: ``rank3.log`` / ``task-3.out``, SLURM ``--output`` patterns with ``%t`` and ``%N``
  (``slurm-<job>-<task>.out``, ``log.<node>.<task>``): the number is the global rank, the varying name part the
  host; files named by host only (``node-b.log``) are one node each.

Rank assumptions (stated because only some logs say):

* ``[rankN]:``, ``[N]:``, a task id of srun without a torchrun prefix under it, a per-task file number: global ranks.
* ``[roleN]:`` and torchrun's ``<local_rank>/`` directories are local ranks: global = the node's first rank + local.
  A node's first rank is read where a line names both (``[default1]:[rank5]:``, torchrun's failure summary
  ``rank : 5 (local_rank: 1)``), else taken as node index x local world size, with the local world size = the
  highest local rank seen + 1 (the same on every node) and the node index = the srun task id when srun starts one
  torchrun per node (``0: [default3]: ...``), else the nodes' names in natural order (noted: torchrun's directory
  names are random, so that order is a guess unless a line names a global rank).
* A line with no rank prefix belongs to the first rank of its node (rank 0 on one node: what most frameworks
  print from rank 0).

Hosts come from the host prefix or file name, NCCL's ``host:pid:tid [dev] NCCL INFO`` lines, torchrun's failure
summary (``host : node-b``) and the DeepSpeed launcher's ``global_rank_mapping=...{'node-a': [0, 1], ...}``. Every
rank's last line is kept (its time, the step the run was at, the text): a rank whose log stops while the other ranks
report NCCL watchdog timeouts, or while they log further steps, is a ``rank_stopped`` event (:func:`stopped_ranks`),
read by :mod:`stability.sources.analysis` as the ``hang`` finding.
"""

from __future__ import annotations

import bisect
import itertools
import re
import statistics
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from stability.errors import SourceError
from stability.records import StepRecord
from stability.sources import system
from stability.sources._model import LoadedLog, LogEvent, Segment
from stability.sources.textlog import TextLogParser

__all__ = ["RankFile", "add_system_logs", "attribute_hosts", "describe_hosts", "discover", "discover_files", "head",
           "host_from_name", "load_ranked", "prefixed", "span", "split_prefixes", "stopped_ranks", "stripped_lines",
           "system_files"]

_TORCH = re.compile(r"^\[([A-Za-z_][A-Za-z_\-]*)?(\d+)\]:[ ]?")
_DS_MAPPING = re.compile(r"'([^']+)':\s*\[([\d,\s]*)\]")
_SYSLOG_LINE = re.compile(r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+[+\-Z][\d:]*) \S+ \S+")
_DMESG_LINE = re.compile(r"^\[\s*\d+\.\d+\] ")
_MID_RANK = re.compile(r"\[rank\d+\]:\[")
_LABEL = re.compile(r"^\s*(\d+): ")
_HOST = re.compile(r"^([A-Za-z][\w.\-]*): ")
_NCCL_HOST = re.compile(r"^\s*([A-Za-z][\w.\-]*):\d+:\d+ \[\d+\] NCCL (?:INFO|WARN)")
_SUMMARY_HOST = re.compile(r"^\s*host\s*:\s*(\S+)\s*$")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_WATCHDOG_WORK = re.compile(r"SeqNum=(\d+),\s*OpType=(\w+)")
_SCALER_KINDS = frozenset({"overflow", "scale_minimum"})
_OUTER_SHARE = 0.9
"""Share of a file's lines that must carry an ``srun --label`` / host prefix for it to be read as one."""
_NOT_HOSTS = frozenset({"INFO", "WARNING", "WARN", "ERROR", "DEBUG", "CRITICAL", "FATAL", "NOTICE", "Warning",
                        "Error", "Info"})
"""Line starts that look like a pdsh host prefix but are log levels."""
_LOG_SUFFIXES = frozenset({".log", ".out", ".err", ".txt", ""})
_NAME_RANK = re.compile(r"(?:^|[._\-])(?:rank|task|proc)[._\-]?(\d+)(?:\D|$)", re.IGNORECASE)
_NAME_TASK = re.compile(r"[._\-](\d+)$")
_NAME_WORDS = frozenset({"log", "logs", "out", "err", "stdout", "stderr", "slurm", "train", "training", "job",
                         "output", "txt", "run"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFile:
    """A log file and what its path says about whose it is."""

    path: Path
    node: str = ""
    """Node key: a host, a torchrun node directory or ``""`` (one node, or unknown)."""
    local: int | None = None
    rank: int | None = None
    host: str = ""
    attempt: int = 0


def split_prefixes(line: str, outer: str = "") -> tuple[str | None, int | None, int | None, str]:
    """``(outer value, local rank, global rank, rest)`` of one line: ``outer`` (``label`` / ``host`` / ``""``) says
    whether the file's lines start with an srun task id or a host; then torchrun prefixes (see the module
    docstring)."""
    value: str | None = None
    if outer:
        match = (_LABEL if outer == "label" else _HOST).match(line)
        if match:
            value, line = match.group(1), line[match.end():]
    local = rank = None
    if not line.startswith("[") and "]:[" in line:  # a C++ log line right after a progress bar (no newline)
        inner = _MID_RANK.search(line)
        if inner:
            line = line[inner.start():]
    while line.startswith("["):
        match = _TORCH.match(line)
        if not match:
            break
        role, number = match.group(1), int(match.group(2))
        if role is None or role.lower() == "rank":
            rank = number
        else:
            local = number
        line = line[match.end():]
    return value, local, rank, line


def _outer_mode(lines: Sequence[str]) -> str:
    body = [line for line in lines if line.strip()]
    if not body:
        return ""
    for mode, pattern in (("label", _LABEL), ("host", _HOST)):
        found = [m.group(1) for m in map(pattern.match, body) if m]
        if len(found) >= _OUTER_SHARE * len(body) and not (mode == "host" and set(found) <= _NOT_HOSTS):
            return mode
    return ""


def head(path: Path, limit: int = 2000) -> list[str]:
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return [line.rstrip("\r\n") for _, line in zip(range(limit), handle, strict=False)]
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None


def prefixed(lines: Sequence[str]) -> bool:
    """Whether a file's first lines carry rank or host prefixes (then it is read by :func:`load_ranked`)."""
    if _outer_mode(lines):
        return True
    return any(_TORCH.match(line) for line in lines)


def stripped_lines(lines: Sequence[str]) -> list[str]:
    """``lines`` without their rank / host prefixes (for sniffing the format under them)."""
    outer = _outer_mode(lines)
    return [split_prefixes(line, outer)[3] for line in lines]


# -- discovery ----------------------------------------------------------------------------------------------------

def discover(directory: Path) -> list[RankFile]:
    """The per-rank log files of ``directory`` (torchrun ``--log-dir``, per-task or per-host files); empty when it
    holds none of these layouts."""
    torchrun = [p for name in ("stdout.log", "stderr.log") for p in directory.rglob(f"attempt_*/*/{name}")]
    if any(_torchrun_file(p) for p in torchrun):
        return discover_files([p for p in torchrun if _torchrun_file(p)])
    files = [p for p in directory.iterdir() if p.is_file() and _is_log_name(p)]
    return discover_files([p for p in files if not _kernel_log(p)])


def system_files(directory: Path) -> list[Path]:
    """Kernel logs (every line a syslog / dmesg line) and ``nvidia-smi -q`` dumps lying among the per-rank logs of
    ``directory``: read as ``--system-log`` files."""
    return sorted(p for p in directory.iterdir() if p.is_file() and (_is_log_name(p) or p.suffix == ".dmesg")
                  and _kernel_log(p))


def _kernel_log(path: Path) -> bool:
    from stability.sources.nvsmi import is_nvsmi

    lines = [line for line in head(path, 200) if line.strip()]
    if not lines:
        return False
    return is_nvsmi(lines[:20]) or all(_SYSLOG_LINE.match(line) or _DMESG_LINE.match(line) for line in lines)


def discover_files(files: Sequence[Path]) -> list[RankFile]:
    """What the paths of these files of one run say about their ranks and nodes (see the module docstring)."""
    torchrun = sorted(p for p in files if _torchrun_file(p))
    if torchrun:
        nodes = {p.parent.parent.parent for p in torchrun}
        multi = len(nodes) > 1
        return [RankFile(path=p, node=p.parent.parent.parent.name if multi else "", local=int(p.parent.name),
                         attempt=int(p.parent.parent.name[8:])) for p in torchrun]
    ordered = sorted(files, key=lambda p: _natural(p.name))
    if len(ordered) < 2:
        return [RankFile(path=p) for p in ordered]
    return _named(ordered)


def _torchrun_file(path: Path) -> bool:
    attempt = path.parent.parent.name
    return path.name in ("stdout.log", "stderr.log") and path.parent.name.isdigit() \
        and attempt.startswith("attempt_") and attempt[8:].isdigit()


def _is_log_name(path: Path) -> bool:
    suffix = path.suffix.lower()
    return (suffix in _LOG_SUFFIXES or suffix[1:].isdigit()) and not path.name.startswith(".") \
        and ".findings" not in path.name and ".report" not in path.name


def _natural(text: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _named(files: Sequence[Path]) -> list[RankFile]:
    """Ranks and hosts from the file names (see the module docstring)."""
    stems = [p.name[: -len(p.suffix)] if p.suffix.lower() in (".log", ".out", ".err", ".txt") else p.name
             for p in files]
    ranks: list[int | None] = []
    rests: list[str] = []
    for stem in stems:
        match = _NAME_RANK.search(stem) or _NAME_TASK.search(stem)
        ranks.append(int(match.group(1)) if match else None)
        rests.append(stem[: match.start()] + stem[match.end():] if match else stem)
    token_sets = [[t for t in re.split(r"[._]", rest) if t] for rest in rests]
    varying = {t for tokens in token_sets for t in tokens} - set.intersection(*(set(t) for t in token_sets))
    hosts = [next((t for t in tokens if t in varying and re.search(r"[A-Za-z]", t) and t.lower() not in _NAME_WORDS),
                  "") for tokens in token_sets]
    if any(r is None for r in ranks) or len(set(ranks)) < 2:
        ranks = [None] * len(files)  # no varying number on every file: ranks come from the lines (or node order)
    if all(r is None for r in ranks) and not all(hosts):
        hosts = [p.name for p in files]
    return [RankFile(path=p, node=h if r is None else "", rank=r, host=h)
            for p, h, r in zip(files, hosts, ranks, strict=True)]


# -- reading --------------------------------------------------------------------------------------------------------

@dataclass
class _Stream:
    node: str
    local: int | None
    rank: int | None
    host: str
    parser: TextLogParser
    last_wall: float | None = None
    first_wall: float | None = None
    dated: int = 0
    last_step: int | None = None
    steps: int = 0
    gap: int = 0
    """Largest step gap seen so far between two of its lines (how sparsely this rank prints)."""
    """Distinct steps the run was at when this stream printed (a rank that printed only at start-up has 1)."""
    last_line: str = ""
    last_source: str = ""
    event_steps: dict[int, int] = field(default_factory=dict)


@dataclass
class _Reader:
    run_id: str
    year: int | None
    ordered: bool
    """One combined file: line order is time order, the run's step at any line is the newest step logged."""
    streams: dict[tuple[str, str, int], _Stream] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    node_hosts: dict[str, str] = field(default_factory=dict)
    rank_hosts: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run_step: int | None = None
    _summary_host: dict[str, str] = field(default_factory=dict)

    def stream(self, node: str, local: int | None, rank: int | None, host: str, source: str) -> _Stream:
        if local is not None:
            key = (node, "L", local)
        elif rank is not None:
            key = (node, "G", rank)
        else:
            key = (node, "U", 0)
        found = self.streams.get(key)
        if found is None:
            guess = rank if rank is not None else (local or 0) + self.offsets.get(node, 0)
            parser = TextLogParser(run_id=self.run_id, source=source, host=host, rank=guess, year=self.year)
            found = self.streams[key] = _Stream(node, local, rank, host, parser)
        if rank is not None:
            found.rank = found.rank if found.rank is not None else rank
            if local is not None:
                self.offsets.setdefault(node, rank - local)
        if host and not found.host:
            found.host = found.parser.host = host
        return found

    def read(self, spec: RankFile) -> None:
        outer = _outer_mode(head(spec.path))
        label_is_node = outer == "label" and self._label_is_node(spec.path)
        seen_attempt: set[int] = set()
        with spec.path.open(encoding="utf-8", errors="replace") as handle:
            for number, raw in enumerate(handle, start=1):
                value, local, rank, rest = split_prefixes(raw.rstrip("\r\n"), outer)
                node, host = spec.node, spec.host
                if outer == "host" and value is not None:
                    node = host = value
                elif outer == "label" and value is not None:
                    if label_is_node:
                        node = value
                    elif rank is None:
                        rank = int(value)
                local = spec.local if local is None else local
                if rank is None and local is None:
                    rank = spec.rank
                self._line(spec, number, node, local, rank, host, rest, seen_attempt)

    def _label_is_node(self, path: Path) -> bool:
        """srun started one torchrun per node: most labelled lines carry a torchrun local-rank prefix too."""
        lines = [split_prefixes(line, "label") for line in head(path) if line.strip()]
        return sum(1 for _, local, _, _ in lines if local is not None) >= 0.5 * max(1, len(lines))

    def _line(self, spec: RankFile, number: int, node: str, local: int | None, rank: int | None, host: str,
              rest: str, seen_attempt: set[int]) -> None:
        self._context_line(node, rest)
        nccl = _NCCL_HOST.match(rest)
        if nccl and not host:
            host = nccl.group(1)
            if node:  # every rank of the node runs there
                self.node_hosts.setdefault(node, host)
        stream = self.stream(node, local, rank, host, str(spec.path))
        parser = stream.parser
        if spec.attempt and id(stream) not in seen_attempt:
            seen_attempt.add(id(stream))
            parser.builder.banner({"attempt": str(spec.attempt)})  # a restart of the worker group
        parser.source = str(spec.path)
        parser._line_no = number - 1  # file:line of the events, in this file
        before = len(parser.events)
        parser.feed(rest)
        own = parser.step
        if own is not None and (self.run_step is None or own > self.run_step):
            self.run_step = own
        at = self.run_step if self.ordered else own
        if at is not None:
            stream.event_steps.update(dict.fromkeys(range(before, len(parser.events)), at))
        if rest.strip():
            self._activity(stream, f"{spec.path.name}:{number}", rest, at)

    def _activity(self, stream: _Stream, where: str, rest: str, at: int | None) -> None:
        """Keep ``stream``'s last line: its date, the step the run was at (``at``), the text."""
        if self.year is None:
            self.year = system.line_year(rest)
            if self.year is not None:  # glog and syslog dates carry no year: take the log's ISO dates'
                for other in self.streams.values():
                    other.parser.year = self.year
        wall, _ = system.parse_time(rest, self.year)
        if wall is not None:
            stream.last_wall = wall
            stream.first_wall = stream.first_wall if stream.first_wall is not None else wall
            stream.dated += 1
        if at is not None and at != stream.last_step:
            stream.steps += 1
            if stream.last_step is not None:
                stream.gap = max(stream.gap, at - stream.last_step)
        stream.last_step = at if at is not None else stream.last_step
        stream.last_line, stream.last_source = rest.strip()[:200], where

    def _context_line(self, node: str, rest: str) -> None:
        """torchrun's failure summary (``host : node-b`` then ``rank : 5 (local_rank: 1)``) and the DeepSpeed
        launcher's ``global_rank_mapping=defaultdict(<class 'list'>, {'node-a': [0, 1], 'node-b': [2, 3]})``."""
        if "global_rank_mapping=" in rest:
            for host, ranks in _DS_MAPPING.findall(rest.split("global_rank_mapping=", 1)[1]):
                for rank in ranks.split(","):
                    if rank.strip().isdigit():
                        self.rank_hosts.setdefault(int(rank), host)
            return
        if ":" not in rest or len(rest) > 120:
            return
        match = _SUMMARY_HOST.match(rest)
        if match:
            self._summary_host[node] = match.group(1)
            return
        match = _SUMMARY_RANK.match(rest)
        if match:
            rank, local = int(match.group(1)), int(match.group(2))
            self.offsets.setdefault(node, rank - local)
            host = self._summary_host.get(node, "")
            if host and host not in ("localhost", "127.0.0.1"):
                self.node_hosts.setdefault(node, host)

    def resolve(self) -> dict[tuple[str, str, int], int]:
        """Stream key -> global rank (see the module docstring)."""
        locals_ = [s.local for s in self.streams.values() if s.local is not None]
        world = max(locals_) + 1 if locals_ else 1
        nodes = sorted({s.node for s in self.streams.values() if s.local is not None}, key=_natural)
        guessed = [n for n in nodes if n not in self.offsets]
        if len(nodes) > 1 and guessed and not all(n.isdigit() for n in nodes):
            self.notes.append(f"global ranks of nodes {', '.join(guessed[:8])} assumed from their order by name "
                              f"x {world} local ranks (no line names a global rank there)")
        taken = {offset // world for offset in self.offsets.values()}
        free = (i for i in range(len(nodes) + len(taken)) if i not in taken)
        first = {n: self.offsets[n] if n in self.offsets else (int(n) if n.isdigit() else next(free)) * world
                 for n in nodes}
        out: dict[tuple[str, str, int], int] = {}
        for key, s in self.streams.items():
            if s.local is not None:
                out[key] = s.rank if s.rank is not None else first.get(s.node, 0) + s.local
            elif s.rank is not None:
                out[key] = s.rank
        for key, s in self.streams.items():
            out.setdefault(key, first.get(s.node, 0))
        return out


def load_ranked(files: Sequence[RankFile | Path], *, run_id: str, year: int | None = None) -> LoadedLog:
    """Read per-rank files or prefixed combined files as one multi-rank run (see the module docstring).

    Raises:
        SourceError: unreadable, or no records nor events in any file.
    """
    specs = [f if isinstance(f, RankFile) else RankFile(path=Path(f)) for f in files]
    if not specs:
        raise SourceError("no log files to read")
    reader = _Reader(run_id=run_id, year=year, ordered=len(specs) == 1)
    for spec in sorted(specs, key=lambda s: (s.attempt, str(s.path))):
        reader.read(spec)
    ranks = reader.resolve()
    hosts: dict[int, str] = {}
    for key, s in reader.streams.items():
        host = s.host or reader.node_hosts.get(s.node, "") or (s.node if s.node and not s.node.isdigit()
                                                              and "_" not in s.node else "")
        if host:
            hosts.setdefault(ranks[key], host)
    for rank, host in reader.rank_hosts.items():
        hosts.setdefault(rank, host)
    hosts = dict(sorted(hosts.items()))
    records, segments = _merge(reader, ranks, hosts)
    events: list[LogEvent] = []
    formats: dict[str, int] = {}
    context: dict[str, str] = {}
    recording = {r.rank for r in records}
    # every data-parallel rank prints DeepSpeed's "OVERFLOW! Rank N" and the minimum-scale message: one rank's (the
    # lowest that logs steps) are the run's
    scaler = min(recording or set(ranks.values()), default=0)
    for key, s in sorted(reader.streams.items(), key=lambda kv: ranks[kv[0]]):
        for fmt, count in s.parser.formats.items():
            formats[fmt] = formats.get(fmt, 0) + count
        for k, v in s.parser.context.items():
            context.setdefault(k, v)
        rank = ranks[key]
        for i, e in enumerate(s.parser.events):
            if e.kind in _SCALER_KINDS and rank != scaler:
                continue
            step = e.step if e.step is not None else s.event_steps.get(i)
            events.append(replace(e, rank=e.rank if e.rank is not None else rank, host=e.host or hosts.get(rank, ""),
                                  step=step))
    events.sort(key=lambda e: (e.wall_time is None, e.wall_time or 0.0, e.step if e.step is not None else -1))
    events += stopped_ranks(reader, ranks, hosts, records, events, context)
    kinds = sorted(formats, key=lambda k: -formats[k])
    notes = list(reader.notes)
    for s in reader.streams.values():
        notes += [n for n in s.parser.notes if n not in notes]
    return LoadedLog(format="+".join(kinds) or "text", records=records, segments=segments, events=events,
                     context=context, notes=notes, hosts=hosts)


def _merge(reader: _Reader, ranks: dict[tuple[str, str, int], int], hosts: dict[int, str]
           ) -> tuple[list[StepRecord], list[Segment]]:
    """Every stream's records, segment i of the run = segment i of each stream (one per process lifetime)."""
    per_stream: list[tuple[int, list[StepRecord], list[Segment]]] = []
    for key, s in reader.streams.items():
        recs, segs = s.parser.builder.finish()
        rank = ranks[key]
        host = hosts.get(rank, "")
        if recs and (recs[0].rank != rank or recs[0].host != host):
            recs = [replace(r, rank=rank, host=r.host or host) for r in recs]
        per_stream.append((rank, recs, segs))
    per_stream.sort(key=lambda t: t[0])
    records: list[StepRecord] = []
    segments: list[Segment] = []
    for index in range(max((len(segs) for _, _, segs in per_stream), default=0)):
        parts = [(recs, segs[index]) for _, recs, segs in per_stream if index < len(segs)]
        start = len(records)
        for recs, seg in parts:
            records.extend(recs[seg.start:seg.stop])
        context: dict[str, str] = {}
        for _, seg in parts:
            for k, v in seg.context.items():
                context.setdefault(k, v)
        head = parts[0][1]
        segments.append(Segment(index=index, start=start, stop=len(records),
                                first_step=min(seg.first_step for _, seg in parts),
                                last_step=max(seg.last_step for _, seg in parts),
                                reason=head.reason if index else "start",
                                resumed_after=segments[-1].last_step if segments else None, context=context))
    return records, segments


# -- hangs ------------------------------------------------------------------------------------------------------------

def span(ranks: Iterable[int]) -> str:
    """``0-3, 5`` for a set of ranks."""
    items = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(out)


def stopped_ranks(reader: _Reader, ranks: dict[tuple[str, str, int], int], hosts: dict[int, str],
                  records: Sequence[StepRecord], events: Sequence[LogEvent], context: dict[str, str]
                  ) -> list[LogEvent]:
    """``rank_stopped`` events: ranks whose log stops while the others wait or go on (see the module docstring).

    * NCCL watchdog timeouts from some ranks: the ranks of the world (``world_size`` of the start-up arguments, else
      the highest rank seen + 1) that reported none, when they are at most half of it, are the ones waited for.
    * Otherwise: a rank that printed at >= 3 different steps and whose last line is more than two logging
      intervals (or two of its own widest gaps between lines, for a rank that prints now and then) behind the newest
      step any rank printed at.
    """
    timeline = sorted((r.wall_time, r.step) for r in records if r.wall_time > 0)
    times = [t for t, _ in timeline]
    last: dict[int, _Stream] = {}
    for key, s in reader.streams.items():
        rank = ranks[key]
        step = s.last_step
        if step is None and s.last_wall is not None and timeline:  # place by date on the run's records
            step = timeline[max(bisect.bisect_right(times, s.last_wall) - 1, 0)][1]
            first = timeline[max(bisect.bisect_right(times, s.first_wall or 0.0) - 1, 0)][1]
            s = replace(s, last_step=step, steps=3 if s.dated >= 3 and step > first else 1)
        old = last.get(rank)
        if old is None or (s.last_step or -1) > (old.last_step or -1):
            last[rank] = s
    waiting = [e for e in events if e.kind == "nccl_timeout" and e.rank is not None]
    waiters = {e.rank for e in waiting if e.rank is not None}
    lowest = min((r.rank for r in records), default=0)
    by_rank = sorted({r.step for r in records if r.rank == lowest})
    gaps = [b - a for a, b in itertools.pairwise(by_rank) if b > a]
    interval = statistics.median(gaps) if gaps else 1
    newest = max((s.last_step for s in last.values() if s.last_step is not None), default=None)
    world_text = context.get("world_size", "")
    world = int(world_text) if world_text.isdigit() else max([*last, *waiters], default=-1) + 1
    out: list[LogEvent] = []
    if waiters:
        suspects = sorted(set(range(world)) - waiters) if world <= 65536 else []
        if not suspects or len(suspects) > max(1, world // 2):
            return []
        timeout = waiting[0]
        work = _WATCHDOG_WORK.search(timeout.message)
        what = f" in {work.group(2)} SeqNum={work.group(1)}" if work else ""
        if not any(r in last for r in suspects):  # none of them is in these logs (e.g. another node's console)
            text = (f"rank(s) {span(suspects)} are not in these logs; rank(s) {span(waiters)} timed out waiting"
                    f"{what} (NCCL watchdog): the rank that stopped is among them")
            return [LogEvent(kind="rank_stopped", message=text, source=timeout.source, step=timeout.step,
                             wall_time=timeout.wall_time, rank=suspects[0], host=hosts.get(suspects[0], ""),
                             value=1.0)]
        for rank in suspects[:8]:
            quiet = last.get(rank)
            host = hosts.get(rank, "")
            where = f"rank {rank}" + (f" on {host}" if host else "")
            if quiet is None:
                text = f"{where} printed nothing"
                step = timeout.step if timeout.step is not None else newest
            else:
                step = quiet.last_step
                text = f"{where}: its log stops" + (f" at step {step}" if step is not None else "") + \
                    f" ({quiet.last_source}: {quiet.last_line})"
            out.append(LogEvent(kind="rank_stopped", message=f"{text} while rank(s) {span(waiters)} timed out "
                                f"waiting for it{what} (NCCL watchdog)",
                                source=quiet.last_source if quiet else timeout.source, step=step,
                                wall_time=quiet.last_wall if quiet else None, rank=rank, host=host, value=1.0))
        return out
    if newest is None:
        return []
    for rank, s in sorted(last.items()):
        if s.last_step is None or s.steps < 3 or newest - s.last_step <= 2 * max(interval, s.gap):
            continue
        host = hosts.get(rank, "")
        where = f"rank {rank}" + (f" on {host}" if host else "")
        ahead = sorted(r for r, o in last.items() if o.last_step is not None and o.last_step > s.last_step)
        out.append(LogEvent(kind="rank_stopped", message=f"{where}: its log stops at step {s.last_step} "
                            f"({s.last_source}: {s.last_line}) while rank(s) {span(ahead)} went on to step {newest}",
                            source=s.last_source, step=s.last_step, wall_time=s.last_wall, rank=rank, host=host,
                            value=0.0))
    return out


# -- system logs ------------------------------------------------------------------------------------------------------

def describe_hosts(hosts: dict[int, str]) -> str:
    """``node-a: ranks 0-3; node-b: ranks 4-7`` (the report's metadata)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        by_host.setdefault(host, []).append(rank)
    return "; ".join(f"{host}: rank{'s' if len(r) > 1 else ''} {span(r)}" for host, r in by_host.items())


def _short(host: str) -> str:
    return host.split(".", 1)[0].lower()


def host_from_name(path: Path, known: Collection[str] = ()) -> str:
    """The host a system-log file belongs to by its name: a known host of the run that the name contains (the
    longest), else the name without words like ``dmesg`` / ``kern`` / ``log``; ``""`` when nothing is left."""
    name = path.name.lower()
    found = sorted((h for h in known if h and _short(h) in name), key=len, reverse=True)
    if found:
        return found[0]
    words = {"dmesg", "kern", "kernel", "journal", "journalctl", "syslog", "messages", "log", "txt", "out", "nvsmi",
             "nvidia", "smi", "q"}
    tokens = [t for t in re.split(r"[._]", path.name) if t and t.lower() not in words]
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
    by_host: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        by_host.setdefault(_short(host), []).append(rank)
    out = []
    for event in events:
        host = event.host or default_host
        mine = sorted(by_host.get(_short(host), [])) if host else []
        out.append(replace(event, host=host, rank=event.rank if event.rank is not None else (mine[0] if mine else None),
                           ranks=tuple(mine) or event.ranks))
    return out
