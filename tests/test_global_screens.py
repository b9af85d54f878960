"""The exact shortcuts of the global detectors (loss spike, gradient explosion, divergence) decide as the full fits.

Each detector runs twice over the same stream: as shipped, and with its screens switched off (every record takes the
full robust-line fit, as before the screens). Findings (``repr``: the same types and floats) and ``state_dict``
(msgpack bytes) must be equal after every record of the stream and after a state round trip mid-stream. The streams
sit near the thresholds (rises of 1.2-1.4x and 4-6x, heavy tails), fall and rise, have gaps, repeated steps,
absent / zero / NaN / infinite values, averaged losses and long spikes that force a re-baseline."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from stability.detectors import divergence, grad, spike
from stability.detectors._slopes import SlidingSlopes
from stability.detectors._stats import Window, robust_line
from stability.detectors.divergence import DivergenceDetector
from stability.detectors.grad import GradExplosionDetector
from stability.detectors.spike import SpikeConfig, SpikeDetector
from stability.records import StepRecord


def _stream(seed: int, n: int = 1500) -> list[StepRecord]:
    rng = random.Random(seed)
    out: list[StepRecord] = []
    step, loss, grad_norm = 0, 6.0, 1.0
    noise = rng.choice((0.002, 0.005, 0.01, 0.05, 0.2))
    drift = rng.choice((-2e-3, -2e-4, 0.0, 5e-4))
    near = 0.03
    for i in range(n):
        step += (rng.choice((2, 0, 150)) if rng.random() < 0.004 else 1) if seed % 2 else 1
        if i % 300 == 150:
            noise = rng.choice((0.002, 0.005, 0.01, 0.05, 0.2))
            drift = rng.choice((-2e-3, -2e-4, 0.0, 5e-4, 3e-3))
            near = rng.choice((0.002, 0.03))  # rare near-threshold values: long quiet stretches the screens take
        loss *= math.exp(drift + rng.gauss(0, noise))
        grad_norm *= math.exp(rng.gauss(0, noise))
        y, g = loss, grad_norm
        roll = rng.random()
        if roll < near:
            y *= rng.uniform(1.15, 1.45)  # near the 1.3x spike threshold
        elif roll < 1.3 * near:
            y *= rng.uniform(2.0, 5.0)
        elif roll < 1.6 * near and i % 500 > 250:
            loss *= 2.5  # a lasting jump (long spikes: re-baselines)
        if rng.random() < near:
            g *= rng.uniform(3.5, 7.0)  # near the 5x gradient threshold
        elif rng.random() < near / 4:
            g *= rng.uniform(40, 80)
        signals: dict[str, float] = {"loss": y, "grad_norm": g}
        odd = rng.random()
        if odd < 0.01:
            signals["loss"] = rng.choice((math.nan, math.inf, 0.0, -1.0))
        elif odd < 0.02:
            signals["grad_norm"] = rng.choice((math.nan, math.inf, 0.0))
        elif odd < 0.03:
            del signals["loss"]
        if seed % 3 == 2 and i > n // 2:
            signals["loss_steps"] = 10.0
        out.append(StepRecord(run_id="r", step=step, signals=signals))
    return out


def _slow_rises(seed: int, n: int = 1500) -> list[StepRecord]:
    """A falling loss that turns into slow rises (the divergence trend rule) and flat noisy stretches."""
    rng = random.Random(seed)
    out, loss = [], 5.0
    for i in range(n):
        phase = (i // 250) % 3
        drift = (-3e-3, rng.choice((3e-3, 6e-3, 1e-2)), 0.0)[phase]
        loss *= math.exp(drift)
        value = loss * math.exp(rng.gauss(0, rng.choice((0.005, 0.02, 0.04))))
        out.append(StepRecord(run_id="r", step=i + (i // 700) * 30, signals={"loss": value}))
    return out


def _state(detector: Any) -> bytes:
    return msgpack.packb(detector.state_dict(), use_bin_type=True, default=repr)  # type: ignore[no-any-return]


def _trace(make: Callable[[], Any], records: list[StepRecord], restore_at: int) -> list[tuple[str, bytes]]:
    """(findings, state) after each record; the detector is rebuilt from its state at ``restore_at``."""
    detector = make()
    out = []
    for i, record in enumerate(records):
        found = repr(detector.update(record))
        if i == restore_at:
            state = detector.state_dict()
            detector = make()
            detector.load_state_dict(state)
        # a snapshot fits the lazy rises: only a few, so that most of the stream runs with them pending
        out.append((found, _state(detector) if i % 397 == 0 or i == restore_at else b""))
    out.append((repr(detector.finish()), _state(detector)))
    return out


CASES: dict[str, tuple[Callable[[], Any], list[tuple[Any, str, Any]]]] = {
    "spike": (SpikeDetector, [(spike, "level_lower_bound", lambda window, x: -math.inf)]),
    "spike_small": (lambda: SpikeDetector(SpikeConfig(window=16, min_points=8, max_active=20)),
                    [(spike, "level_lower_bound", lambda window, x: -math.inf)]),
    "grad": (GradExplosionDetector, [(grad, "level_lower_bound", lambda window, x: -math.inf)]),
    "divergence": (DivergenceDetector, [(divergence, "SCREENS", False)]),
}


@pytest.mark.parametrize("seed", range(7))
@pytest.mark.parametrize("name", sorted(CASES))
def test_screens_decide_as_the_full_fit(name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    make, patches = CASES[name]
    records = _stream(seed) if seed < 4 or name != "divergence" else _slow_rises(seed)
    fast = _trace(make, records, restore_at=len(records) // 3)
    for module, attr, value in patches:
        monkeypatch.setattr(module, attr, value)
    slow = _trace(make, records, restore_at=len(records) // 3)
    for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert a == b, f"record {i}"
    assert any(f != "[]" for f, _ in fast), "the stream has findings: the comparison covers them"


@pytest.mark.parametrize("seed", range(10))
def test_sliding_slopes_are_the_robust_line_slope(seed: int) -> None:
    """Bit-identical to ``robust_line``'s slope whenever known: only on full windows with increasing x and finite
    y (gaps of several sizes, repeated and backward x, NaN / inf / signed zeros, clears)."""
    rng = random.Random(seed)
    size = (2, 3, 5, 16, 33, 64, 96, 7, 24, 25)[seed]
    slopes, window = SlidingSlopes(size), Window(size)
    checked = 0
    for _ in range(1500):
        x = window.x[-1] if len(window) else 0.0
        x += rng.choice((1.0, 1.0, 1.0, 3.0, 0.5)) if rng.random() > 0.01 else rng.choice((0.0, -1.0))
        y = rng.gauss(0, 1) if rng.random() > 0.01 else rng.choice((0.0, math.nan, -0.0, math.inf))
        if rng.random() < 0.002:
            slopes.clear()
            window.clear()
        slopes.push(x, y)
        window.push(x, y)
        slope = slopes.slope()
        if slope is not None:
            checked += 1
            assert len(window) == size and (np.diff(window.x) > 0).all() and np.isfinite(window.y).all()
            assert np.float64(slope).tobytes() == np.float64(robust_line(window.x, window.y)[1]).tobytes()
    assert checked > 100


def test_spike_lazy_rises_keep_a_bounded_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long quiet stream: every record is screened and its rise kept lazily; the accepted log stays within
    4 windows, and the rises, fitted at the end, are those of the full fit."""
    rng = random.Random(7)
    records = [StepRecord(run_id="r", step=i, signals={"loss": 3.0 * math.exp(rng.gauss(0, 0.01))})
               for i in range(5000)]
    fast, slow = SpikeDetector(), SpikeDetector()
    for record in records:
        fast.update(record)
        assert len(fast._log_x) < 4 * fast.config.window
    assert len(fast._lazy) == fast.config.window
    monkeypatch.setattr(spike, "level_lower_bound", lambda window, x: -math.inf)
    for record in records:
        slow.update(record)
    assert not slow._lazy
    assert _state(fast) == _state(slow)


def _lr_stream(seed: int, n: int = 3000) -> list[float]:
    """Warm-up, flat stretches (repeated values), a quantised cosine decay, restarts, re-warms, jumps, an int LR,
    absent / zero / NaN values."""
    rng = random.Random(seed)
    out: list[float] = []
    peak = rng.choice((3e-4, 1e-3, 6e-4))
    warm = rng.choice((0, 50, 200))
    for i in range(n):
        if i < warm:
            lr = peak * (i + 1) / warm
        else:
            t = (i - warm) % 1000 / 1000
            lr = peak * (0.5 + 0.5 * math.cos(math.pi * t)) if rng.random() < 0.7 or i % 400 < 200 else out[-1]
        lr = float(f"{lr:.{rng.choice((2, 3, 6))}g}") if i % 3 else lr
        roll = rng.random()
        if roll < 0.01:
            lr *= rng.choice((3.0, 10.0, 1.5))
        elif roll < 0.02:
            lr = rng.choice((math.nan, 0.0, -1.0))
        elif roll < 0.025:
            lr = 1  # an int, equal to a float 1.0 the next time
        out.append(lr)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_schedule_shortcut_of_an_unchanged_lr_is_exact(seed: int) -> None:
    from stability.detectors.schedule import LrSchedule

    fast, slow = LrSchedule(), LrSchedule()
    slow._steady = False  # every record through the general path
    for i, lr in enumerate(_lr_stream(seed)):
        assert repr(fast.update(i, lr)) == repr(slow.update(i, lr)), f"record {i}"
        if i % 5 == 0:
            assert msgpack.packb(fast.state_dict(), default=repr) == msgpack.packb(slow.state_dict(), default=repr)
        if i == 1500:
            state = fast.state_dict()
            fast = LrSchedule()
            fast.load_state_dict(state)
