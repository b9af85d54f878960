"""Evidence files the training side leaves in the run directory, found for the post-mortem report.

* ``profile-rank<r>-step<s>.json.gz`` (+ ``.summary.json``): a ``torch.profiler`` Chrome trace of steps ``s`` to
  the summary's ``last_step`` (:mod:`stability.hooks.profiler`), asked for on a performance incident or by
  ``stability profile``;
* ``hang-rank<r>-step<s>.txt``: the Python stacks the hang watchdog dumped while rank ``r`` waited for step ``s``
  (:class:`stability.hooks.timing.Watchdog`).

The report links them (paths relative to the report's directory) and ``findings.json`` lists them. No import of
:mod:`stability.postmortem` here (it imports this module).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MAX_ARTIFACTS", "Artifact", "find_artifacts"]

MAX_ARTIFACTS = 200
"""At most this many files are listed (the newest by step are kept)."""
_PROFILE = re.compile(r"^profile-rank(\d+)-step(\d+)\.json\.gz$")
_HANG = re.compile(r"^hang-rank(\d+)-step(\d+)\.txt$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Artifact:
    """One evidence file of the run directory."""

    kind: str
    """``profile`` (a Chrome trace) or ``hang_stacks`` (a watchdog's stack dump)."""
    path: Path
    rank: int
    step: int
    """First profiled step, or the step the rank was waiting for."""
    last_step: int | None = None
    """Last profiled step (from the summary)."""
    summary: Mapping[str, Any] = field(default_factory=dict)
    """A profile's ``top_ops`` (first 5) and ``split_s`` (compute / comm / memcpy / data seconds)."""

    def link(self, base: Path | None) -> str:
        """The path relative to ``base`` (the directory of the report that links it), else absolute."""
        if base is None:
            return str(self.path)
        try:
            return os.path.relpath(self.path, base)
        except ValueError:  # another drive (Windows)
            return str(self.path)

    def describe(self) -> str:
        """``profile of rank 0, steps 5-7`` / ``hang stacks of rank 1 waiting for step 30``."""
        if self.kind == "profile":
            steps = f"steps {self.step}-{self.last_step}" if self.last_step is not None else f"from step {self.step}"
            return f"profile of rank {self.rank}, {steps}"
        return f"hang stacks of rank {self.rank} waiting for step {self.step}"

    def to_dict(self, base: Path | None = None) -> dict[str, Any]:
        """JSON-ready fields, ``path`` relative to ``base`` (see :meth:`link`)."""
        out: dict[str, Any] = {"kind": self.kind, "rank": self.rank, "step": self.step, "path": self.link(base)}
        if self.last_step is not None:
            out["last_step"] = self.last_step
        if self.summary:
            out.update({k: v for k, v in self.summary.items() if k in ("top_ops", "split_s")})
            summary = _summary_file(self.path)
            out["summary_path"] = str(summary) if base is None else os.path.relpath(summary, base)
        return out


def _summary_file(trace: Path) -> Path:
    return trace.with_name(trace.name[: -len(".json.gz")] + ".summary.json")


def _summary(trace: Path) -> tuple[int | None, dict[str, Any]]:
    try:
        data = json.loads(_summary_file(trace).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, {}
    if not isinstance(data, dict):
        return None, {}
    last = data.get("last_step")
    split = data.get("split_s")
    ops = data.get("top_ops")
    out: dict[str, Any] = {}
    if isinstance(split, dict):
        out["split_s"] = {str(k): float(v) for k, v in split.items() if isinstance(v, int | float)}
    if isinstance(ops, list):
        out["top_ops"] = [{"name": str(o.get("name", "")), "self_s": float(o.get("self_s", 0.0)),
                           "category": str(o.get("category", ""))} for o in ops[:5] if isinstance(o, dict)]
    return (int(last) if isinstance(last, int | float) else None), out


def find_artifacts(run_dir: str | Path | None) -> tuple[Artifact, ...]:
    """Profile traces and hang stack dumps in ``run_dir`` (not recursive), by step then rank; empty when the
    directory is None or unreadable."""
    if run_dir is None:
        return ()
    root = Path(run_dir)
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return ()
    found: list[Artifact] = []
    for name in names:
        if match := _PROFILE.match(name):
            last, summary = _summary(root / name)
            found.append(Artifact(kind="profile", path=root / name, rank=int(match[1]), step=int(match[2]),
                                  last_step=last, summary=summary))
        elif match := _HANG.match(name):
            found.append(Artifact(kind="hang_stacks", path=root / name, rank=int(match[1]), step=int(match[2])))
    found.sort(key=lambda a: (a.step, a.rank, a.kind))
    return tuple(found[-MAX_ARTIFACTS:])
