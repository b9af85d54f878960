"""The learned LR schedule (``lr_off_schedule``), plateau causes, slow divergence and growth rules on synthetic
record streams built from the magnitudes of issue #8 (several seeds and noise levels, with the clean traps)."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from stability.detectors import RunDiagnoser, Severity
from stability.detectors.base import Finding
from stability.detectors.schedule import LrSchedule, ScheduleDetector
from stability.records import StepRecord

Schedule = Callable[[np.ndarray], np.ndarray]


def warm(t: np.ndarray, steps: int, *, exp: bool = False) -> np.ndarray:
    """Linear (or exponential from 1% of the peak) warm-up factor. (A warm-up whose first ``settle`` records
    print the same value, e.g. from 1e-6 with 6 decimals, cannot be told from a flat start: not tested.)"""
    if steps <= 0:
        return np.ones_like(t, dtype=float)
    frac = np.minimum(1.0, (t + 1) / steps)
    return 1e-2 ** (1.0 - frac) if exp else frac


def cosine(n: int, floor: float = 0.1) -> Schedule:
    return lambda t: floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * np.minimum(t / n, 1.0)))


CLEAN: dict[str, Callable[[int], np.ndarray]] = {
    "constant": lambda n: np.full(n, 3e-4),
    "no-warmup-cosine": lambda n: 3e-4 * cosine(n)(np.arange(n)),
    "linear-warmup-cosine": lambda n: 3e-4 * warm(np.arange(n), 100) * cosine(n)(np.arange(n)),
    "long-warmup-linear-decay": lambda n: 6e-4 * warm(np.arange(n), 1500) * np.clip(1.0 - (np.arange(n) - 1500) / n,
                                                                                     0.0, 1.0),
    "exp-warmup-constant": lambda n: 1e-3 * warm(np.arange(n), 400, exp=True),
    "wsd": lambda n: 1e-3 * warm(np.arange(n), 50) * np.clip((n - np.arange(n)) / (0.2 * n), 0.0, 1.0),
    "step-decay": lambda n: 1e-3 * warm(np.arange(n), 20) * 0.3 ** (np.arange(n) // (n // 4)),
    "inverse-sqrt": lambda n: 1e-3 * np.minimum((np.arange(n) + 1) / 200, np.sqrt(200 / (np.arange(n) + 1))),
    "warm-restarts": lambda n: 1e-3 * warm(np.arange(n), 30) * (0.5 * (1 + np.cos(np.pi * (np.arange(n) % 400) / 400))
                                                                  + 1e-3),
    "restarts-to-lower-peaks": lambda n: 1e-3 * 0.7 ** (np.arange(n) // 500) * cosine(500, 0.02)(np.arange(n) % 500),
    "planned-drop-and-restore": lambda n: np.where((np.arange(n) > 800) & (np.arange(n) < 1100), 1e-4, 1e-3),
    "rewarm-after-anneal": lambda n: 1e-3 * np.where(np.arange(n) < 1000, cosine(1000, 0.0)(np.arange(n)) + 1e-4,
                                                     warm(np.arange(n) - 1000, 200)),
}


def lr_records(lr: np.ndarray, every: int = 1, decimals: int | None = None, noise: float = 0.0,
               seed: int = 0) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(0, len(lr), every):
        value = float(lr[step]) * (1 + noise * rng.normal()) if noise else float(lr[step])
        if decimals is not None:
            value = round(value, decimals)
        out.append(StepRecord(run_id="r", step=step, signals={"lr": value, "loss": 3.0}))
    return out


def off_findings(recs: list[StepRecord]) -> list[Finding]:
    det = ScheduleDetector()
    return [f for r in recs for f in det.update(r)]


@pytest.mark.parametrize("name", sorted(CLEAN))
@pytest.mark.parametrize(("every", "decimals", "noise"), [(1, None, 0.0), (1, None, 1e-7), (10, None, 0.0),
                                                           (50, None, 1e-6), (1, 6, 0.0), (5, 7, 0.0)])
def test_clean_schedules_stay_on_schedule(name: str, every: int, decimals: int | None, noise: float) -> None:
    lr = CLEAN[name](3000)
    assert off_findings(lr_records(lr, every, decimals, noise)) == [], name


def test_llmc_like_quantized_warmup_has_a_peak_and_ends() -> None:
    """llm.c prints the LR with 6 decimals: the 700-step warm-up repeats values (0.000003 twice)."""
    t = np.arange(5000)
    lr = 6e-4 * warm(t, 700) * np.clip(1 - (t - 700) / 4300, 0, 1)
    sched = LrSchedule()
    for r in lr_records(lr, decimals=6):
        assert sched.update(r.step, r.get("lr")) is None
    assert sched.ramp_started and not sched.warming and 690 <= (sched.warmup_end or 0) <= 720
    assert sched.peak == pytest.approx(6e-4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("base", ["constant", "linear-warmup-cosine", "wsd", "step-decay", "warm-restarts"])
def test_slow_rise_off_schedule_is_warned_within_20_steps(base: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 3000
    lr = CLEAN[base](n).copy()
    start = int(rng.integers(600, 1800))
    rate = float(rng.uniform(0.015, 0.02))  # x2 every 35-46 steps
    lr[start:] = lr[start - 1] * (1 + rate) ** np.arange(1, n - start + 1)
    for every, noise in [(1, 0.0), (1, 1e-7), (10, 0.0)]:
        found = off_findings(lr_records(lr, every, noise=noise, seed=seed))
        assert len(found) == 1, (every, found)
        alert = found[0]
        assert alert.kind == "lr_off_schedule" and alert.severity is Severity.WARNING
        late = 0 if every == 1 else every  # a sparse log shows the departure one record interval late at most
        assert start <= alert.step <= start + 20 + late, (every, start, alert)
        assert alert.onset <= start + every and alert.evidence["factor"] >= 1.2


@pytest.mark.parametrize("factor", [10.0, 150.0, 1000.0])
def test_sudden_jump_above_the_peak_is_off_schedule_at_once(factor: float) -> None:
    n = 2000
    lr = CLEAN["linear-warmup-cosine"](n).copy()
    lr[1200:1203] *= factor
    [alert] = off_findings(lr_records(lr))
    assert alert.step == 1200 and alert.onset == 1200 and "jumped" in alert.message


def test_jump_rearms_after_the_lr_falls_back() -> None:
    lr = np.full(2000, 1e-3)
    lr[500:505] *= 30.0
    lr[1500:] *= 2.0
    assert [f.step for f in off_findings(lr_records(lr))] == [500, 1500]


@pytest.mark.parametrize("split", [5, 400, 1210])
def test_schedule_state_round_trip(split: int) -> None:
    lr = CLEAN["linear-warmup-cosine"](2000).copy()
    lr[1200:] = lr[1199] * 1.02 ** np.arange(1, 801)
    recs = lr_records(lr, decimals=8)
    full = off_findings(recs)
    first = ScheduleDetector()
    got = [f for r in recs[:split] for f in first.update(r)]
    second = ScheduleDetector()
    second.load_state_dict(msgpack.unpackb(msgpack.packb(first.state_dict()), raw=False))
    got += [f for r in recs[split:] for f in second.update(r)]
    assert got == full and len(full) == 1


@pytest.mark.parametrize("to", [0.0, 1e-9])
@pytest.mark.parametrize("base", ["constant", "linear-warmup-cosine", "step-decay", "inverse-sqrt"])
def test_lr_falling_off_its_schedule_is_warned_once(base: str, to: float) -> None:
    """A scheduler whose horizon ends before the run (or a LambdaLR returning 0) drops the LR to ~0 at once."""
    lr = CLEAN[base](3000).copy()
    lr[1500:] = to
    for every in (1, 10, 50):
        found = off_findings(lr_records(lr, every))
        assert [(f.step, bool(f.evidence.get("fell"))) for f in found] == [(1500, True)], (every, found)
        assert "fell" in found[0].message and found[0].severity is Severity.WARNING


def test_lr_fall_rearms_when_the_lr_comes_back_and_survives_a_state_round_trip() -> None:
    lr = np.full(3000, 1e-3)
    lr[1000:1100] = 0.0
    lr[2000:] = 0.0
    recs = lr_records(lr)
    assert [f.step for f in off_findings(recs)] == [1000, 2000]
    first = ScheduleDetector()
    got = [f for r in recs[:1050] for f in first.update(r)]
    second = ScheduleDetector()
    second.load_state_dict(msgpack.unpackb(msgpack.packb(first.state_dict()), raw=False))
    got += [f for r in recs[1050:] for f in second.update(r)]
    assert [f.step for f in got] == [1000, 2000]


# --- the whole diagnoser: plateau cause, divergence cause -------------------------------------------------------


def run(series: dict[str, np.ndarray]) -> tuple[list[Finding], RunDiagnoser]:
    diag = RunDiagnoser()
    n = len(series["loss"])
    alerts = []
    for s in range(n):
        signals = {k: float(v[s]) for k, v in series.items() if math.isfinite(v[s]) or k == "loss"}
        alerts += diag.update(StepRecord(run_id="r", step=s, signals=signals))
    return alerts + diag.finish(), diag


def lr_rise_run(seed: int, *, n: int = 4000, start: int = 2500, rate: float = 0.017,
                noise: float = 0.03) -> dict[str, np.ndarray]:
    """Issue #8, class 3: a cosine run whose LR leaves its schedule at ``start`` growing ``rate`` per step; the
    loss flattens, then turns upward once the LR is ~10x (after ~140 steps), slowly."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    lr = 1e-3 * warm(t, 200) * cosine(n)(t)
    lr[start:] = lr[start - 1] * (1 + rate) ** np.arange(1, n - start + 1)
    ratio = lr / lr[start - 1]
    log_loss = np.log(2.5 + 3.0 * np.exp(-t / 400.0)) + 0.02 * np.log(np.maximum(ratio, 1.0)) ** 2
    return {"loss": np.exp(log_loss + rng.normal(0, noise, n)), "lr": lr,
            "grad_norm": np.exp(rng.normal(0, 0.1, n)) * np.maximum(1.0, ratio / 10) ** 0.5}


@pytest.mark.parametrize("seed", range(3))
def test_lr_leaving_its_schedule_is_warned_first_and_names_lr_too_high(seed: int) -> None:
    series = lr_rise_run(seed)
    alerts, diag = run(series)
    first = alerts[0]
    assert first.kind == "lr_off_schedule" and 2500 <= first.step <= 2520, first
    assert first.causes[0].cause == "lr_too_high"
    for incident in diag.incidents:
        for f in incident.findings:
            assert not (f.kind == "plateau" and f.causes[0].cause == "lr_too_low"), f
    loss_events = [f for i in diag.incidents for f in i.findings if f.kind in ("divergence", "loss_spike")]
    assert loss_events and all(f.causes[0].cause == "lr_too_high" for f in loss_events), loss_events


def test_lr_falling_to_zero_names_lr_too_low() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(3000)
    lr = 1e-3 * warm(t, 200) * cosine(3000)(t)
    lr[1800:] = 0.0
    loss = np.exp(np.log(2.5 + 3.0 * np.exp(-np.minimum(t, 1800) / 400.0)) + rng.normal(0, 0.02, 3000))
    alerts, _ = run({"loss": loss, "lr": lr, "grad_norm": np.exp(rng.normal(0, 0.1, 3000))})
    fell = [a for a in alerts if a.kind == "lr_off_schedule"]
    assert [a.step for a in fell] == [1800] and fell[0].causes[0].cause == "lr_too_low", fell


def test_plateau_while_the_lr_rises_does_not_name_lr_too_low() -> None:
    """The loss is flat (plateau) while the LR keeps rising slowly (20x over the window): never ``lr_too_low``."""
    n = 6000
    rng = np.random.default_rng(5)
    t = np.arange(n)
    loss = np.where(t < 2000, 6.0 * np.exp(-t / 700.0) + 2.0, 6.0 * np.exp(-2000 / 700.0) + 2.0)
    lr = np.full(n, 1e-4)
    lr[2000:] = 1e-4 * 1.0015 ** np.arange(n - 2000)  # 20x in 2000 steps: off schedule, then a plateau
    _, diag = run({"loss": loss * np.exp(rng.normal(0, 0.02, n)), "lr": lr})
    plateaus = [f for i in diag.incidents for f in i.findings if f.kind == "plateau"]
    assert plateaus, "the flat loss is still a plateau"
    for f in plateaus:
        assert f.evidence["lr_ratio"] >= 1.2 and f.causes[0].cause == "lr_too_high", f.causes


# --- slow divergence ---------------------------------------------------------------------------------------------


def slow_rise(seed: int, noise: float, rate: float, n: int = 2600) -> tuple[dict[str, np.ndarray], int]:
    """An improving run (loss 5.5 -> ~2.6, nearly flat by step 1500) whose loss starts rising ``rate`` per step
    (log) at a random step; per-step noise ``noise`` (log), with rare one-step batch outliers."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    start = int(rng.integers(1500, 2300))
    log_loss = np.log(2.5 + 3.0 * np.exp(-t / 400.0)) + rng.normal(0, noise, n)
    log_loss[start:] += rate * np.arange(n - start)
    outliers = rng.random(n) < 0.002
    log_loss[outliers] += np.log(1.6)
    return {"loss": np.exp(log_loss), "lr": np.full(n, 1e-3), "grad_norm": np.exp(rng.normal(0, 0.1, n))}, start


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("noise", [0.02, 0.035, 0.05])
@pytest.mark.parametrize("rate", [0.003, 0.006, 0.01])
def test_slow_sustained_rise_is_a_divergence_within_50_steps(seed: int, noise: float, rate: float) -> None:
    series, start = slow_rise(seed, noise, rate)
    alerts, _ = run(series)
    div = [a for a in alerts if a.kind == "divergence"]
    assert div, [(a.kind, a.step) for a in alerts]
    first = div[0]
    assert start <= first.step <= start + 50, (start, first.step, first.message)
    assert first.severity is Severity.ERROR and first.onset <= first.step
    assert not any(a.kind == "loss_spike" and a.severity is not Severity.INFO and a.step < first.step for a in alerts)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("noise", [0.02, 0.05])
def test_noisy_improving_runs_and_a_learning_phase_transition_raise_nothing(seed: int, noise: float) -> None:
    """Clean traps: a noisy loss that keeps improving, with batch outliers, a flat noisy plateau and a phase
    transition (loss 3.8 -> 1.9 within ~40 steps) followed by a slow drift back up of 3 % (within the noise)."""
    rng = np.random.default_rng(100 + seed)
    n = 3000
    t = np.arange(n)
    log_loss = np.log(1.9 + 1.9 / (1 + np.exp((t - 1200) / 8.0)) + 0.3 * np.exp(-t / 300))
    log_loss += 0.03 * np.clip((t - 1500) / 600, 0, 1)  # a small, slow drift up after the transition
    log_loss += rng.normal(0, noise, n) + np.where(rng.random(n) < 0.003, np.log(1.7), 0.0)
    alerts, _ = run({"loss": np.exp(log_loss), "lr": np.full(n, 1e-3), "grad_norm": np.exp(rng.normal(0, 0.1, n))})
    assert [a for a in alerts if a.severity is not Severity.INFO] == []


@pytest.mark.parametrize("seed", range(3))
def test_slow_rise_in_coarse_logging_views(seed: int) -> None:
    """The same rise seen as every 10th step and as 10-step means (``loss_steps`` = 10) is still a divergence
    (the trend needs its 5 confirming records: 50 steps more at this cadence)."""
    series, start = slow_rise(seed, 0.04, 0.006)
    loss = series["loss"]
    views = {"every10": [(s, float(loss[s]), None) for s in range(0, len(loss), 10)],
             "mean10": [(s + 9, float(np.exp(np.mean(np.log(loss[s:s + 10])))), 10.0) for s in range(0, len(loss), 10)]}
    for name, rows in views.items():
        diag = RunDiagnoser()
        alerts: list[Finding] = []
        for step, value, steps in rows:
            signals = {"loss": value, **({"loss_steps": steps} if steps else {})}
            alerts += diag.update(StepRecord(run_id="r", step=step, signals=signals))
        loss_events = [a for a in alerts if a.kind in ("divergence", "loss_spike") and a.severity is Severity.ERROR]
        assert loss_events and start <= loss_events[0].step <= start + 120, (name, start, loss_events)
        found = [f.kind for i in diag.incidents for f in i.findings]
        assert "divergence" in found, (name, found)  # (it may join a loss spike's incident without a new alert)


# --- attention-logit and activation growth -----------------------------------------------------------------------


def growth_run(seed: int, *, n: int = 900, loss_trend: float = 0.0, every: int = 1,
               noise: float = 0.03) -> dict[str, np.ndarray]:
    """A post-warm-up stretch: loss ~2.6 (with a per-step log trend ``loss_trend``), two layers' attention logits
    at ~3 and an activation at ~1; series recorded every ``every`` steps (NaN elsewhere)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    sparse = np.where(t % every == 0, 1.0, np.nan)
    return {"loss": np.exp(np.log(2.6) + loss_trend * t + rng.normal(0, noise, n)), "lr": np.full(n, 1e-3),
            "grad_norm": np.exp(rng.normal(0, 0.1, n)),
            **{f"attn_logit_max/h.{i}": sparse * 3.0 * np.exp(rng.normal(0, 0.03, n)) for i in range(2)},
            "act_absmax/wpe": sparse * np.exp(rng.normal(0, 0.03, n))}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rate", [0.012, 0.0163, 0.025])
def test_steady_attention_logit_growth_warns_by_4x(seed: int, rate: float) -> None:
    """Issue #8, class 5: the logits grow steadily (16x over 170 steps at 1.63 %/step) from ~3 while the loss
    stalls: a WARNING by the time they have grown ~4x, not at 16x."""
    s = growth_run(seed)
    start = 400
    s["attn_logit_max/h.1"][start:] *= np.exp(rate * np.arange(900 - start))
    alerts, _ = run(s)
    [alert] = [a for a in alerts if a.kind == "attention_logit_growth"]
    grown = math.exp(rate * (alert.step - start))
    assert alert.severity is Severity.WARNING and alert.signal == "attn_logit_max/h.1"
    assert 1.5 <= grown <= 5.0, (alert.step, grown)
    assert alert.causes[0].cause == "attention_logit_growth"


@pytest.mark.parametrize("seed", range(3))
def test_attention_logits_growing_10x_while_the_loss_halves_is_learning(seed: int) -> None:
    """The clean trap: a learning phase transition (loss 3.8 -> 1.9 within ~40 steps, logits 10x)."""
    s = growth_run(seed)
    t = np.arange(900)
    s["loss"] *= (1.9 + 1.9 / (1 + np.exp((t - 420) / 6.0))) / 2.6
    for i in range(2):
        s[f"attn_logit_max/h.{i}"] *= 1 + 9 / (1 + np.exp(-(t - 420) / 6.0))
    alerts, _ = run(s)
    assert [a for a in alerts if a.severity is not Severity.INFO] == []


@pytest.mark.parametrize("seed", range(3))
def test_slow_activation_growth_from_a_small_init_on_a_healthy_run_is_quiet(seed: int) -> None:
    """nanoGPT's position embedding (init std 0.02): its activation grows ~12x over 2,400 healthy steps (stats
    every 50 steps), fastest at first, while the loss falls: quiet. A steady (exponential) 12x growth while the
    loss stalls is a warning; the same while the loss falls is learning."""
    n, every = 3000, 50
    t = np.arange(n)
    shapes = {"sqrt": 0.06 * (1 + 11 * np.sqrt(np.minimum(t, 2400) / 2400)),
              "exp": 0.06 * np.exp(np.log(12) * np.minimum(t, 2400) / 2400)}
    for loss_falls, shape, expect in [(True, "sqrt", []), (False, "exp", ["activation_growth"]),
                                      (True, "exp", [])]:
        s = growth_run(seed, n=n, every=every, loss_trend=-2e-4 if loss_falls else 0.0)
        for i in range(2):
            del s[f"attn_logit_max/h.{i}"]
        s["act_absmax/wpe"] *= shapes[shape]
        alerts, _ = run(s)
        assert [a.kind for a in alerts if a.severity is not Severity.INFO] == expect, (loss_falls, shape)


def test_the_saved_lr_state_names_every_attribute_the_tracker_has() -> None:
    """``LrSchedule.state_dict`` names its fields (no ``vars(self)``, which slows the hot object on CPython 3.11+):
    a field added to ``__init__`` must be added to ``_STATE`` too, or a restored tracker would lose it."""
    from stability.detectors.schedule import LrSchedule

    tracker = LrSchedule()
    for step, lr in enumerate([1e-4, 2e-4, 3e-4, 3e-4, 2.9e-4, 5e-3]):
        tracker.update(step, lr)
    fields = [k for k in vars(tracker) if k not in ("config", "_steady")]
    assert list(LrSchedule._STATE) == fields
    restored = LrSchedule()
    restored.load_state_dict(tracker.state_dict())
    assert restored.state_dict() == tracker.state_dict()
