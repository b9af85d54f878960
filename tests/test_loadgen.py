"""``bench/loadgen.py`` end to end: a private redis-server, a real worker process, realistic records with injected
anomalies; both modes finish with every entry acked and report sane figures (no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _loadgen(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "loadgen.py"), *args, "--json", str(out),
                           "--modules", "8", "--timeout", "240"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "records/s drained" in proc.stdout
    return json.loads(out.read_text())


def test_backlog_mode_drains_everything_and_finds_the_injected_anomalies(tmp_path: Path) -> None:
    got = _loadgen(tmp_path, "--mode", "backlog", "--runs", "2", "--ranks", "2", "--steps", "120",
                   "--anomaly-every", "20")
    assert got["records"] == 2 * 2 * 120 and got["lag_end"] == 0
    assert got["signals"] == 6 + 5 * 8
    assert got["processed_per_s"] > 0 and got["baseline_per_s"] > 0
    assert 0 < got["vs_baseline"] < 1  # detectors cost something; a bare read+ack loop is the ceiling
    assert got["findings"].get("nan", 0) >= 2  # step 60 of each run carries a NaN loss
    assert got["used_memory"] > 0 and got["bytes_per_record"] > 100


def test_live_mode_reports_lag_and_latency_of_every_injected_nan(tmp_path: Path) -> None:
    got = _loadgen(tmp_path, "--mode", "live", "--runs", "2", "--ranks", "3", "--step-rate", "2",
                   "--duration", "4", "--sweep-s", "0.3")
    assert got["lag_end"] == 0 and got["records"] == 2 * 3 * 8
    assert got["injected"] == 2 * 3  # one NaN per run and step from step 1 on, each rank once
    assert got["latency_samples"] == got["injected"]  # every one became a finding in Redis
    assert 0 < got["latency_p50_s"] <= got["latency_p99_s"] <= got["latency_max_s"] < 240
