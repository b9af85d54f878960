"""SIGTERM in the training process: flush what was captured, record the run as died, then die as before.

Why: a ``timeout``, a scheduler's preemption or an elastic agent ends a training process with SIGTERM; with the
default action the records still queued in the capture and the emitter are lost and the run looks "running"
forever. The handler is installed only when nobody else has one (the disposition is ``SIG_DFL``), only from the
main thread, and it ends by restoring ``SIG_DFL`` and re-sending SIGTERM to this process, so the exit status is
still "killed by SIGTERM" (what ``timeout``/schedulers look at). A framework that installs its own handler later
and chains to the previous one (Lightning does) calls this one last. The flush is bounded (a few seconds), below the
usual grace period before a scheduler's SIGKILL.

Training-side module: standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["install"]

log = logging.getLogger(__name__)

_installed: Callable[[int, FrameType | None], None] | None = None
FLUSH_S = 20.0
"""Upper bound of the flush: it runs on a helper thread that the handler joins with this timeout, so a lock held by
the interrupted main thread (the handler runs on it) can delay the exit, never prevent it."""


def install(on_term: Callable[[str], None]) -> bool:
    """Call ``on_term("SIGTERM")`` when SIGTERM arrives, then terminate as the default action would.

    Returns False (and installs nothing) off the main thread or when a SIGTERM handler is already set.
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        current = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):  # pragma: no cover - no signals on this platform
        return False
    if current is not signal.SIG_DFL:
        return False

    def flush() -> None:
        try:
            on_term("SIGTERM")
        except Exception as exc:  # never keep the process alive because the flush failed
            log.warning("stability: flush on SIGTERM failed (%s: %s)", type(exc).__name__, exc)

    def handler(signum: int, frame: FrameType | None) -> None:
        try:
            helper = threading.Thread(target=flush, name="stability-sigterm", daemon=True)
            helper.start()
            helper.join(FLUSH_S)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    _installed = handler
    return True


def uninstall() -> None:
    """Restore ``SIG_DFL`` if our handler is still the one installed (a closed handle needs no flush)."""
    global _installed
    if _installed is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _installed:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = None
