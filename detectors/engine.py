"""RunDiagnoser: runs the detector suite over the records of one training run (all ranks).

INTERFACE (stable; the worker and post-mortem depend on it):

    diag = RunDiagnoser()                      # or RunDiagnoser(config=DiagnoserConfig(...))
    findings = diag.update(record)             # records of each rank in step order; ranks may interleave
    findings += diag.finish()                  # end of run: flush pending (e.g. unconfirmed spikes)
    state = diag.state_dict(); diag2.load_state_dict(state)   # plain data (msgpack/JSON-able)

STUB: only NaN detection; replaced by the full detector suite.
"""

from __future__ import annotations

import math
from typing import Any

from stability.detectors.base import CauseHint, Finding, Severity
from stability.detectors.causes import remedy
from stability.records import StepRecord

__all__ = ["RunDiagnoser"]


class RunDiagnoser:
    """Detector suite for one run."""

    def __init__(self) -> None:
        self._seen_nan: dict[int, bool] = {}

    def update(self, record: StepRecord) -> list[Finding]:
        loss = record.get("loss")
        if math.isnan(loss) or math.isinf(loss):
            if self._seen_nan.get(record.rank):
                return []
            self._seen_nan[record.rank] = True
            return [
                Finding(
                    kind="nan",
                    step=record.step,
                    onset=record.step,
                    severity=Severity.ERROR,
                    signal="loss",
                    value=loss,
                    message=f"loss is {loss} at step {record.step}",
                    detector="nan",
                    rank=record.rank,
                    causes=(CauseHint(cause="numerical_nan", score=1.0, evidence="loss non-finite",
                                      remedy=remedy("numerical_nan")),),
                )
            ]
        return []

    def finish(self) -> list[Finding]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"seen_nan": {str(k): v for k, v in self._seen_nan.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seen_nan = {int(k): bool(v) for k, v in state.get("seen_nan", {}).items()}
