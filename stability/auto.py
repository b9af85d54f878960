"""``import stability.auto``: instrument a plain PyTorch training loop with no other edit.

Configuration comes from ``STABILITY_*`` environment variables (see :mod:`stability.config`). The handle is
``stability.auto.handle`` and is closed (everything flushed) at interpreter exit. Nothing here may crash the
training script: any failure to attach is logged once and stability stays off.

Lazy: the import only installs the hooks. The run directory, the embedded Redis and the local worker are created
on the first training step (the capture's first record), on a background thread while the records wait in a
buffer; a process that imports stability but never trains starts nothing.
"""

from __future__ import annotations

import atexit
import logging
import sys

from stability._watch import Handle, watch

__all__ = ["handle"]

log = logging.getLogger(__name__)

handle: Handle | None = None

try:
    handle = watch(lazy=True)
except Exception as exc:  # never break the training script
    log.warning("stability: not attached (%s: %s)", type(exc).__name__, exc)
    handle = None
else:

    def _close_at_exit(handle: Handle = handle) -> None:
        """Close the handle; after an uncaught exception (Python sets ``sys.last_value`` before the atexit handlers
        run) the run is recorded as died, with the exception, instead of finished."""
        error = getattr(sys, "last_value", None)
        handle.close(died=f"{type(error).__name__}: {error}"[:300] if error is not None else None)

    atexit.register(_close_at_exit)
