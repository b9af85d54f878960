"""Hostile input to the record decoder: random bytes and mutated valid records only ever give a StepRecord or a
RecordError (never another exception, never a hang), and NaN/Inf survive every valid round trip."""

from __future__ import annotations

import math
import random

import msgpack

from stability.errors import RecordError
from stability.records import StepRecord, decode, encode

VALID = encode(
    StepRecord(run_id="fuzz", step=7, rank=1, wall_time=1.5, host="h", coords={"dp": 1}, batch="b7",
               signals={"loss": 2.5, "grad_norm": math.nan, "grad_norm/h.0": math.inf, "lr": -math.inf})
)  # fmt: skip


def _decode_or_error(data: bytes) -> StepRecord | None:
    try:
        return decode(data)
    except RecordError:
        return None


def test_random_bytes_are_rejected_cleanly() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        rec = _decode_or_error(data)  # anything but RecordError propagates and fails the test
        if rec is not None:
            assert isinstance(rec.step, int) and rec.step >= 0 and isinstance(rec.run_id, str)


def test_mutated_records_decode_or_raise_record_error() -> None:
    rng = random.Random(1)
    accepted = 0
    for _ in range(3000):
        data = bytearray(VALID)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.5:
                data[pos] = rng.getrandbits(8)
            elif op < 0.75:
                del data[pos]
            else:
                data.insert(pos, rng.getrandbits(8))
        rec = _decode_or_error(bytes(data))
        if rec is not None:
            accepted += 1
            assert all(isinstance(v, float) for v in rec.signals.values())
    assert accepted < 3000  # most mutations are caught


def test_structurally_hostile_maps_name_the_field() -> None:
    base = msgpack.unpackb(VALID, raw=False)
    cases = {
        "step": -1, "rank": "0", "run": "../etc", "n": "loss", "x": "1234", "coords": {"dp": "x"},
        "batch": 5, "t": "now", "host": 7,
    }  # fmt: skip
    for field, bad in cases.items():
        obj = {**base, field: bad}
        try:
            decode(msgpack.packb(obj, use_bin_type=True))
        except RecordError as exc:
            assert field in str(exc) or field in ("run", "n", "x"), (field, str(exc))
        else:
            raise AssertionError(f"{field}={bad!r} was accepted")


def test_nan_and_inf_survive_the_round_trip() -> None:
    rec = decode(VALID)
    assert math.isnan(rec.signals["grad_norm"]) and rec.signals["grad_norm/h.0"] == math.inf
    assert rec.signals["lr"] == -math.inf and rec.signals["loss"] == 2.5


def test_mutated_csv_logs_load_or_raise_source_error(tmp_path) -> None:
    """Truncated and corrupted CSV logs: `load_csv` returns records or raises SourceError naming the file."""
    from stability.errors import SourceError
    from stability.postmortem import load_csv

    good = "step,loss,grad_norm,lr,note\n" + "".join(f"{s},{3 - s / 100:.4f},{0.5 + s % 3},1e-3,x\n" for s in range(50))
    rng = random.Random(2)
    alphabet = "0123456789.,-eE\nnaNInfity\"x "
    path = tmp_path / "log.csv"
    loaded = 0
    for _ in range(300):
        text = list(good[: rng.randint(0, len(good))])  # truncated log
        for _ in range(rng.randint(0, 5)):
            if text:
                text[rng.randrange(len(text))] = rng.choice(alphabet)
        path.write_text("".join(text))
        try:
            records = load_csv(path)
        except SourceError as exc:
            assert str(path) in str(exc) or path.name in str(exc), str(exc)
        else:
            loaded += 1
            assert all(isinstance(r.step, int) for r in records)
    assert 0 < loaded < 300


def test_diagnoser_survives_extreme_finite_values() -> None:
    """Values spanning the whole float range (1e-300 then 1e300: log ratios beyond exp's range) give findings,
    never an exception (every detector's ratio saturates instead of overflowing)."""
    import warnings

    from stability.detectors import RunDiagnoser

    rng = random.Random(5)
    diag = RunDiagnoser()
    magnitudes = [1e-300, 1e-30, 1.0, 1e30, 1e300, 5e-324, 1.7e308]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float32 history turns 1e300 into inf, by design
        for step in range(300):
            value = 1e-300 if step < 100 else rng.choice(magnitudes)
            names = ("loss", "grad_norm", "loss_scale", "update_ratio/a", "grad_norm/a", "attn_logit_max/a",
                     "adam_v_ratio/a", "act_absmax/a", "logit_z")
            signals = {n: value * rng.uniform(0.5, 2.0) for n in names}
            signals.update(lr=1e-3, loss_steps=float(rng.choice([1, 10])))
            diag.update(StepRecord(run_id="fuzz", step=step, rank=step % 2, signals=signals))
        diag.finish()
    assert diag.incidents  # it saw the jumps
