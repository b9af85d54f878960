"""W&B sink: one *diagnosis* run per training run, with alerts, an incremental findings table and the loss /
grad-norm values around each incident.

The worker never writes into the trainer's own W&B run (co-writers overwrite each other's ``_step``s; shared mode
is experimental and online-only, see service-notes §1.2). It creates a separate run in the same project and group
(``job_type="diagnosis"``) whose config names the training run. ``wandb`` is imported only when a run is created.

Per finding (deduplicated by ``(rank, kind, step)``):

* a row in the table ``findings`` (``log_mode="INCREMENTAL"``: each log writes only the new rows);
* for severity >= warning, ``run.alert(...)`` (title ``"<kind> at step <step>"``, level WARN/ERROR,
  ``wait_duration=300`` s so W&B itself also throttles repeats of one title);
* for incidents, ``diag/loss`` and ``diag/grad_norm`` of the rank for the steps within ``window`` of the incident,
  logged against the custom step metric ``diag/step`` (so out-of-order steps are accepted).

W&B failures are logged and never raised: the diagnosis must go on when W&B is unreachable.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stability.detectors.base import Finding, Severity
from stability.detectors.causes import remedy as catalogue_remedy
from stability.worker.sinks import Entry, MetaLookup, finding_key

__all__ = ["TABLE_COLUMNS", "WandbSink"]

logger = logging.getLogger(__name__)

TABLE_COLUMNS: list[str | int] = [
    "step", "rank", "kind", "severity", "top_cause", "score", "evidence", "remedy", "rollback_step",
]  # fmt: skip
"""Columns of the incremental ``findings`` table."""

ALERT_WAIT_S = 300
"""``wait_duration`` of every alert: W&B drops a repeat of the same title within this many seconds."""


@dataclass(slots=True)
class _RunState:
    """What the sink keeps for one training run."""

    run: Any
    table: Any
    seen: set[str] = field(default_factory=set)
    recent: dict[int, deque[tuple[int, float, float]]] = field(default_factory=dict)
    """Per rank: the last ``window`` (step, loss, grad_norm)."""
    windows: list[tuple[int, int, int]] = field(default_factory=list)
    """Open incident windows (rank, first step, last step) still waiting for later records."""
    logged: set[tuple[int, int]] = field(default_factory=set)
    """(rank, step) already logged as diag/* values."""


class WandbSink:
    """Sends findings to a W&B diagnosis run per training run.

    Enabled for a run when its metadata has ``wandb_project`` or ``WANDB_PROJECT`` is set. The mode comes from the
    metadata's ``wandb_mode`` or ``WANDB_MODE``; files go to the run's ``run_dir`` when it exists on this host,
    else to a temporary directory.

    Args:
        meta: Run metadata lookup (``run_dir``, ``wandb_project``, ``wandb_group``, ``wandb_run_id``,
            ``wandb_mode``).
        window: Steps before and after an incident whose loss and grad norm are logged.
    """

    def __init__(self, meta: MetaLookup, *, window: int = 10) -> None:
        self._meta = meta
        self._window = window
        self._runs: dict[str, _RunState | None] = {}

    def emit(self, run_id: str, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        """Remember the batch's loss/grad norm values, then report new findings."""
        try:
            state = self._state(run_id)
            if state is not None:
                self._emit(state, findings, records)
        except Exception:
            logger.exception("%s: W&B diagnosis logging failed; continuing without it for this batch", run_id)

    def close(self, run_id: str) -> None:
        """Finish the run's diagnosis run."""
        state = self._runs.pop(run_id, None)
        if state is None:
            return
        try:
            state.run.finish()
        except Exception:
            logger.exception("%s: W&B finish failed", run_id)

    # -- run creation ----------------------------------------------------------------------------------------

    def _state(self, run_id: str) -> _RunState | None:
        if run_id not in self._runs:
            self._runs[run_id] = self._start(run_id)
        return self._runs[run_id]

    def _start(self, run_id: str) -> _RunState | None:
        meta = self._meta(run_id)
        project = meta.get("wandb_project") or os.environ.get("WANDB_PROJECT")
        if not project:
            return None
        import wandb

        os.environ.pop("WANDB_SERVICE", None)  # never attach to a wandb-core inherited from a parent process
        run_dir = meta.get("run_dir")
        directory = run_dir if run_dir and Path(run_dir).is_dir() else tempfile.mkdtemp(prefix="stability-wandb-")
        try:
            run = wandb.init(
                project=project,
                group=meta.get("wandb_group") or run_id,
                job_type="diagnosis",
                name=f"{run_id}-diagnosis",
                config={"training_run_id": run_id, "training_wandb_run_id": meta.get("wandb_run_id")},
                dir=directory,
                mode=meta.get("wandb_mode") or os.environ.get("WANDB_MODE") or None,  # type: ignore[arg-type]
                reinit="create_new",
            )
        except Exception:
            logger.exception("%s: wandb.init failed; no W&B diagnosis run for this run", run_id)
            return None
        run.define_metric("diag/step")
        run.define_metric("diag/*", step_metric="diag/step")
        table = wandb.Table(columns=TABLE_COLUMNS, log_mode="INCREMENTAL")
        logger.info("%s: W&B diagnosis run %s in project %s", run_id, run.id, project)
        return _RunState(run=run, table=table)

    # -- per batch -------------------------------------------------------------------------------------------

    def _emit(self, state: _RunState, findings: Sequence[Finding], records: Sequence[Entry]) -> None:
        points = self._points(state, records)
        for rank, lo, hi in state.windows:  # incidents of earlier batches still collecting later steps
            self._log_range(state, rank, lo, hi, points)
        new = 0
        for f in findings:
            if finding_key(f) in state.seen:
                continue
            state.seen.add(finding_key(f))
            new += 1
            state.table.add_data(*_row(f))
            if f.severity.rank >= Severity.WARNING.rank:
                state.run.alert(
                    title=f"{f.kind} at step {f.step}"[:64],
                    text=_alert_text(f),
                    level="ERROR" if f.severity is Severity.ERROR else "WARN",
                    wait_duration=ALERT_WAIT_S,
                )
                window = (f.rank, f.step - self._window, f.step + self._window)
                state.windows.append(window)
                self._log_range(state, *window, points)
        if new:
            state.run.log({"findings": state.table})
        for entry in records:
            rec = entry.record
            recent = state.recent.setdefault(entry.rank, deque(maxlen=self._window + 1))
            recent.append((rec.step, rec.get("loss"), rec.get("grad_norm")))
        last = {rank: max(steps) for rank, steps in points.items() if steps}
        state.windows = [w for w in state.windows if last.get(w[0], -1) < w[2]]

    @staticmethod
    def _points(state: _RunState, records: Sequence[Entry]) -> dict[int, dict[int, tuple[int, float, float]]]:
        """(rank -> step -> (step, loss, grad_norm)) of the recent past and this batch."""
        points: dict[int, dict[int, tuple[int, float, float]]] = {}
        for rank, recent in state.recent.items():
            points.setdefault(rank, {}).update((p[0], p) for p in recent)
        for entry in records:
            rec = entry.record
            points.setdefault(entry.rank, {})[rec.step] = (rec.step, rec.get("loss"), rec.get("grad_norm"))
        return points

    def _log_range(
        self, state: _RunState, rank: int, lo: int, hi: int, points: dict[int, dict[int, tuple[int, float, float]]]
    ) -> None:
        for step in sorted(s for s in points.get(rank, {}) if lo <= s <= hi):
            self._log_point(state, rank, points[rank][step])

    def _log_point(self, state: _RunState, rank: int, point: tuple[int, float, float]) -> None:
        step, loss, grad_norm = point
        if (rank, step) in state.logged:
            return
        state.logged.add((rank, step))
        state.run.log({"diag/step": step, "diag/rank": rank, "diag/loss": loss, "diag/grad_norm": grad_norm})


def _row(f: Finding) -> list[Any]:
    top = f.causes[0] if f.causes else None
    evidence = top.evidence if top else ", ".join(f"{k}={v:.4g}" for k, v in f.evidence.items())
    return [
        f.step,
        f.rank,
        f.kind,
        f.severity.value,
        top.cause if top else "",
        float(top.score if top else f.score),
        evidence,
        (top.remedy or catalogue_remedy(top.cause)) if top else "",
        f.rollback_step if f.rollback_step is not None else -1,
    ]


def _alert_text(f: Finding) -> str:
    lines = [f"rank {f.rank}: {f.message}"]
    for hint in f.causes[:3]:
        lines.append(f"- {hint.cause} ({hint.score:.2f}): {hint.evidence}")
    if f.causes:
        lines.append(f"Remedy: {f.causes[0].remedy or catalogue_remedy(f.causes[0].cause)}")
    if f.rollback_step is not None:
        lines.append(f"Safe rollback step: {f.rollback_step}")
    return "\n".join(lines)
