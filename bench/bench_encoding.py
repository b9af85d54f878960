"""Record encoding: stability's wire format vs a msgpack map of floats vs JSON, for 200 per-layer signals.

Run: ``python bench/bench_encoding.py``. Prints encode / decode time per record and size, with ratios against
(a) ``stability.records`` (names list + one little-endian float64 byte string), measured in the same run.
"""

from __future__ import annotations

import json
import math
import timeit
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from stability.records import StepRecord, decode, encode

N_LAYERS = 200
REPEAT = 7


def make_record() -> StepRecord:
    signals = {f"grad_norm/model.layers.{i}.mlp": 0.01 * (i + 1) for i in range(N_LAYERS - 3)}
    signals.update({"loss": 2.31, "lr": 3e-4, "grad_norm": math.inf})
    return StepRecord(
        run_id="run-20261202-153011-a1b2c3",
        step=12_345,
        rank=3,
        wall_time=1_764_689_411.123,
        host="node-17",
        coords={"dp": 3, "tp": 0, "pp": 0, "world_size": 8},
        signals=signals,
    )


def _meta(record: StepRecord) -> dict[str, Any]:
    return {
        "v": 1,
        "run": record.run_id,
        "step": record.step,
        "rank": record.rank,
        "t": record.wall_time,
        "host": record.host,
        "coords": dict(record.coords),
        "batch": record.batch,
    }


def msgpack_map_encode(record: StepRecord) -> bytes:
    """(b): metadata plus the signals as a msgpack map name -> float."""
    data: bytes = msgpack.packb({**_meta(record), "s": dict(record.signals)}, use_bin_type=True)
    return data


def msgpack_map_decode(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = msgpack.unpackb(data, raw=False)
    return obj


def json_encode(record: StepRecord) -> bytes:
    """(c): the same map as JSON (Python's NaN/Infinity extension keeps non-finite values)."""
    return json.dumps({**_meta(record), "s": dict(record.signals)}).encode()


def json_decode(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(data)
    return obj


def lean_encode(record: StepRecord) -> bytes:
    """(a'): the same bytes as (a), with the values read by ``dict.values()`` (no per-name lookup)."""
    signals = record.signals
    values = np.fromiter(signals.values(), dtype="<f8", count=len(signals))
    data: bytes = msgpack.packb({**_meta(record), "n": list(signals), "x": values.tobytes()}, use_bin_type=True)
    return data


def per_call_us(func: Callable[[], object]) -> float:
    """Best-of-REPEAT mean time of one call, in microseconds."""
    timer = timeit.Timer(func)
    number, _ = timer.autorange()
    return min(timer.repeat(REPEAT, number)) / number * 1e6


def main() -> None:
    record = make_record()
    formats: list[tuple[str, Callable[[StepRecord], bytes], Callable[[bytes], object]]] = [
        ("(a) stability (names + float64 bytes)", encode, decode),
        ("(b) msgpack map of floats", msgpack_map_encode, msgpack_map_decode),
        ("(c) JSON", json_encode, json_decode),
        ("(a') format (a), encode reads dict.values()", lean_encode, decode),
    ]
    assert lean_encode(record) == encode(record)
    rows = []
    for name, enc, dec in formats:
        data = enc(record)
        rows.append((name, per_call_us(lambda e=enc: e(record)), per_call_us(lambda d=dec, b=data: d(b)), len(data)))
    base_enc, base_dec, base_size = rows[0][1:]
    print(f"one record of {N_LAYERS} signals; best of {REPEAT} repeats; ratio = value / (a)")
    print(f"{'format':42} {'encode us':>10} {'x':>6} {'decode us':>10} {'x':>6} {'bytes':>7} {'x':>6}")
    for name, enc_us, dec_us, size in rows:
        print(
            f"{name:42} {enc_us:10.1f} {enc_us / base_enc:6.2f} {dec_us:10.1f} {dec_us / base_dec:6.2f}"
            f" {size:7d} {size / base_size:6.2f}"
        )


if __name__ == "__main__":
    main()
