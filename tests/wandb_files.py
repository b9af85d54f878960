"""Read an offline W&B run back: the records of a ``.wandb`` file (service-notes §1.4), for tests.

wandb 0.31 has no public reader (``wandb.sdk.internal.datastore`` is gone), so this parses the file format
directly: header ``b":W&B"`` + uint16 LE magic ``0xBEE1`` + uint8 version, then LevelDB-log framing in 32 KiB
blocks (chunk header ``crc32 (4) | length (2, LE) | type (1)``; FULL=1, FIRST=2, MIDDLE=3, LAST=4; the CRC covers
the type byte and the payload), each record a protobuf ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FILE_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(record type, Record)`` for each record of a finished offline ``.wandb`` file."""
    from wandb.proto.wandb_internal_pb2 import Record

    raw = Path(path).read_bytes()
    if raw[:4] != b":W&B" or struct.unpack_from("<H", raw, 4)[0] != 0xBEE1:
        raise ValueError(f"{path} is not a .wandb file")
    off, parts = FILE_HEADER, []
    while off + CHUNK_HEADER <= len(raw):
        room = BLOCK - off % BLOCK
        if room < CHUNK_HEADER or raw[off + 6] == 0:  # block trailer or zero fill
            off += room
            continue
        crc, size, kind = struct.unpack_from("<IHB", raw, off)
        body = raw[off + CHUNK_HEADER : off + CHUNK_HEADER + size]
        off += CHUNK_HEADER + size
        if zlib.crc32(bytes([kind]) + body) != crc:
            raise ValueError(f"{path}: CRC mismatch before offset {off} (torn tail?)")
        parts.append(body)
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield str(record.WhichOneof("record_type")), record


def find_run_files(root: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file of the offline runs under ``root``."""
    return sorted(Path(root).rglob("offline-run-*/run-*.wandb"))


def finished_run_file(root: str | Path, timeout: float = 15.0) -> Path:
    """The one offline run file under ``root``, once it holds its ``exit`` record.

    ``run.finish()`` can return before wandb-core has flushed the file (seen with 0.31 under pytest), so wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        files = find_run_files(root)
        if len(files) > 1:
            raise ValueError(f"{len(files)} offline runs under {root}, expected one")
        try:
            if files and any(kind == "exit" for kind, _ in wandb_records(files[0])):
                return files[0]
        except ValueError:  # torn tail while it is being written
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no finished offline run under {root} after {timeout}s: {files}")
        time.sleep(0.05)


def alerts(path: str | Path) -> list[dict[str, Any]]:
    """The alert records: ``title``, ``text``, ``level``, ``wait_duration`` (ms)."""
    return [
        {"title": r.alert.title, "text": r.alert.text, "level": r.alert.level, "wait_duration": r.alert.wait_duration}
        for kind, r in wandb_records(path)
        if kind == "alert"
    ]


def history(path: str | Path) -> list[dict[str, Any]]:
    """The history rows, ``{key: decoded JSON value}`` (nested keys joined with ``/``)."""
    rows = []
    for kind, r in wandb_records(path):
        if kind == "history":
            row = {}
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def config(path: str | Path) -> dict[str, Any]:
    """The run config as logged in the run record and later config records (values JSON-decoded)."""
    out: dict[str, Any] = {}
    for kind, r in wandb_records(path):
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_info(path: str | Path) -> dict[str, Any]:
    """Fields of the run record: ``project``, ``group``, ``job_type``, ``display_name``, ``run_id``."""
    for kind, r in wandb_records(path):
        if kind == "run":
            return {
                "project": r.run.project,
                "group": r.run.run_group,
                "job_type": r.run.job_type,
                "display_name": r.run.display_name,
                "run_id": r.run.run_id,
            }
    kinds = [k for k, _ in wandb_records(path)]
    raise ValueError(f"{path} has no run record; records: {kinds}")
