"""The `stability` command line: post-mortem of a real public log, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real-runs"
if not REAL.is_dir():
    REAL = Path("/work/shared/data/real-runs")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stability.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_postmortem_of_a_real_spike_excerpt(tmp_path: Path) -> None:
    src = REAL / "bigscience_tr11-176B-BLOOM_spike_excerpt.csv"
    if not src.exists():
        pytest.skip(f"real-run data not found at {REAL}")
    out, html = tmp_path / "f.json", tmp_path / "r.html"
    proc = _cli("postmortem", str(src), "--json", str(out), "--html", str(html), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(out.read_text())
    assert findings["run_id"] == src.stem and findings["steps"] == 11
    spikes = [e for e in findings["events"] if e["kind"] == "loss_spike" and e["severity"] == "error"]
    assert spikes and 31216 <= spikes[0]["onset"] <= 31219, findings["events"]
    assert "Plotly.newPlot" in html.read_text() and "loss_spike" in proc.stdout


def test_postmortem_writes_next_to_the_source_by_default_and_fails_on_request(tmp_path: Path) -> None:
    src = REAL / "bigscience_tr11-176B-BLOOM_spike_excerpt.csv"
    if not src.exists():
        pytest.skip(f"real-run data not found at {REAL}")
    local = tmp_path / src.name
    local.write_bytes(src.read_bytes())
    proc = _cli("postmortem", str(local), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    findings, report = tmp_path / f"{local.stem}.findings.json", tmp_path / f"{local.stem}.report.html"
    assert json.loads(findings.read_text())["counts"]["error"] >= 1 and report.stat().st_size > 1_000_000
    assert f"findings: {findings}" in proc.stdout and f"report:   {report}" in proc.stdout
    out = tmp_path / "ci"
    proc = _cli("postmortem", str(local), "-o", str(out), "--fail-on", "error", cwd=tmp_path)
    assert proc.returncode == 1 and "--fail-on error" in proc.stderr
    assert (out / f"{local.stem}.findings.json").exists() and (out / f"{local.stem}.report.html").exists()
    clean = tmp_path / "clean.csv"
    clean.write_text("step,loss\n" + "".join(f"{s},{3.0 - s / 1000:.4f}\n" for s in range(200)))
    proc = _cli("postmortem", str(clean), "--fail-on", "warning", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_version_and_fast_help(tmp_path: Path) -> None:
    from stability import __version__

    proc = _cli("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"stability {__version__}"
    proc = _cli("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "postmortem" in proc.stdout and "``" not in proc.stdout
    # help imports none of the heavy dependencies (what made it take seconds)
    heavy = "('torch', 'celery', 'pyarrow', 'stability.detectors', 'rich', 'numpy')"
    code = ("import sys; from stability import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {heavy} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_demo_faults_listed_by_the_cli_are_the_demo_faults() -> None:
    from stability import cli, demo

    assert cli.FAULTS == demo.FAULTS and cli.DEFAULT_FAULT == demo.DEFAULT_FAULT


def test_worker_without_redis_url_says_which_redis_it_uses(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "STABILITY_REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "stability.cli", "worker", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "redis://127.0.0.1:6379/0" in proc.stdout and "``" not in proc.stdout


def test_postmortem_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "log.csv"
    bad.write_text("iteration,loss\n1,2.0\n")
    proc = _cli("postmortem", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert "step" in proc.stderr and str(bad) in proc.stderr
    proc = _cli("postmortem", str(tmp_path / "missing"), cwd=tmp_path)
    assert proc.returncode == 2 and "missing" in proc.stderr
