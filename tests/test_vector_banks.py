"""The vectorised paths of the per-module detectors (``detectors/_jumprows.py``, ``_adamrows.py``, the fast paths of
``vanish.py`` / ``growth.py``) against their per-series paths on the same records: identical findings (every
field, unrounded) and identical ``state_dict`` (msgpack bytes) all along, with a state round trip mid-stream and
with the path switching back and forth.

Streams (``tests/_vec_streams.py``): per-layer and update-ratio jumps, NaN / inf / negative / zero values, a
repeated step, sparse statistics (records without the per-module series), heavy-tailed noise with steps that skip
ahead, series that appear mid-run and vanish; plus one with a resume (the steps go back: irregular windows) and
one where whole quantities drop out for a while. The engine case runs the whole suite over two ranks with a resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import pytest

from stability.detectors import growth, update, vanish
from stability.detectors._jumprows import JumpRows, JumpSettings
from stability.detectors._rolling import FastBaseline
from stability.detectors._stats import pack_window
from stability.detectors.engine import RunDiagnoser
from stability.records import StepRecord
from tests import _vec_streams as vs

MODULES = (update, vanish, growth)
"""The modules whose ``VECTOR_MIN`` picks the path (a record with fewer series takes the per-series one)."""
PATHS = {"vectorised": 1, "per-series": 10**9}


@contextmanager
def _path(least: int) -> Iterator[None]:
    saved = [m.VECTOR_MIN for m in MODULES]
    for m in MODULES:
        m.VECTOR_MIN = least  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, v in zip(MODULES, saved, strict=True):
            m.VECTOR_MIN = v  # type: ignore[attr-defined]


def _packed(state: Any) -> bytes:
    return msgpack.packb(state, use_bin_type=True)  # type: ignore[no-any-return]


def _state(det: Any) -> Any:
    """The packed state; the vanishing-gradient detector's with its windows as lists (its two paths have always
    written an empty window differently: ``{"x": [], "y": []}`` and packed; both load the same)."""
    state = det.state_dict()
    if isinstance(det, vanish.GradVanishingDetector):
        return _plain(state)
    return _packed(state)


_plain = vs.plain


def _round_trip(det: Any, make: Callable[[], Any]) -> Any:
    state = msgpack.unpackb(_packed(det.state_dict()), raw=False, strict_map_key=False)
    fresh = make()
    fresh.load_state_dict(state)
    return fresh


def _trace(make: Callable[[], Any], records: list[StepRecord], least: int | Callable[[int], int], *,
           resume_at: int | None = None) -> list[Any]:
    """Findings (``to_dict``) of every record and the packed state every 25 records and at the end."""
    pick = least if callable(least) else (lambda i: least)
    det = make()
    out: list[Any] = []
    for i, rec in enumerate(records):
        if i == resume_at:
            det = _round_trip(det, make)
        with _path(pick(i)):
            out.append([f.to_dict() for f in det.update(rec)])
        if i % 25 == 0:
            out.append(_state(det))
    out.append([f.to_dict() for f in det.finish()])
    out.append(_state(det))
    return out


def _resumed(records: list[StepRecord]) -> list[StepRecord]:
    """The records with a resume: after 200 of them the steps go back 80 (a restart from a checkpoint)."""
    return records[:200] + records[120:]


def _gaps(records: list[StepRecord]) -> list[StepRecord]:
    """Per-module quantities missing from some records (each for a while), and records of the globals alone."""
    out = []
    for i, rec in enumerate(records):
        drop = ("update_ratio/",) if 60 <= i < 90 else ("grad_norm/",) if 150 <= i < 160 else (
            "adam_v_ratio/", "act_absmax/") if i % 17 == 0 else ()
        signals = {k: v for k, v in rec.signals.items() if not k.startswith(drop)}
        out.append(StepRecord(run_id=rec.run_id, step=rec.step, rank=rec.rank, wall_time=rec.wall_time,
                              host=rec.host, coords=rec.coords, signals=signals))
    return out


STREAMS = {**dict(vs.streams()), "resumed": _resumed(vs.stream(6)), "gaps": _gaps(vs.stream(7))}


@pytest.mark.parametrize("sname", list(STREAMS))
def test_the_vectorised_paths_are_the_per_series_paths(sname: str) -> None:
    records = STREAMS[sname]
    found = 0
    for make in vs.DETECTORS.values():
        want = _trace(make, records, PATHS["per-series"])
        assert _trace(make, records, PATHS["vectorised"]) == want
        found += sum(len(x) for x in want if isinstance(x, list))
    assert found, "the stream has findings: the comparison covers them"


@pytest.mark.parametrize("sname", ["s0", "s4-chaos", "resumed"])
def test_a_state_round_trip_and_switching_paths_change_nothing(sname: str) -> None:
    records = STREAMS[sname]
    for make in vs.DETECTORS.values():
        want = _trace(make, records, PATHS["per-series"])
        assert _trace(make, records, PATHS["vectorised"], resume_at=len(records) // 2) == want
        assert _trace(make, records, lambda i: 1 if (i // 37) % 2 else 10**9) == want  # (the state moves)


def test_the_engine_is_the_same_on_both_paths() -> None:
    rank0 = _resumed(vs.stream(8, steps=300, modules=12))
    rank1 = [vs._rank(r, 3) for r in vs.stream(9, steps=380, modules=12)]
    records = [r for pair in zip(rank0, rank1, strict=True) for r in pair]
    traces = {}
    for path, least in PATHS.items():
        with _path(least):
            diag = RunDiagnoser()
            out: list[Any] = []
            for i, rec in enumerate(records):
                if i == len(records) // 2:
                    state = msgpack.unpackb(_packed(diag.state_dict()), raw=False, strict_map_key=False)
                    out.append(_plain(state))  # (see _state)
                    diag = RunDiagnoser()
                    diag.load_state_dict(state)
                out += [f.to_dict() for f in diag.update(rec)]
            out += [f.to_dict() for f in diag.finish()]
            out.append(_plain(diag.state_dict()))
            traces[path] = out
    assert traces["vectorised"] == traces["per-series"]
    assert any("kind" in x for x in traces["per-series"] if isinstance(x, dict))


@pytest.mark.parametrize("seed", range(4))
def test_a_loaded_window_is_regular_exactly_when_the_sorted_window_is(seed: int) -> None:
    """Regularity (the screen's premise) after a load and after pushes, against ``SortedWindow.regular``."""
    rng = np.random.default_rng(seed)
    cfg = JumpSettings(window=6, min_points=2, factor=10.0, z_threshold=6.0, scale_floor=0.05, cooldown=3,
                       max_series=4)
    for _ in range(40):
        n = int(rng.integers(1, 12))
        xs = np.cumsum(rng.choice([0.0, 0.5, 1.0, 1.0, 3.0], n)).tolist()
        ys = rng.normal(size=n).tolist()
        if rng.random() < 0.3:
            (xs if rng.random() < 0.5 else ys)[int(rng.integers(n))] = math.nan
        bank = JumpRows(cfg)
        bank.load({"a": {"base": pack_window(xs, ys), "quiet": 0}})
        ref = FastBaseline(window=6, min_points=2, scale_floor=0.05)
        ref.load_state_dict(pack_window(xs, ys))
        for _ in range(8):
            assert (int(bank._bad[0]) == 0) == ref.regular
            x = (ref.last_x if math.isfinite(ref.last_x) else 0.0) + float(rng.choice([0.0, 1.0, 2.0]))
            y = float(rng.normal())
            last = bank._rings.row(0)[0]
            bank._push(np.array([0]), np.array([y]), np.array([last[-1] if len(last) else -math.inf]), x)
            ref.accept(x, y)
            assert bank._rings.row_state(0) == ref.state_dict()  # (packed: NaNs compare by their bits)
        assert bank.state() == {"a": {"base": ref.state_dict(), "quiet": 0}}
