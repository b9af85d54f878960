"""The fp16, vanishing-gradient, growth and plateau detectors, resume handling and NaN naming (synthetic series)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stability.detectors import Severity
from stability.detectors.base import Finding
from stability.detectors.nan import NanDetector
from stability.records import StepRecord
from stability.testing import diagnose, diagnose_split

N = 900


def base(n: int = N, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return {
        "loss": (2.5 + 3.0 * np.exp(-t / 200.0)) * np.exp(rng.normal(0, 0.02, n)),
        "grad_norm": np.exp(rng.normal(0, 0.1, n)),
        "lr": np.full(n, 1e-3),
        **{f"grad_norm/h.{i}": (0.5 + 0.1 * i) * np.exp(rng.normal(0, 0.1, n)) for i in range(4)},
    }


def to_records(series: dict[str, np.ndarray], rank: int = 0, host: str = "") -> list[StepRecord]:
    n = len(series["loss"])
    return [StepRecord(run_id="r", step=s, rank=rank, host=host,
                       signals={k: float(v[s]) for k, v in series.items() if not np.isnan(v[s]) or k == "loss"})
            for s in range(n)]


def found(alerts: list[Finding], kind: str) -> list[tuple[int, int, Severity]]:
    return [(a.onset, a.step, a.severity) for a in alerts if a.kind == kind]


# --- fp16 loss scale ---------------------------------------------------------------------------------------------


def test_loss_scale_collapse_is_a_warning_at_the_eighth() -> None:
    s = base()
    s["loss_scale"] = np.full(N, 65536.0)
    s["loss_scale"][500:] = 65536.0 / 2.0 ** np.minimum(np.arange(N - 500) + 1, 3)
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "loss_scale_collapse") == [(500, 502, Severity.WARNING)]
    [alert] = [a for a in alerts if a.kind == "loss_scale_collapse"]
    assert "fell 8x in 3 steps" in alert.message and alert.causes[0].cause == "fp16_loss_scale"
    assert alert.rollback_step == 499


def test_healthy_dynamic_loss_scaling_is_quiet() -> None:
    s = base(3000)
    scale, value = np.empty(3000), 2.0**16
    for step in range(3000):
        if step % 400 == 150:  # an isolated overflow halves it, a growth interval later it doubles back
            value /= 2
        elif step % 400 == 349:
            value *= 2
        scale[step] = value
    s["loss_scale"] = scale
    s["skipped"] = np.array([1.0 if step % 400 == 150 else 0.0 for step in range(3000)])
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "loss_scale_collapse") == []


def test_skipped_step_burst_and_floor_and_then_nan() -> None:
    s = base()
    s["skipped"] = np.zeros(N)
    s["skipped"][[600, 602, 603, 605, 607]] = 1.0
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "loss_scale_collapse") == [(600, 607, Severity.WARNING)]

    s = base()
    s["loss_scale"] = np.full(N, 8.0)
    s["loss_scale"][300:] = 1.0
    s["loss"][330] = np.nan
    alerts, diag = diagnose(to_records(s))
    assert found(alerts, "loss_scale_collapse") == [(300, 300, Severity.ERROR)]
    [incident] = [i for i in diag.incidents if "nan" in i.kinds]
    assert "loss_scale_collapse" in incident.kinds
    assert incident.headline.kind == "nan" and incident.headline.causes[0].cause == "fp16_loss_scale"


# --- vanishing gradients -----------------------------------------------------------------------------------------


def test_layer_grad_norm_collapse_names_the_layer() -> None:
    s = base()
    s["grad_norm/h.2"][500:] *= 1e-3
    alerts, _ = diagnose(to_records(s))
    [alert] = [a for a in alerts if a.kind == "grad_vanishing"]
    assert (alert.onset, alert.step, alert.severity, alert.signal) == (500, 504, Severity.WARNING, "grad_norm/h.2")
    assert "h.2" in alert.message and alert.causes[0].cause == "vanishing_gradients"


def test_dead_layer_from_the_start_and_frozen_updates() -> None:
    s = base()
    s["grad_norm/h.0"][:] = 1e-7
    alerts, _ = diagnose(to_records(s))
    assert [(a.signal, a.step) for a in alerts if a.kind == "grad_vanishing"] == [("grad_norm/h.0", 4)]

    s = base()
    s["update_ratio/h.1"] = np.full(N, 1e-3)
    s["update_ratio/h.1"][400:] = 1e-8
    alerts, _ = diagnose(to_records(s))
    assert [(a.signal, a.onset, a.step) for a in alerts if a.kind == "grad_vanishing"] == [
        ("update_ratio/h.1", 400, 404)]
    s["lr"][390:] = 1e-7  # a decayed LR legitimately stops the updates
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "grad_vanishing") == []


def test_falling_grad_norm_early_in_training_is_not_vanishing() -> None:
    s = base(1500)
    t = np.arange(1500)
    s["grad_norm"] = (0.27 + 15.0 * np.exp(-t / 30.0)) * np.exp(np.random.default_rng(1).normal(0, 0.15, 1500))
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "grad_vanishing") == []


# --- growth --------------------------------------------------------------------------------------------------------


def _growth_series(n: int = N) -> dict[str, np.ndarray]:
    s = base(n)
    rng = np.random.default_rng(5)
    for i in range(3):
        s[f"attn_logit_max/h.{i}"] = 8.0 * np.exp(rng.normal(0, 0.03, n))
        s[f"act_absmax/h.{i}"] = 30.0 * np.exp(rng.normal(0, 0.03, n))
    s["logit_z"] = 1.0 + rng.normal(0, 0.05, n)
    return s


def test_attention_logit_growth_names_the_layer() -> None:
    s = _growth_series()
    s["attn_logit_max/h.1"][400:] *= np.exp(0.05 * np.arange(N - 400))
    alerts, _ = diagnose(to_records(s))
    [alert] = [a for a in alerts if a.kind == "attention_logit_growth"]
    assert alert.signal == "attn_logit_max/h.1" and alert.severity is Severity.WARNING
    assert 415 <= alert.step <= 450 and "grew steadily" in alert.message
    assert alert.causes[0].cause == "attention_logit_growth"
    assert found(alerts, "activation_growth") == [] and found(alerts, "logit_divergence") == []


@pytest.mark.parametrize("vectorised", [True, False])
def test_series_of_one_kind_growing_together_are_one_finding(vectorised: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers' attention logits grow at once: one finding for the kind (the stronger layer), which counts the
    other; on the vectorised and the per-value path alike."""
    from stability.detectors import growth

    monkeypatch.setattr(growth, "VECTOR_MIN", 1 if vectorised else 10**9)
    s = _growth_series()
    s["attn_logit_max/h.1"][400:] *= np.exp(0.05 * np.arange(N - 400))
    s["attn_logit_max/h.2"][400:] *= np.exp(0.08 * np.arange(N - 400))
    alerts, _ = diagnose(to_records(s))
    [alert] = [a for a in alerts if a.kind == "attention_logit_growth"]
    assert alert.signal == "attn_logit_max/h.2", alert
    assert alert.message.endswith("(1 more series of the same kind grow too)"), alert.message


def test_activation_growth_and_logit_z_drift() -> None:
    s = _growth_series()
    s["act_absmax/h.0"][300:] *= np.exp(0.06 * np.arange(N - 300))
    s["logit_z"][600:] += 0.08 * np.arange(N - 600)
    alerts, _ = diagnose(to_records(s))
    assert [(a.signal, a.severity) for a in alerts if a.kind == "activation_growth"] == [
        ("act_absmax/h.0", Severity.WARNING)]
    [drift] = [a for a in alerts if a.kind == "logit_divergence"]
    assert drift.signal == "logit_z" and 620 <= drift.step <= 660
    assert drift.causes[0].cause == "output_logit_divergence"


def test_growth_during_warmup_is_quiet() -> None:
    s = _growth_series()
    s["lr"] = np.minimum(1.0, (np.arange(N) + 1) / 600.0) * 1e-3
    s["attn_logit_max/h.1"][:500] *= np.exp(0.004 * np.arange(500))
    s["attn_logit_max/h.1"][500:] *= np.exp(0.004 * 500)
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "attention_logit_growth") == []



def test_logits_grown_while_learning_do_not_date_a_later_blow_up() -> None:
    """The demo's shape: attention logits grow 2.3x while the loss falls (learning), sit flat, then an LR spike blows
    them up 2.3x more with a loss spike. The cumulative rise since the learning phase (5x) is no slow growth: the
    incident starts at the spike (it once showed onset 82 for an LR spike at step 240)."""
    n = 400
    rng = np.random.default_rng(3)
    t = np.arange(n, dtype=float)
    lr = np.minimum(1.0, (t + 1) / 30.0) * 3e-3
    lr[240:242] = 0.18
    loss = (1.2 + 3.1 * np.exp(-np.maximum(t - 40, 0) / 35.0)) * np.exp(rng.normal(0, 0.02, n))
    loss[241:] *= 1.0 + 4.2 * np.exp(-(t[241:] - 241) / 30.0)
    logit = np.interp(t, [0, 40, 60, 120, 241, 243, n], [2.0, 3.0, 7.4, 17.0, 17.5, 40.0, 40.0])
    s = {"loss": loss, "lr": lr, "grad_norm": np.exp(rng.normal(0, 0.1, n)),
         "attn_logit_max/blocks.0": logit * np.exp(rng.normal(0, 0.04, n))}
    alerts, diag = diagnose(to_records(s))
    assert any(a.kind == "loss_spike" for a in alerts), alerts
    assert [f for f in (f for i in diag.incidents for f in i.findings)
            if f.kind == "attention_logit_growth" and f.onset < 240] == []
    [incident] = [i for i in diag.incidents if "loss_spike" in i.kinds]
    assert 240 <= incident.onset <= 242, [(f.kind, f.onset, f.message) for f in incident.findings]


# --- plateau -------------------------------------------------------------------------------------------------------


def test_plateau_info_then_warning_and_quiet_when_lr_decayed() -> None:
    n = 6000
    rng = np.random.default_rng(2)
    t = np.arange(n)
    loss = np.where(t < 2000, 6.0 * np.exp(-t / 700.0) + 2.0, 6.0 * np.exp(-2000 / 700.0) + 2.0)
    s = {"loss": loss * np.exp(rng.normal(0, 0.02, n)), "lr": np.full(n, 1e-3)}
    alerts, _ = diagnose(to_records(s))
    plateaus = found(alerts, "plateau")
    assert [sev for _, _, sev in plateaus] == [Severity.INFO, Severity.WARNING]
    assert 2000 <= plateaus[0][0] <= 2600 and plateaus[0][1] <= 3200
    info = next(a for a in alerts if a.kind == "plateau")
    assert info.causes[0].cause == "lr_too_low"
    s["lr"] = np.where(t < 2000, 1e-3, 1e-5)
    alerts, _ = diagnose(to_records(s))
    assert found(alerts, "plateau") == []


# --- resume, divergence re-baseline, state -----------------------------------------------------------------------


def test_resume_rebaselines_and_opens_a_new_incident() -> None:
    s = base(700)
    recs = to_records(s)
    s2 = base(700, seed=9)
    s2["loss"] *= 0.8  # the resumed run continues at another level
    s2["loss"][560:564] *= 2.0
    resumed = [r for r in to_records(s2) if r.step >= 400]
    alerts, diag = diagnose(recs[:600] + resumed)
    assert diag.resumes == [(0, 599, 400)]
    assert [(a.kind, a.onset) for a in alerts if a.severity is not Severity.INFO] == [("loss_spike", 560)]


def test_divergence_rebaselines_after_it_fired() -> None:
    n = 1400
    rng = np.random.default_rng(4)
    t = np.arange(n)
    loss = (2.0 + 3.0 * np.exp(-t / 150.0)) * np.exp(rng.normal(0, 0.02, n))
    loss[500:] *= np.exp(np.minimum(t[500:] - 500, 100) * 0.01)  # rises 2.7x, then stays at the new level
    loss[1200:1204] *= 2.0  # a spike at the new level is still found
    alerts, _ = diagnose(to_records({"loss": loss}))
    kinds = [(a.kind, a.onset) for a in alerts if a.severity is not Severity.INFO]
    assert kinds[0][0] in ("divergence", "loss_spike") and 500 <= kinds[0][1] <= 560
    assert ("loss_spike", 1200) in kinds


@pytest.mark.parametrize("split", [350, 420, 503, 640])
def test_state_round_trip_with_the_new_detectors(split: int) -> None:
    s = _growth_series()
    s["attn_logit_max/h.1"][400:] *= np.exp(0.05 * np.arange(N - 400))
    s["loss_scale"] = np.full(N, 65536.0)
    s["loss_scale"][500:] = 65536.0 / 2.0 ** np.minimum(np.arange(N - 500) + 1, 4)
    s["grad_norm/h.2"][600:] *= 1e-3
    recs = to_records(s)
    full_alerts, _ = diagnose(recs)
    assert diagnose_split(recs, split) == full_alerts
    assert {a.kind for a in full_alerts} >= {"attention_logit_growth", "loss_scale_collapse", "grad_vanishing"}


# --- NaN naming ----------------------------------------------------------------------------------------------------


def test_nan_names_the_same_signal_whatever_the_column_order() -> None:
    signals = {"loss": float("nan"), "grad_norm": float("nan"), "grad_norm/h.10.attn": float("nan"),
               "grad_norm/h.2.mlp": float("nan"), "act_absmax/h.3.attn": float("inf"),
               "act_absmax/h.11.mlp": float("nan"), "grad_norm/wte": float("nan")}
    names = set()
    for seed in range(6):
        items = list(signals.items())
        random.Random(seed).shuffle(items)
        [finding] = NanDetector().update(StepRecord(run_id="r", step=5, signals=dict(items)))
        names.add(finding.signal)
    assert names == {"act_absmax/h.3.attn"}  # forward before backward, closest to the input
    no_act = {k: v for k, v in signals.items() if not k.startswith("act_")}
    [finding] = NanDetector().update(StepRecord(run_id="r", step=5, signals=no_act))
    # a NaN loss makes every gradient NaN: no gradient names where it came from; the loss does, and says so
    assert finding.signal == "loss" and "the gradients of 3 module(s) followed" in finding.message
    no_act["loss"] = 2.5  # a finite loss: the NaN arose in the backward pass, which starts at the output
    for order in (sorted(no_act.items()), sorted(no_act.items(), reverse=True)):
        [finding] = NanDetector().update(StepRecord(run_id="r", step=5, signals=dict(order)))
        assert finding.signal == "grad_norm/h.10.attn"
    with_head = {**no_act, "grad_norm/lm_head": float("nan"), "param_norm/wte": float("nan")}
    [finding] = NanDetector().update(StepRecord(run_id="r", step=5, signals=with_head))
    assert finding.signal == "grad_norm/lm_head"


def test_overflow_the_fp16_scaler_skipped_is_not_a_nan_event() -> None:
    s = base()
    s["loss_scale"] = np.full(N, 65536.0)
    s["loss_scale"][301:] = 32768.0
    s["skipped"] = np.zeros(N)
    s["skipped"][300] = 1.0
    s["grad_norm"][300] = np.inf
    s["grad_norm/h.1"][300] = np.inf  # (to_records drops NaN cells as absent)
    alerts, _ = diagnose(to_records(s))
    assert [a for a in alerts if a.severity is not Severity.INFO] == []
    s["skipped"][300] = 0.0  # the same non-finite gradients on a step that was applied: a NaN event
    alerts, _ = diagnose(to_records(s))
    assert [(a.kind, a.step, a.signal) for a in alerts] == [("nan", 300, "grad_norm/h.1")]


def test_every_new_finding_has_a_remedy_a_rollback_step_and_batches_to_skip() -> None:
    s = _growth_series()
    s["attn_logit_max/h.1"][400:] *= np.exp(0.05 * np.arange(N - 400))
    s["loss_scale"] = np.full(N, 65536.0)
    s["loss_scale"][500:] = 65536.0 / 2.0 ** np.minimum(np.arange(N - 500) + 1, 4)
    s["grad_norm/h.2"][600:] *= 1e-3
    s["logit_z"][700:] += 0.1 * np.arange(N - 700)
    recs = [StepRecord(run_id="r", step=r.step, signals=r.signals, batch=f"b{r.step}") for r in to_records(s)]
    _, diag = diagnose(recs)
    findings = [f for i in diag.incidents for f in i.findings if f.severity is not Severity.INFO]
    assert {f.kind for f in findings} == {"attention_logit_growth", "loss_scale_collapse", "grad_vanishing",
                                          "logit_divergence"}
    for f in findings:
        assert f.causes and all(c.remedy for c in f.causes)
        assert f.rollback_step is not None and f.rollback_step < f.onset
        assert f.skip_batches and f.skip_batches[0] == f"b{f.onset}"


# --- update-ratio jumps --------------------------------------------------------------------------------------------


def test_update_ratio_jump_names_the_largest_layer_counts_the_others_and_cools_down() -> None:
    s = base()
    rng = np.random.default_rng(3)
    for i in range(4):
        s[f"update_ratio/h.{i}"] = np.full(N, np.nan)
        s[f"update_ratio/h.{i}"][::10] = 1e-3 * np.exp(rng.normal(0, 0.1, N // 10))  # sampled every 10 steps
    s["update_ratio/h.2"][400] *= 50.0
    s["update_ratio/h.3"][400] *= 20.0
    s["update_ratio/h.2"][410] *= 50.0  # the next sample of the same series: within the cooldown
    alerts, _ = diagnose(to_records(s))
    jumps = [a for a in alerts if a.kind == "update_ratio_jump"]
    assert [(a.step, a.signal, a.severity) for a in jumps] == [(400, "update_ratio/h.2", Severity.WARNING)]
    assert "1 more layers jumped too" in jumps[0].message and jumps[0].evidence["layers"] == 2.0


def test_adam_lag_is_a_warning_before_the_loss_moves_and_info_when_the_batch_already_hit_it() -> None:
    s = base()
    s["adam_v_ratio/h.1"] = 1.0 + 0.3 * np.abs(np.random.default_rng(4).normal(0, 1, N))
    s["adam_v_ratio/h.1"][300] = 40.0  # g^2 40x Adam's estimate, loss unchanged: a precursor
    s["adam_v_ratio/h.1"][600] = 60.0  # the same with the loss 3x at that step: the batch's own gradient
    s["loss"][600] *= 3.0
    found_ = [a for a in diagnose(to_records(s))[0] if a.kind == "adam_v_lag"]
    assert [(a.step, a.severity) for a in found_] == [(300, Severity.WARNING), (600, Severity.INFO)]
    assert found_[0].causes[0].cause == "adam_second_moment" and "40x Adam's second-moment" in found_[0].message
    assert "the loss jumped 2.96x at the same step" in found_[1].message


def test_one_layer_exploding_inside_a_calm_global_norm_is_a_grad_explosion_naming_it() -> None:
    s = base()  # four layers with per-layer grad norms every step; the global norm is a separate series
    s["grad_norm/h.0"][500:504] *= 60.0  # a small layer explodes; the global norm (dominated by others) is unchanged
    s["grad_norm/h.3"][700] *= 12.0  # a 12x blip: under the 20x rule (bad batches reach 6-12x per layer)
    s["grad_norm/h.1"][800] *= 60.0  # one step, back at the next: a bad batch's gradient (INFO, reverted)
    alerts, diag = diagnose(to_records(s))
    layer = [a for a in alerts if a.kind == "grad_explosion"]
    assert [(a.onset, a.step, a.signal, a.severity, a.detector) for a in layer] == [
        (500, 501, "grad_norm/h.0", Severity.WARNING, "layer_grad"),  # confirmed by the next record
        (800, 801, "grad_norm/h.1", Severity.INFO, "layer_grad")]
    assert "grad_norm/h.0 jumped" in layer[0].message and "still" in layer[0].message
    assert layer[1].evidence["reverted"] == 1.0 and diag.incidents[-1].headline.causes[0].cause == "bad_batch"


def test_one_side_of_a_game_rising_is_not_a_divergence_but_still_spikes() -> None:
    from stability.detectors.divergence import DivergenceDetector
    from stability.detectors.engine import RunDiagnoser

    rng = random.Random(3)
    losses = [0.75 * (1.004 ** max(0, i - 200)) * (1 + rng.gauss(0, 0.02)) for i in range(400)]  # +1.6x over 200

    def records(game: bool, spike_at: int | None = None) -> list[StepRecord]:
        extra = {"objectives": 2.0} if game else {}
        return [StepRecord(run_id="r", step=i, signals={"loss": y * (8.0 if i == spike_at else 1.0), **extra})
                for i, y in enumerate(losses)]

    def kinds(recs: list[StepRecord]) -> set[str]:
        diag = RunDiagnoser()
        found = [f for r in recs for f in diag.update(r)] + diag.finish()
        return {f.kind for f in found if f.severity is not Severity.INFO}

    alone = DivergenceDetector()
    assert any(f.kind == "divergence" for r in records(False) for f in alone.update(r))  # a single objective: yes
    assert "divergence" not in kinds(records(True))  # the discriminator's loss as its generator improves: no
    assert "loss_spike" in kinds(records(True, spike_at=120))  # spikes are still spikes


# --- MoE experts --------------------------------------------------------------------------------------------------


def test_an_moe_experts_gradient_swinging_with_its_routed_tokens_is_no_layer_jump() -> None:
    """An expert's gradient and update follow the tokens routed to it: none on most steps, a few, then many (a 30x
    swing). The per-layer gradient and update-ratio detectors leave experts out; the same series on a dense layer
    still jumps, and an expert's weights (param_jump) are still judged."""
    from stability.detectors.update import LAYER_GRAD, PARAM_JUMP, UPDATE_RATIO, LayerJumpConfig, LayerJumpDetector

    rng = np.random.default_rng(5)

    def records(module: str) -> list[StepRecord]:
        out = []
        for step in range(200):
            tokens = 30 if step == 150 else 0 if rng.random() < 0.5 else 1
            grad = 0.01 * tokens * float(np.exp(rng.normal(0, 0.05)))
            signals = {"loss": 2.0, "lr": 1e-3, f"grad_norm/{module}": grad, f"update_ratio/{module}": 1e-3 * grad,
                       f"param_norm/{module}": 3.0 if step != 150 else 60.0}
            out.append(StepRecord(run_id="r", step=step, signals=signals))
        return out

    def judge(config: LayerJumpConfig, module: str) -> list[Finding]:
        detector = LayerJumpDetector(config)
        return [f for r in records(module) for f in detector.update(r)]

    for config in (LAYER_GRAD, UPDATE_RATIO):
        fired = {module: judge(config, module) for module in ("blocks.1.experts.3.w1", "blocks.1.mlp.w1")}
        assert fired["blocks.1.experts.3.w1"] == [], (config.name, fired)
        assert fired["blocks.1.mlp.w1"], config.name
    assert [f.onset for f in judge(PARAM_JUMP, "blocks.1.experts.3.w1")] == [150]
