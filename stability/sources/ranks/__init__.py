"""Multi-rank logs: per-rank files, or one file whose lines carry rank / host prefixes, read as one multi-rank run.

Four parts, each with its assumptions in its docstring:

* :mod:`~stability.sources.ranks.layout`: whose a file is (torchrun ``--log-dir``, SLURM per-task and per-host
  file names: :func:`discover`, :func:`discover_files`) and whose a line is (``[rankN]:`` / ``[defaultN]:`` /
  ``srun --label`` / pdsh prefixes: :func:`split_prefixes`).
* :mod:`~stability.sources.ranks.reader`: :func:`load_ranked` reads the files line by line, attributes each line to
  a (rank, host) (global rank = the node's first rank + local rank where only the local rank is known) and merges
  the ranks' records into one run.
* :mod:`~stability.sources.ranks.hangs`: a rank whose log stops while the other ranks' NCCL watchdogs time out, or
  while they log further steps, is a ``rank_stopped`` event (:func:`stopped_ranks`), read by
  :mod:`stability.sources.analysis` as the ``hang`` finding.
* :mod:`~stability.sources.ranks.hosts`: ``--system-log`` events matched to the ranks of their host
  (:func:`add_system_logs`, :func:`attribute_hosts`).
"""

from __future__ import annotations

from stability.sources.ranks.hangs import span, stopped_ranks
from stability.sources.ranks.hosts import add_system_logs, attribute_hosts, describe_hosts, host_from_name
from stability.sources.ranks.layout import (
    RankFile,
    discover,
    discover_files,
    head,
    prefixed,
    split_prefixes,
    stripped_lines,
    system_files,
)
from stability.sources.ranks.reader import load_ranked

__all__ = ["RankFile", "add_system_logs", "attribute_hosts", "describe_hosts", "discover", "discover_files", "head",
           "host_from_name", "load_ranked", "prefixed", "span", "split_prefixes", "stopped_ranks", "stripped_lines",
           "system_files"]
