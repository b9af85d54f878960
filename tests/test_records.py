"""The record codec: exact round trips, and a RecordError naming the field for every malformed input."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest

from stability import records as records_module
from stability.errors import RecordError
from stability.records import MAX_RECORD_BYTES, StepRecord, decode, encode, is_urgent, split_signal

_DELETE = object()


def _record(**changes: Any) -> StepRecord:
    fields: dict[str, Any] = {
        "run_id": "run-1",
        "step": 7,
        "rank": 3,
        "wall_time": 1_700_000_000.125,
        "host": "node-3",
        "coords": {"dp": 1, "tp": 1, "pp": 0, "world_size": 4},
        "batch": "shard-2:offset-88",
        "signals": {"loss": 2.5, "grad_norm/h.0.attn": 0.125, "lr": 3e-4},
    }
    fields.update(changes)
    return StepRecord(**fields)


def _raw(**changes: Any) -> bytes:
    """A hand-built wire map (version 1) with ``changes`` applied; ``_DELETE`` removes a field."""
    obj: dict[str, Any] = {
        "v": 1,
        "run": "run-1",
        "step": 7,
        "rank": 0,
        "t": 1.5,
        "host": "h",
        "coords": {},
        "batch": None,
        "n": ["loss", "lr"],
        "x": np.array([1.0, 2.0], dtype="<f8").tobytes(),
    }
    for key, value in changes.items():
        if value is _DELETE:
            del obj[key]
        else:
            obj[key] = value
    return msgpack.packb(obj, use_bin_type=True)


def test_round_trip_keeps_every_field_and_nonfinite_values_exactly() -> None:
    signals = {"loss": math.nan, "grad_norm": math.inf, "loss_scale": -math.inf, "lr": 1e-308, "tokens": -0.0}
    original = _record(signals=signals)
    back = decode(encode(original))
    assert (back.run_id, back.step, back.rank, back.wall_time) == ("run-1", 7, 3, 1_700_000_000.125)
    assert (back.host, dict(back.coords), back.batch) == (
        "node-3",
        {"dp": 1, "tp": 1, "pp": 0, "world_size": 4},
        "shard-2:offset-88",
    )
    assert list(back.signals) == list(signals)  # order kept
    assert math.isnan(back.signals["loss"])
    assert back.signals["grad_norm"] == math.inf and back.signals["loss_scale"] == -math.inf
    assert back.signals["lr"] == 1e-308
    assert math.copysign(1.0, back.signals["tokens"]) == -1.0
    assert math.isnan(back.get("absent")) and back.get("absent", 0.0) == 0.0


def test_round_trip_of_a_record_without_batch_or_coords() -> None:
    back = decode(encode(StepRecord(run_id="r", step=0, signals={})))
    assert back.batch is None and dict(back.coords) == {} and dict(back.signals) == {}


def test_unknown_fields_are_ignored() -> None:
    back = decode(_raw(future_field={"anything": [1, 2]}, zz=3))
    assert back.step == 7 and dict(back.signals) == {"loss": 1.0, "lr": 2.0}


def test_split_signal() -> None:
    assert split_signal("grad_norm/transformer.h.3.attn") == ("grad_norm", "transformer.h.3.attn")
    assert split_signal("loss") == ("loss", None)


@pytest.mark.parametrize(
    ("data", "names_in_message"),
    [
        (b"\xc1\x00garbage", "not valid msgpack"),
        (msgpack.packb([1, 2]), "msgpack map"),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "limit"),
        (_raw(v=2), "version"),
        (_raw(v=_DELETE), "version"),
        (_raw(step=_DELETE), "'step'"),
        (_raw(step=-1), "'step'"),
        (_raw(step=1.5), "'step'"),
        (_raw(step=True), "'step'"),
        (_raw(rank=-2), "'rank'"),
        (_raw(t="noon"), "'t'"),
        (_raw(host=5), "'host'"),
        (_raw(batch=7), "'batch'"),
        (_raw(coords=[1]), "'coords'"),
        (_raw(coords={"dp": "one"}), "'coords'"),
        (_raw(run=_DELETE), "run id"),
        (_raw(run="has space"), "run id"),
        (_raw(run="x" * 200), "run id"),
        (_raw(n="loss"), "'n'"),
        (_raw(x=[1.0, 2.0]), "'x'"),
        (_raw(n=["loss", ""]), "signal name"),
        (_raw(n=["loss", 3]), "signal name"),
        (_raw(n=["loss", "bad\nname"]), "signal name"),
        (_raw(n=["loss", "y" * 600]), "signal name"),
        (_raw(n=["loss", "lr", "tokens"]), "3 signal names but 2 values"),
        (_raw(x=b"\x00" * 12), "2 signal names but 1 values"),
        (_raw(n=["loss", "loss"]), "duplicate signal names"),
    ],
)
def test_malformed_input_raises_record_error_naming_the_problem(data: bytes, names_in_message: str) -> None:
    with pytest.raises(RecordError, match=names_in_message):
        decode(data)


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(RecordError, match="bytes"):
        decode("a string")  # type: ignore[arg-type]


def test_encode_rejects_non_numeric_and_oversized_records() -> None:
    with pytest.raises(RecordError, match="signal value is not a number"):
        encode(_record(signals={"loss": "high"}))
    with pytest.raises(RecordError, match="over the"):
        encode(_record(host="h" * (MAX_RECORD_BYTES + 1)))


def _slow_decode(data: bytes) -> StepRecord:
    """``decode`` read field by field (the known-layout split turned off): the reference of the split."""
    records_module._LAST_LAYOUT[0] = None
    return decode(data)


def test_known_layout_split_equals_the_field_by_field_read() -> None:
    names = ["loss", "lr"]
    values = np.array([1.0, 2.0], dtype="<f8").tobytes()
    tail = msgpack.packb("n") + msgpack.packb(names) + msgpack.packb("x") + msgpack.packb(values, use_bin_type=True)
    cases = [
        _raw(),
        _raw(step=300, host="x" * 40, coords={"dp": 70000}),  # wider ints and strings before the names
        _raw(future=tail),  # a bin ending with the bytes of a known layout's names + values
        _raw(n=["loss", "lr", "tokens"], x=np.arange(3, dtype="<f8").tobytes()),  # another layout
        _raw(),  # and back
        b"\x8b" + msgpack.packb("n") + msgpack.packb(["zz"]) + _raw()[1:],  # "n" twice: the last one counts
    ]
    decode(_raw())
    assert records_module._split_known_layout(_raw()) is not None
    for data in cases:
        decode(_raw())  # the split is tried with this layout
        fast = decode(data)
        assert repr(fast) == repr(_slow_decode(data))
    decode(_raw())
    bad = _raw()[:-1]  # the values cut short: no split, the field-by-field read names the problem
    with pytest.raises(RecordError, match="not valid msgpack"):
        decode(bad)


@pytest.mark.parametrize(("signals", "urgent"), [
    ({"loss": 2.0, "grad_norm": 1.0, "nonfinite_grads": 0.0}, False),
    ({"grad_norm/h.0": math.nan}, False),  # one layer's norm: the records' detectors judge it, not the sweep
    ({"loss": math.nan}, True),
    ({"loss": 1.0, "grad_norm": math.inf}, True),
    ({"loss": 1.0, "nonfinite_grads": 3.0}, True),
])
def test_a_record_is_urgent_when_its_loss_or_gradient_is_not_finite(signals: dict[str, float], urgent: bool) -> None:
    assert is_urgent(StepRecord(run_id="r", step=1, wall_time=0.0, signals=signals)) is urgent
