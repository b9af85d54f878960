"""The per-record shortcuts of the scalar detectors are exact.

``_stats.median`` (a Python sort on short windows, an in-place partition of temporaries) is bit-identical to the
former ``np.partition`` median (and equal to ``np.median`` without NaN), including even lengths (``(a + b) / 2``),
signed zeros and infinities; the line fit and MAD scale are those of the plain numpy formulas; the cached LR
resolution is the uncached one; the loss-scale detector's cached window peak is always ``max(window, key=(value,
step))`` and its findings and state are those of a detector that recomputes it every record; the cross-rank
detector skips its rules on a step one rank reported with the same findings and state."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from stability.detectors import schedule
from stability.detectors._stats import mad_scale, median, predict_line, robust_line
from stability.detectors.base import Finding
from stability.detectors.crossrank import CrossRankDetector
from stability.detectors.fp16 import LossScaleDetector
from stability.records import StepRecord


def _partition_median(values: np.ndarray) -> float:
    """The former ``median``: ``np.partition`` and the mean of the middle two."""
    n = len(values)
    lo, hi = (n - 1) // 2, n // 2
    part = np.partition(values, (lo, hi)) if lo != hi else np.partition(values, lo)
    return float(0.5 * (part[lo] + part[hi]))


def _bits(value: float) -> bytes:
    return np.float64(value).tobytes()


def _arrays(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(1, 80))
        kind = i % 6
        if kind == 0:
            v = rng.normal(size=n)
        elif kind == 1:  # many ties, zeros of both signs
            v = rng.integers(-2, 3, size=n).astype(np.float64) * rng.choice([1.0, -1.0], size=n)
        elif kind == 2:
            v = np.where(rng.random(n) < 0.2, np.nan, rng.normal(size=n))
        elif kind == 3:
            v = rng.choice([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0], size=n)
        elif kind == 4:  # overflowing middle sums
            v = rng.normal(size=n) * 1e308
        else:
            v = np.round(rng.normal(size=n), 2)
        out.append(v[::2] if i % 7 == 0 else v)  # and non-contiguous views
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_median_is_bit_identical_to_partition_median() -> None:
    for values in _arrays(0, 6000):
        before = values.copy()
        got = median(values)
        assert _bits(got) == _bits(_partition_median(values)), values
        assert np.array_equal(values, before, equal_nan=True)  # the caller's array is left alone
        if np.isfinite(values).all() and abs(values).max() < 1e300:  # (np.median: sign of a zero may differ, as before)
            assert got == float(np.median(values)), values


def test_even_length_median_is_the_mean_of_the_middle_two() -> None:
    assert median(np.array([1.0, 2.0])) == 1.5
    a, b = 0.1, 0.7
    assert _bits(median(np.array([b, 5.0, a, -3.0]))) == _bits(float(np.median([a, b, 5.0, -3.0]))) == \
        _bits((a + b) / 2)
    assert _bits(median(np.array([-0.0, 0.0, -0.0]))) == _bits(_partition_median(np.array([-0.0, 0.0, -0.0])))


def _line_reference(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    half = len(y) // 2
    if half == 0:
        return float(y[-1]), 0.0
    slope = _partition_median((y[half: 2 * half] - y[:half]) / (x[half: 2 * half] - x[:half]))
    return _partition_median(y - slope * (x - x[-1])), slope


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_line_and_scale_are_the_numpy_formulas() -> None:
    rng = random.Random(1)
    for values in _arrays(2, 1500):
        if np.isnan(values).any() or np.isinf(values).any() or abs(values).max(initial=0.0) > 1e200:
            continue
        xs = np.cumsum([rng.choice((1.0, 1.0, 3.0)) for _ in values])
        level, slope = robust_line(xs, values)
        ref_level, ref_slope = _line_reference(xs, values)
        assert (_bits(level), _bits(slope)) == (_bits(ref_level), _bits(ref_slope))
        ref_scale = 1.4826 * _partition_median(np.abs(values - _partition_median(values)))
        assert _bits(mad_scale(values)) == _bits(ref_scale)
        pred = predict_line(xs, values, xs[-1] + 1.0, min_points=4, scale_floor=0.01)
        if len(values) >= 4:
            residual_scale = 1.4826 * _partition_median(np.abs(
                (r := values - (ref_level + ref_slope * (xs - xs[-1]))) - _partition_median(r)))
            assert _bits(pred.scale) == _bits(max(residual_scale, 0.01))
            assert _bits(pred.level) == _bits(ref_level + ref_slope * (xs[-1] + 1.0 - xs[-1]))


def test_cached_resolution_is_the_uncached_one() -> None:
    rng = random.Random(3)
    values = [0.0, -0.0, 1.0, 3e-4, 0.000526, 1e-20, math.inf, math.nan, 6e-05, 1.5e300]
    values += [rng.uniform(0, 1e-3) for _ in range(300)] + [round(rng.uniform(0, 1e-3), 6) for _ in range(300)]
    for value in values * 2:
        assert _bits(schedule.resolution(value)) == _bits(schedule._resolution(value))


class _Uncached(LossScaleDetector):
    """Forgets its cached peak before each record: recomputes ``max`` every time (the former code)."""

    def update(self, record: StepRecord) -> list[Finding]:
        self._peak = None
        return super().update(record)


def _scale_stream(seed: int, n: int) -> list[StepRecord]:
    rng = random.Random(seed)
    scale, out, step = 2.0**16, [], rng.choice((0, 500))
    for _ in range(n):
        step += rng.choice((1, 1, 1, 2, 40, 130))
        r = rng.random()
        if r < 0.08:
            scale /= 2
        elif r < 0.12:
            scale *= 2
        elif r < 0.13:
            scale = 2.0 ** rng.randint(0, 20)
        skipped = 1.0 if rng.random() < 0.05 else 0.0
        loss = math.nan if rng.random() < 0.01 else 2.0
        out.append(StepRecord(run_id="r", step=step, signals={"loss": loss, "grad_norm": 1.0,
                                                              "loss_scale": scale, "skipped": skipped}))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_loss_scale_peak_cache_is_exact(seed: int) -> None:
    cached, uncached = LossScaleDetector(), _Uncached()
    for i, record in enumerate(_scale_stream(seed, 3000)):
        assert cached.update(record) == uncached.update(record)
        if cached._peak is not None:
            assert cached._peak == max(cached._scales, key=lambda p: (p[1], p[0]))
            assert any(entry is cached._peak for entry in cached._scales)
        assert cached.state_dict() == uncached.state_dict()
        if i % 500 == 250:  # a restored detector recomputes its peak
            state = cached.state_dict()
            cached = LossScaleDetector()
            cached.load_state_dict(state)


class _AlwaysSuspects(CrossRankDetector):
    """Runs every rule on a step one rank reported too (the former code)."""

    def _lone(self, values: dict[int, list[float | None]]) -> dict[int, tuple[str, float, float, float, bool]]:
        return self._suspects(values)


@pytest.mark.parametrize("seed", range(4))
def test_crossrank_lone_rank_shortcut_is_exact(seed: int) -> None:
    """Ranks that miss steps (decided by the lag with one, two or all ranks), replicas that disagree now and then
    (grad and loss faults, a NaN), on a single-rank and a 4-rank run: same findings, verdicts and state."""
    rng = random.Random(seed)
    ranks = 1 if seed == 0 else 4
    fast, slow = CrossRankDetector(), _AlwaysSuspects()
    for step in range(1500):
        grad = 1.0 + rng.gauss(0, 0.01)
        for rank in range(ranks):
            if ranks > 1 and rng.random() < (0.6 if step % 200 < 50 else 0.05):
                continue  # this rank's record is missing: the step may be decided with fewer ranks
            loss = 2.0 + rng.gauss(0, 0.02)
            g = grad
            if rng.random() < 0.01:
                g *= rng.choice((5.0, 0.1, math.inf))
            if rng.random() < 0.01:
                loss *= 3.0
            record = StepRecord(run_id="r", step=step, rank=rank, host=f"h{rank}", coords={"dp": rank},
                                signals={"loss": loss, "grad_norm": g})
            assert fast.update(record) == slow.update(record)
            assert fast.verdicts() == slow.verdicts()
        if step % 300 == 0:
            assert fast.state_dict() == slow.state_dict()
    assert fast.finish() == slow.finish()
    assert fast.state_dict() == slow.state_dict()
