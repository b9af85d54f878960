"""Per-rank recent history for root-cause ranking: ring buffers of signals plus the learned LR schedule.

Values are stored as float32 (in memory and in the state), so a restored history ranks exactly like the
original. Global signals keep ``steps`` records, per-module signals (``<quantity>/<module>`` for the quantities in
:data:`TRACKED_QUANTITIES`) keep ``module_steps`` records, at most ``max_series`` series each; absent = NaN.
Size of the state: about ``4 * module_steps * max_series`` bytes (196 KB for 96 x 512).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from stability.detectors._modules import Schema, layout
from stability.detectors.schedule import LrSchedule
from stability.records import StepRecord

__all__ = ["History", "LrTracker", "Ring", "TRACKED_QUANTITIES"]

LrTracker = LrSchedule
"""The LR-schedule model every detector and the ranking read (:mod:`~stability.detectors.schedule`)."""

logger = logging.getLogger(__name__)

TRACKED_QUANTITIES = frozenset(
    {"grad_norm", "update_ratio", "adam_v_ratio", "act_absmax", "act_rms", "attn_logit_max", "logit_z"}
)
"""Per-module quantities kept for ranking."""

_SPLITS: dict[Schema, tuple[list[str], np.ndarray, list[str], np.ndarray]] = {}


def _split(schema: Schema) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    """A record layout's global names and positions, and its tracked per-module ones (cached per layout)."""
    glob = [i for i, m in enumerate(schema.modules) if m is None]
    mods = [i for i, (q, m) in enumerate(zip(schema.quantities, schema.modules, strict=True))
            if m is not None and q in TRACKED_QUANTITIES]
    if len(_SPLITS) >= 256:
        _SPLITS.clear()
    split = _SPLITS[schema] = ([schema.names[i] for i in glob], np.array(glob, dtype=np.intp),
                               [schema.names[i] for i in mods], np.array(mods, dtype=np.intp))
    return split


class Ring:
    """The last ``size`` records of a set of named float32 series, aligned on one step column.

    The series are the rows of one ``[series x size]`` matrix (``series`` maps each name to its row, a view), so a
    record is pushed with two column stores whatever its number of signals; the rows a record's names go to are
    worked out once per name list (:meth:`push_layout`).
    """

    def __init__(self, size: int, max_series: int) -> None:
        self.size = size
        self.max_series = max_series
        self.steps = np.full(size, -1, dtype=np.int64)
        self.series: dict[str, np.ndarray] = {}
        """Name -> its row of the matrix (a view: do not keep it across a push, which may move the matrix)."""
        self.count = 0
        self._data = np.full((0, size), np.nan, dtype=np.float32)
        self._plans: dict[int, tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]] = {}
        """id(name list) -> (the list, positions of the names that have a row, their rows; the positions in row
        order when the names cover every row, else None)."""
        self._warned = False

    def push(self, step: int, values: dict[str, float]) -> None:
        """Append one record's values (series not named get NaN at this step)."""
        names = list(values)
        self.push_layout(step, names, np.fromiter(values.values(), dtype=np.float64, count=len(names)), cache=False)

    def push_layout(self, step: int, names: list[str], values: np.ndarray, *, cache: bool = True) -> None:
        """:meth:`push` of ``values[i]`` for ``names[i]``; with ``cache`` the rows of ``names`` are kept for the next
        push of the same list object (the caller keeps it unchanged)."""
        plan = self._plans.get(id(names)) if cache else None
        if plan is None or plan[0] is not names:
            plan = self._plan(names)
            if cache:
                if len(self._plans) >= 64:
                    self._plans.clear()
                self._plans[id(names)] = plan
        _, positions, rows, every = plan
        slot = self.count % self.size
        self.steps[slot] = step
        data = self._data
        if every is not None:  # (every series has a value: one column store)
            data[:, slot] = values[every]
        else:
            data[:, slot] = np.nan
            data[rows, slot] = values[positions]  # float64 -> float32: the same rounding as a scalar store
        self.count += 1

    def _plan(self, names: list[str]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows of ``names`` (new series get new rows, in order, up to ``max_series``; later ones are ignored)."""
        new = [n for n in dict.fromkeys(names) if n not in self.series]
        room = self.max_series - len(self.series)
        if len(new) > room:
            if not self._warned:
                logger.warning("history keeps at most %d series; ignoring %s and later ones", self.max_series,
                               new[max(room, 0)])
                self._warned = True
            new = new[:max(room, 0)]
        if new:
            grown = np.full((len(self.series) + len(new), self.size), np.nan, dtype=np.float32)
            grown[: len(self._data)] = self._data
            self._data = grown
            self.series = {name: grown[i] for i, name in enumerate([*self.series, *new])}
            self._plans.clear()
        index = {name: i for i, name in enumerate(self.series)}
        kept = [(i, index[n]) for i, n in enumerate(names) if n in index]
        rows = {r: i for i, r in kept}  # (a repeated name: its last value, as the fancy store keeps)
        every = np.array([rows[r] for r in range(len(index))], dtype=np.intp) if len(rows) == len(index) else None
        return (names, np.array([i for i, _ in kept], dtype=np.intp), np.array([r for _, r in kept], dtype=np.intp),
                every)

    def ordered(self, name: str | None = None) -> np.ndarray:
        """Steps (``name=None``) or the series ``name``, oldest first."""
        array = self.steps if name is None else self.series[name]
        n = min(self.count, self.size)
        start = self.count % self.size if self.count > self.size else 0
        return np.concatenate([array[start:], array[:start]])[:n] if start else array[:n]

    def state_dict(self) -> dict[str, Any]:
        """Compact plain data (float32 bytes)."""
        return {"size": self.size, "count": self.count, "steps": self.steps.tobytes(),
                "series": {k: v.tobytes() for k, v in self.series.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.count = int(state["count"])
        self.steps = np.frombuffer(state["steps"], dtype=np.int64).copy()
        names = list(state["series"])
        data = np.full((len(names), self.size), np.nan, dtype=np.float32)
        for i, name in enumerate(names):
            data[i] = np.frombuffer(state["series"][name], dtype=np.float32)
        self._data = data
        self.series = {name: data[i] for i, name in enumerate(names)}
        self._plans.clear()


class History:
    """Recent history of one rank: global signals, per-module signals, batch ids and the LR tracker."""

    def __init__(self, *, steps: int = 256, module_steps: int = 96, max_series: int = 512) -> None:
        self.globals = Ring(steps, max_series)
        self.modules = Ring(module_steps, max_series)
        self.batches: dict[int, str] = {}
        self.batch_keep = steps
        self.lr = LrTracker()
        self.first_step: int | None = None

    def push(self, record: StepRecord) -> None:
        """Add one record."""
        if self.first_step is None:
            self.first_step = record.step
        schema, values = layout(record)
        split = _SPLITS.get(schema)
        if split is None:
            split = _split(schema)
        glob, glob_at, mods, mods_at = split
        self.globals.push_layout(record.step, glob, values[glob_at])
        if mods:
            self.modules.push_layout(record.step, mods, values[mods_at])
        if record.batch is not None:
            self.batches[record.step] = record.batch
            if len(self.batches) > self.batch_keep:
                del self.batches[min(self.batches)]
        self.lr.update(record.step, record.get("lr"))

    def state_dict(self) -> dict[str, Any]:
        """Compact plain data."""
        return {"globals": self.globals.state_dict(), "modules": self.modules.state_dict(),
                "batches": [[k, v] for k, v in self.batches.items()], "lr": self.lr.state_dict(),
                "first_step": self.first_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.globals.load_state_dict(state["globals"])
        self.modules.load_state_dict(state["modules"])
        self.batches = {int(k): str(v) for k, v in state["batches"]}
        self.lr.load_state_dict(state["lr"])
        self.first_step = state["first_step"]
