"""Step-time regressions, spikes and data-loader stalls of one rank (signals of :mod:`stability.hooks.timing`).

Per rank, on ``step_time`` (and ``data_time`` when recorded):

* **Recurring outliers are learned, not alarmed**: a step ``>= spike_ratio`` (3x) the baseline median and ``>=
  z_threshold`` (8) robust sigmas above it (MAD floored at ``floor`` = 5 % of the median) is an outlier. Outliers
  never enter the baseline. An outlier whose distance to the previous outlier equals (+-1 step, +-2 %) one of the
  last gaps between outliers of similar size (ratios within 2x) is expected (checkpoint saves, evaluation every N
  steps) and raises nothing. A checkpoint
  save or an evaluation runs between the optimizer step and the next forward, so it counts as ``data_time`` too:
  only recurrence tells it from a data stall.
* ``spike_count`` (3) irregular outliers within ``spike_window`` (200) steps (one alone may be the first of a
  recurring series) -> ``dataloader_stall`` when most of them spent most (>= ``data_share``, half) of their
  excess waiting for data (``data_time`` above its own median), WARNING when their median ratio is ``>= warn_stall``
  (10x) and their median excess ``>= warn_min_s`` (0.25 s), else INFO; otherwise ``step_time_spike`` INFO.
* **regression**: the median of the last ``persist`` (16) non-outlier steps is ``>= regress_ratio`` (1.3x) the
  median of the ``window`` (128) steps before them -> ``dataloader_stall`` (when data waiting explains at least
  half of the rise) or ``slowdown``: WARNING from ``warn_ratio`` (2x), INFO below; the baseline then restarts from
  the new level (one alert per change); a WARNING also needs the rise to be ``>= warn_min_s``.

Silent on records without ``step_time`` (every corpus recorded before the timing hooks). Findings carry the
medians before / after and the data share in ``evidence``; their cause is named by their kind
(:data:`PERF_CAUSES`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy
from stability.records import StepRecord

__all__ = ["PERF_CAUSES", "PERF_KINDS", "PERF_SIGNALS", "StepTimeConfig", "StepTimeDetector", "perf_causes"]

PERF_SIGNALS = frozenset({
    "step_time", "data_time", "compute_time", "samples_per_s", "tokens_per_s", "host_rss", "host_mem_limit",
    "device_step_time", "mem_allocated", "mem_reserved", "mem_peak", "mem_limit", "hang_s", "profile_compute_s",
    "profile_comm_s", "profile_memcpy_s", "profile_data_s"})
"""Wall-clock and memory signals of :mod:`stability.hooks.timing` (and the profile split): not features of the
numerical cause rules (the odd-record forest of :mod:`~stability.detectors.oddity` ignores them)."""

PERF_CAUSES: dict[str, tuple[str, float]] = {
    "dataloader_stall": ("dataloader_stall", 0.9),
    "slowdown": ("slowdown", 0.8),
    "step_time_spike": ("slowdown", 0.5),
    "straggler": ("straggler", 0.92),
    "memory_leak": ("memory_leak", 0.9),
    "hang": ("hang", 0.95),
}
"""Performance finding kinds and the cause each names (they never take part in the loss-event rules)."""

PERF_KINDS = frozenset(PERF_CAUSES)


def perf_causes(finding: Finding) -> tuple[CauseHint, ...]:
    """The cause hint of a performance finding (its kind names it; the evidence is the finding's message)."""
    cause, score = PERF_CAUSES[finding.kind]
    return (CauseHint(cause=cause, score=score, evidence=finding.message, remedy=remedy(cause)),)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeConfig:
    """Settings of :class:`StepTimeDetector`."""

    window: int = 128
    min_steps: int = 32
    """Baseline steps before anything is judged (the first steps compile and warm up)."""
    warmup: int = 5
    """Records ignored at the start (and after a restart)."""
    spike_ratio: float = 3.0
    z_threshold: float = 8.0
    floor: float = 0.05
    persist: int = 16
    regress_ratio: float = 1.3
    data_share: float = 0.5
    warn_ratio: float = 2.0
    """A step-time rise (or stalls) of at least this factor is a WARNING; below it an INFO (a shared machine's load
    moves step times by tens of percent; a dedicated GPU job's step time is steady, and a 2x slower job matters)."""
    warn_stall: float = 10.0
    """Irregular stalls whose median ratio to the baseline reaches this factor are a WARNING (load jitter makes
    3-5x outliers; a data stall of seconds on sub-second steps is far above)."""
    warn_min_s: float = 0.25
    """...and the slow steps' excess over the baseline must reach this many seconds: a 30x pause of a 1 ms CPU step is
    the OS scheduler or the garbage collector on a busy machine (seen on clean pytorch/examples scripts), not a stall
    worth a person's attention (it stays an INFO)."""
    gaps: int = 4
    """Gaps between recent outliers remembered (recurring outliers)."""
    gap_tolerance: float = 0.02
    """An outlier this close (relative, at least 1 step) to a remembered gap after the last one is recurring."""
    spike_count: int = 3
    spike_window: int = 200
    """``spike_count`` irregular outliers within this many steps make a finding (a single one may be the first of a
    recurring series, e.g. the first checkpoint save)."""


def _alike(a: float, b: float) -> bool:
    """Two outliers of the same recurring kind: ratios to the baseline within 2x of each other (a checkpoint save
    takes about as long each time; load jitter is much smaller)."""
    return max(a, b) <= 2.0 * min(a, b)


class StepTimeDetector:
    """Streaming step-time detector of one rank (see the module docstring)."""

    name = "steptime"

    def __init__(self, config: StepTimeConfig | None = None) -> None:
        self.config = config or StepTimeConfig()
        self._base: deque[tuple[float, float]] = deque(maxlen=self.config.window)
        """(step_time, data_time or NaN) of accepted steps before the recent ones."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.config.persist)
        self._seen = 0
        self._outliers: deque[tuple[int, float]] = deque(maxlen=self.config.gaps + 1)
        """(step, ratio to the baseline) of the last outliers."""
        self._irregular: list[tuple[int, float, float]] = []
        """(step, ratio, data share) of recent outliers that were not recurring."""

    def update(self, record: StepRecord) -> list[Finding]:
        step_time = record.signals.get("step_time")
        if step_time is None or not math.isfinite(step_time) or step_time <= 0:
            return []
        self._seen += 1
        if self._seen <= self.config.warmup:
            return []
        data = record.signals.get("data_time", math.nan)
        data = data if math.isfinite(data) else math.nan
        cfg = self.config
        if len(self._base) < cfg.min_steps:
            self._push(step_time, data)
            return []
        base = np.array([b[0] for b in self._base])
        med = float(np.median(base))
        scale = max(1.4826 * float(np.median(np.abs(base - med))), cfg.floor * med)
        if step_time >= cfg.spike_ratio * med and (step_time - med) / scale >= cfg.z_threshold:
            return self._outlier(record, step_time, data, med, scale)
        self._push(step_time, data)
        if len(self._recent) == cfg.persist:
            now = float(np.median([r[0] for r in self._recent]))
            if now >= cfg.regress_ratio * med:
                return [self._regression(record, med, now)]
        return []

    def _push(self, step_time: float, data: float) -> None:
        if len(self._base) < self.config.min_steps:
            self._base.append((step_time, data))
            return
        if len(self._recent) == self.config.persist:
            self._base.append(self._recent[0])
        self._recent.append((step_time, data))

    def _data_median(self, values: Any) -> float:
        data = [d for _, d in values if math.isfinite(d)]
        return float(np.median(data)) if data else math.nan

    def _outlier(self, record: StepRecord, step_time: float, data: float, med: float, scale: float) -> list[Finding]:
        cfg, step = self.config, record.step
        ratio_now = step_time / med
        kept = list(self._outliers)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(kept) if _alike(a[1], b[1])]
        last = kept[-1] if kept else None
        expected = last is not None and _alike(last[1], ratio_now) and any(
            abs((step - last[0]) - g) <= max(1.0, cfg.gap_tolerance * g) for g in gaps)
        self._outliers.append((step, ratio_now))
        if expected:
            return []
        data_med = self._data_median(self._base)
        share = (data - data_med) / (step_time - med) if math.isfinite(data) and math.isfinite(data_med) else 0.0
        self._irregular = [s for s in self._irregular if step - s[0] < cfg.spike_window]
        self._irregular.append((step, step_time / med, share))
        if len(self._irregular) < cfg.spike_count:
            return []
        spikes, self._irregular = self._irregular, []
        steps = ", ".join(str(s[0]) for s in spikes)
        ratio = max(s[1] for s in spikes)
        data_driven = sum(s[2] >= cfg.data_share for s in spikes)
        evidence = {"step_time": step_time, "baseline": med, "ratio": ratio, "spikes": float(len(spikes)),
                    "data_share": share, "onset": float(spikes[0][0])}
        what = (f"{len(spikes)} irregular slow steps ({steps}; up to {ratio:.1f}x the usual {med:.3g} s, not a "
                "recurring checkpoint / eval step)")
        typical = sorted(s[1] for s in spikes)[len(spikes) // 2]
        big = typical >= cfg.warn_stall and (typical - 1.0) * med >= cfg.warn_min_s
        if 2 * data_driven > len(spikes):
            return [Finding(
                kind="dataloader_stall", step=step, onset=spikes[0][0],
                severity=Severity.WARNING if big else Severity.INFO, signal="data_time",
                value=data, score=ratio, detector=self.name, rank=record.rank, host=record.host,
                evidence={**evidence, "data_time": data},
                message=f"{what}: {data_driven} of them spent most of the excess waiting for data")]
        return [Finding(
            kind="step_time_spike", step=step, onset=spikes[0][0], severity=Severity.INFO, signal="step_time",
            value=step_time, score=(step_time - med) / scale, detector=self.name, rank=record.rank,
            host=record.host, evidence=evidence, message=f"{what}, not waiting for data")]

    def _regression(self, record: StepRecord, before: float, now: float) -> Finding:
        cfg = self.config
        data_before, data_now = self._data_median(self._base), self._data_median(self._recent)
        share = ((data_now - data_before) / (now - before)
                 if math.isfinite(data_before) and math.isfinite(data_now) else 0.0)
        onset = record.step - cfg.persist + 1
        evidence = {"before": before, "after": now, "ratio": now / before, "data_share": share}
        what = f"step time rose {now / before:.2f}x ({before:.3g} s -> {now:.3g} s, median of {cfg.persist} steps)"
        self._base.clear()  # the new level is the baseline from now on
        self._base.extend(self._recent)
        self._recent.clear()
        big = now >= cfg.warn_ratio * before and now - before >= cfg.warn_min_s
        severity = Severity.WARNING if big else Severity.INFO
        if share >= cfg.data_share:
            return Finding(kind="dataloader_stall", step=record.step, onset=onset, severity=severity,
                           signal="data_time", value=data_now, score=now / before, detector=self.name,
                           rank=record.rank, host=record.host, evidence=evidence,
                           message=f"{what}; {share:.0%} of the rise is waiting for data "
                                   f"({data_before:.3g} s -> {data_now:.3g} s)")
        return Finding(kind="slowdown", step=record.step, onset=onset, severity=severity, signal="step_time",
                       value=now, score=now / before, detector=self.name, rank=record.rank, host=record.host,
                       evidence=evidence, message=f"{what}; not data waiting (compute or communication got slower)")

    def state_dict(self) -> dict[str, Any]:
        return {"base": [list(b) for b in self._base], "recent": [list(r) for r in self._recent], "seen": self._seen,
                "outliers": [list(o) for o in self._outliers], "irregular": [list(i) for i in self._irregular]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._base = deque(((float(a), float(b)) for a, b in state["base"]), maxlen=self.config.window)
        self._recent = deque(((float(a), float(b)) for a, b in state["recent"]), maxlen=self.config.persist)
        self._seen = int(state["seen"])
        self._outliers = deque(((int(s), float(r)) for s, r in state["outliers"]), maxlen=self.config.gaps + 1)
        self._irregular = [(int(a), float(b), float(c)) for a, b, c in state.get("irregular", [])]
