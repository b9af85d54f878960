"""The spool: an append-only local file that holds records while Redis cannot be reached.

One file per rank, ``<spool_dir>/spool-rank<rank>.bin``. Each frame is ::

    <uint32 LE length> <uint32 LE crc32 of body> <body = msgpack [entry id: str, encoded record: bytes]>

Frames are appended in queue order and fsync'ed per batch, so after a crash the file holds every record the
emitter had accepted, except possibly a torn last frame. A write that fails part-way (``ENOSPC``, ``EFBIG``) is cut
back to the last whole frame at once, so later frames never land behind a torn one (issue 14 item 1).

Readers skip a torn tail with a warning. A damaged region in the middle (a bad CRC, a body that does not parse, a
length that cannot be right: left by an older writer or by the disk) does not end the read: the reader searches
forward for the next whole frame, and counts and logs each region it skipped, so a replay that then removes the file
has said what it could not recover.
"""

from __future__ import annotations

import logging
import mmap
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

__all__ = ["Spool", "SpoolReader", "lost_path", "read_spool", "scan_spool", "spool_path"]

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


def lost_path(spool_dir: str | Path, rank: int) -> Path:
    """Where ``rank``'s emitter leaves the count of records it could not spool when Redis never came back."""
    return Path(spool_dir) / f"lost-rank{rank}"


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

    After iteration, ``corrupt`` is the number of damaged regions skipped (each held at least one record),
    ``skipped_bytes`` their total size, ``end`` the offset just past the last whole frame, ``torn`` whether
    unreadable bytes follow ``end`` (a torn tail: a write cut by a crash; not counted in ``corrupt``) and
    ``tail_bytes`` how many.
    """

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self._stream = stream
        self._name = name
        self.corrupt = 0
        self.skipped_bytes = 0
        self.end = 0
        self.torn = False
        self.tail_bytes = 0

    @property
    def damaged(self) -> int:
        """Regions skipped, the torn tail included: each held at least one record that is now lost."""
        return self.corrupt + int(self.torn)

    def __iter__(self) -> Iterator[Entry]:
        self._stream.seek(0, os.SEEK_END)
        size = self._stream.tell()
        self._stream.seek(0)
        if size == 0:
            return
        with mmap.mmap(self._stream.fileno(), size, access=mmap.ACCESS_READ) as data:
            offset = 0
            while offset < size:
                entry, length = _frame_at(data, offset, size)
                if entry is not None:
                    offset += length
                    self.end = offset
                    yield entry
                    continue
                why = _why_not(data, offset, size)
                resume = _next_frame(data, offset + 1, size)
                if resume is None:
                    self.torn = True
                    self.tail_bytes = size - offset
                    logger.warning("spool %s: %s at offset %d; the %d bytes after it hold no whole frame and are "
                                   "skipped", self._name, why, offset, size - offset)
                    return
                self.corrupt += 1
                self.skipped_bytes += resume - offset
                logger.error("spool %s: %s at offset %d; %d damaged bytes skipped, reading on at offset %d",
                             self._name, why, offset, resume - offset, resume)
                offset = resume


def _frame_at(data: mmap.mmap, offset: int, size: int) -> tuple[Entry | None, int]:
    """The entry of a whole, valid frame at ``offset`` and the frame's size; ``(None, 0)`` if there is none."""
    if offset + _HEADER.size > size:
        return None, 0
    length, crc = _HEADER.unpack_from(data, offset)
    start = offset + _HEADER.size
    if length > MAX_FRAME_BYTES or start + length > size or length == 0 or data[start] != _BODY_START:
        return None, 0
    body = data[start : start + length]
    if zlib.crc32(body) != crc:
        return None, 0
    entry = _parse_body(body)
    return (entry, _HEADER.size + length) if entry is not None else (None, 0)


def _why_not(data: mmap.mmap, offset: int, size: int) -> str:
    if offset + _HEADER.size > size:
        return "torn last frame header"
    length, _crc = _HEADER.unpack_from(data, offset)
    if length > MAX_FRAME_BYTES:
        return f"impossible frame length {length}"
    if offset + _HEADER.size + length > size:
        return f"torn last frame ({size - offset - _HEADER.size} of {length} bytes)"
    return "corrupt frame"


def _next_frame(data: mmap.mmap, start: int, size: int) -> int | None:
    """Offset of the first whole valid frame at or after ``start`` (None: none)."""
    # every body starts with a msgpack array of 2 (0x92): look at the positions just after such a byte
    pos = data.find(bytes([_BODY_START]), start + _HEADER.size)
    while pos != -1:
        candidate = pos - _HEADER.size
        if _frame_at(data, candidate, size)[0] is not None:
            return candidate
        pos = data.find(bytes([_BODY_START]), pos + 1)
    return None


_BODY_START = 0x92
"""msgpack's fixarray of 2: the first byte of every frame body."""


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
    damaged regions with an error log (see :func:`scan_spool` for the counts); decode payloads with
    :func:`stability.records.decode`.

    Raises:
        SourceError: the file cannot be opened or read.
    """
    return scan_spool(path)[0]


def scan_spool(path: str | Path) -> tuple[list[Entry], SpoolReader]:
    """Like :func:`read_spool`, plus the finished reader (``corrupt``, ``skipped_bytes``, ``torn``, ``tail_bytes``).

    Raises:
        SourceError: the file cannot be opened or read.
    """
    path = Path(path)
    try:
        with path.open("rb") as stream:
            reader = SpoolReader(stream, str(path))
            return list(reader), reader
    except OSError as exc:
        raise SourceError(f"cannot read spool file {path}: {exc}") from None


class Spool:
    """The spool file of one emitter. Used only from the emitter thread.

    ``_good_end`` is the size of the file's whole-frame prefix as this object last knew it (None: not checked yet,
    or a failed write could not be cut back): every append first makes the file exactly that long.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._good_end: int | None = None
        self.tails_cut = 0
        """Torn tails (an earlier process's records cut by a crash mid-write) truncated before appending."""

    def has_data(self) -> bool:
        """Whether the file exists and is not empty."""
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def append(self, entries: Sequence[Entry]) -> None:
        """Append ``entries`` durably (write, flush, fsync), all or nothing.

        Raises:
            OSError: the disk refused (full, quota, file size limit); the file is cut back to its last whole frame.
        """
        if self._good_end is None:
            self._good_end = self._cut_torn_tail()
        good_end = self._good_end
        data = encode_frames(entries)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != good_end:
                os.ftruncate(fd, good_end)
            os.lseek(fd, good_end, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            self._cut_back(fd, good_end)
            raise
        finally:
            os.close(fd)
        self._good_end = good_end + len(data)

    def _cut_back(self, fd: int, good_end: int) -> None:
        """Remove the part of a failed append that reached the file (a truncate needs no free space)."""
        try:
            os.ftruncate(fd, good_end)
        except OSError as exc:
            logger.error("spool %s: cannot cut a failed write back to offset %d (%s); it is cut before the next "
                         "write", self.path, good_end, exc)
            self._good_end = None

    def open_reader(self) -> tuple[BinaryIO, SpoolReader]:
        """Open the file for replay; the caller closes the stream."""
        stream = self.path.open("rb")
        return stream, SpoolReader(stream, str(self.path))

    def remove(self) -> None:
        """Delete the file (after a complete replay)."""
        self.path.unlink(missing_ok=True)
        self._good_end = 0

    def _cut_torn_tail(self) -> int:
        """Truncate a torn tail left by a crash, so that new frames are not swallowed by it; the size after."""
        if not self.has_data():
            return 0
        with self.path.open("r+b") as stream:
            reader = SpoolReader(stream, str(self.path))
            for _ in reader:
                pass
            if reader.torn:
                logger.warning("spool %s: truncating unreadable tail at offset %d", self.path, reader.end)
                stream.truncate(reader.end)
                self.tails_cut += 1
            return reader.end
