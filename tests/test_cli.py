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
    assert "<svg" in html.read_text() and "loss_spike" in proc.stdout


def test_postmortem_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "log.csv"
    bad.write_text("iteration,loss\n1,2.0\n")
    proc = _cli("postmortem", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert "step" in proc.stderr and str(bad) in proc.stderr
    proc = _cli("postmortem", str(tmp_path / "missing"), cwd=tmp_path)
    assert proc.returncode == 2 and "missing" in proc.stderr
