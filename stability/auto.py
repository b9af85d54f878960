"""``import stability.auto``: instrument a plain PyTorch training loop with no other edit.

Configuration comes from ``STABILITY_*`` environment variables (see :mod:`stability.config`). The handle is
``stability.auto.handle`` and is closed (everything flushed) at interpreter exit. Nothing here may crash the
training script: any failure to attach is logged once and stability stays off.

Lazy: the import only installs the hooks (redis-py, the transport and the console are imported when the session
opens). The run directory, the embedded Redis and the local worker are created on the first training step (the
capture's first record), on a background thread while the records wait in a buffer; a process that imports
stability but never trains starts nothing.

Fast exit: at interpreter exit the handle waits only for the records to reach Redis (at most
``STABILITY_EXIT_FLUSH_S`` seconds, default 1), records the run's end and prints the summary line; the local
worker finishes the diagnosis after the process has gone (findings.json and report.html appear in the run
directory shortly after), then the supervisor stops it and redis-server. ``STABILITY_EXIT_WAIT_DRAIN=1`` makes the
exit wait for the worker instead (the report exists when the process ends). A script that ends with ``os._exit``
(which skips atexit) gets the same close first: ``os._exit`` is wrapped, in this process only.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn

from stability._watch import Handle, watch

__all__ = ["handle"]

log = logging.getLogger(__name__)

handle: Handle | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_seconds(name: str) -> float | None:
    """A non-negative number of seconds from the environment; None (the default) when unset or invalid."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else None
    except ValueError:
        value = None
    if raw and (value is None or value < 0):
        log.warning("stability: %s=%r is not a number of seconds; using the default", name, raw)
        return None
    return value


try:
    handle = watch(lazy=True)
except Exception as exc:  # never break the training script
    log.warning("stability: not attached (%s: %s)", type(exc).__name__, exc)
    handle = None
else:

    def _close(died: str | None, handle: Handle = handle) -> None:
        """The fast exit's close (see the module docstring); ``died``: why the process ends abnormally."""
        handle.close(died=died, wait_drained=_env_flag("STABILITY_EXIT_WAIT_DRAIN"),
                     flush_s=_env_seconds("STABILITY_EXIT_FLUSH_S"))

    def _close_at_exit() -> None:
        """Close the handle; after an uncaught exception (Python sets ``sys.last_value`` before the atexit handlers
        run) the run is recorded as died, with the exception, instead of finished."""
        error = getattr(sys, "last_value", None)
        _close(f"{type(error).__name__}: {error}"[:300] if error is not None else None)

    atexit.register(_close_at_exit)

    _real_exit = os._exit
    _main_pid = os.getpid()
    EXIT_CLOSE_S = 10.0
    """Upper bound of the close done for ``os._exit`` (on a helper thread: a lock held elsewhere can delay the exit,
    never prevent it)."""

    def _exit_closing(status: int) -> NoReturn:
        """``os._exit`` skips atexit: a script that ends with it (to skip a slow NCCL or DataLoader teardown) lost
        its last records and was recorded as died ("vanished without a clean close"). Close first (bounded), as
        finished for status 0, else died; then exit. Forked children (DataLoader workers) exit untouched."""
        if os.getpid() == _main_pid:
            died = None if status == 0 else f"os._exit({status})"

            def close() -> None:
                try:
                    _close(died)
                except Exception as exc:  # never keep the process alive because the close failed
                    log.warning("stability: close at os._exit failed (%s: %s)", type(exc).__name__, exc)

            helper = threading.Thread(target=close, name="stability-exit", daemon=True)
            helper.start()
            helper.join(EXIT_CLOSE_S)
        _real_exit(status)

    os._exit = _exit_closing  # type: ignore[assignment]
