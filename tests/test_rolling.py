"""The streaming fast path of the per-module detectors (``detectors/_rolling.py``) decides exactly as the full fit:
the sorted window's median is bit-identical to ``median(window.y)``, the level bound never exceeds the robust line's
prediction, ``FastBaseline`` is ``Baseline`` (predictions and state), and the per-layer jump, vanishing-gradient
and Adam-lag detectors give the same findings and state with the fast path as without it."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from stability.detectors import update, vanish
from stability.detectors._rolling import FastBaseline, SortedWindow, level_lower_bound
from stability.detectors._stats import Baseline, Window, median
from stability.detectors.update import LAYER_GRAD, UPDATE_RATIO, AdamLagConfig, AdamLagDetector, LayerJumpDetector
from stability.detectors.vanish import GradVanishingDetector
from stability.records import StepRecord


def _stream(seed: int, n: int = 600) -> list[tuple[float, float]]:
    """(x, y) points: noise, a trend, level shifts, single jumps, gaps in x."""
    rng = random.Random(seed)
    out, x, level = [], 0.0, 0.0
    for i in range(n):
        x += rng.choice((1, 1, 1, 10, 50))
        if i % 97 == 0:
            level += rng.uniform(-3, 3)
        y = level + 0.002 * i + rng.gauss(0, rng.choice((0.05, 0.3, 1.0)))
        if rng.random() < 0.03:
            y += rng.uniform(-8, 8)
        out.append((x, y))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_sorted_window_median_is_the_window_median(seed: int) -> None:
    size = (16, 32, 64, 5, 1, 128)[seed]
    fast, ref = SortedWindow(size), Window(size)
    for i, (x, y) in enumerate(_stream(seed)):
        fast.push(x, y)
        ref.push(x, y)
        if i == 300:
            fast.clear()
            ref.clear()
            continue
        assert len(fast) == len(ref)
        assert fast.median == median(ref.y)  # bit-identical, not approximately
        assert (fast.low, fast.high) == (float(ref.y.min()), float(ref.y.max()))


@pytest.mark.parametrize("seed", range(8))
def test_level_bound_never_exceeds_the_robust_line(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice((8, 32, 64))
    fast, ref = SortedWindow(size), Baseline(window=size, min_points=8, scale_floor=0.05)
    checked = 0
    for x, y in _stream(seed):
        if len(ref) >= 8:
            bound = level_lower_bound(fast, x)
            assert bound <= ref.predict(x).level
            checked += math.isfinite(bound)
        fast.push(x, y)
        ref.accept(x, y)
    assert checked > 400  # the bound was usable, not just -inf


def test_irregular_or_nonfinite_windows_have_no_bound() -> None:
    win = SortedWindow(8)
    for x in (1.0, 2.0, 2.0, 3.0):  # a repeated step: pairs half a window apart may be < h steps apart
        win.push(x, 0.0)
    assert level_lower_bound(win, 4.0) == -math.inf
    for x in range(4, 12):  # the repeated step left the window
        win.push(float(x), 0.0)
    assert level_lower_bound(win, 12.0) > -1.0
    win.push(12.0 + 1, math.nan)
    assert not win.finite and level_lower_bound(win, 14.0) == -math.inf


@pytest.mark.parametrize("seed", range(4))
def test_fast_baseline_is_baseline(seed: int) -> None:
    fast = FastBaseline(window=32, min_points=8, scale_floor=0.05)
    ref = Baseline(window=32, min_points=8, scale_floor=0.05)
    for x, y in _stream(seed, 200):
        if len(ref):
            assert fast.predict(x + 1) == ref.predict(x + 1)
        fast.accept(x, y)
        ref.accept(x, y)
    assert fast.state_dict() == ref.state_dict()
    copy = FastBaseline(window=32, min_points=8, scale_floor=0.05)
    copy.load_state_dict(ref.state_dict())
    assert copy.predict(1e4) == ref.predict(1e4) and copy.median == fast.median


def _records(seed: int, n: int = 500) -> list[StepRecord]:
    """Per-layer gradient norms and update ratios with jumps, collapses, zeros (unused experts) and an LR ramp."""
    rng = random.Random(seed)
    out = []
    for step in range(n):
        lr = 1e-3 * min(1.0, (step + 1) / 50) * (1 + (step > 300) * 4)
        sig: dict[str, float] = {"loss": 2.0 + rng.gauss(0, 0.05), "lr": lr,
                                 "grad_norm": math.exp(rng.gauss(0, 0.2)) * (1e-4 if 200 < step < 260 else 1.0)}
        for m in range(6):
            g = math.exp(rng.gauss(m * 0.3, 0.25))
            if rng.random() < 0.02:
                g *= rng.choice((30.0, 300.0, 1e-6))
            if m == 5 and step > 350:
                g *= 1e-7  # a layer that dies
            sig[f"grad_norm/layer{m}"] = 0.0 if (m == 4 and step % 7 == 0) else g
            if step % 3 == 0:
                sig[f"update_ratio/layer{m}"] = lr * math.exp(rng.gauss(0, 0.2)) * (50.0 if rng.random() < 0.02 else 1)
                sig[f"adam_v_ratio/layer{m}"] = math.exp(rng.gauss(0, 0.3)) * (100.0 if rng.random() < 0.02 else 1)
        sig["adam_v_ratio/wte"] = 0.0 if step % 4 else math.exp(rng.gauss(1, 1.5))
        out.append(StepRecord(run_id="r", step=step, signals=sig))
    return out


def _run(detector: Any, records: list[StepRecord]) -> tuple[list[dict[str, Any]], Any]:
    found = [f.to_dict() for r in records for f in detector.update(r)] + [f.to_dict() for f in detector.finish()]
    return found, detector.state_dict()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [UPDATE_RATIO, LAYER_GRAD], ids=["update_ratio", "layer_grad"])
def test_layer_jumps_are_the_same_with_and_without_the_fast_path(seed: int, config: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records(seed)
    fast = _run(LayerJumpDetector(config), records)
    monkeypatch.setattr(update, "level_lower_bound", lambda window, x: -math.inf)  # always the full fit
    slow = _run(LayerJumpDetector(config), records)
    assert fast == slow
    assert fast[0], "the stream has jumps: the comparison covers findings"


@pytest.mark.parametrize("seed", range(3))
def test_vanishing_is_the_same_with_the_scalar_median(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records(seed)
    fast = _run(GradVanishingDetector(), records)
    monkeypatch.setattr(vanish, "row_median", lambda a: np.array([np.median(row) for row in a]))  # numpy's median
    slow = _run(GradVanishingDetector(), records)
    assert fast == slow
    assert fast[0], "the stream has collapses: the comparison covers findings"


def test_adam_lag_thresholds_never_fall_below_the_shortcut() -> None:
    """The detector computes a module's threshold only for values >= min(lag, sparse_lag): no threshold is lower."""
    cfg = AdamLagConfig()
    detector = AdamLagDetector(cfg)
    least = min(cfg.lag, cfg.sparse_lag)
    seen = 0
    for record in _records(1):
        for name in record.signals:
            if name.startswith("adam_v_ratio/"):
                assert detector._threshold(name) >= least
                seen += 1
        detector.update(record)
    assert seen > 100


def test_load_state_restores_the_sorted_copy() -> None:
    records = _records(2)
    whole = GradVanishingDetector()
    for r in records:
        whole.update(r)
    first, second = GradVanishingDetector(), GradVanishingDetector()
    for r in records[:250]:
        first.update(r)
    second.load_state_dict(first.state_dict())
    assert [f.to_dict() for r in records[250:] for f in second.update(r)] == \
        [f.to_dict() for r in records[250:] for f in first.update(r)]
    assert vanish.GradVanishingDetector().state_dict()["series"] == {}
