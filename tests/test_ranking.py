"""Root-cause ranking on synthetic scenarios with a known cause."""

from __future__ import annotations

import re

import numpy as np

from stability.detectors import RunDiagnoser, Severity
from stability.records import StepRecord

N = 700


def base(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(N)
    return {
        "loss": (2.5 + 3.0 * np.exp(-t / 200.0)) * np.exp(rng.normal(0, 0.02, N)),
        "grad_norm": np.exp(rng.normal(0, 0.1, N)),
        "lr": np.full(N, 1e-3),
        "grad_norm/h.0.attn": 0.5 * np.exp(rng.normal(0, 0.1, N)),
        "grad_norm/h.1.attn": 0.4 * np.exp(rng.normal(0, 0.1, N)),
        "update_ratio/h.1.attn": 1e-3 * np.exp(rng.normal(0, 0.05, N)),
    }


def diagnose(series: dict[str, np.ndarray], batches: bool = False):
    diag = RunDiagnoser()
    alerts = []
    for step in range(N):
        signals = {k: float(v[step]) for k, v in series.items() if not np.isnan(v[step]) or k == "loss"}
        rec = StepRecord(run_id="r", step=step, signals=signals, batch=f"b{step}" if batches else None)
        alerts += diag.update(rec)
    alerts += diag.finish()
    return [a for a in alerts if a.severity is not Severity.INFO], diag


def test_one_step_jump_without_precursor_is_a_bad_batch() -> None:
    s = base()
    s["loss"][500] *= 1.9
    _, diag = diagnose(s, batches=True)
    [finding] = diag.incidents[0].findings
    assert finding.causes[0].cause == "bad_batch" and "reverted" in finding.causes[0].evidence
    assert finding.skip_batches == ("b500",) and finding.rollback_step == 499


def test_sustained_spike_without_precursor_is_a_bad_batch() -> None:
    s = base()
    s["loss"][500:504] *= 2.0
    [alert], _ = diagnose(s, batches=True)
    assert alert.causes[0].cause == "bad_batch"
    assert alert.rollback_step == 499 and alert.skip_batches[0] == "b500"


def test_lr_jump_with_update_ratio_precursor_is_lr_too_high() -> None:
    s = base()
    s["lr"][480:] *= 10.0
    s["update_ratio/h.1.attn"][480:] *= 10.0
    s["grad_norm/h.1.attn"][486:] *= 40.0
    s["loss"][489:495] *= 2.0
    alerts, _ = diagnose(s)
    spike = next(a for a in alerts if a.kind == "loss_spike")
    top = spike.causes[0]
    assert top.cause == "lr_too_high" and top.score >= 0.9
    assert "lr raised 10x at step 480" in top.evidence
    assert spike.rollback_step == 479


def test_layer_grad_norm_precursor_names_the_layer_and_lead() -> None:
    s = base()
    s["grad_norm/h.1.attn"][497:] *= 40.0
    s["loss"][500:505] *= 2.0
    alerts, _ = diagnose(s)
    spike = next(a for a in alerts if a.kind == "loss_spike")
    assert spike.causes[0].cause == "lr_too_high"
    assert re.search(r"grad_norm/h\.1\.attn rose (3\d|4\d)x 3 steps before the loss spike", spike.causes[0].evidence)
    assert "lr unchanged" in spike.causes[0].evidence
    assert spike.rollback_step == 496


def test_loss_scale_collapse_then_nan_is_fp16() -> None:
    s = base()
    scale = np.full(N, 65536.0)
    scale[490:] = 65536.0 / 2.0 ** np.minimum(np.arange(N - 490) + 1, 6)
    s["loss_scale"] = scale
    s["loss"][500] = np.nan
    alerts, _ = diagnose(s)
    [nan] = [a for a in alerts if a.kind == "nan"]
    assert nan.step == 500 and nan.causes[0].cause == "fp16_loss_scale"
    assert "loss_scale fell" in nan.causes[0].evidence
    assert nan.causes[1].cause == "numerical_nan"
    assert nan.rollback_step < 491


def test_nan_from_nothing_is_numerical() -> None:
    s = base()
    s["loss"][500] = np.inf
    alerts, _ = diagnose(s)
    [nan] = alerts
    assert nan.causes[0].cause == "numerical_nan" and nan.rollback_step == 499
    assert "no loss-scale collapse" in nan.causes[0].evidence


def test_adam_second_moment_jump_before_the_spike() -> None:
    s = base()
    s["adam_v_ratio/h.0.attn"] = np.exp(np.random.default_rng(5).normal(0, 0.05, N))
    s["adam_v_ratio/h.0.attn"][496:] *= 20.0
    s["loss"][500:505] *= 2.0
    alerts, _ = diagnose(s)
    spike = next(a for a in alerts if a.kind == "loss_spike")
    assert spike.causes[0].cause == "adam_second_moment"
    assert "adam_v_ratio/h.0.attn" in spike.causes[0].evidence


def test_spike_during_warmup_points_at_the_warmup() -> None:
    s = base()
    s["lr"] = np.minimum(1.0, (np.arange(N) + 1) / 800.0) * 1e-3
    s["loss"][500:505] *= 2.0
    alerts, _ = diagnose(s)
    spike = next(a for a in alerts if a.kind == "loss_spike")
    assert spike.causes[0].cause == "warmup_too_short"


def test_every_cause_has_a_remedy_and_scores_are_sorted() -> None:
    s = base()
    s["loss"][500:504] *= 2.0
    [alert], _ = diagnose(s)
    scores = [c.score for c in alert.causes]
    assert scores == sorted(scores, reverse=True) and all(c.remedy for c in alert.causes)
