"""The spool: an append-only local file that holds records while Redis cannot be reached.

One file per rank, ``<spool_dir>/spool-rank<rank>.bin``. Each frame is ::

    <uint32 LE length> <uint32 LE crc32 of body> <body = msgpack [entry id: str, encoded record: bytes]>

Frames are appended in queue order and fsync'ed per batch, so after a crash the file holds every record the
emitter had accepted, except possibly a torn last frame. Readers skip a torn tail with a warning and skip a frame
whose CRC or body is wrong (logged and counted); a length that cannot be right stops the read there.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import msgpack

from stability.errors import SourceError
from stability.records import MAX_RECORD_BYTES

__all__ = ["Spool", "SpoolReader", "read_spool", "spool_path"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = MAX_RECORD_BYTES + 1024
"""A frame body longer than this cannot have been written by the emitter: the file is unreadable from there."""
_ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")

Entry = tuple[str, bytes]
"""``(stream entry id, encoded record)``."""


def spool_path(spool_dir: str | Path, rank: int) -> Path:
    """The spool file of ``rank`` in ``spool_dir``."""
    return Path(spool_dir) / f"spool-rank{rank}.bin"


def encode_frames(entries: Sequence[Entry]) -> bytes:
    """Frame ``entries`` for appending to a spool file."""
    parts = []
    for entry_id, payload in entries:
        body: bytes = msgpack.packb([entry_id, payload], use_bin_type=True)
        parts.append(_HEADER.pack(len(body), zlib.crc32(body)))
        parts.append(body)
    return b"".join(parts)


class SpoolReader:
    """Iterate the valid frames of an open spool file, in order.

    After iteration, ``corrupt`` is the number of frames skipped because their CRC or body was wrong, ``end`` the
    offset just past the last whole frame, and ``torn`` whether unreadable bytes follow ``end``.
    """

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self._stream = stream
        self._name = name
        self.corrupt = 0
        self.end = 0
        self.torn = False

    def __iter__(self) -> Iterator[Entry]:
        while True:
            header = self._stream.read(_HEADER.size)
            if not header:
                return
            if len(header) < _HEADER.size:
                self._stop("torn last frame header")
                return
            length, crc = _HEADER.unpack(header)
            if length > MAX_FRAME_BYTES:
                self._stop(f"impossible frame length {length}")
                return
            body = self._stream.read(length)
            if len(body) < length:
                self._stop(f"torn last frame ({len(body)} of {length} bytes)")
                return
            offset, self.end = self.end, self.end + _HEADER.size + length
            entry = _parse_body(body) if zlib.crc32(body) == crc else None
            if entry is None:
                self.corrupt += 1
                logger.error("spool %s: corrupt frame at offset %d skipped", self._name, offset)
                continue
            yield entry

    def _stop(self, why: str) -> None:
        self.torn = True
        logger.warning("spool %s: %s at offset %d; the rest of the file is skipped", self._name, why, self.end)


def _parse_body(body: bytes) -> Entry | None:
    try:
        obj = msgpack.unpackb(body, raw=False, max_bin_len=MAX_FRAME_BYTES, max_str_len=64, max_array_len=2)
    except Exception:  # msgpack raises several unrelated types
        return None
    if (
        isinstance(obj, list)
        and len(obj) == 2
        and isinstance(obj[0], str)
        and _ENTRY_ID.match(obj[0])
        and isinstance(obj[1], bytes)
    ):
        return obj[0], obj[1]
    return None


def read_spool(path: str | Path) -> list[Entry]:
    """All readable ``(entry id, encoded record)`` pairs of a spool file, in write order.

    Used by the post-mortem to recover records that never reached Redis. A torn tail is skipped with a warning and
    corrupt frames are skipped with an error log; decode payloads with :func:`stability.records.decode`.

    Raises:
        SourceError: the file cannot be opened or read.
    """
    path = Path(path)
    try:
        with path.open("rb") as stream:
            return list(SpoolReader(stream, str(path)))
    except OSError as exc:
        raise SourceError(f"cannot read spool file {path}: {exc}") from None


class Spool:
    """The spool file of one emitter. Used only from the emitter thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._checked = False

    def has_data(self) -> bool:
        """Whether the file exists and is not empty."""
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def append(self, entries: Sequence[Entry]) -> None:
        """Append ``entries`` durably (write, flush, fsync). Raises ``OSError`` if the disk refuses."""
        if not self._checked:
            self._cut_torn_tail()
            self._checked = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as stream:
            stream.write(encode_frames(entries))
            stream.flush()
            os.fsync(stream.fileno())

    def open_reader(self) -> tuple[BinaryIO, SpoolReader]:
        """Open the file for replay; the caller closes the stream."""
        stream = self.path.open("rb")
        return stream, SpoolReader(stream, str(self.path))

    def remove(self) -> None:
        """Delete the file (after a complete replay)."""
        self.path.unlink(missing_ok=True)
        self._checked = True

    def _cut_torn_tail(self) -> None:
        """Truncate a torn tail left by a crash, so that new frames are not swallowed by it."""
        if not self.has_data():
            return
        with self.path.open("r+b") as stream:
            reader = SpoolReader(stream, str(self.path))
            for _ in reader:
                pass
            if reader.torn:
                logger.warning("spool %s: truncating unreadable tail at offset %d", self.path, reader.end)
                stream.truncate(reader.end)
