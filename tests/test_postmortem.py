"""Post-mortem: CSV loading edge cases, run-directory loading, analysis JSON and reports."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stability.errors import SourceError
from stability.postmortem import analyze, default_outputs, load_csv, load_run_dir, run
from stability.records import StepRecord, encode
from stability.report import render_html, render_text
from stability.transport._spool import Spool


def write(tmp_path: Path, text: str, name: str = "run.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_values_spellings_absent_cells_text_columns_and_sorting(tmp_path: Path) -> None:
    path = write(tmp_path, "step,loss,grad_norm,episode,note,rank,batch\n"
                           "3,nan,1e-3,a,x,0,b3\n"
                           "1,NAN,,a,,0,\n"
                           "2,Infinity,-inf,a,y,0,b2\n"
                           "0,7.343709E+00,inf,a,,1,\n"
                           "1,2.5,0.5,a,,1,\n")
    recs = load_csv(path)
    assert [(r.rank, r.step) for r in recs] == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    r01, r02, r03, r10, _ = recs
    assert math.isnan(r01.signals["loss"]) and "grad_norm" not in r01.signals and r01.batch is None
    assert r02.signals["loss"] == math.inf and r02.signals["grad_norm"] == -math.inf and r02.batch == "b2"
    assert r03.signals["grad_norm"] == 1e-3 and r10.signals["loss"] == 7.343709
    assert set(r03.signals) == {"loss", "grad_norm"}  # episode / note are ignored
    assert r03.run_id == "run"


@pytest.mark.parametrize(("text", "message"), [
    ("iteration,loss\n1,2.0\n", r"line 1: no 'step' column \(columns: iteration, loss\)"),
    ("step,loss\n1,2.0\n2,abc\n", r"line 3, column 'loss': 'abc' is not a number"),
    ("step,loss\n1,2.0\nx,3.0\n", r"line 3, column 'step': 'x' is not an integer"),
    ("step,loss\n1,2.0\n,3.0\n", r"line 3, column 'step': is empty"),
    ("step,loss\n-4,2.0\n", r"line 2, column 'step': -4 is negative"),
    ("step,loss\n1.5,2.0\n", r"line 2, column 'step': '1.5' is not an integer"),
    ("step,rank,loss\n1,r0,2.0\n", r"line 2, column 'rank': 'r0' is not an integer"),
    ("", r"empty"),
    ("step,loss,loss\n1,2,3\n", r"duplicate column"),
])
def test_csv_errors_name_file_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SourceError, match=message) as info:
        load_csv(path)
    assert str(path) in str(info.value)


def test_averaged_losses_get_the_log_interval_as_loss_steps(tmp_path: Path) -> None:
    megatron = write(tmp_path, "step,loss,consumed_samples,skipped_iters\n7000,6.44,260912,0\n7010,11.42,261872,0\n"
                               "7220,7.16,282032,0\n")
    assert [r.signals.get("loss_steps") for r in load_csv(megatron)] == [10.0, 10.0, 10.0]  # smallest step gap
    assert all("loss_steps" not in r.signals for r in load_csv(megatron, loss_averaged=False))
    plain = write(tmp_path, "step,loss\n0,3.0\n10,2.9\n20,2.8\n", "plain.csv")
    assert all("loss_steps" not in r.signals for r in load_csv(plain))  # auto: only Megatron's log fields
    assert [r.signals["loss_steps"] for r in load_csv(plain, loss_averaged=True)] == [10.0] * 3
    own = write(tmp_path, "step,loss,loss_steps\n0,3.0,4\n10,2.9,4\n", "own.csv")
    assert [r.signals["loss_steps"] for r in load_csv(own, loss_averaged=True)] == [4.0, 4.0]  # the column wins
    per_step = write(tmp_path, "step,loss\n5,3.0\n6,2.9\n", "per_step.csv")
    assert all("loss_steps" not in r.signals for r in load_csv(per_step, loss_averaged=True))
    result = run(megatron)  # 1.77x in a 10-step mean: one batch alone would have to be 8.7x
    assert [(e["kind"], e["step"], e["severity"]) for e in result.events][:1] == [("loss_spike", 7010, "error")]
    assert not [e for e in run(megatron, loss_averaged=False).events if e["severity"] != "info"]


def test_csv_rename_and_step_column(tmp_path: Path) -> None:
    path = write(tmp_path, "log_index,train_loss\n2,1.5\n1,1.25\n")
    recs = load_csv(path, step_column="log_index", rename={"train_loss": "loss"})
    assert [(r.step, r.signals) for r in recs] == [(1, {"loss": 1.25}), (2, {"loss": 1.5})]


def _spiky_csv(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = ["step,loss,grad_norm,batch"]
    for step in range(400):
        loss = 3.0 * math.exp(rng.normal(0, 0.02)) * (2.0 if 300 <= step < 303 else 1.0)
        rows.append(f"{step},{loss:.6f},{math.exp(rng.normal(0, 0.1)):.4f},batch-{step}")
    return write(tmp_path, "\n".join(rows) + "\n", "spiky.csv")


def test_analyze_json_shape_and_reports(tmp_path: Path) -> None:
    path = _spiky_csv(tmp_path)
    result = run(path, tmp_path / "out.json", tmp_path / "out.html")
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["run_id"] == "spiky" and data["steps"] == 400
    [event] = data["events"]
    assert {k: event[k] for k in ("kind", "step", "onset", "end", "severity")} == {
        "kind": "loss_spike", "step": 301, "onset": 300, "end": 302, "severity": "error"}
    assert event["causes"][0]["cause"] == "bad_batch" and isinstance(event["causes"][0]["score"], float)
    assert event["rollback_step"] == 299 and event["skip_batches"] == ["batch-300", "batch-301", "batch-302"]
    assert event["remedy"] and event["rank"] == 0 and event["signal"] == "loss"
    text = render_text(result)
    assert "loss_spike" in text and "bad_batch" in text and "rollback step: 299" in text
    page = (tmp_path / "out.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    # self-contained: plotly.js and the data are inlined, nothing is fetched (no src/href to any resource)
    assert re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=", page) == []
    assert "Plotly.newPlot" in page and 'id="stability-data"' in page and len(page) > 1_000_000
    data = json.loads(page.split('id="stability-data">', 1)[1].split("</script>", 1)[0])
    assert data["incidents"][0]["onset"] == 300 and data["incidents"][0]["rollback"] == 299
    assert len(data["overview"]["series"]["loss"][0]) == 400 and "grad_norm" in data["overview"]["series"]
    assert "batch-300, batch-301, batch-302" in page and "Resume from the last checkpoint at or before step 299" in page


def test_json_is_strict_with_nonfinite_values() -> None:
    recs = [StepRecord(run_id="r", step=s, signals={"loss": 2.0 if s != 5 else math.nan}) for s in range(10)]
    result = analyze(recs, "r")
    data = json.loads(result.to_json())
    assert data["events"][0]["kind"] == "nan" and data["events"][0]["value"] == "nan"
    assert "no instability" in render_text(analyze(recs[:4], "r"))


def _archive(run_dir: Path, steps: range, rank: int = 0) -> None:
    (run_dir / "archive").mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "run_id": ["demo"] * len(steps), "rank": [rank] * len(steps), "step": list(steps),
        "wall_time": [float(s) for s in steps], "host": ["h"] * len(steps), "batch": [None] * len(steps),
        "entry_id": [f"{s + 1}-0" for s in steps],
        "loss": [3.0 if s != 60 else None for s in steps], "grad_norm/h.0": [1.0] * len(steps),
    })
    pq.write_table(table, run_dir / "archive" / f"part-{steps.start}.parquet")


def test_load_run_dir_merges_archive_and_spool(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    _archive(run_dir, range(0, 100))
    (run_dir / "spool").mkdir()
    spool = Spool(run_dir / "spool" / "spool-rank0.bin")
    spool.append([(f"{s + 1}-0", encode(StepRecord(run_id="demo", step=s, signals={"loss": 9.0 if s < 100 else 3.0})))
                  for s in range(95, 130)])
    recs = load_run_dir(run_dir)
    assert [r.step for r in recs] == list(range(130))
    assert recs[96].signals["loss"] == 3.0  # the archive wins for duplicated steps
    assert "loss" not in recs[60].signals and recs[60].signals["grad_norm/h.0"] == 1.0
    assert recs[120].signals == {"loss": 3.0}
    result = run(run_dir)
    assert result.run_id == "demo" and result.steps == 130


def test_empty_run_dir_and_missing_source_raise(tmp_path: Path) -> None:
    (tmp_path / "empty" / "archive").mkdir(parents=True)
    with pytest.raises(SourceError, match="no records"):
        load_run_dir(tmp_path / "empty")
    with pytest.raises(SourceError, match="no such file"):
        run(tmp_path / "missing.csv")


def test_render_html_escapes_text() -> None:
    recs = [StepRecord(run_id="r", step=s, signals={"loss": 2.0 if s != 5 else math.inf}) for s in range(10)]
    page = render_html(analyze(recs, "r<x>"), recs)
    assert "r&lt;x&gt;" in page and "r<x>" not in page


def test_multi_rank_csv_with_hosts_names_the_faulty_rank_in_json_text_and_html(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    grad = np.exp(rng.normal(0, 0.1, 300))
    lines = ["step,rank,host,loss,grad_norm,batch"]
    for step in range(300):
        for rank in range(4):
            g = grad[step] * (3.0 if rank == 2 and step == 200 else 1.0)
            loss = 3.0 * math.exp(rng.normal(0, 0.02))
            lines.append(f"{step},{rank},node-{rank},{loss:.6f},{g:.6f},b{step}-{rank}")
    path = write(tmp_path, "\n".join(lines) + "\n", "dp.csv")
    result = run(path, tmp_path / "dp.json", tmp_path / "dp.html")
    [event] = [e for e in json.loads((tmp_path / "dp.json").read_text())["events"] if e["severity"] != "info"]
    assert (event["kind"], event["rank"], event["host"], event["step"]) == ("rank_disagreement", 2, "node-2", 200)
    assert event["causes"][0]["cause"] == "hardware_fault" and event["skip_batches"] == ["b200-2"]
    assert event["rollback_step"] == 199
    text = render_text(result)
    assert "(rank 2, host node-2)" in text and "hardware_fault" in text
    assert "2, host node-2" in (tmp_path / "dp.html").read_text()


def test_default_outputs_sit_next_to_the_source_or_in_the_output_directory(tmp_path: Path) -> None:
    csv_path = write(tmp_path, "step,loss\n0,1\n", "megatron-log.csv")
    assert default_outputs(csv_path) == (tmp_path / "megatron-log.findings.json", tmp_path / "megatron-log.report.html")
    assert default_outputs(csv_path, tmp_path / "out") == (tmp_path / "out" / "megatron-log.findings.json",
                                                         tmp_path / "out" / "megatron-log.report.html")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert default_outputs(run_dir) == (run_dir / "findings.json", run_dir / "report.html")
    out = tmp_path / "o"
    assert default_outputs(run_dir, out) == (out / "findings.json", out / "report.html")


def test_the_worker_report_sink_writes_findings_and_report_next_to_the_archive(tmp_path: Path) -> None:
    from stability.worker.sinks import ReportSink

    run_dir = tmp_path / "demo"
    _archive(run_dir, range(0, 100))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "demo", "torch": "2.13.0", "world_size": 1}))
    ReportSink(lambda run_id: {"run_dir": str(run_dir)}).close("demo")
    findings = json.loads((run_dir / "findings.json").read_text())
    assert findings["run_id"] == "demo" and findings["steps"] == 100 and findings["meta"]["torch"] == "2.13.0"
    assert "Plotly.newPlot" in (run_dir / "report.html").read_text()
    # the run directory is on another machine: the files go next to the archive in STABILITY_ARCHIVE_DIR
    base = tmp_path / "archives"
    _archive(base / "remote-run", range(0, 50))
    (base / "remote-run" / "archive").rename(base / "tmp")
    (base / "remote-run").rmdir()
    (base / "tmp").rename(base / "remote-run")
    ReportSink(lambda run_id: {"run_dir": "/nonexistent/remote-run"}, archive_dir=base).close("remote-run")
    assert json.loads((base / "remote-run" / "findings.json").read_text())["steps"] == 50
    assert (base / "remote-run" / "report.html").exists()
    # nothing archived: nothing written, nothing raised
    ReportSink(lambda run_id: {}).close("unknown")


def test_a_skip_remedy_without_batch_ids_says_none_were_recorded(tmp_path: Path) -> None:
    """findings.json never tells a person to 'skip the listed batches' when the list is empty."""
    path = _spiky_csv(tmp_path)
    rows = path.read_text().splitlines()
    header = rows[0].split(",")
    if "batch" in header:  # drop the batch column: no batch ids recorded
        i = header.index("batch")
        rows = [",".join(c for j, c in enumerate(r.split(",")) if j != i) for r in rows]
    path.write_text("\n".join(rows) + "\n")
    data = json.loads(analyze(load_csv(path), "spiky").to_json())
    [event] = data["events"]
    assert event["skip_batches"] == [] and event["causes"][0]["cause"] == "bad_batch"
    assert not event["remedy"].startswith("Skip the listed batches") and "no batch ids" in event["remedy"]


def test_repeated_steps_are_a_resume_not_last_wins(tmp_path: Path) -> None:
    """Issue #14 item 2: NaN at 260-299, rolled back to 200 and resumed; load_csv keeps both copies of 200-299 (in
    file order) and analyze splits them into two segments, so the NaN is reported and steps are counted once."""
    rows = ["step,loss"] + [f"{s},{'nan' if s >= 260 else 3.0 - s / 1000}" for s in range(300)]
    rows += [f"{s},{3.0 - s / 1000}" for s in range(200, 400)]
    path = write(tmp_path, "\n".join(rows) + "\n")
    records = load_csv(path)
    assert len(records) == 500 and [r.step for r in records[299:302]] == [299, 200, 201]
    result = analyze(records, "r")
    assert [(e["kind"], e["onset"]) for e in result.events if e["severity"] == "error"] == [("nan", 260)]
    assert result.steps == 400 and [s.resumed_after for s in result.segments] == [None, 299]


def test_run_dir_with_a_kernel_log_keeps_its_metadata_and_gets_the_hardware_event(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _archive(run_dir, range(0, 100))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "torch": "2.13.0"}))
    kern = write(tmp_path, "[ 8123.45] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, An uncorrectable double bit error "
                           "(DBE) has been detected on GPU in the framebuffer at partition 6.\n", "kern.log")
    result = run(run_dir, json_out=tmp_path / "f.json", system_logs=[kern])
    assert result.meta["torch"] == "2.13.0"
    hardware = [e for e in result.events if e["kind"] == "hardware_error"]
    assert hardware and hardware[0]["causes"][0]["cause"] == "hardware_fault" and hardware[0]["onset"] == 99
    assert [e.kind for e in result.log_events] == ["xid", "ecc"]  # Xid 48 is an ECC error
