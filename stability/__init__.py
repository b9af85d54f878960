"""stability: training-stability diagnosis for large-model training.

``import stability.auto`` instruments a plain PyTorch loop; ``stability.watch(model, optimizer)`` is the explicit
form. Records stream to Redis; a worker runs the detectors; ``stability postmortem`` analyses a run afterwards.

``watch`` and ``Handle`` are imported lazily so that the worker and the post-mortem never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stability.config import WatchConfig
from stability.errors import (
    ConfigError,
    EmbeddedServerError,
    RecordError,
    SourceError,
    StabilityError,
    TransportError,
)
from stability.records import StepRecord

if TYPE_CHECKING:
    from stability._watch import Handle, watch

__all__ = [
    "ConfigError",
    "EmbeddedServerError",
    "Handle",
    "RecordError",
    "SourceError",
    "StabilityError",
    "StepRecord",
    "TransportError",
    "WatchConfig",
    "watch",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("watch", "Handle"):
        from stability import _watch

        return getattr(_watch, name)
    raise AttributeError(f"module 'stability' has no attribute {name!r}")
