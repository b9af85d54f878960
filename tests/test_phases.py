"""Change-point phases of a run (issue #11): warm-up, stable, degradation, divergence, restart.

Synthetic series with a known shape, plus real logs: a clean modded-nanogpt / llm.c baseline (warm-up then stable
only) and the nanoGPT #215 fp16 run whose loss turns NaN (ends in divergence); see ../shared/data/real-runs.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from stability.phases import run_phases, segment_phases
from stability.postmortem import load_source, run
from stability.records import StepRecord
from stability.report import render_text
from stability.sources import Segment

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real-runs"
if not REAL.is_dir():
    REAL = Path("/work/shared/data/real-runs")
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="shared real-runs data not available")


def records(losses: list[float], lrs: list[float] | None = None, start: int = 0) -> list[StepRecord]:
    out = []
    for i, loss in enumerate(losses):
        signals = {"loss": loss}
        if lrs is not None:
            signals["lr"] = lrs[i]
        out.append(StepRecord(run_id="r", step=start + i, rank=0, signals=signals))
    return out


def curve(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [2.0 + 8.0 * math.exp(-s / 60) + 0.3 * math.exp(-s / 2000) + rng.gauss(0, 0.02) for s in range(n)]


def labels(phases: list) -> list[str]:  # type: ignore[type-arg]
    return [p.label for p in phases]


def test_clean_curve_is_warmup_then_stable() -> None:
    lrs = [min(1.0, (s + 1) / 100) * 3e-4 for s in range(1500)]
    phases = segment_phases(records(curve(1500), lrs))
    assert labels(phases) == ["warm-up", "stable"]
    assert 99 <= phases[0].last_step <= 300  # LR peak at step 99; the steep drop is 80 % done by ~100
    assert phases[1].last_step == 1499
    assert phases[0].loss_start is not None and phases[0].loss_start > 8



def test_an_lr_spike_after_the_warm_up_does_not_extend_it() -> None:
    """The demo's LR fault: the LR is 60x its plateau for 3 steps at step 1000, long after a 100-step warm-up. The
    warm-up ends with the schedule's rise (it once ran until the spike: "LR rises ... -> 0.018 until step 1000")."""
    lrs = [min(1.0, (s + 1) / 100) * 3e-4 for s in range(1500)]
    lrs[1000:1003] = [0.018] * 3
    losses = curve(1500)
    losses[1001:1040] = [x * 4 for x in losses[1001:1040]]
    phases = segment_phases(records(losses, lrs))
    warm = phases[0]
    assert warm.label == "warm-up" and 99 <= warm.last_step <= 300, phases
    assert "-> 0.0003 until step 94" in warm.evidence and "0.018" not in warm.evidence, warm.evidence
    assert "divergence" in labels(phases), phases

def test_loss_creeping_up_is_degradation_and_blowing_up_is_divergence() -> None:
    rng = random.Random(1)
    flat = [3.0 + rng.gauss(0, 0.01) for _ in range(400)]
    creep = [3.0 * (1 + 0.12 * s / 200) + rng.gauss(0, 0.01) for s in range(200)]
    blow = [3.4 * math.exp(s / 30) for s in range(100)]
    phases = segment_phases(records(flat + creep + blow))
    assert labels(phases) == ["stable", "degradation", "divergence"]
    assert 400 <= phases[1].first_step <= 520
    assert phases[2].first_step <= 650


def test_nan_tail_is_divergence_but_one_nan_is_not() -> None:
    losses = curve(300)[200:] + [math.nan] * 20
    assert labels(segment_phases(records(losses)))[-1] == "divergence"
    blip = curve(300)[200:]
    blip[50] = math.inf
    assert "divergence" not in labels(segment_phases(records(blip)))


def test_restart_phase_opens_each_resumed_segment() -> None:
    first, second = records(curve(300)[200:], start=200), records(curve(300)[250:], start=250)
    segs = [Segment(index=0, start=0, stop=100, first_step=200, last_step=299),
            Segment(index=1, start=100, stop=150, first_step=250, last_step=299, reason="step went back",
                    resumed_after=299)]
    phases = run_phases(first + second, segs)
    restart = [p for p in phases if p.label == "restart"]
    assert len(restart) == 1 and restart[0].first_step == 250 and restart[0].segment == 1
    assert {p.segment for p in phases} == {0, 1}


@needs_real
def test_real_clean_baseline_is_warmup_then_stable(tmp_path: Path) -> None:
    log = load_source(REAL / "mng_llmc_gpt2_124M_2024-10-13.csv")
    phases = run_phases(log.records, log.segments)
    assert labels(phases) == ["warm-up", "stable"]
    assert 600 <= phases[0].last_step <= 2500  # LR warm-up ends at 699 (README); the steep drop a little later
    assert "LR rises" in phases[0].evidence


@needs_real
def test_real_nan_run_ends_in_divergence(tmp_path: Path) -> None:
    result = run(REAL / "snippets" / "nanogpt_issue215_fp16_nan_onset.csv", json_out=tmp_path / "f.json")
    assert [p.label for p in result.phases][-1] == "divergence"
    assert result.phases[-1].first_step == 3010  # loss nan from 3010 (thread)
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["phases"][-1]["label"] == "divergence"
    assert "divergence  steps 3010-3070" in render_text(result)


@needs_real
def test_real_excerpts_spike_and_reverting_inf() -> None:
    tr1 = load_source(REAL / "bigscience_tr1-13B_spike_excerpt.csv")
    phases = run_phases(tr1.records, tr1.segments)
    assert labels(phases) == ["stable", "divergence"] and phases[1].first_step == 29050  # 2.77 -> 7.34 (chronicles)
    ipex = load_source(REAL / "snippets" / "ipex_llm_issue1486_bigdl_inf_loss.csv")
    assert "divergence" not in labels(run_phases(ipex.records, ipex.segments))  # one Infinity, then 1.248
