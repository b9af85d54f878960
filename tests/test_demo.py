"""The README's first command, end to end: a real CPU training run with an injected fault, `import stability.auto`,
the embedded redis-server, a real local Celery worker process, live findings, then the post-mortem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

STEPS = 300
FAULT_STEP = int(STEPS * 0.6)

EXPECTED = {  # fault -> (kind, top cause, onset range)
    "lr-spike": ("loss_spike", "lr_too_high", (FAULT_STEP, FAULT_STEP + 3)),
    "bad-batch": ("loss_spike", "bad_batch", (FAULT_STEP, FAULT_STEP)),
    "nan": ("nan", "numerical_nan", (FAULT_STEP, FAULT_STEP)),
    "divergence": ("divergence", "lr_too_high", (FAULT_STEP, STEPS)),
}


def _demo(tmp_path: Path, fault: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / f"demo-{fault}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "stability.cli", "demo", "--fault", fault, "--steps", str(STEPS), "--run-dir",
         str(run_dir)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, run_dir


def _serious(events: list[dict]) -> list[dict]:
    return [e for e in events if e["severity"] in ("warning", "error")]


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_demo_fault_is_diagnosed(tmp_path: Path, fault: str) -> None:
    kind, cause, (lo, hi) = EXPECTED[fault]
    proc, run_dir = _demo(tmp_path, fault)
    findings = json.loads((run_dir / "findings.json").read_text())
    assert findings["run_id"] == run_dir.name and findings["steps"] == STEPS
    serious = _serious(findings["events"])
    assert serious, findings
    if fault == "divergence":  # the LR ramp leaves its schedule first: a precursor warning, then the divergence
        precursor = serious.pop(0)
        assert precursor["kind"] == "lr_off_schedule" and precursor["severity"] == "warning", precursor
        assert precursor["causes"][0]["cause"] == "lr_too_high" and lo <= precursor["onset"], precursor
    first = serious[0]
    assert first["kind"] == kind, serious
    assert lo <= first["onset"] <= hi, serious
    assert first["causes"][0]["cause"] == cause, first["causes"]
    assert first["severity"] == "error"
    # the live path reported it while training ran (worker -> findings stream -> console)
    assert f"ALERT ERROR {kind}" in proc.stdout
    # everything the run produced is in the run directory, and nothing is left running
    assert list((run_dir / "archive").glob("*.parquet")) and (run_dir / "report.html").stat().st_size > 1000
    assert list((run_dir / "redis").rglob("*.aof*")), "embedded Redis keeps an append-only file"
    with pytest.raises((redis.ConnectionError, FileNotFoundError)):
        redis.Redis(unix_socket_path=str(run_dir / "redis" / "redis.sock"), socket_timeout=1).ping()


@pytest.mark.slow
def test_clean_demo_raises_no_error(tmp_path: Path) -> None:
    proc, run_dir = _demo(tmp_path, "none")
    findings = json.loads((run_dir / "findings.json").read_text())
    assert findings["steps"] == STEPS
    assert [e for e in findings["events"] if e["severity"] == "error"] == []
    assert "ALERT ERROR" not in proc.stdout
