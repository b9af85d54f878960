"""Loss-spike detector: robust z of log loss against a local-linear baseline, confirmed at the next step.

Rules (calibrated on the clean modded-nanogpt baselines in ``/work/shared/data/real-runs``; see the README traps):

* **Candidate** at step t: ``z >= z_threshold`` (6, OLMo-core's 6 sigma) and ``loss / baseline >= ratio_threshold``
  (1.3). The baseline is a robust line through the last ``window`` accepted log losses (``_stats.Baseline``).
* **Few points** (fewer than ``min_points`` accepted points, e.g. the start of a run or a short excerpt): no scale
  is known, so a candidate needs ``ratio >= few_ratio`` (1.5) against the median of at least ``few_min_points`` (2)
  points. Across the ~61k steps of clean baselines no step-to-step rise of the median of the first points reaches
  1.5x (start-up transients fall), and a candidate still has to be confirmed by the next step.
* **Heavy tails**: a candidate must also rise ``tail_factor`` (2) times, in log space, above the
  ``tail_rank``-th (2nd) largest rise of the last ``window`` judged records. A near-zero classification loss is
  heavy-tailed (a few hard samples lift a CNN's 1e-2 loss 3-4x every few steps, each 9+ robust sigmas): such a
  series is not spiking each time. With Gaussian noise the 2nd largest of 96 rises is ~2.2 sigma, so the z >= 6
  rule binds first and nothing changes there.
* **Huge jump** (``ratio >= immediate_ratio``, 3x): ERROR at once (delay 0).
* **Averaged records** (``loss_steps`` = s > 1: the logged loss is the mean of s steps, as Megatron and the HF
  Trainer log it): a candidate whose mean rose ``ratio`` would need one batch of ``1 + s * (ratio - 1)`` to be a
  batch outlier, so that *implied one-step ratio* is what the huge-jump rule compares (a 10-step mean 1.77x up =
  one 8.7x batch or a sustained jump: ERROR at once). One such record is also enough history for the few-points
  rule (it already averages ``few_min_points`` steps or more). On 10-step means of the clean baselines no record
  rises even 1.15x over the previous one, so this cannot fire on their noise.
* **Confirmation** at the next record: if that loss passes the same test against the same (frozen) baseline the
  spike is real: ``loss_spike`` ERROR (WARNING when the peak ratio is below ``error_ratio``), delay 1. If it is
  back at the baseline (within ``recover_ratio`` or 3 robust sigmas, the recovery test below) it was a one-step
  batch-content jump (36 such in the clean 1.5B run, all reverting): ``loss_spike`` INFO with
  ``evidence["reverted"] = 1``. If it is neither (still up, but under the candidate test: 4.4 -> 7.9 -> 6.3 ->
  8.3 after a missing warm-up) the verdict waits up to ``max_wait`` (2) more records: a record passing the test
  confirms, one back at the baseline reverts, and a loss still in between after that is confirmed (it stayed up).
* **End**: while a confirmed spike lasts, points are not accepted; when the loss is back within
  ``recover_ratio`` of the pre-spike level the detector emits a closing INFO finding (same ``onset``, ``end`` set,
  ``evidence["closes"] = 1``). After ``max_active`` records without recovery it re-baselines on the new level.
  A record more than ``max_gap`` (100) steps after the spike's last one closes it (nothing is known in the gap:
  an excerpt, a resume) and is judged afresh against the pre-spike baseline; a candidate whose next record is
  that far is reported unconfirmed (WARNING), as at the end of the records.
* **Screen** (exact, issue #11): with ``min_points`` points or more, a loss less than ``ratio_threshold`` over
  :func:`~stability.detectors._rolling.level_lower_bound` cannot be a candidate, so it is accepted without the
  line fit. Its rise over the line (the heavy-tail rule's history) is then kept *lazily*: the record's window is
  the ``window`` accepted points before it (an append-only log of the accepted points since the last re-baseline
  holds them), and the rise is fitted only when the tail rule or :meth:`~SpikeDetector.state_dict` reads it (a
  candidate past the ratio and z tests; a snapshot). Same floats, same state.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors._candidate import candidate_finding
from stability.detectors._rolling import FastBaseline, level_lower_bound
from stability.detectors._stats import SCREEN_MARGIN, Prediction, log_positive, predict_level, safe_exp, times
from stability.detectors.base import Finding, Severity
from stability.records import StepRecord, loss_steps

__all__ = ["SpikeConfig", "SpikeDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SpikeConfig:
    """Settings of :class:`SpikeDetector` (log-space)."""

    window: int = 96
    min_points: int = 32
    few_min_points: int = 2
    z_threshold: float = 6.0
    ratio_threshold: float = 1.3
    few_ratio: float = 1.5
    immediate_ratio: float = 3.0
    error_ratio: float = 1.5
    recover_ratio: float = 1.1
    max_wait: int = 2
    max_gap: int = 100
    scale_floor: float = 1e-3
    max_active: int = 200
    tail_factor: float = 2.0
    tail_rank: int = 2
    signal: str = "loss"


class SpikeDetector:
    """Streaming loss-spike detector for one rank (see the module docstring)."""

    name = "spike"
    kind = "loss_spike"

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        cfg = self.config
        self._base = FastBaseline(window=cfg.window, min_points=cfg.min_points, scale_floor=cfg.scale_floor)
        self._pending: dict[str, Any] | None = None
        self._active: dict[str, Any] | None = None
        self._jumps: deque[float | int] = deque(maxlen=cfg.window)
        """Rises over the line of the last ``window`` judged records; an ``int`` is a lazy one (an index of
        :attr:`_lazy`) until :meth:`_resolve` fits it."""
        self._lazy: dict[int, tuple[int, float, float]] = {}
        """Lazy rises: id -> (end of the record's window in the accepted log, step, log loss)."""
        self._next_lazy = 0
        self._log_x: list[float] = []
        self._log_y: list[float] = []
        self._log_start = 0
        """The accepted points since the last re-baseline (from absolute index ``_log_start``; see the module
        docstring): a lazy rise's window is the ``window`` points before its end."""
        self._quiet = math.log(cfg.ratio_threshold) - SCREEN_MARGIN

    def _accept(self, x: int, y: float) -> None:
        """Add a point to the baseline and the accepted log (trimmed to what the lazy rises can still need)."""
        self._base.accept(x, y)
        self._log_x.append(float(x))
        self._log_y.append(y)
        window = self.config.window
        if len(self._log_x) >= 4 * window:  # keep the window of the oldest lazy rise (or the baseline's)
            end = next(iter(self._lazy.values()))[0] if self._lazy else self._log_start + len(self._log_x)
            drop = max(0, end - window) - self._log_start
            if drop > 0:
                del self._log_x[:drop], self._log_y[:drop]
                self._log_start += drop

    def _rebaseline(self) -> None:
        """Clear the baseline (and the log, once the lazy rises that read it are fitted)."""
        self._resolve()
        self._base.clear()
        self._log_x, self._log_y, self._log_start = [], [], 0

    def _resolve(self) -> deque[float]:
        """The rises with every lazy one fitted (the same float as the fit at its record)."""
        if self._lazy:
            window = self.config.window
            for i in range(len(self._jumps)):
                item = self._jumps[i]
                if type(item) is int:
                    end, x, y = self._lazy[item]
                    a, b = max(0, end - window) - self._log_start, end - self._log_start
                    xs = np.array(self._log_x[a:b], dtype=np.float64)
                    ys = np.array(self._log_y[a:b], dtype=np.float64)
                    self._jumps[i] = y - predict_level(xs, ys, x)
            self._lazy.clear()
        return self._jumps  # type: ignore[return-value]

    def _anomalous(self, y: float, pred: Prediction) -> bool:
        ratio = safe_exp(y - pred.level)
        if pred.points < self.config.min_points:
            return ratio >= self.config.few_ratio
        return (ratio >= self.config.ratio_threshold and pred.z(y) >= self.config.z_threshold
                and y - pred.level >= self.config.tail_factor * self._usual_jump())

    def _usual_jump(self) -> float:
        """The ``tail_rank``-th largest rise over the baseline among the last ``window`` judged records (0 while
        fewer): a jump must be ``tail_factor`` times that (in log space) to count."""
        k = self.config.tail_rank
        if len(self._jumps) < k:
            return 0.0
        return max(0.0, heapq.nlargest(k, self._resolve())[-1])

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one record."""
        value = record.get(self.config.signal)
        y = log_positive(value)
        if y is None:
            return []
        out = self._forget_across_gap(record)
        if self._active is not None:
            return out + self._track(record, y)
        if self._pending is not None:
            return out + self._judge_pending(record, y, self._pending)
        return out + self._candidate(record, y)

    def _forget_across_gap(self, record: StepRecord) -> list[Finding]:
        """A record more than ``max_gap`` steps after the open spike or candidate: nothing is known in between, so
        the spike is closed and the candidate reported unconfirmed; the record is then judged afresh."""
        out = []
        if self._active is not None and record.step - self._active["last"] > self.config.max_gap:
            gap = record.step - self._active["last"]
            out.append(self._close(record, self._active,
                                   f"records resume at step {record.step}, {gap} steps after the spike's last record"))
            self._active = None
        if self._pending is not None and record.step - self._pending["step"] > self.config.max_gap:
            gap = record.step - self._pending["step"]
            out.append(self._unconfirmed(self._pending, f"the next record is {gap} steps later, too far to tell "
                                         "whether it reverted at once"))
            self._pending = None
        return out

    def _judge_pending(self, record: StepRecord, y: float, pending: dict[str, Any]) -> list[Finding]:
        """Confirm the candidate, call it reverted, or wait (at most ``max_wait`` records)."""
        if self._anomalous(y, self._base.predict(record.step)):
            self._pending = None
            return [self._confirm(record, y, pending)]
        if self._recovered(y, pending):
            self._pending = None
            self._accept(record.step, y)
            return [self._reverted(record, pending)]
        pending["waited"] = pending.get("waited", 0) + 1
        if pending["waited"] > self.config.max_wait:  # neither back nor spiking again: it stayed up
            self._pending = None
            return [self._confirm(record, y, pending)]
        return []

    def _candidate(self, record: StepRecord, y: float) -> list[Finding]:
        """Judge a record with nothing open: accept it into the baseline, alarm at once, or hold a candidate."""
        steps = loss_steps(record)
        needed = 1 if steps >= self.config.few_min_points else self.config.few_min_points
        if len(self._base) < needed:
            self._accept(record.step, y)
            return []
        if len(self._base) >= self.config.min_points and y - level_lower_bound(self._base, record.step) < self._quiet:
            self._lazy_jump(record.step, y)  # under ratio_threshold over the line, whatever its fit: accepted
            self._accept(record.step, y)
            return []
        pred = self._base.predict(record.step)
        anomalous = self._anomalous(y, pred)
        if pred.points >= self.config.min_points:
            self._push_jump(y - pred.level)
        if not anomalous:
            self._accept(record.step, y)
            return []
        ratio = safe_exp(y - pred.level)
        cand = {"step": record.step, "y": y, "level": pred.level, "scale": pred.scale, "ratio": ratio,
                "z": pred.z(y), "points": pred.points, "rank": record.rank}
        implied = 1.0 + steps * (ratio - 1.0)
        if implied >= self.config.immediate_ratio:
            self._active = {**cand, "peak": ratio, "last": record.step, "records": 0}
            what = f"jumped {times(ratio)} over its baseline"
            if steps > 1:
                what += (f" (the loss is a mean over {steps:g} steps: one batch alone would have to be "
                         f"{times(implied)}, so the jump is sustained)")
            return [self._finding(record, cand, Severity.ERROR, what,
                                  extra={"loss_steps": steps} if steps > 1 else None)]
        self._pending = cand
        return []

    def _lazy_jump(self, x: int, y: float) -> None:
        """Append the rise of ``y`` over the line through the current window, to be fitted when read."""
        self._lazy[self._next_lazy] = (self._log_start + len(self._log_x), x, y)
        self._push_jump(self._next_lazy)
        self._next_lazy += 1

    def _push_jump(self, item: float | int) -> None:
        """Append a rise (or a lazy one's id), forgetting the lazy one the full deque drops."""
        jumps = self._jumps
        if len(jumps) == jumps.maxlen and type(jumps[0]) is int:
            del self._lazy[jumps[0]]  # type: ignore[index]
        jumps.append(item)

    def _confirm(self, record: StepRecord, y: float, cand: dict[str, Any]) -> Finding:
        ratio_now = safe_exp(y - cand["level"])
        peak = max(cand["ratio"], ratio_now)
        severity = Severity.ERROR if peak >= self.config.error_ratio else Severity.WARNING
        self._active = {**cand, "peak": peak, "last": record.step, "records": 0}
        return self._finding(
            record, cand, severity,
            f"jumped {times(cand['ratio'])} over its baseline at step {cand['step']} and is still "
            f"{times(ratio_now)} at step {record.step}",
            extra={"confirm_ratio": ratio_now},
        )

    def _reverted(self, record: StepRecord, cand: dict[str, Any]) -> Finding:
        return self._finding(
            record, cand, Severity.INFO,
            f"{'one-step ' if not cand.get('waited') else ''}jump of {times(cand['ratio'])} at step {cand['step']} "
            f"reverted at step {record.step}: a batch-content outlier, not an instability of the run",
            end=cand["step"], extra={"reverted": 1.0},
        )

    def _recovered(self, y: float, cand: dict[str, Any]) -> bool:
        """``y`` is back within ``recover_ratio`` (or 3 robust sigmas) of the candidate's baseline."""
        scale = cand["scale"] if cand["scale"] == cand["scale"] else 0.0
        return bool(y - cand["level"] <= max(math.log(self.config.recover_ratio), 3.0 * scale))

    def _track(self, record: StepRecord, y: float) -> list[Finding]:
        active = self._active
        assert active is not None
        if self._recovered(y, active):
            self._active = None
            self._accept(record.step, y)
            return [self._close(record, active, f"back to baseline at step {record.step}")]
        active["last"] = record.step
        active["peak"] = max(active["peak"], safe_exp(y - active["level"]))
        active["records"] += 1
        if active["records"] > self.config.max_active:
            self._active = None
            self._rebaseline()
            self._accept(record.step, y)
        return []

    def _close(self, record: StepRecord, active: dict[str, Any], why: str) -> Finding:
        return self._finding(record, active, Severity.INFO, f"{why} (spike steps {active['step']}..{active['last']})",
                             end=active["last"], extra={"closes": 1.0})

    def _finding(self, record: StepRecord, cand: dict[str, Any], severity: Severity, what: str, *,
                 end: int | None = None, extra: dict[str, float] | None = None) -> Finding:
        return candidate_finding(self, self.config.signal, record, cand, severity, what, end=end, extra=extra)

    def finish(self) -> list[Finding]:
        """Flush a candidate that the end of the records left unconfirmed (WARNING)."""
        if self._pending is None:
            return []
        cand, self._pending = self._pending, None
        return [self._unconfirmed(cand, "the records end before it could be confirmed")]

    def _unconfirmed(self, cand: dict[str, Any], why: str) -> Finding:
        baseline = safe_exp(cand["level"])
        return Finding(
            kind=self.kind, step=cand["step"], onset=cand["step"], severity=Severity.WARNING,
            signal=self.config.signal, value=safe_exp(cand["y"]),
            message=f"{self.config.signal} jumped {times(cand['ratio'])} over its baseline {baseline:.4g} at step "
            f"{cand['step']}; {why}",
            detector=self.name, rank=cand["rank"], score=cand["ratio"],
            evidence={"ratio": cand["ratio"], "z": cand["z"], "baseline": baseline, "unconfirmed": 1.0},
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"base": self._base.state_dict(), "pending": self._pending,
                "active": None if self._active is None else dict(self._active), "jumps": list(self._resolve())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._base.load_state_dict(state["base"])
        self._log_x, self._log_y, self._log_start = self._base.steps(), self._base.values(), 0
        self._lazy.clear()
        self._pending = None if state["pending"] is None else dict(state["pending"])
        self._active = None if state["active"] is None else dict(state["active"])
        self._jumps.clear()
        self._jumps.extend(float(v) for v in state.get("jumps", ()))
