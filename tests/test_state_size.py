"""Per-rank detector state is compact (issue #10) and a state saved in the former format (windows as lists of
floats) loads and goes on to the same findings as a run that never stopped."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _records import RecordFactory

from stability.detectors._stats import unpack_window
from stability.detectors.engine import RunDiagnoser

SNAPSHOT_BOUND = 236 * 1024
"""Bytes of one rank's msgpack snapshot at 206 signals after 120 steps (measured 225 KB after the packing; 231 KB
with the weight-jump detector's 40 series of 8 samples)."""


def _records(steps: int) -> list[Any]:
    factory = RecordFactory(run_id="x", rank=0, modules=40)
    return [factory.record(s, 1e9 + s, "spike" if s == 90 else None) for s in range(steps)]


def _old_format(state: Any) -> Any:
    """``state`` with every packed window and packed float list written as the former plain lists."""
    if isinstance(state, dict):
        if "yb" in state:
            xs, ys = unpack_window(state)
            return {"x": [int(x) for x in xs.tolist()], "y": ys.tolist()}
        return {k: _old_format(v) for k, v in state.items()}
    return state


def test_snapshot_of_one_rank_at_206_signals_is_bounded() -> None:
    diag = RunDiagnoser()
    for rec in _records(120):
        diag.update(rec)
    assert len(rec.signals) == 206
    size = len(msgpack.packb(diag.state_dict(), use_bin_type=True))
    assert size < SNAPSHOT_BOUND, size


def test_a_former_format_state_loads_and_continues_identically() -> None:
    records = _records(160)
    whole = RunDiagnoser()
    want = [f.to_dict() for r in records for f in whole.update(r)] + [f.to_dict() for f in whole.finish()]
    first = RunDiagnoser()
    got = [f.to_dict() for r in records[:80] for f in first.update(r)]
    state = msgpack.unpackb(msgpack.packb(first.state_dict(), use_bin_type=True), raw=False, strict_map_key=False)
    old = _old_format(state)
    adam = old["ranks"]["0"]["detectors"]["adam_lag"]
    adam["own"] = {k: unpack_window({"yb": v, "xb": v})[1].tolist() for k, v in adam["own"].items()}
    assert old != state
    resumed = RunDiagnoser()
    resumed.load_state_dict(old)
    got += [f.to_dict() for r in records[80:] for f in resumed.update(r)] + [f.to_dict() for f in resumed.finish()]
    assert got == want
    assert want  # the stream has findings to compare
