"""Processes a training script starts with ``multiprocessing`` that train on their own (Hogwild with the ``spawn`` or
``forkserver`` start method: each child imports the script, so ``stability.auto`` again, instead of inheriting the
parent's capture as a forked child does)."""

from __future__ import annotations

import os

__all__ = ["LAUNCHER_RANK_VARS", "child_ordinal"]

LAUNCHER_RANK_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""Variables a launcher (torchrun, Lightning, SLURM, MPI) sets to give a process its rank."""


def child_ordinal() -> int | None:
    """This process's ordinal among the processes its parent started with ``multiprocessing`` (1, 2, ...: the
    parent's counter, as in ``Process-2``) when it is such a child and no launcher variable gives it a rank; None
    otherwise. Callers ask ``torch.distributed`` first: ``torch.multiprocessing.spawn`` DDP ranks are its ranks.
    Without this every such child was rank 0 of the parent's run, and their records collided."""
    if any(os.environ.get(name, "").strip().isdigit() for name in LAUNCHER_RANK_VARS):
        return None
    import multiprocessing  # the standard library's; torch imports it anyway

    if multiprocessing.parent_process() is None:
        return None
    identity = getattr(multiprocessing.current_process(), "_identity", ())
    return int(identity[-1]) if identity else None
