"""JSON lines, HF Trainer ``trainer_state.json``, TensorBoard event directories and W&B offline runs.

* JSON lines: one object per line; the step is the first of ``step``, ``global_step``, ``iteration``, ``iter``,
  ``num_updates``, ``_step`` present; numeric values are signals (:func:`~stability.sources.textlog.signal_name`;
  nested objects are flattened with ``_``); non-finite values may be ``NaN``/``Infinity`` or strings.
* ``trainer_state.json``: its ``log_history`` entries (``loss``, ``grad_norm``, ``learning_rate``, ``eval_loss``,
  ... with ``step``); ``global_step`` etc. are context.
* TensorBoard: every scalar tag of the event files under a directory, read with ``tensorboard``'s
  ``EventAccumulator`` (tags ``train/loss`` -> ``train_loss`` -> ``loss``; wall times kept); files are read in
  name order (one per process start), so a restart with steps going back is a new segment.
* W&B offline run directory (``offline-run-*/run-*.wandb``): the history rows, read with wandb's own record
  protobuf (:mod:`stability.sources.wandb_offline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stability.errors import SourceError
from stability.records import StepRecord
from stability.sources._model import LoadedLog
from stability.sources._segments import SegmentBuilder
from stability.sources.textlog import signal_name

__all__ = ["load_jsonl", "load_tensorboard", "load_trainer_state", "rows_to_log"]

STEP_KEYS = ("step", "global_step", "iteration", "iter", "num_updates", "_step", "trainer/global_step")
_TB_PREFIXES = ("train/", "training/", "train_", "trainer/")


def _flat(obj: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in obj.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}_")
        else:
            yield f"{prefix}{key}", value


def _value(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _tag_name(tag: str) -> str:
    for prefix in _TB_PREFIXES:
        if tag.startswith(prefix) and len(tag) > len(prefix):
            tag = tag[len(prefix):]
            break
    return signal_name(tag.replace("/", "_"))


def rows_to_log(rows: Iterator[tuple[str, Mapping[str, Any]]], run_id: str, fmt: str) -> LoadedLog:
    """Records from ``(where, row)`` pairs in log order (a row without a step key gets its ordinal)."""
    builder = SegmentBuilder("log")
    notes: list[str] = []
    ordinal = 0
    for where, row in rows:
        values = dict(_flat(row))
        step_value = next((_value(values.pop(k)) for k in STEP_KEYS if k in values), None)
        signals: dict[str, float] = {}
        wall = _value(values.pop("_timestamp", values.pop("timestamp", None))) or 0.0
        for key, raw in values.items():
            number = _value(raw)
            if number is not None:
                signals[signal_name(key.replace("/", "_"))] = number
        if not signals:
            continue
        if step_value is None or not math.isfinite(step_value) or step_value < 0:
            ordinal += 1
            step = ordinal
            if not notes:
                notes.append(f"{where}: rows carry no step; steps are their ordinals")
        else:
            step = int(step_value)
        builder.add(StepRecord(run_id=run_id, step=step, signals=signals, wall_time=wall))
    records, segments = builder.finish()
    return LoadedLog(format=fmt, records=records, segments=segments, notes=notes)


def load_jsonl(path: Path, run_id: str) -> LoadedLog:
    """Read a JSON-lines file (streaming)."""
    def rows() -> Iterator[tuple[str, Mapping[str, Any]]]:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise SourceError(f"{path}, line {number}: not a JSON object") from None
                if isinstance(obj, dict):
                    yield f"{path}:{number}", obj
    return rows_to_log(rows(), run_id, "jsonl")


def load_trainer_state(path: Path, run_id: str) -> LoadedLog:
    """Read an HF Trainer ``trainer_state.json`` (its ``log_history``)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path}: cannot read trainer_state.json ({exc})") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise SourceError(f"{path}: no 'log_history' list (expected an HF Trainer trainer_state.json)")
    loaded = rows_to_log(((f"{path}:log_history[{i}]", row) for i, row in enumerate(history)
                          if isinstance(row, dict)), run_id, "hf-trainer-state")
    loaded.context = {k: str(state[k]) for k in ("global_step", "max_steps", "logging_steps", "train_batch_size",
                                                  "num_train_epochs") if k in state}
    return loaded


def load_tensorboard(directory: Path, run_id: str) -> LoadedLog:
    """Read the scalars of every event file under ``directory`` (tensorboard's ``EventAccumulator``)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise SourceError(f"{directory}: reading TensorBoard event files needs the 'tensorboard' package "
                          "(pip install tensorboard)") from None
    files = sorted(directory.rglob("events.out.tfevents*"))
    if not files:
        raise SourceError(f"{directory}: no events.out.tfevents* files")
    builder = SegmentBuilder("log")
    for file in files:
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
        try:
            acc.Reload()
        except Exception as exc:  # a torn or foreign file: name it and read the others
            raise SourceError(f"{file}: cannot read the TensorBoard event file ({exc})") from None
        rows: dict[int, dict[str, float]] = {}
        walls: dict[int, float] = {}
        order: list[int] = []
        for tag in acc.Tags().get("scalars", []):
            name = _tag_name(tag)
            for event in acc.Scalars(tag):
                if event.step not in rows:
                    rows[event.step] = {}
                    order.append(event.step)
                rows[event.step][name] = float(event.value)
                walls[event.step] = max(walls.get(event.step, 0.0), float(event.wall_time))
        for step in sorted(order, key=lambda s: (walls[s], s)):
            builder.add(StepRecord(run_id=run_id, step=int(step), signals=rows[step], wall_time=walls[step]))
    records, segments = builder.finish()
    return LoadedLog(format="tensorboard", records=records, segments=segments)
