"""Whose is a log file and whose is a line: the directory layouts of per-rank logs and the rank / host prefixes of
combined ones.

Layouts (a directory is searched by :func:`discover`, a list of files named by :func:`discover_files`):

* **torchrun** ``--log-dir D --redirects 3`` (or ``--tee 3``): ``D/<rdzv_run_id>_<random>/attempt_<k>/<local_rank>/
  stdout.log`` and ``stderr.log`` (PyTorch's ``DefaultLogsSpecs``; each node's agent makes its own
  ``<rdzv_run_id>_<random>`` directory, so one such directory is one node; ``attempt_<k>`` is the k-th restart of
  the worker group: a new segment; ``filtered_*.log`` copies are skipped). ``--local-ranks-filter`` only filters
  what is copied to the console: the files hold every local rank, a console capture only the filtered ones.
* **per-task files**: ``rank3.log`` / ``task-3.out``, SLURM ``--output`` patterns with ``%t`` and ``%N``
  (``slurm-<job>-<task>.out``, ``log.<node>.<task>``): the number is the global rank, the varying name part the
  host; files named by host only (``node-b.log``) are one node each.
* Kernel logs (every line a syslog / dmesg line) and ``nvidia-smi -q`` dumps lying among them are not rank logs
  (:func:`system_files`: read as ``--system-log`` files).

Line prefixes (:func:`split_prefixes`), of one combined console file or of each line of any file:

* torchrun ``--tee`` prefixes ``[default3]:`` (``[${role_name}${local_rank}]:``: a local rank); PyTorch >= 2.2
  prefixes worker exceptions and C++ log lines with ``[rank3]:`` (the global rank), a
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` of ``[${rank}]:`` gives ``[3]:`` (global);
* ``srun --label`` prefixes ``3: `` (the task id) and pdsh / clush ``host-12: `` (the host): the "outer" prefix of a
  file, read as one only when >= 90 % of its lines have it (:func:`outer_mode`).
* Prefixes nest (``0: [default3]:[rank3]: ...``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stability.errors import SourceError

_TORCH = re.compile(r"^\[([A-Za-z_][A-Za-z_\-]*)?(\d+)\]:[ ]?")
_MID_RANK = re.compile(r"\[rank\d+\]:\[")
_LABEL = re.compile(r"^\s*(\d+): ")
_HOST = re.compile(r"^([A-Za-z][\w.\-]*): ")
_OUTER_SHARE = 0.9
"""Share of a file's lines that must carry an ``srun --label`` / host prefix for it to be read as one."""
_NOT_HOSTS = frozenset({"INFO", "WARNING", "WARN", "ERROR", "DEBUG", "CRITICAL", "FATAL", "NOTICE", "Warning",
                        "Error", "Info"})
"""Line starts that look like a pdsh host prefix but are log levels."""
_SYSLOG_LINE = re.compile(r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+[+\-Z][\d:]*) \S+ \S+")
_DMESG_LINE = re.compile(r"^\[\s*\d+\.\d+\] ")
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


# -- prefixes -------------------------------------------------------------------------------------------------------

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


def outer_mode(lines: Sequence[str]) -> str:
    """``label`` (srun task ids), ``host`` (pdsh / clush) or ``""``: the outer prefix of a file's first lines."""
    body = [line for line in lines if line.strip()]
    if not body:
        return ""
    for mode, pattern in (("label", _LABEL), ("host", _HOST)):
        found = [m.group(1) for m in map(pattern.match, body) if m]
        if len(found) >= _OUTER_SHARE * len(body) and not (mode == "host" and set(found) <= _NOT_HOSTS):
            return mode
    return ""


def head(path: Path, limit: int = 2000) -> list[str]:
    """The first ``limit`` lines of a file, without their line ends.

    Raises:
        SourceError: unreadable.
    """
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return [line.rstrip("\r\n") for _, line in zip(range(limit), handle, strict=False)]
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None


def prefixed(lines: Sequence[str]) -> bool:
    """Whether a file's first lines carry rank or host prefixes (then it is read by
    :func:`~stability.sources.ranks.load_ranked`)."""
    if outer_mode(lines):
        return True
    return any(_TORCH.match(line) for line in lines)


def stripped_lines(lines: Sequence[str]) -> list[str]:
    """``lines`` without their rank / host prefixes (for sniffing the format under them)."""
    outer = outer_mode(lines)
    return [split_prefixes(line, outer)[3] for line in lines]


# -- discovery ------------------------------------------------------------------------------------------------------

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
    ordered = sorted(files, key=lambda p: natural(p.name))
    if len(ordered) < 2:
        return [RankFile(path=p) for p in ordered]
    return _named(ordered)


def natural(text: str) -> list[object]:
    """Sort key of natural order (``node2`` before ``node10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _torchrun_file(path: Path) -> bool:
    attempt = path.parent.parent.name
    return path.name in ("stdout.log", "stderr.log") and path.parent.name.isdigit() \
        and attempt.startswith("attempt_") and attempt[8:].isdigit()


def _is_log_name(path: Path) -> bool:
    suffix = path.suffix.lower()
    return (suffix in _LOG_SUFFIXES or suffix[1:].isdigit()) and not path.name.startswith(".") \
        and ".findings" not in path.name and ".report" not in path.name


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
