"""Evaluation harness: a labelled corpus (synthetic CPU runs with injected faults + real logs), event-window
scoring, simple baselines and the ``stability eval`` table (docs/evaluation.md).

::

    python -m stability.evaluation            # reduced corpus (CI size)
    python -m stability.evaluation --full --json eval.json
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``stability eval``: see :func:`stability.evaluation.runner.main`."""
    from stability.evaluation.runner import main as run_main

    return run_main(argv)
