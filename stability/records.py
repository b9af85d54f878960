"""Step records: what the hooks capture, what the transport carries and what detectors read.

A :class:`StepRecord` is metadata (run id, rank and its parallel coordinates, step, wall time, optional batch
identity) plus a flat mapping of signal name -> float. Global signals are bare names (``loss``, ``lr``,
``grad_norm``, ``loss_scale``, ``skipped``, ``tokens``); per-module signals are ``<quantity>/<module path>``
(``grad_norm/transformer.h.3.attn``). The same names are the CSV columns that ``stability postmortem`` accepts.

Wire format (version 1): a msgpack map ::

    {"v": 1, "run": str, "step": int, "rank": int, "t": float, "host": str,
     "coords": {str: int}, "batch": str | None,
     "n": [signal names], "x": bytes}          # x = little-endian float64 array, one per name

Packing the values as one float64 byte string keeps NaN and +/-Inf exact at the same size as a msgpack map of
floats, and keeps a record self-contained (a spool file or an archive can be read alone). ``bench/bench_encoding.py``
measures the alternatives (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import math
import re
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgpack

from stability.errors import RecordError

__all__ = [
    "FORMAT_VERSION",
    "FORK",
    "SHARDED",
    "MAX_RECORD_BYTES",
    "MAX_SIGNALS",
    "GLOBAL_SIGNALS",
    "PER_MODULE_QUANTITIES",
    "StepRecord",
    "PackedSignals",
    "decode",
    "decode_packed",
    "encode",
    "is_urgent",
    "loss_steps",
    "split_signal",
]

FORMAT_VERSION = 1
MAX_RECORD_BYTES = 8 * 1024 * 1024
MAX_SIGNALS = 100_000
MAX_NAME_CHARS = 512
MAX_ID_CHARS = 256

GLOBAL_SIGNALS: tuple[str, ...] = (
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped",
    "tokens",
    "nonfinite_grads",
    "logit_z",
    "batch_loss_max",
    "loss_steps",
)
"""Well-known global signals (others are accepted too).

``loss_steps`` is metadata carried as a signal: the number of optimizer steps the record's ``loss`` is the mean of
(Megatron's ``log_interval``, HF Trainer's ``logging_steps``); absent means 1 (the hooks report every step). It
changes what a jump means: a mean over 10 steps that rises 1.8x cannot be one bad batch (that batch alone would
have to be 9x), see ``detectors/spike.py``."""


def is_urgent(record: StepRecord) -> bool:
    """A record a worker should read before the others: a non-finite loss or gradient norm, or non-finite gradient
    elements counted (its emitter pushes the rank to ``keys.URGENT``)."""
    signals = record.signals
    for name in ("loss", "grad_norm"):
        value = signals.get(name)
        if value is not None and not math.isfinite(value):
            return True
    count = signals.get("nonfinite_grads")
    return count is not None and count != 0


def loss_steps(record: StepRecord) -> float:
    """How many optimizer steps ``record``'s loss averages (``loss_steps`` signal; 1 when absent or invalid)."""
    value = record.signals.get("loss_steps", 1.0)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 1 else 1.0


def adversarial(record: StepRecord) -> bool:
    """``record``'s loss is one side of a game (``objectives`` > 1: other optimizers stepped on losses of their own
    in its step, as a GAN's generator does between two discriminator steps): it rises whenever the other side
    improves, so its slow drifts say nothing about divergence."""
    value = record.signals.get("objectives", 1.0)
    return isinstance(value, (int, float)) and value > 1


PER_MODULE_QUANTITIES: tuple[str, ...] = (
    "grad_norm",
    "param_norm",
    "update_ratio",
    "act_absmax",
    "act_rms",
    "attn_logit_max",
    "adam_v_ratio",
    "logit_z",
)
"""Well-known per-module quantities, used as ``<quantity>/<module path>``."""

_SWAP = sys.byteorder != "little"
"""Signal values travel as little-endian float64 (``array`` keeps the training-side import free of numpy)."""
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")


_SPLIT: dict[str, tuple[str, str | None]] = {}
"""Memo of :func:`split_signal`: a run repeats the same few hundred names on every record, and the detectors split
each name several times per record (a dict hit costs a third of a ``partition``)."""
_SPLIT_MAX = 65_536


def split_signal(name: str) -> tuple[str, str | None]:
    """Split ``"grad_norm/h.3.attn"`` into ``("grad_norm", "h.3.attn")``; a global name gives ``(name, None)``."""
    parts = _SPLIT.get(name)
    if parts is None:
        quantity, sep, module = name.partition("/")
        parts = (quantity, module) if sep else (name, None)
        if len(_SPLIT) >= _SPLIT_MAX:
            _SPLIT.clear()
        _SPLIT[name] = parts
    return parts


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it is a valid run id, else raise :class:`RecordError` naming the problem."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise RecordError(
            f"run id {run_id!r} is invalid: use 1-128 characters of letters, digits, '_', '.', ':' or '-'"
        )
    return run_id


FORK = "fork"
"""Coordinate of a forked child's records (Hogwild: processes forked from the captured one train a shared model,
each recorded as a rank of its own, ``fork`` = its ordinal): such ranks are not replicas and never wait for each
other, so the cross-rank comparison puts each in its own group and the straggler and silence rules leave them out."""

SHARDED = "sharded"
"""Coordinate set to 1 on records whose gradient, parameter and optimizer-state statistics are those of the rank's
shard of sharded parameters (FSDP2's ``fully_shard``, tensor-parallel ``DTensor`` s): ranks hold different shards,
so those statistics legitimately differ across ranks (the cross-rank detector compares only their losses)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimizer step of one rank."""

    run_id: str
    step: int
    signals: Mapping[str, float]
    rank: int = 0
    wall_time: float = 0.0
    host: str = ""
    coords: Mapping[str, int] = field(default_factory=dict)
    """Parallel coordinates when known: ``dp``, ``tp``, ``pp``, ``ep``, ``cp``, ``world_size``, ``local_rank``;
    ``sharded`` (:data:`SHARDED`) = 1 when the norms are of this rank's parameter shards (FSDP2 / ``DTensor``)."""
    batch: str | None = None
    """Optional batch identity (for replay and skip lists)."""

    def get(self, name: str, default: float = math.nan) -> float:
        """The value of signal ``name``, or ``default`` when absent."""
        return float(self.signals.get(name, default))


def encode(record: StepRecord) -> bytes:
    """Encode ``record`` to bytes; raise :class:`RecordError` if it cannot be represented."""
    names = list(record.signals)
    try:
        values = array("d", record.signals.values())
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"record step {record.step}: a signal value is not a number ({exc})") from None
    payload = {
        "v": FORMAT_VERSION,
        "run": record.run_id,
        "step": int(record.step),
        "rank": int(record.rank),
        "t": float(record.wall_time),
        "host": record.host,
        "coords": dict(record.coords),
        "batch": record.batch,
        "n": names,
        "x": _little_endian(values).tobytes(),
    }
    data: bytes = msgpack.packb(payload, use_bin_type=True)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record step {record.step} is {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte limit")
    return data


def decode(data: bytes) -> StepRecord:
    """Decode and validate one record; raise :class:`RecordError` naming the first problem found.

    Unknown top-level fields are ignored (forward compatibility); NaN and Inf values are kept.

    The signal names are not unpacked per record: a run repeats the same few name lists (layouts), each decoded and
    checked once and cached by its msgpack bytes. A record laid out as :func:`encode` writes it with the layout of the
    record before (``n`` and ``x`` last) is split by byte comparison and only its scalar fields are unpacked;
    any other is read field by field (``n`` skipped, its bytes looked up). ~2x faster than unpacking the whole map
    at 206 signals (``bench/bench_drain.py --stages``, docs/benchmarks.md).
    """
    return decode_packed(data)[0]


PackedSignals = tuple[tuple[str, ...], bytes]
"""A decoded record's signals as they travelled: the names (one tuple object per layout, shared by every record of
it) and their values, little-endian float64 (what the archive writes column-wise without touching each value)."""


def decode_packed(data: bytes) -> tuple[StepRecord, PackedSignals]:
    """:func:`decode`, also returning the record's signals as :data:`PackedSignals`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(f"record payload must be bytes, not {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record is {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte limit")
    data = bytes(data)
    obj = _split_known_layout(data) or _unpack_map(data)
    record = _from_map(obj)
    return record, (obj["n"].names, obj["x"])


_LIMITS: dict[str, int] = {
    "max_bin_len": MAX_RECORD_BYTES,
    "max_str_len": MAX_RECORD_BYTES,
    "max_array_len": MAX_SIGNALS,
    "max_map_len": MAX_SIGNALS,
}


def _split_known_layout(data: bytes) -> dict[str, Any] | None:
    """The record's map when it ends with the names of the last layout seen and its values, as :func:`encode` writes
    it; else None (then :func:`_unpack_map` reads it).

    Exact, not a guess: the map's header is decremented by the two entries cut off and the rest must unpack to a map
    of exactly those bytes, so the bytes cut off are the map's last two entries (msgpack is prefix-free), ``n``
    holding the layout's names and ``x`` a bin of one float64 per name. A malformed record misses here and gets its
    error from :func:`_unpack_map`.
    """
    last = _LAST_LAYOUT[0]
    if last is None:
        return None
    layout, tail = last
    values = 8 * len(layout.names)
    names_end = len(data) - values - len(tail)
    start = names_end - len(layout.raw)
    head = data[0] if data else 0
    if start < 3 or not 0x82 <= head <= 0x8F or data[start - 2:start] != b"\xa1n" \
            or data[names_end:names_end + len(tail)] != tail or data[start:names_end] != layout.raw:
        return None
    try:
        obj = msgpack.unpackb(bytes((head - 2,)) + data[1:start - 2], raw=False, strict_map_key=True, **_LIMITS)
    except Exception:  # msgpack raises several unrelated types; the field-by-field read names the problem
        return None
    obj["n"] = layout
    obj["x"] = data[len(data) - values:]
    return obj  # type: ignore[no-any-return]


def _unpack_map(data: bytes) -> dict[str, Any]:
    """The record's top-level map; the value of ``n`` is the validated names' :class:`_Layout` (None when it is not
    a list, for :func:`_signals` to name the problem)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, **_LIMITS)
    unpacker.feed(data)
    try:
        size = unpacker.read_map_header()
    except Exception:  # not a map, or not msgpack: the whole-value unpack names which
        _not_a_map(data)
    obj: dict[str, Any] = {}
    try:
        for _ in range(size):
            key = unpacker.unpack()
            if not isinstance(key, (str, bytes)):
                raise RecordError(f"record is not valid msgpack: {type(key).__name__} is not allowed for map key")
            if key == "n":
                start = unpacker.tell()
                unpacker.skip()
                obj[key] = _layout(data[start:unpacker.tell()])
            else:
                obj[key] = unpacker.unpack()  # type: ignore[index]
        extra = unpacker.tell() != len(data)
    except RecordError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise RecordError(f"record is not valid msgpack: {exc}") from None
    if extra:
        raise RecordError("record is not valid msgpack: extra data after the map")
    return obj


def _not_a_map(data: bytes) -> NoReturn:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, **_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RecordError(f"record is not valid msgpack: {exc}") from None
    raise RecordError(f"record must be a msgpack map, got {type(obj).__name__}")


@dataclass(frozen=True, slots=True)
class _Layout:
    """One signal-name list, decoded and checked once: the names (interned) and an empty-valued dict of them in
    order, copied and filled per record (cheaper than building a dict from pairs)."""

    raw: bytes
    """The msgpack bytes of the name list."""
    names: tuple[str, ...]
    template: dict[str, Any]


_LAST_LAYOUT: list[tuple[_Layout, bytes] | None] = [None]
"""The layout of the last record decoded field by field, and the bytes between its names and its values: the key
``x`` and the header of a bin of one float64 per name (:func:`_split_known_layout`)."""


_LAYOUTS: dict[bytes, _Layout] = {}
"""Msgpack bytes of a valid name list -> its :class:`_Layout` (~20 KB each at 206 signals; cleared when full)."""
_LAYOUTS_MAX = 256


def _layout(raw: bytes) -> _Layout | None:
    """The layout of the name list packed in ``raw`` (None when it is not a list; RecordError for a bad name)."""
    layout = _LAYOUTS.get(raw)
    if layout is None:
        layout = _new_layout(raw)
    if layout is not None:
        _LAST_LAYOUT[0] = (layout, b"\xa1x" + _bin_header(8 * len(layout.names)))
    return layout


def _bin_header(size: int) -> bytes:
    """The msgpack header of a bin of ``size`` bytes, as msgpack packs it (the shortest)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def _new_layout(raw: bytes) -> _Layout | None:
    names = msgpack.unpackb(raw, raw=False, **_LIMITS)
    if not isinstance(names, list):
        return None
    if not _known_names(names):
        for name in names:
            if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
                raise RecordError(f"signal name {name!r} is invalid: use 1-{MAX_NAME_CHARS} printable characters")
        if len(_VALID_NAMES) + len(names) > _VALID_NAMES_MAX:
            _VALID_NAMES.clear()
        _VALID_NAMES.update(names)
    interned = tuple(map(sys.intern, names))
    template = dict.fromkeys(interned)
    if len(template) != len(interned):
        raise RecordError("record has duplicate signal names")
    layout = _Layout(raw, interned, template)
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[raw] = layout
    return layout


def _from_map(obj: dict[str, Any]) -> StepRecord:
    version = obj.get("v")
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version!r} is not supported (expected {FORMAT_VERSION})")
    run_id = check_run_id(obj.get("run"))
    step = _int_field(obj, "step")
    rank = _int_field(obj, "rank")
    wall = obj.get("t", 0.0)
    if not isinstance(wall, (int, float)) or isinstance(wall, bool):
        raise RecordError(f"record field 't' must be a number, got {type(wall).__name__}")
    host = obj.get("host", "")
    if not isinstance(host, str) or len(host) > MAX_ID_CHARS:
        raise RecordError("record field 'host' must be a string of at most 256 characters")
    batch = obj.get("batch")
    if batch is not None and (not isinstance(batch, str) or len(batch) > MAX_ID_CHARS):
        raise RecordError("record field 'batch' must be null or a string of at most 256 characters")
    coords = _coords(obj.get("coords", {}))
    return StepRecord(
        run_id=run_id,
        step=step,
        rank=rank,
        wall_time=float(wall),
        host=host,
        coords=coords,
        batch=batch,
        signals=_signals(obj.get("n"), obj.get("x")),
    )


def _int_field(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > sys.maxsize:
        raise RecordError(f"record field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _coords(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict) or len(raw) > 32:
        raise RecordError("record field 'coords' must be a map of at most 32 entries")
    for key, value in raw.items():
        if not isinstance(key, str) or not isinstance(value, int) or isinstance(value, bool):
            raise RecordError(f"record field 'coords' entry {key!r} must map a string to an integer")
    return raw


def _signals(layout: object, packed: object) -> dict[str, float]:
    if not isinstance(layout, _Layout):
        raise RecordError("record field 'n' (signal names) must be a list")
    if not isinstance(packed, bytes):
        raise RecordError("record field 'x' (signal values) must be bytes")
    names = layout.names
    if len(packed) != 8 * len(names):
        raise RecordError(f"record has {len(names)} signal names but {len(packed) // 8} values")
    floats = array("d")
    floats.frombytes(packed)
    signals = layout.template.copy()
    signals.update(zip(names, _little_endian(floats).tolist(), strict=True))
    return signals


_VALID_NAMES: set[str] = set()
"""Signal names already checked (a run repeats the same few hundred on every record): a set lookup per name
instead of ``str.isprintable`` over its characters (decode ~1.6x faster at 206 signals)."""
_VALID_NAMES_MAX = 65_536


def _known_names(names: list[Any]) -> bool:
    """Every name is one :func:`_signals` has already accepted (False for anything else: checked then)."""
    try:
        return all(map(_VALID_NAMES.__contains__, names))
    except TypeError:  # an unhashable name: the per-name check names it
        return False


def _little_endian(values: array[float]) -> array[float]:
    """``values`` in (or from) little-endian byte order, in place."""
    if _SWAP:
        values.byteswap()
    return values
