"""One thread per process renews the leases of the drains running in it.

A drain renews its lease on a background thread while a batch runs (a slow batch must not lose the lease midway).
Starting and joining a thread for every batch cost ~2 ms, more than half of a shard drain that finds nothing new
(a sweep every 0.5 s drains each of a 16,384-rank run's 16 shards); :func:`lease_kept` registers the renewal with
one long-lived thread instead.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["lease_kept"]

_lock = threading.Condition()
_due: dict[int, tuple[float, float, Callable[[], object]]] = {}
"""Registration -> (next renewal, monotonic; period, s; renew)."""
_ids = itertools.count()
_thread_pid = [0]
"""The process whose keeper thread runs (a forked child starts its own)."""


@contextlib.contextmanager
def lease_kept(renew: Callable[[], object], every_s: float) -> Iterator[None]:
    """Call ``renew()`` every ``every_s`` seconds on the keeper thread while the body runs; a ``renew`` that raises
    is not called again (the lease is lost or Redis is away: the body finds out at its next guarded write)."""
    key = next(_ids)
    with _lock:
        _due[key] = (time.monotonic() + every_s, every_s, renew)
        if _thread_pid[0] != os.getpid():
            _thread_pid[0] = os.getpid()
            threading.Thread(target=_run, name="stability-lease-keeper", daemon=True).start()
        _lock.notify()
    try:
        yield
    finally:
        with _lock:
            _due.pop(key, None)


def _run() -> None:
    while True:
        with _lock:
            now = time.monotonic()
            ready = [(key, every_s, renew) for key, (at, every_s, renew) in _due.items() if at <= now]
            if not ready:
                _lock.wait(min((at for at, _, _ in _due.values()), default=now + 60) - now)
                continue
            for key, every_s, renew in ready:
                _due[key] = (now + every_s, every_s, renew)
        for key, _, renew in ready:
            try:
                renew()
            except Exception:
                with _lock:
                    _due.pop(key, None)
