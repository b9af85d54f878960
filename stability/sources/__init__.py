"""Post-mortem sources beyond stability's own run directories: the logs people actually have.

:func:`load_log` sniffs the format of a file or directory and returns a :class:`LoadedLog` (records in log order
grouped into :class:`Segment` s, plus :class:`LogEvent` s and the run's start-up context):

* text logs (:mod:`~stability.sources.textlog`): Megatron-LM / Megatron-DeepSpeed, DeepSpeed, HF Trainer prints,
  fairseq, nanoGPT / llm.c, and system lines (dmesg / journal / NCCL watchdog) inside or beside them;
* multi-rank logs (:mod:`~stability.sources.ranks`): a directory of per-rank files (torchrun ``--log-dir``, SLURM
  per-task files), several files (:func:`load_logs`), or one file whose lines carry torchrun / srun / pdsh rank or
  host prefixes: one run, every record with its rank and host, ``rank_stopped`` events for ranks whose log stops;
* structured (:mod:`~stability.sources.structured`): JSON lines, HF ``trainer_state.json``, TensorBoard event
  directories, W&B offline run directories (:mod:`~stability.sources.wandb_offline`).

A file that is none of these raises :class:`~stability.errors.SourceError` with one line naming the formats that
were expected (:data:`EXPECTED`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

from stability.errors import SourceError
from stability.sources._model import EVENT_KINDS, SYSTEM_KINDS, LoadedLog, LogEvent, Segment
from stability.sources._segments import SegmentBuilder

__all__ = ["EVENT_KINDS", "EXPECTED", "SYSTEM_KINDS", "LoadedLog", "LogEvent", "Segment", "SegmentBuilder",
           "load_log", "load_logs", "load_system_log", "sniff"]

EXPECTED = ("a CSV with a 'step' column, a stability run directory, a Megatron-LM/DeepSpeed/HF Trainer/fairseq/"
            "nanoGPT training log, JSON lines, trainer_state.json, a TensorBoard event directory or a W&B offline "
            "run directory")
"""What ``stability postmortem`` understands (the one-line error of an unknown source)."""


def _run_id(path: Path) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.:\-]", "-", path.stem if path.is_file() else path.name).strip("-_.:") or "run"
    return cleaned[:128]


def sniff(path: Path) -> str:
    """The format of ``path``: ``csv``, ``jsonl``, ``hf-trainer-state``, ``tensorboard``, ``wandb-offline``,
    ``text`` (a training or system log, maybe with rank / host prefixes), ``ranked`` (a directory of per-rank
    logs, :mod:`~stability.sources.ranks`) or ``unknown``."""
    if path.is_dir():
        return _sniff_dir(path)
    if path.suffix == ".wandb":
        return "wandb-offline"
    if path.suffix.lower() in (".csv", ".tsv"):
        return "csv"
    if path.name.startswith("events.out.tfevents"):
        return "tensorboard"
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            head = [line for _, line in zip(range(2000), handle, strict=False)]
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None
    body = [line for line in head if line.strip() and not line.startswith("#")]
    if not body:
        return "unknown"
    first = body[0].lstrip()
    if path.name == "trainer_state.json" or (first.startswith("{") and '"log_history"' in "".join(head)):
        return "hf-trainer-state"
    if first.startswith("{") and first.rstrip().endswith("}") and first.startswith('{"'):
        return "jsonl"
    from stability.sources import ranks
    from stability.sources.textlog import sniff_lines

    if sniff_lines(iter(head)):
        return "text"
    if ranks.prefixed(head) and sniff_lines(iter(ranks.stripped_lines(head))):
        return "text"
    if "," in first and not first.startswith("{"):
        return "csv"
    return "unknown"


def _sniff_dir(path: Path) -> str:
    if next(path.rglob("events.out.tfevents*"), None) is not None:
        return "tensorboard"
    if next(path.rglob("run-*.wandb"), None) is not None:
        return "wandb-offline"
    if _trainer_state(path) is not None:
        return "hf-trainer-state"
    from stability.sources import ranks

    if any(_sniff_file(f.path) == "text" for f in ranks.discover(path)[:64]):
        return "ranked"
    return "unknown"


def _sniff_file(path: Path) -> str:
    try:
        return sniff(path)
    except SourceError:
        return "unknown"


def _trainer_state(directory: Path) -> Path | None:
    """The ``trainer_state.json`` of an HF output directory: its own, else that of the latest ``checkpoint-N``
    (each checkpoint holds the whole log history up to N)."""
    if (directory / "trainer_state.json").is_file():
        return directory / "trainer_state.json"
    found = [p for p in directory.glob("checkpoint-*/trainer_state.json") if p.parent.name[11:].isdigit()]
    return max(found, key=lambda p: int(p.parent.name[11:])) if found else None


def load_log(path: str | Path, *, run_id: str | None = None, fmt: str | None = None) -> LoadedLog:
    """Read a non-CSV source (see the module docstring); ``fmt`` skips sniffing.

    Raises:
        SourceError: unreadable, not a known format (one line naming the expected formats), or no records.
    """
    from stability.sources import structured, textlog, wandb_offline

    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    fmt = fmt or sniff(path)
    rid = run_id or _run_id(path)
    if fmt == "tensorboard":
        loaded = structured.load_tensorboard(path if path.is_dir() else path.parent, rid)
    elif fmt == "wandb-offline":
        loaded = wandb_offline.load_wandb(path, rid)
    elif fmt == "hf-trainer-state":
        state = _trainer_state(path) if path.is_dir() else path
        if state is None:
            raise SourceError(f"{path}: no trainer_state.json (nor checkpoint-*/trainer_state.json)")
        loaded = structured.load_trainer_state(state, rid)
    elif fmt == "jsonl":
        loaded = structured.load_jsonl(path, rid)
    elif fmt == "ranked" or (fmt == "text" and _prefixed(path)):
        from stability.sources import ranks

        files = ranks.discover(path) if path.is_dir() else [ranks.RankFile(path=path)]
        loaded = ranks.load_ranked(files, run_id=rid)
        beside = ranks.system_files(path) if path.is_dir() else []
        ranks.add_system_logs(loaded, beside)
        loaded.notes += [f"{p.name}: read as a system log (kernel / nvidia-smi)" for p in beside]
    elif fmt == "text":
        parser = textlog.TextLogParser(run_id=rid, source=str(path))
        parser.read(path)
        records, segments = parser.builder.finish()
        kinds = sorted(parser.formats, key=lambda k: -parser.formats[k])
        loaded = LoadedLog(format="+".join(kinds) or "text", records=records, segments=segments,
                           events=parser.events, context=parser.context, notes=parser.notes)
    else:
        raise SourceError(f"{path}: format not recognised; expected {EXPECTED}")
    _drop_static_scale(loaded)
    if not loaded.records and not loaded.events:
        raise SourceError(f"{path}: no training records or events found (read as {loaded.format}); expected "
                          f"{EXPECTED}")
    return loaded


def _prefixed(path: Path) -> bool:
    from stability.sources import ranks

    return ranks.prefixed(ranks.head(path))


def load_logs(paths: Sequence[str | Path], *, run_id: str | None = None) -> LoadedLog:
    """Several files of one run (one per rank, node or task: :mod:`~stability.sources.ranks` reads their names)
    as one multi-rank run.

    Raises:
        SourceError: a file missing or not a training log (one line naming the expected formats), or no records.
    """
    from stability.sources import ranks

    files = [Path(p) for p in paths]
    formats = {}
    for file in files:
        if not file.is_file():
            raise SourceError(f"{file}: no such file")
        formats[file] = sniff(file)
        if formats[file] not in ("text", "unknown"):  # unknown: a rank that printed only warnings / a traceback
            raise SourceError(f"{file}: a {formats[file]} source; several sources must each be the text log of one "
                              f"rank, node or task")
    if "text" not in formats.values():
        raise SourceError(f"{', '.join(map(str, files))}: format not recognised; expected {EXPECTED}")
    named = ranks.discover_files(files)
    loaded = ranks.load_ranked(named, run_id=run_id or _run_id(files[0].parent if len(files) > 1 else files[0]))
    _drop_static_scale(loaded)
    if not loaded.records and not loaded.events:
        raise SourceError(f"{', '.join(map(str, files))}: no training records or events found")
    return loaded


_PLACEHOLDERS = {"loss_scale": 1.0, "grad_norm": 0.0}
"""Signal values that, on every record of a segment, mean "not computed": Megatron prints ``loss scale: 1.0`` in
bf16 / fp32 runs (no dynamic scaling) and some builds ``grad norm: 0.000`` when the norm is not computed
(BigScience tr1-13B)."""


def _drop_static_scale(loaded: LoadedLog) -> None:
    """Drop the :data:`_PLACEHOLDERS` signals from segments where they never change, so a static 1.0 is not read
    as a loss scale collapsed to its floor, nor a 0.000 grad norm as vanished gradients."""
    from dataclasses import replace

    for seg in loaded.segments:
        chunk = loaded.records[seg.start:seg.stop]
        drop = {name for name, value in _PLACEHOLDERS.items()
                if {r.signals[name] for r in chunk if name in r.signals} == {value}}
        if drop:
            loaded.records[seg.start:seg.stop] = [
                replace(r, signals={k: v for k, v in r.signals.items() if k not in drop}) for r in chunk]


def load_system_log(path: str | Path, *, year: int | None = None, hosts: Collection[str] = ()) -> list[LogEvent]:
    """The system events (Xid, ECC, hung tasks, OOM kills, NCCL failures) of a dmesg / journal file, or the ECC
    errors, pending page retirements / row remappings and hardware slowdowns of an ``nvidia-smi -q`` dump
    (:mod:`~stability.sources.nvsmi`).

    An event's host is the one its syslog line names, else the one the file name gives (one file per node:
    ``node-b.dmesg``, ``dmesg-node-b.txt``; a host of ``hosts``, the run's, contained in the name wins,
    :func:`~stability.sources.ranks.host_from_name`)."""
    from stability.sources import nvsmi
    from stability.sources.ranks import head, host_from_name
    from stability.sources.textlog import TextLogParser

    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    first = head(path, 20)
    host = host_from_name(path, hosts)
    if nvsmi.is_nvsmi(first):
        events = nvsmi.read_nvsmi(path)
    else:
        parser = TextLogParser(run_id="system", source=str(path), year=year)
        parser.read(path)
        events = [e for e in parser.events if e.kind in SYSTEM_KINDS]
    if not host:
        return events
    from dataclasses import replace

    return [e if e.host else replace(e, host=host) for e in events]
