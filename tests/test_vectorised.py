"""The vectorised per-module detectors (``detectors/_modules.py``; ``vanish.py``, ``growth.py``) decide
exactly as the per-value code they replaced: the record streams of ``tests/_vec_streams.py`` (per-layer jumps,
vanishing and dead layers, frozen updates, growth, Adam lags, series that appear and vanish, zero / non-finite
values, a repeated step, sparse statistics, heavy-tailed noise) give the same findings (kind, step, onset, rank,
severity, signal, message, evidence to 10 significant digits) as the reference findings the per-value code
produced (``tests/data/vectorised_findings.json``), with and without a state save / load in the middle, and a
state saved by the per-value code loads and goes on to the same findings."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from stability.detectors import growth, vanish
from stability.detectors._modules import Rings, row_median
from stability.detectors._stats import Window, median
from tests import _vec_streams as vs

REFERENCE = json.loads(vs.FIXTURE.read_text())
VECTORISED = [d for d in vs.DETECTORS if d.startswith(("vanish", "growth"))]
"""The configurations whose state round trips are checked here (the per-layer jump and Adam-lag detectors'
vectorised banks are pinned to their per-value paths by ``tests/test_vector_banks.py``; the first test covers
them too)."""
STREAMS = dict(vs.streams())


_plain = vs.plain


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == w


@pytest.mark.parametrize("sname", list(STREAMS))
def test_findings_are_the_reference_findings(sname: str) -> None:
    for dname in vs.DETECTORS:
        _same(vs.run_detector(vs.DETECTORS[dname], STREAMS[sname]), REFERENCE["findings"][f"{sname}:{dname}"])


@pytest.mark.parametrize("path", ["vectorised", "per-value"])
@pytest.mark.parametrize("sname", ["s3-small", "s1"])
def test_both_paths_give_the_reference_findings(sname: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each implementation alone (whatever the record size; the default switches at ``VECTOR_MIN`` series)."""
    least = 1 if path == "vectorised" else 10**9
    monkeypatch.setattr(vanish, "VECTOR_MIN", least)
    monkeypatch.setattr(growth, "VECTOR_MIN", least)
    for dname in ("vanish", "vanish_tight", "growth", "growth_tight"):
        _same(vs.run_detector(vs.DETECTORS[dname], STREAMS[sname]), REFERENCE["findings"][f"{sname}:{dname}"])


@pytest.mark.parametrize("dname", ["vanish_tight", "growth_tight"])
def test_switching_paths_midway_changes_nothing(dname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout that crosses ``VECTOR_MIN`` moves the state to the other implementation: same findings."""
    records = STREAMS["s0"]
    for module in (vanish, growth):
        monkeypatch.setattr(module, "VECTOR_MIN", 10**9)
    det = vs.DETECTORS[dname]()
    got = [vs.describe(f) for rec in records[:150] for f in det.update(rec)]
    for module in (vanish, growth):
        monkeypatch.setattr(module, "VECTOR_MIN", 1)
    det._wide_by.clear()
    got += [vs.describe(f) for rec in records[150:] for f in det.update(rec)]
    assert type(det._impl).__name__.startswith("_Vector")
    _same(got + [vs.describe(f) for f in det.finish()], REFERENCE["findings"][f"s0:{dname}"])


def test_engine_alerts_are_the_reference_alerts() -> None:
    _same(vs.run_engine(vs.engine_stream()), REFERENCE["findings"]["engine"])


@pytest.mark.parametrize("dname", VECTORISED)
def test_a_state_round_trip_changes_nothing(dname: str) -> None:
    records = STREAMS["s0"]
    _same(vs.run_detector(vs.DETECTORS[dname], records, resume_at=250), REFERENCE["findings"][f"s0:{dname}"])


@pytest.mark.parametrize("dname", [d for d in vs.STATE_DETECTORS if d in VECTORISED])
def test_a_state_saved_by_the_per_value_code_loads(dname: str) -> None:
    det = vs.DETECTORS[dname]()
    det.load_state_dict(REFERENCE["states"][dname])
    assert _plain(det.state_dict()) == _plain(REFERENCE["states"][dname])  # (packed now: same values)
    got = [vs.describe(f) for rec in vs.resume_stream()[vs.RESUME:] for f in det.update(rec)]
    _same(got + [vs.describe(f) for f in det.finish()], REFERENCE["resumed"][dname])


def test_rings_hold_the_trailing_window_in_order() -> None:
    rng = np.random.default_rng(0)
    rings, refs = Rings(5), [Window(5) for _ in range(3)]
    for _ in range(3):
        rings.add_row()
    for t in range(40):
        rows = np.flatnonzero(rng.random(3) < 0.7)
        ys = rng.normal(size=len(rows))
        rings.push(rows, float(t), ys)
        assert rings.slab(1)[1][rows, 0].tolist() == ys.tolist()
        for r, y in zip(rows.tolist(), ys.tolist(), strict=True):
            refs[r].push(float(t), y)
        if t == 20:
            rings.clear(1)
            refs[1].clear()
        for r, ref in enumerate(refs):
            xs, ys_r = rings.row(r)
            assert xs.tolist() == ref.x.tolist() and ys_r.tolist() == ref.y.tolist()
            assert rings.row_state(r) == ref.state_dict()


@pytest.mark.parametrize("n", [1, 2, 7, 8, 32])
def test_row_median_is_the_scalar_median(n: int) -> None:
    a = np.random.default_rng(n).standard_cauchy((6, n))
    assert row_median(a).tolist() == [median(row) for row in a]
