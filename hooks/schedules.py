"""Sampling schedules: plain callables ``step -> bool`` saying on which optimizer steps to compute something.

Steps are 0-based (the first optimizer step is step 0). ``every(50)`` samples steps 0, 50, 100, ...
"""

from __future__ import annotations

from collections.abc import Callable

from stability.errors import ConfigError

__all__ = ["Schedule", "every", "never"]

Schedule = Callable[[int], bool]
"""A sampling schedule: called with the 0-based optimizer step, returns True to sample that step."""


def never(step: int) -> bool:
    """The schedule that samples nothing."""
    return False


def every(n: int, offset: int = 0) -> Schedule:
    """Sample every ``n``-th step, starting at ``offset``; ``n == 0`` samples nothing.

    Args:
        n: period in optimizer steps (``>= 0``).
        offset: first sampled step (``>= 0``).

    Returns:
        The schedule.

    Raises:
        ConfigError: ``n`` or ``offset`` is negative.
    """
    if n < 0 or offset < 0:
        raise ConfigError(f"every(n={n}, offset={offset}): n and offset must be >= 0")
    if n == 0:
        return never

    def schedule(step: int) -> bool:
        return step >= offset and (step - offset) % n == 0

    return schedule
