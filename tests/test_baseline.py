"""``stability postmortem SOURCE --baseline OTHER`` (issue #11): where and in which signals two runs part.

The two runs are Megatron-LM training logs in the exact iteration-line format (as in tests/data/logs): identical
until step 120, then the grad norm of one drifts up and, 15 steps later, its loss follows.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from stability.baseline import compare_runs
from stability.cli import main
from stability.errors import SourceError
from stability.postmortem import load_source
from stability.records import StepRecord

LINE = (" [2024-05-13 10:{m:02d}:{s:02d}] iteration {it:8d}/     300 | consumed samples: {cs:12d} | elapsed time per "
        "iteration (ms): 812.3 | learning rate: {lr:.6E} | global batch size:   128 | lm loss: {loss:.6E} | loss "
        "scale: 65536.0 | grad norm: {gn:.3f} | num zeros: 0.0 | number of skipped iterations:   0 | number of nan "
        "iterations:   0 |")


def megatron_log(path: Path, *, drift_from: int | None = None, loss_lag: int = 15, steps: int = 240) -> Path:
    rng = random.Random(7)
    lines = [" loading checkpoint from /ckpt/gpt at iteration 0"]
    for it in range(1, steps + 1):
        loss = 2.5 + 6.0 * math.exp(-it / 40) + rng.gauss(0, 0.02)
        gn = 1.0 + 0.3 * math.exp(-it / 30) + abs(rng.gauss(0, 0.05))
        if drift_from is not None and it >= drift_from:
            gn *= 1 + 0.08 * (it - drift_from + 1)
        if drift_from is not None and it >= drift_from + loss_lag:
            loss *= 1 + 0.01 * (it - drift_from - loss_lag + 1)
        lines.append(LINE.format(m=it // 60, s=it % 60, it=it, cs=it * 128, lr=3e-4 * min(1.0, it / 50), loss=loss,
                                 gn=gn))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_runs_part_in_grad_norm_before_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = megatron_log(tmp_path / "base.log")
    drift = megatron_log(tmp_path / "drift.log", drift_from=120)
    code = main(["postmortem", str(drift), "--baseline", str(base), "-o", str(tmp_path / "out")])
    assert code == 0
    data = json.loads((tmp_path / "out" / "drift.findings.json").read_text())
    cmp = data["baseline"]
    assert cmp["baseline"] == str(base)
    assert 120 <= cmp["parts_at"] <= 122
    order = [row["signal"] for row in cmp["signals"] if row["parts_at"] is not None]
    assert order[0] == "grad_norm"
    assert "loss" in order and order.index("loss") > 0
    loss = next(row for row in cmp["signals"] if row["signal"] == "loss")
    assert 135 <= loss["parts_at"] <= 140
    same = {row["signal"] for row in cmp["signals"] if row["parts_at"] is None}
    assert {"lr", "consumed_samples"} <= same  # identical schedules do not part
    out = capsys.readouterr().out
    assert "the runs part at step" in out and "first in grad_norm" in out
    html = (tmp_path / "out" / "drift.report.html").read_text()
    assert '<h2 id="baseline">' in html and "The runs part at step 12" in html
    assert "<h2>Phases</h2>" in html


def test_identical_runs_do_not_part(tmp_path: Path) -> None:
    a = load_source(megatron_log(tmp_path / "a.log")).records
    b = load_source(megatron_log(tmp_path / "b.log")).records
    cmp = compare_runs(a, b)
    assert cmp["parts_at"] is None and cmp["shared_steps"] == 240
    assert all(row["parts_at"] is None for row in cmp["signals"])


def test_noise_band_comes_from_early_steps() -> None:
    """Two seeds differ by ~5 % from the start: that is their noise, not a parting; a 3x loss later is."""
    rng = random.Random(3)

    def recs(scale: float) -> list[StepRecord]:
        return [StepRecord(run_id="r", step=s, rank=0,
                           signals={"loss": (3.0 if s < 150 else 3.0 * scale) * (1 + rng.gauss(0, 0.03))})
                for s in range(200)]
    cmp = compare_runs(recs(3.0), recs(1.0))
    assert cmp["parts_at"] is not None and 150 <= cmp["parts_at"] <= 152
    quiet = compare_runs(recs(1.0), recs(1.0))
    assert quiet["parts_at"] is None


def test_one_sided_nan_parts_and_no_common_step_is_an_error() -> None:
    a = [StepRecord(run_id="a", step=s, rank=0, signals={"loss": math.nan if s >= 50 else 2.0}) for s in range(60)]
    b = [StepRecord(run_id="b", step=s, rank=0, signals={"loss": 2.0}) for s in range(60)]
    assert compare_runs(a, b)["parts_at"] == 50
    c = [StepRecord(run_id="c", step=s, rank=0, signals={"loss": 2.0}) for s in range(100, 160)]
    with pytest.raises(SourceError, match="no signal logged at two or more steps of both runs"):
        compare_runs(a, c)
