"""Reading multi-rank logs: every line attributed to a (rank, host) and fed to that rank's text-log parser.

Each file (:class:`~stability.sources.ranks.layout.RankFile`) is read line by line; the line's prefixes
(:func:`~stability.sources.ranks.layout.split_prefixes`) and the file's path say whose it is, and each rank (or
local rank of a node) gets its own :class:`~stability.sources.textlog.TextLogParser`. After the last file the
streams get their global ranks, their records are merged segment by segment and their last lines are checked for
a rank that stopped (:mod:`~stability.sources.ranks.hangs`).

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
summary (``host : node-b``) and the DeepSpeed launcher's ``global_rank_mapping=...{'node-a': [0, 1], ...}``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from stability.errors import SourceError
from stability.records import StepRecord
from stability.sources import system
from stability.sources._model import LoadedLog, LogEvent, Segment
from stability.sources.ranks.hangs import LastLine, stopped_ranks
from stability.sources.ranks.layout import RankFile, head, natural, outer_mode, split_prefixes
from stability.sources.textlog import TextLogParser

_DS_MAPPING = re.compile(r"'([^']+)':\s*\[([\d,\s]*)\]")
_NCCL_HOST = re.compile(r"^\s*([A-Za-z][\w.\-]*):\d+:\d+ \[\d+\] NCCL (?:INFO|WARN)")
_SUMMARY_HOST = re.compile(r"^\s*host\s*:\s*(\S+)\s*$")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_SCALER_KINDS = frozenset({"overflow", "scale_minimum"})

_Key = tuple[str, str, int]
"""A stream: (node, ``L`` local rank / ``G`` global rank / ``U`` unprefixed, number)."""


@dataclass
class _Stream:
    """The lines of one rank (or local rank of a node) so far."""

    node: str
    local: int | None
    rank: int | None
    host: str
    parser: TextLogParser
    last: LastLine = field(default_factory=LastLine)
    event_steps: dict[int, int] = field(default_factory=dict)
    """Index of one of the parser's events -> the step the run was at when it was printed."""


@dataclass
class _Reader:
    """The state of reading one run's files: its streams and what the lines said about ranks and hosts."""

    run_id: str
    year: int | None
    ordered: bool
    """One combined file: line order is time order, the run's step at any line is the newest step logged."""
    streams: dict[_Key, _Stream] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    """Node -> its first global rank, where a line names a global and a local rank."""
    node_hosts: dict[str, str] = field(default_factory=dict)
    rank_hosts: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run_step: int | None = None
    """The newest step any stream logged so far."""
    _summary_host: dict[str, str] = field(default_factory=dict)
    """Node -> the ``host :`` line of torchrun's failure summary, until its ``rank :`` line."""

    def stream(self, node: str, local: int | None, rank: int | None, host: str, source: str) -> _Stream:
        """The stream of a line: by its local rank, else its global rank, else the node's unprefixed lines."""
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
        """Every line of one file, attributed by its prefixes, else by what the file's path says."""
        outer = outer_mode(head(spec.path))
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
        """One attributed line: host and rank hints, then its stream's parser and last line."""
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
        stream.last.note(wall, at, rest, where)

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

    def resolve(self) -> dict[_Key, int]:
        """Stream key -> global rank (see the module docstring)."""
        locals_ = [s.local for s in self.streams.values() if s.local is not None]
        world = max(locals_) + 1 if locals_ else 1
        nodes = sorted({s.node for s in self.streams.values() if s.local is not None}, key=natural)
        guessed = [n for n in nodes if n not in self.offsets]
        if len(nodes) > 1 and guessed and not all(n.isdigit() for n in nodes):
            self.notes.append(f"global ranks of nodes {', '.join(guessed[:8])} assumed from their order by name "
                              f"x {world} local ranks (no line names a global rank there)")
        taken = {offset // world for offset in self.offsets.values()}
        free = (i for i in range(len(nodes) + len(taken)) if i not in taken)
        first = {n: self.offsets[n] if n in self.offsets else (int(n) if n.isdigit() else next(free)) * world
                 for n in nodes}
        out: dict[_Key, int] = {}
        for key, s in self.streams.items():
            if s.local is not None:
                out[key] = s.rank if s.rank is not None else first.get(s.node, 0) + s.local
            elif s.rank is not None:
                out[key] = s.rank
        for key, s in self.streams.items():
            out.setdefault(key, first.get(s.node, 0))
        return out

    def hosts(self, ranks: dict[_Key, int]) -> dict[int, str]:
        """Rank -> host, in rank order: the stream's own host, else its node's, else the node's name when that is a
        host (not a task id nor a torchrun ``<run_id>_<random>`` directory); then the DeepSpeed launcher's map."""
        hosts: dict[int, str] = {}
        for key, s in self.streams.items():
            host = s.host or self.node_hosts.get(s.node, "") or (s.node if s.node and not s.node.isdigit()
                                                                and "_" not in s.node else "")
            if host:
                hosts.setdefault(ranks[key], host)
        for rank, host in self.rank_hosts.items():
            hosts.setdefault(rank, host)
        return dict(sorted(hosts.items()))


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
    hosts = reader.hosts(ranks)
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
    events += stopped_ranks([(ranks[key], s.last) for key, s in reader.streams.items()], hosts, records, events,
                            context)
    kinds = sorted(formats, key=lambda k: -formats[k])
    notes = list(reader.notes)
    for s in reader.streams.values():
        notes += [n for n in s.parser.notes if n not in notes]
    return LoadedLog(format="+".join(kinds) or "text", records=records, segments=segments, events=events,
                     context=context, notes=notes, hosts=hosts)


def _merge(reader: _Reader, ranks: dict[_Key, int], hosts: dict[int, str]
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
        first = parts[0][1]
        segments.append(Segment(index=index, start=start, stop=len(records),
                                first_step=min(seg.first_step for _, seg in parts),
                                last_step=max(seg.last_step for _, seg in parts),
                                reason=first.reason if index else "start",
                                resumed_after=segments[-1].last_step if segments else None, context=context))
    return records, segments
