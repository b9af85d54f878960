"""WandbSink against real wandb in offline mode (the W&B server is the one part that cannot run here): the
``.wandb`` file written by wandb-core is parsed back (tests/wandb_files.py) and its records asserted."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from stability.detectors.base import CauseHint, Finding, Severity
from stability.records import StepRecord
from stability.worker.sinks import Entry
from stability.worker.wandb_sink import TABLE_COLUMNS, WandbSink
from tests import wandb_files


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_SERVICE", "inherited-from-a-parent")  # must be stripped by the sink
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return run_dir


def entries(run_id: str, steps: range, rank: int = 0) -> list[Entry]:
    return [
        Entry(
            entry_id=f"{1000 + s}-{s}",
            rank=rank,
            record=StepRecord(run_id=run_id, step=s, rank=rank, signals={"loss": 10.0 - 0.1 * s, "grad_norm": 1.0 + s}),
        )
        for s in steps
    ]


SPIKE = Finding(
    kind="loss_spike", step=15, onset=14, severity=Severity.WARNING, signal="loss", value=3.0,
    message="loss jumped 5x", detector="spike", score=7.5,
    causes=(
        CauseHint(cause="bad_batch", score=0.8, evidence="no gradient precursor", remedy="skip the batch"),
        CauseHint(cause="lr_too_high", score=0.3, evidence="lr rose"),
    ),
    skip_batches=("b14", "b15"),
)  # fmt: skip
NAN = Finding(
    kind="nan", step=30, onset=30, severity=Severity.ERROR, signal="loss", value=math.nan,
    message="loss is nan", detector="nan", rollback_step=20,
)  # fmt: skip
INFO = Finding(
    kind="grad_vanishing", step=35, onset=33, severity=Severity.INFO, signal="grad_norm", value=1e-9,
    message="tiny grads", detector="vanish",
)  # fmt: skip


def test_alerts_table_and_history_in_the_offline_run(offline_wandb: Path) -> None:
    meta = {
        "wandb_project": "stab-test",
        "wandb_group": "grp",
        "wandb_run_id": "train123",
        "run_dir": str(offline_wandb),
    }
    sink = WandbSink(lambda run_id: meta, window=5)
    sink.emit("r1", [SPIKE], entries("r1", range(0, 20)))
    sink.emit("r1", [SPIKE, NAN, INFO], entries("r1", range(20, 40)))  # SPIKE again: a re-delivered batch
    sink.emit("r1", [NAN], [])
    sink.close("r1")

    path = wandb_files.finished_run_file(offline_wandb)  # files go to the run dir, not WANDB_DIR
    info = wandb_files.run_info(path)
    assert info["project"] == "stab-test" and info["group"] == "grp" and info["job_type"] == "diagnosis"
    assert info["display_name"] == "r1-diagnosis"
    config = wandb_files.config(path)
    assert config["training_run_id"] == "r1" and config["training_wandb_run_id"] == "train123"

    alerts = wandb_files.alerts(path)
    assert [(a["title"], a["level"]) for a in alerts] == [
        ("loss_spike at step 15", "WARN"),
        ("nan at step 30", "ERROR"),
    ]
    assert all(a["wait_duration"] == 300_000 for a in alerts)
    assert "loss jumped 5x" in alerts[0]["text"] and "bad_batch" in alerts[0]["text"]
    assert "skip the batch" in alerts[0]["text"] and "rollback step: 20" in alerts[1]["text"]

    rows = wandb_files.history(path)
    diag = {r["diag/step"]: r for r in rows if "diag/loss" in r}
    # +-5 steps around 15 (20..20 arrived in the next batch) and around 30 (35 is the last one in the window)
    assert sorted(diag) == [*range(10, 21), *range(25, 36)]
    assert diag[12]["diag/loss"] == pytest.approx(10.0 - 1.2) and diag[12]["diag/grad_norm"] == 13.0
    tables = [r for r in rows if r.get("findings/_type") == "incremental-table-file"]
    assert [t["findings/nrows"] for t in tables] == [1, 3]  # cumulative row count; the repeated SPIKE is not a row
    assert [t["findings/increment_num"] for t in tables] == [0, 1]

    table_rows = []
    for t in tables:
        content = json.loads((path.parent / "files" / t["findings/path"]).read_text())
        assert content["columns"] == TABLE_COLUMNS
        table_rows += content["data"]  # each increment file holds only the rows new in that log
    assert [(r[0], r[2], r[3], r[4]) for r in table_rows] == [
        (15, "loss_spike", "warning", "bad_batch"), (30, "nan", "error", ""), (35, "grad_vanishing", "info", ""),
    ]  # fmt: skip
    named = [dict(zip(TABLE_COLUMNS, r, strict=True)) for r in table_rows]
    assert {"step", "kind", "severity", "top_causes", "evidence", "remedy", "rollback_step"} <= set(TABLE_COLUMNS)
    assert named[0]["top_causes"] == "bad_batch (0.80); lr_too_high (0.30)"
    assert named[0]["evidence"] == "no gradient precursor" and named[0]["remedy"] == "skip the batch"
    assert named[0]["skip_batches"] == "b14 b15"
    assert named[1]["rollback_step"] == 20 and named[0]["rollback_step"] == -1

    # one line chart per incident, of the finding's signal over its +-5 window, logged once the window is complete
    visualize = {k: v for k, v in wandb_files.config(path).items() if k.startswith("_wandb/visualize/")}
    assert sorted(visualize) == [
        "_wandb/visualize/incidents/loss_spike_step15_rank0", "_wandb/visualize/incidents/nan_step30_rank0",
    ]  # fmt: skip
    spike_chart = visualize["_wandb/visualize/incidents/loss_spike_step15_rank0"]
    assert spike_chart["panel_config"]["panelDefId"] == "wandb/line/v0"
    assert spike_chart["panel_config"]["fieldSettings"] == {"x": "step", "y": "loss", "stroke": None}
    chart_table = next(r for r in rows if "incidents/loss_spike_step15_rank0_table/path" in r)
    data = json.loads((path.parent / "files" / chart_table["incidents/loss_spike_step15_rank0_table/path"]).read_text())
    assert data["columns"] == ["step", "loss"] and [d[0] for d in data["data"]] == list(range(10, 21))
    assert data["data"][2][1] == pytest.approx(10.0 - 1.2)


def test_disabled_without_project(offline_wandb: Path) -> None:
    sink = WandbSink(lambda run_id: {"run_dir": str(offline_wandb)})
    sink.emit("r2", [NAN], entries("r2", range(0, 5)))
    sink.close("r2")
    assert wandb_files.find_run_files(offline_wandb) == []
    assert not (offline_wandb / "wandb").exists()


def test_wandb_project_env_and_temp_dir(offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    sink = WandbSink(lambda run_id: {"run_dir": "/nonexistent/on/this/host"})
    sink.emit("r3", [NAN, NAN], entries("r3", range(25, 32)))  # two identical findings -> one alert
    sink.close("r3")
    path = wandb_files.finished_run_file(tmp_path / "tmp")
    assert wandb_files.run_info(path)["project"] == "from-env"
    assert wandb_files.run_info(path)["group"] == "r3"
    assert [a["title"] for a in wandb_files.alerts(path)] == ["nan at step 30"]


def test_the_findings_own_signal_is_charted_even_when_the_run_ends_inside_its_window(offline_wandb: Path) -> None:
    """A per-module finding logs ``diag/<its signal>`` next to loss and grad norm; its window is still open when
    the run ends (steps 8..18 wanted, 0..12 seen), so the chart is logged at close with what arrived."""
    explosion = Finding(
        kind="grad_explosion", step=13, onset=12, severity=Severity.ERROR, signal="grad_norm/h.1.attn",
        value=99.0, message="h.1.attn grads exploded", detector="grad", rollback_step=9,
    )  # fmt: skip
    records = [
        Entry(
            entry_id=f"{1000 + s}-{s}",
            rank=1,
            record=StepRecord(
                run_id="r4", step=s, rank=1, signals={"loss": 2.0, "grad_norm": 1.0, "grad_norm/h.1.attn": 0.5 + s}
            ),
        )
        for s in range(0, 13)
    ]
    sink = WandbSink(lambda run_id: {"wandb_project": "p", "run_dir": str(offline_wandb)}, window=5)
    sink.emit("r4", [replace(explosion, rank=1)], records)
    sink.close("r4")
    path = wandb_files.finished_run_file(offline_wandb)
    diag = {r["diag/step"]: r for r in wandb_files.history(path) if "diag/step" in r}
    assert sorted(diag) == list(range(8, 13))
    assert all(r["diag/rank"] == 1 for r in diag.values())
    assert diag[10]["diag/grad_norm/h.1.attn"] == 10.5 and diag[10]["diag/loss"] == 2.0
    visualize = [k for k in wandb_files.config(path) if k.startswith("_wandb/visualize/")]
    assert visualize == ["_wandb/visualize/incidents/grad_explosion_step13_rank1"]


def test_a_revised_diagnosis_is_alerted_again_once(offline_wandb: Path) -> None:
    """A revision (the engine's ``evidence["revised"]``: the first cause changed after the alert, e.g. a cross-rank
    verdict that came after a provisional alert) gets a row and an alert titled "(revised)"; the same revision
    delivered again (a re-processed batch) adds nothing."""
    sink = WandbSink(lambda run_id: {"run_dir": str(offline_wandb), "wandb_project": "stab-test"})
    hardware = CauseHint(cause="hardware_fault", score=0.9, evidence="rank 0 disagrees with its replicas")
    revision = replace(SPIKE, causes=(hardware, *SPIKE.causes), evidence={"revised": 1.0})
    sink.emit("r5", [SPIKE], entries("r5", range(10, 20)))
    sink.emit("r5", [revision, revision, SPIKE], entries("r5", range(20, 30)))
    sink.close("r5")
    path = wandb_files.finished_run_file(offline_wandb)
    alerts = wandb_files.alerts(path)
    assert [a["title"] for a in alerts] == ["loss_spike at step 15", "loss_spike at step 15 (revised)"]
    assert alerts[1]["text"].startswith("Revised diagnosis") and "hardware_fault (0.90)" in alerts[1]["text"]
