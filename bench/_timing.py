"""Stage timers for the benchmarks: wrap an attribute so that every call adds its duration to a tally."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any


def tally_calls(owner: Any, name: str, spent: dict[str, float], label: str | None = None,
                clock: Callable[[], float] = time.perf_counter) -> None:
    """Replace ``owner.name`` by a wrapper that adds each call's ``clock`` time to ``spent[label or name]``."""
    inner = getattr(owner, name)
    key = label or name

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + clock() - start

    setattr(owner, name, wrapper)
