"""Straggler ranks: one rank consistently slower than its peers, named with its host.

Engine-level (all ranks). In data-parallel training the gradient all-reduce makes every rank's wall step time
equal to the slowest one's, so the comparison uses what each rank did *before* its first collective: ``work`` =
``data_time`` + ``compute_time`` (:mod:`stability.hooks.timing`; NVIDIA resiliency-ext's straggler detector times
sections the same way). Records without them are ignored, so the detector is silent on every older corpus; so
are the records of forked Hogwild processes (coordinate ``fork``: no collective, nobody waits for them).

Per step, once every known rank reported it (or the newest step is ``lag`` (64) steps ahead), each rank's score is
``work / median(work of the other ranks)``. A rank is a straggler when, over its last ``window`` (24) scored steps,
its median score is ``>= ratio`` (1.15), at least ``share`` (75 %) of them are ``>= 1.05``, and the log of its
median score is ``z_threshold`` (5) standard errors above 0 (standard error: the ranks' pooled robust spread of log
scores around their own medians, x 1.2533 / sqrt(window)). One slow step (a checkpoint, a GC pause) is not a
straggler; a rank 20 % slower on every step is named within ~``window`` steps when the ranks' step-to-step noise is
~10 %; noisier ranks need a larger gap to be named (no false straggler). One finding
per rank until it has been below the ratio for a whole window again.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stability.detectors.base import Finding, Severity
from stability.records import FORK, StepRecord

__all__ = ["StragglerConfig", "StragglerDetector"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerConfig:
    """Settings of :class:`StragglerDetector`."""

    window: int = 24
    ratio: float = 1.15
    share: float = 0.75
    slow: float = 1.05
    z_threshold: float = 5.0
    """... and its median log score is this many standard errors above 0 (noisy ranks need a larger gap)."""
    lag: int = 64
    warmup: int = 5
    """Steps of each rank ignored at the start (compilation, cache warm-up)."""


def _work(record: StepRecord) -> float | None:
    data, compute = record.signals.get("data_time"), record.signals.get("compute_time")
    if data is None and compute is None:
        return None
    total = (data or 0.0) + (compute or 0.0)
    return total if math.isfinite(total) and total > 0 else None


class StragglerDetector:
    """Relative per-rank section time against the peers (see the module docstring)."""

    name = "straggler"

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._pending: dict[int, dict[int, float]] = {}
        self._hosts: dict[int, str] = {}
        self._seen: dict[int, int] = {}
        self._scores: dict[int, deque[float]] = {}
        self._flagged: set[int] = set()
        self._newest = -1
        self._decided = -1

    def update(self, record: StepRecord) -> list[Finding]:
        work = _work(record)
        if work is None or record.coords.get(FORK):  # Hogwild processes wait for no one
            return []
        rank = record.rank
        self._hosts[rank] = record.host or self._hosts.get(rank, "")
        seen = self._seen[rank] = self._seen.get(rank, 0) + 1
        if seen <= self.config.warmup or record.step <= self._decided:
            return []
        self._pending.setdefault(record.step, {})[rank] = work
        self._newest = max(self._newest, record.step)
        out: list[Finding] = []
        while self._pending:
            step = min(self._pending)
            if len(self._pending[step]) < len(self._hosts) and step > self._newest - self.config.lag:
                break
            out += self._decide(step, self._pending.pop(step))
            self._decided = step
        return out

    def _decide(self, step: int, works: dict[int, float]) -> list[Finding]:
        if len(works) < 2:
            return []
        cfg = self.config
        out: list[Finding] = []
        for rank, work in works.items():
            peers = float(np.median([w for r, w in works.items() if r != rank]))
            scores = self._scores.setdefault(rank, deque(maxlen=cfg.window))
            scores.append(work / peers)
            if len(scores) < cfg.window:
                continue
            med = float(np.median(scores))
            share = sum(s >= cfg.slow for s in scores) / len(scores)
            if rank in self._flagged:
                if max(scores) < cfg.ratio:
                    self._flagged.discard(rank)
                continue
            if med >= cfg.ratio and share >= cfg.share and math.log(med) >= cfg.z_threshold * self._noise():
                self._flagged.add(rank)
                host = self._hosts.get(rank, "")
                where = f"rank {rank}" + (f" on {host}" if host else "")
                out.append(Finding(
                    kind="straggler", step=step, onset=step - cfg.window + 1, severity=Severity.WARNING,
                    signal="compute_time", value=work, score=med, detector=self.name, rank=rank, host=host,
                    evidence={"ratio": med, "share": share, "work": work, "peers": peers, "ranks": float(len(works))},
                    message=f"{where} is a straggler: its data + compute time before the first collective is "
                            f"{med:.2f}x its {len(works) - 1} peers' (median over {cfg.window} steps, slower on "
                            f"{share:.0%} of them); every rank waits for it at the all-reduce"))
        return out

    def _noise(self) -> float:
        """Standard error of a rank's median log score: pooled robust spread of every rank's log scores around its
        own median, / sqrt(window)."""
        residuals = []
        for scores in self._scores.values():
            logs = np.log(np.asarray(scores, dtype=float))
            residuals.append(logs - np.median(logs))
        spread = 1.4826 * float(np.median(np.abs(np.concatenate(residuals)))) if residuals else 0.0
        return 1.2533 * spread / math.sqrt(self.config.window)

    def state_dict(self) -> dict[str, Any]:
        return {"pending": {str(s): {str(r): w for r, w in v.items()} for s, v in self._pending.items()},
                "hosts": {str(r): h for r, h in self._hosts.items()},
                "seen": {str(r): n for r, n in self._seen.items()},
                "scores": {str(r): list(v) for r, v in self._scores.items()}, "flagged": sorted(self._flagged),
                "newest": self._newest, "decided": self._decided}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = {int(s): {int(r): float(w) for r, w in v.items()} for s, v in state["pending"].items()}
        self._hosts = {int(r): str(h) for r, h in state["hosts"].items()}
        self._seen = {int(r): int(n) for r, n in state["seen"].items()}
        self._scores = {int(r): deque((float(x) for x in v), maxlen=self.config.window)
                        for r, v in state["scores"].items()}
        self._flagged = {int(r) for r in state["flagged"]}
        self._newest, self._decided = int(state["newest"]), int(state["decided"])
