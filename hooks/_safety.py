"""The one way framework adapters run their code: an exception never reaches training; it is counted and logged
once per call site (with its traceback), and the code runs inside :func:`hook_scope` so the tests' host-read
traps cover it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from stability.hooks.capture import hook_scope

__all__ = ["AdapterErrors"]

logger = logging.getLogger(__name__)


class AdapterErrors:
    """Guarded execution for one adapter; ``count`` is the number of exceptions swallowed so far."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self.count = 0
        self._sites: set[str] = set()
        self._lock = threading.Lock()

    def run(self, where: str, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)``; on an exception count it and log it the first time ``where`` fails."""
        try:
            with hook_scope():
                fn(*args)
        except Exception:
            with self._lock:
                self.count += 1
                first = where not in self._sites
                self._sites.add(where)
            if first:
                logger.exception("stability: %s adapter failed in %s (training continues)", self.adapter, where)
