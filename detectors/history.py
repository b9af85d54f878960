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

from stability.detectors.schedule import LrSchedule
from stability.records import StepRecord, split_signal

__all__ = ["History", "LrTracker", "Ring", "TRACKED_QUANTITIES"]

LrTracker = LrSchedule
"""The LR-schedule model every detector and the ranking read (:mod:`~stability.detectors.schedule`)."""

logger = logging.getLogger(__name__)

TRACKED_QUANTITIES = frozenset(
    {"grad_norm", "update_ratio", "adam_v_ratio", "act_absmax", "act_rms", "attn_logit_max", "logit_z"}
)
"""Per-module quantities kept for ranking."""


class Ring:
    """The last ``size`` records of a set of named float32 series, aligned on one step column."""

    def __init__(self, size: int, max_series: int) -> None:
        self.size = size
        self.max_series = max_series
        self.steps = np.full(size, -1, dtype=np.int64)
        self.series: dict[str, np.ndarray] = {}
        self.count = 0
        self._warned = False

    def push(self, step: int, values: dict[str, float]) -> None:
        """Append one record's values (series not named get NaN at this step)."""
        slot = self.count % self.size
        self.steps[slot] = step
        for array in self.series.values():
            array[slot] = np.nan
        for name, value in values.items():
            if name not in self.series:
                if len(self.series) >= self.max_series:
                    if not self._warned:
                        logger.warning("history keeps at most %d series; ignoring %s and later ones",
                                       self.max_series, name)
                        self._warned = True
                    continue
                self.series[name] = np.full(self.size, np.nan, dtype=np.float32)
            self.series[name][slot] = value
        self.count += 1

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
        self.series = {k: np.frombuffer(v, dtype=np.float32).copy() for k, v in state["series"].items()}


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
        glob: dict[str, float] = {}
        mods: dict[str, float] = {}
        for name, value in record.signals.items():
            quantity, module = split_signal(name)
            if module is None:
                glob[name] = value
            elif quantity in TRACKED_QUANTITIES:
                mods[name] = value
        self.globals.push(record.step, glob)
        if mods:
            self.modules.push(record.step, mods)
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
