"""The post-mortem report of a run with the timing hooks (issue 12): step-time and memory timelines per rank with
the performance incidents marked, and links to the run directory's profiler traces and hang stack dumps.

Real parts: torch on the CPU under the real Capture hooks (a data loader that sleeps on three steps, an on-demand
profile of three steps written by the real profiler), the real hang watchdog's stack dump, the real post-mortem.
"""

from __future__ import annotations

import gzip
import html
import json
import time
from pathlib import Path

import torch

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.postmortem import analyze, write_outputs
from stability.records import StepRecord
from stability.report import render_text
from stability.testing import capture_loop

STALLS = {45, 53, 68}


def _train(run_dir: Path, steps: int = 75) -> list[StepRecord]:
    def loader(step: int, capture: Capture) -> None:
        if step == 10:
            capture._perf.profiler.request(3, "test")  # what `stability profile` asks through Redis
        time.sleep(0.6 if step in STALLS else 0.0)  # the data loader

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    config = WatchConfig(run_id="slow-report", run_dir=run_dir, layer_every=0, stats_every=0)
    return capture_loop(config, steps, loader, model=model)


def _hang_dump(run_dir: Path) -> Path:
    """A real watchdog dump of this thread's stacks (rank 0 waiting for step 6)."""
    from stability.hooks.timing import StepTiming, TimingConfig, Watchdog

    timing = StepTiming(TimingConfig(hang_min_s=0.5, poll_s=3600.0))
    dog = Watchdog(timing, run_dir, 0, lambda step, waited, path: None)
    try:
        for step in range(6):
            timing.end_step(step, torch.device("cpu"), {})
        assert timing.last_end is not None
        dump = dog.check(timing.last_end + 5.0)
    finally:
        dog.close()
    assert dump is not None
    return dump


def test_report_shows_step_time_and_memory_timelines_and_links_the_traces(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = _train(run_dir)
    (trace,) = run_dir.glob("profile-rank0-step*.json.gz")
    dump = _hang_dump(run_dir)
    result = analyze(records, "slow-report", run_dir=run_dir)
    stall = [e for e in result.events if e["kind"] == "dataloader_stall"]
    assert stall and stall[-1]["onset"] in STALLS, result.events

    out = tmp_path / "out"  # the report elsewhere: links relative to it
    write_outputs(result, records, json_out=out / "findings.json", html_out=out / "report.html")
    page = (out / "report.html").read_text()
    data = json.loads(page.split('<script type="application/json" id="stability-data">')[1].split("</script>")[0])
    perf = data["perf"]
    assert perf["ranks"] == [0]
    series = perf["series"]["0"]
    assert {"step_time", "data_time", "compute_time", "host_rss", "host_mem_limit"} <= set(series)
    steps, values = series["data_time"]
    by_step = dict(zip(steps, values, strict=True))
    others = sorted(v for s, v in by_step.items() if s not in STALLS)
    assert all(by_step[s] >= 0.6 for s in STALLS) and others[len(others) // 2] < 0.1
    assert [i["kind"] for i in perf["incidents"]].count("dataloader_stall") == len(stall)
    assert 'id="perf"' in page and "perfRows(D.perf)" in page
    assert f'href="../run/{trace.name}"' in page and f'href="../run/{dump.name}"' in page
    summary = json.loads(Path(str(trace).replace(".json.gz", ".summary.json")).read_text())
    top = [op["name"] for op in summary["top_ops"][:3]]  # which ops lead varies with the machine's load
    assert top and all(html.escape(name) in page for name in top)  # the trace's top operators, from its summary

    findings = json.loads((out / "findings.json").read_text())
    listed = {a["kind"]: a for a in findings["artifacts"]}
    assert listed["profile"]["path"] == f"../run/{trace.name}" and listed["profile"]["rank"] == 0
    assert listed["profile"]["last_step"] - listed["profile"]["step"] == 2 and listed["profile"]["split_s"]
    assert listed["hang_stacks"] == {"kind": "hang_stacks", "rank": 0, "step": 6, "path": f"../run/{dump.name}"}
    with gzip.open(out / listed["profile"]["path"], "rt") as f:  # the link resolves to the trace
        assert json.load(f)["traceEvents"]
    assert findings["performance"][0].startswith("rank 0: step time median")

    text = render_text(result)
    assert f"profile trace: profile of rank 0, steps {listed['profile']['step']}" in text and str(trace) in text
    assert f"hang stacks: hang stacks of rank 0 waiting for step 6: {dump}" in text
    assert "performance: rank 0: step time median" in text and "data wait" in text


def test_a_run_without_timing_signals_keeps_its_report() -> None:
    records = [StepRecord(run_id="old", step=s, signals={"loss": 2.0 - 0.01 * s, "grad_norm": 1.0})
               for s in range(50)]
    result = analyze(records, "old")
    from stability.report import render_html

    page = render_html(result, records)
    assert 'id="perf"' not in page and "Step time and memory" not in page and '"perf"' not in page
    assert "artifacts" not in result.to_dict() and "performance" not in result.to_dict()
    assert "performance:" not in render_text(result)
