"""Alerts in the training terminal: real training runs with `import stability.auto` (embedded redis-server, real local
worker) print the start line, the alert and the summary; the reader de-duplicates and rate-limits real findings
read from a real Redis stream; a process that never trains starts nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stability import keys, supervisor
from stability.console import BURST, ConsoleReporter, alert_line, display_remedy, summary_line
from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy

TRAIN = """
import stability.auto  # the one line
from stability.demo import train
train(steps={steps}, fault="bad-batch", fault_step={fault_step})
{wait}print("training finished", flush=True)
"""

# A real job trains for hours after an incident; this one ends ~80 steps after it. On a loaded machine the local
# worker can still be catching up then, and the alert would arrive after the process has gone. The script keeps
# running (as a longer job would) until its console reader has printed an error, or 180 s.
WAIT_FOR_ALERT = """import time
session = stability.auto.handle.session
deadline = time.monotonic() + 180
while session is not None and session.reporter is not None and not session.reporter.counts["error"] \\
        and time.monotonic() < deadline:
    time.sleep(0.2)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(OMP_NUM_THREADS="1", STABILITY_STATS_EVERY="10", PYTHONUNBUFFERED="1", **extra)
    return env


def _train(tmp_path: Path, steps: int, fault_step: int, wait: bool = False,
           **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(steps=steps, fault_step=fault_step, wait=WAIT_FOR_ALERT if wait else ""))
    proc = subprocess.run([sys.executable, str(script)], env=_env(tmp_path, **extra), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "STABILITY_RUN_DIR" in extra:  # the local worker finishes the run after the fast exit
        assert supervisor.wait_stopped(Path(extra["STABILITY_RUN_DIR"]), 240)
    return proc


@pytest.mark.slow
def test_a_bad_batch_is_announced_in_the_training_terminal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(tmp_path, 200, 120, wait=True, STABILITY_RUN_DIR=str(run_dir), STABILITY_RUN_ID="console-run")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stability:")]
    assert lines[0] == f"stability: run console-run -> {run_dir} · embedded Redis · local worker · W&B off", lines
    alerts = [line for line in lines if line.startswith("stability: ERROR loss_spike at step 12")]
    assert len(alerts) == 1, lines
    alert = alerts[0]
    assert "(rank 0 on " in alert and "likely bad_batch" in alert and "remedy: " in alert, alert
    assert "rollback to step 11" in alert, alert
    # the records carry no batch ids: the remedy must not point at a list that is not there
    assert "Skip the listed batches" not in proc.stderr and "no batch ids were recorded" in alert
    summary = lines[-1]
    assert summary.startswith("stability: run console-run done · "), lines
    assert "1 error" in summary and f"report {run_dir / 'report.html'}" in summary, summary
    # the worker left the findings and the report in the run directory
    findings = json.loads((run_dir / "findings.json").read_text())
    # a loaded machine may add INFO step-time events (they sort by step, before or after the spike)
    errors = [e for e in findings["events"] if e["severity"] == "error"]
    assert findings["counts"]["error"] == 1 and len(errors) == 1, findings["events"]
    assert errors[0]["kind"] == "loss_spike" and errors[0]["causes"][0]["cause"] == "bad_batch", errors[0]
    others = {e["causes"][0]["cause"] for e in findings["events"] if e["severity"] != "error"}
    assert others <= {"slowdown", "dataloader_stall"}, findings["events"]
    assert (run_dir / "report.html").stat().st_size > 100_000
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == "console-run"
    # stdout is the script's own
    assert proc.stdout.strip() == "training finished"


@pytest.mark.slow
def test_quiet_prints_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(tmp_path, 60, 40, STABILITY_RUN_DIR=str(run_dir), STABILITY_QUIET="1")
    assert "stability:" not in proc.stderr, proc.stderr[-2000:]
    assert (run_dir / "findings.json").exists()  # quiet changes the terminal only


def test_a_process_that_never_trains_starts_nothing(tmp_path: Path) -> None:
    script = (
        "import threading, torch\n"
        "import stability.auto\n"
        "model = torch.nn.Linear(4, 1)\n"
        "with torch.no_grad():\n"
        "    model(torch.randn(2, 4))\n"
        "handle = stability.auto.handle\n"
        "print(handle is not None and handle.session is None, handle.run_dir,\n"
        "      sorted(t.name for t in threading.enumerate() if t.name.startswith('stability')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attached, run_dir, threads = proc.stdout.split(" ", 2)
    assert attached == "True", proc.stdout
    assert str(tmp_path / "stability-runs") in run_dir
    assert "stability-session" not in threads and "stability-console" not in threads, threads
    assert not (tmp_path / "stability-runs").exists(), list(tmp_path.rglob("*"))
    assert "stability:" not in proc.stderr, proc.stderr


# -------------------------------------------------------------------------------- the reader, on a real Redis


def _finding(kind: str, step: int, severity: Severity = Severity.ERROR, rank: int = 0, onset: int | None = None,
             cause: str = "lr_too_high", skip: tuple[str, ...] = ()) -> Finding:
    return Finding(kind=kind, step=step, onset=step if onset is None else onset, severity=severity, signal="loss",
                   value=9.0, message=f"{kind} at {step}", detector="test", rank=rank, host="node-3",
                   rollback_step=step - 3, skip_batches=skip,
                   causes=(CauseHint(cause=cause, score=0.9, evidence="lr rose 60x", remedy=remedy(cause)),))


def _publish(client, run_id: str, *findings: Finding) -> None:
    for f in findings:
        client.xadd(keys.findings(run_id), {"f": json.dumps(f.to_dict())})


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_reader_prints_new_alerts_once_rate_limits_and_summarises(redis_server, redis_client, tmp_path: Path) -> None:
    run_id = "r1"
    _publish(redis_client, run_id, _finding("loss_spike", 5))  # a resumed run's old finding: not repeated
    out = io.StringIO()
    printed: list[dict] = []
    reporter = ConsoleReporter(redis_server.url, run_id, tmp_path, "stability: run r1 -> here",
                               stream=out, on_line=lambda f, _t: printed.append(dict(f))).start()
    try:
        first = _finding("loss_spike", 100, rank=2)
        _publish(redis_client, run_id, first, first, _finding("loss_spike", 101, rank=2, onset=100),
                 _finding("plateau", 110, Severity.INFO))
        _wait(lambda: reporter.counts["error"] == 1 and reporter.counts["info"] == 1)
        _publish(redis_client, run_id, *[_finding("grad_explosion", 200 + i, Severity.WARNING) for i in range(20)])
        _wait(lambda: reporter.counts["warning"] == 20)
    finally:
        reporter.stop(drained=True)
    lines = out.getvalue().splitlines()
    assert lines[0] == "stability: run r1 -> here"
    alerts = lines[1:-1]
    assert alerts[0].startswith("stability: ERROR loss_spike at step 100 (rank 2 on node-3) · likely lr_too_high")
    assert "rollback to step 97" in alerts[0] and "remedy: Roll back" in alerts[0]
    assert len(alerts) == BURST == len(printed), alerts  # 1 error + 4 warnings, then the rate limit
    assert reporter.suppressed == 16 and reporter.counts == {"error": 1, "warning": 20, "info": 1}
    assert lines[-1] == ("stability: run r1 done · 22 findings (1 error, 20 warning, 1 info) · 16 alert lines "
                         "suppressed by the rate limit · no report (see the worker log)")


def test_a_revised_diagnosis_gets_one_update_line(redis_server, redis_client, tmp_path: Path) -> None:
    """The engine alerts again (``evidence["revised"]``) when an alerted incident's first cause changes (a jump
    that reverted at the next record: bad_batch, not the gradient precursor the first line named) or it falls to
    INFO: one UPDATE line, counted once; an unchanged or never-printed revision prints nothing."""
    import dataclasses

    run_id = "rev"
    out = io.StringIO()
    reporter = ConsoleReporter(redis_server.url, run_id, tmp_path, "stability: run rev -> here", stream=out).start()

    def revised(f: Finding, **changes) -> Finding:
        return dataclasses.replace(f, evidence={**f.evidence, "revised": 1.0}, **changes)

    try:
        first = _finding("loss_spike", 120)
        other = _finding("grad_explosion", 300, Severity.WARNING)
        _publish(redis_client, run_id, first, other)
        _wait(lambda: reporter.counts["error"] == 1 and reporter.counts["warning"] == 1)
        better = revised(first, causes=(CauseHint(cause="bad_batch", score=0.93, evidence="reverted at the next step",
                                                  remedy=remedy("bad_batch")),))
        _publish(redis_client, run_id, revised(other), better, revised(_finding("nan", 400)),  # unchanged, unprinted
                 revised(other, severity=Severity.INFO))
        _wait(lambda: reporter.counts["info"] == 1)
    finally:
        reporter.stop(drained=True)
    lines = out.getvalue().splitlines()
    updates = [line for line in lines if "UPDATE" in line]
    assert len(updates) == 2, lines
    assert updates[0].startswith("stability: UPDATE error loss_spike at step 120 (rank 0 on node-3) · likely bad_batch")
    assert updates[0].endswith("(was likely lr_too_high)")
    assert updates[1].startswith("stability: UPDATE info grad_explosion at step 300") and "(was warning)" in updates[1]
    assert reporter.counts == {"error": 1, "warning": 0, "info": 1}


def test_alert_line_and_remedy_wording() -> None:
    with_batches = alert_line(_finding("loss_spike", 50, cause="bad_batch", skip=("b50", "b51")).to_dict())
    assert "remedy: Skip the listed batches" in with_batches and "skip batches b50, b51" in with_batches
    without = alert_line(_finding("loss_spike", 50, cause="bad_batch").to_dict())
    assert "listed" not in without and "no batch ids were recorded" in without and "skip batches" not in without
    assert display_remedy("Lower the LR.", ()) == "Lower the LR."
    assert summary_line("r", {"error": 1}, "/x/report.html") == (
        "stability: run r done · 1 incident (1 error, 0 warning, 0 info) · report /x/report.html")


def test_the_summary_line_says_how_a_run_died_on_one_line() -> None:
    reason = ("RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
              + "x" * 300)
    line = summary_line("r", {"error": 1}, None, died=reason)
    assert line.startswith("stability: run r died (RuntimeError: CUDA error: an illegal memory access was encountered "
                           "CUDA kernel errors might be xxx")
    assert "\n" not in line and "…) · 1 incident (1 error, 0 warning, 0 info) · no report" in line
    assert " done " not in line
