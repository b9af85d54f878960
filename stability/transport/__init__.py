"""Transport from the training process to Redis Streams: the :class:`Emitter`, its spool file and helpers.

Training side only: imports nothing but the standard library, redis and msgpack (plus ``stability.records``).
"""

from stability.transport._emitter import Emitter, EmitterStats, push_urgent
from stability.transport._ids import parse_id
from stability.transport._spool import read_spool, scan_spool, spool_path

__all__ = ["Emitter", "EmitterStats", "parse_id", "push_urgent", "read_spool", "scan_spool", "spool_path"]
