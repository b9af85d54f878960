"""W&B offline run directories (``wandb/offline-run-*/run-*.wandb``) read without a server.

wandb 0.31 has no public reader of its run files, so the framing is read here (the same way as the project's test
helper ``tests/wandb_files.py``): header ``b":W&B"`` + uint16 LE magic ``0xBEE1`` + uint8 version, then LevelDB-log
framing in 32 KiB blocks (``crc32 | length | type`` chunk headers; FULL=1, FIRST=2, MIDDLE=3, LAST=4), each record
a ``wandb_internal_pb2.Record`` decoded with wandb's own protobuf classes. A torn tail (a crashed run) ends the read
with the records before it.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stability.errors import SourceError
from stability.sources._model import LoadedLog
from stability.sources.structured import rows_to_log

__all__ = ["find_run_files", "history_rows", "load_wandb"]

_BLOCK = 32 * 1024
_CHUNK = 7
_HEADER = 7
_FULL, _LAST = 1, 4


def find_run_files(root: Path) -> list[Path]:
    """The ``run-*.wandb`` files under ``root`` (a run directory, or a ``wandb/`` folder of several)."""
    if root.is_file():
        return [root]
    return sorted(root.rglob("run-*.wandb"))


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto.wandb_internal_pb2 import Record  # type: ignore[attr-defined]

    raw = path.read_bytes()
    if raw[:4] != b":W&B" or len(raw) < _HEADER or struct.unpack_from("<H", raw, 4)[0] != 0xBEE1:
        raise SourceError(f"{path}: not a W&B run file (no ':W&B' header)")
    off, parts = _HEADER, []
    while off + _CHUNK <= len(raw):
        room = _BLOCK - off % _BLOCK
        if room < _CHUNK or raw[off + 6] == 0:
            off += room
            continue
        crc, size, kind = struct.unpack_from("<IHB", raw, off)
        body = raw[off + _CHUNK: off + _CHUNK + size]
        off += _CHUNK + size
        if len(body) < size or zlib.crc32(bytes([kind]) + body) != crc:
            return  # torn tail of a crashed run: keep what came before
        parts.append(body)
        if kind in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def history_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(where, {key: value})`` of each history row of one run file."""
    for number, record in enumerate(_records(path)):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            try:
                row[key] = json.loads(item.value_json)
            except ValueError:
                continue
        yield f"{path}#{number}", row


def load_wandb(root: Path, run_id: str) -> LoadedLog:
    """Read the history of the offline run(s) under ``root`` in file order."""
    files = find_run_files(root)
    if not files:
        raise SourceError(f"{root}: no run-*.wandb file (expected a W&B offline run directory)")

    def rows() -> Iterator[tuple[str, Mapping[str, Any]]]:
        for file in files:
            yield from history_rows(file)
    return rows_to_log(rows(), run_id, "wandb-offline")
