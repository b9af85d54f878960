"""W&B sink: one *diagnosis* run per training run, with alerts, an incremental findings table and the loss /
grad-norm values around each incident.

The worker never writes into the trainer's own W&B run (co-writers overwrite each other's ``_step``s; shared mode
is experimental and online-only, see service-notes §1.2). It creates a separate run in the same project and group
(``job_type="diagnosis"``) whose config names the training run. ``wandb`` is imported only when a run is created.

Per finding (deduplicated by ``(rank, kind, step)``):

* a row in the table ``findings`` (``log_mode="INCREMENTAL"``: each log writes only the new rows), columns
  :data:`TABLE_COLUMNS`: step, rank, kind, severity, top cause, top three causes with scores, score, evidence,
  remedy, rollback step, batches to skip;
* for severity >= warning, ``run.alert(...)`` (title ``"<kind> at step <step>"``, level WARN/ERROR,
  ``wait_duration=300`` s so W&B itself also throttles repeats of one title); a revision of an alerted diagnosis
  (``evidence["revised"]``: its first cause or severity changed, e.g. a cross-rank verdict that came after a
  provisional alert) adds a row and an alert titled ``"<kind> at step <step> (revised)"``;
* for incidents, the detector signals of the rank for the steps within ``window`` of the incident: ``diag/loss``,
  ``diag/grad_norm`` and ``diag/<the finding's signal>`` (e.g. ``diag/grad_norm/h.1.attn``), logged against the
  custom step metric ``diag/step`` (so out-of-order steps are accepted), and, once the window is complete (or the
  run ends), a line chart of the finding's signal over the window (``wandb.plot.line``, key
  ``incidents/<kind>_step<step>_rank<rank>``).

Linking: the run metadata written by the training side (``stability.session``) carries ``wandb_run_id``,
``wandb_group`` and ``wandb_project`` when the training script had an active ``wandb.run``; the diagnosis run
then uses the same project and group and names the training run in its config (``training_wandb_run_id``). It
never writes to the training run (another process owns it).

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
from stability.records import StepRecord
from stability.worker.sinks import Entry, MetaLookup, finding_key

__all__ = ["TABLE_COLUMNS", "WandbSink"]

logger = logging.getLogger(__name__)

TABLE_COLUMNS: list[str | int] = [
    "step", "rank", "kind", "severity", "top_cause", "top_causes", "score", "evidence", "remedy", "rollback_step",
    "skip_batches",
]  # fmt: skip
"""Columns of the incremental ``findings`` table (``rollback_step`` -1: none)."""

ALERT_WAIT_S = 300
"""``wait_duration`` of every alert: W&B drops a repeat of the same title within this many seconds."""

BASE_SIGNALS: tuple[str, ...] = ("loss", "grad_norm")
"""Signals logged as ``diag/<name>`` around every incident, besides the finding's own signal."""


@dataclass(slots=True)
class _Window:
    """An incident whose surrounding steps are being logged."""

    rank: int
    lo: int
    hi: int
    kind: str
    step: int
    signal: str
    points: dict[int, float] = field(default_factory=dict)
    """step -> value of ``signal``, for the incident's chart."""


@dataclass(slots=True)
class _RunState:
    """What the sink keeps for one training run."""

    run: Any
    table: Any
    seen: set[str] = field(default_factory=set)
    recent: dict[int, deque[StepRecord]] = field(default_factory=dict)
    """Per rank: the last ``window + 1`` records."""
    windows: list[_Window] = field(default_factory=list)
    """Open incident windows still waiting for later records."""
    logged: set[tuple[int, int, str]] = field(default_factory=set)
    """(rank, step, signal) already logged as a diag/* value."""
    charts: int = 0


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
            for window in state.windows:  # the run ended before these windows filled up
                self._chart(state, window)
            state.windows = []
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
        for window in state.windows:  # incidents of earlier batches still collecting later steps
            self._log_range(state, window, points)
        new = 0
        for f in findings:
            if finding_key(f) in state.seen:
                continue
            state.seen.add(finding_key(f))
            new += 1
            state.table.add_data(*_row(f))
            revised = bool(f.evidence.get("revised"))
            if revised or f.severity.rank >= Severity.WARNING.rank:
                state.run.alert(
                    title=f"{f.kind} at step {f.step}{' (revised)' if revised else ''}"[:64],
                    text=("Revised diagnosis\n" if revised else "") + _alert_text(f),
                    level="ERROR" if f.severity is Severity.ERROR else "WARN",
                    wait_duration=ALERT_WAIT_S,
                )
                if revised:
                    continue  # its window was opened by the alert it corrects
                window = _Window(f.rank, f.step - self._window, f.step + self._window, f.kind, f.step, f.signal)
                state.windows.append(window)
                self._log_range(state, window, points)
        if new:
            state.run.log({"findings": state.table})
        for entry in records:
            recent = state.recent.setdefault(entry.rank, deque(maxlen=self._window + 1))
            recent.append(entry.record)
        last = {rank: max(steps) for rank, steps in points.items() if steps}
        still_open = []
        for window in state.windows:
            if last.get(window.rank, -1) < window.hi:
                still_open.append(window)
            else:
                self._chart(state, window)
        state.windows = still_open

    @staticmethod
    def _points(state: _RunState, records: Sequence[Entry]) -> dict[int, dict[int, StepRecord]]:
        """rank -> step -> record, of the recent past and this batch."""
        points: dict[int, dict[int, StepRecord]] = {}
        for rank, recent in state.recent.items():
            points.setdefault(rank, {}).update((r.step, r) for r in recent)
        for entry in records:
            points.setdefault(entry.rank, {})[entry.record.step] = entry.record
        return points

    def _log_range(self, state: _RunState, window: _Window, points: dict[int, dict[int, StepRecord]]) -> None:
        names = tuple(dict.fromkeys((*BASE_SIGNALS, window.signal)))
        by_step = points.get(window.rank, {})
        for step in sorted(s for s in by_step if window.lo <= s <= window.hi):
            record = by_step[step]
            value = record.get(window.signal)
            if value is not None:
                window.points[step] = value
            row = {
                f"diag/{name}": record.get(name)
                for name in names
                if record.get(name) is not None and (window.rank, step, name) not in state.logged
            }
            if row:
                state.logged.update((window.rank, step, k[len("diag/") :]) for k in row)
                state.run.log({"diag/step": step, "diag/rank": window.rank, **row})

    def _chart(self, state: _RunState, window: _Window) -> None:
        """Log the incident's signal over its window as a line chart (``incidents/<kind>_step<step>_rank<r>``)."""
        if not window.points:
            return
        import wandb

        table = wandb.Table(columns=["step", window.signal], data=[[s, v] for s, v in sorted(window.points.items())])
        title = f"{window.kind} at step {window.step} (rank {window.rank}): {window.signal}"
        key = f"incidents/{window.kind}_step{window.step}_rank{window.rank}"
        state.run.log({key: wandb.plot.line(table, "step", window.signal, title=title)})
        state.charts += 1


def _row(f: Finding) -> list[Any]:
    top = f.causes[0] if f.causes else None
    evidence = top.evidence if top else ", ".join(f"{k}={v:.4g}" for k, v in f.evidence.items())
    return [
        f.step,
        f.rank,
        f.kind,
        f.severity.value,
        top.cause if top else "",
        "; ".join(f"{c.cause} ({c.score:.2f})" for c in f.causes[:3]),
        float(top.score if top else f.score),
        evidence,
        (top.remedy or catalogue_remedy(top.cause)) if top else "",
        f.rollback_step if f.rollback_step is not None else -1,
        " ".join(f.skip_batches),
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
