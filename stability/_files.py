"""Private files of a run directory: the directory 0700, every file in it 0600 (issue 14 item 6).

Why: a run directory holds record contents (spool, the embedded Redis's append-only file, archives), the Redis URL
and logs. They are created by the training process, the local supervisor and its redis-server and worker; each
creates its files through these helpers or under ``umask 077`` (:data:`PRIVATE_UMASK`), so the modes agree.

Training-side module: stdlib only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["PRIVATE_UMASK", "make_private_dir", "open_private", "write_private_text"]

PRIVATE_UMASK = 0o077
"""The umask of the processes that own a run directory (supervisor, embedded redis-server, local worker)."""


def make_private_dir(path: str | Path) -> Path:
    """Create ``path`` (and parents) if needed and make ``path`` itself 0700; returns it.

    A directory that cannot be chmod'ed (owned by someone else) is left as it is: the files in it are still 0600.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    return path


def open_private(path: str | Path, mode: str = "ab") -> IO[Any]:
    """``open(path, mode)`` for writing (``"ab"``, ``"wb"``, ``"a"``, ``"w"``), the file created 0600."""
    encoding = None if "b" in mode else "utf-8"
    stream: IO[Any] = open(path, mode, encoding=encoding, opener=_private_opener)
    with contextlib.suppress(OSError):
        os.fchmod(stream.fileno(), 0o600)  # a file an older version created 0644
    return stream


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def write_private_text(path: str | Path, text: str) -> None:
    """Write ``path`` atomically (a temporary file, then rename), 0600."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp, "w") as out:
            out.write(text)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
