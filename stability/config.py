"""Configuration of the training-side capture: one frozen, keyword-only dataclass, validated where declared.

Every field can be set from an environment variable (``WatchConfig.from_env``), which is how
``import stability.auto`` is configured:

=============================  ==========================  ==============================================
variable                       field                       meaning
=============================  ==========================  ==============================================
``STABILITY_DISABLE=1``        ``enabled=False``           attach nothing
``STABILITY_RUN_ID``           ``run_id``                  id of the training run (default: generated)
``STABILITY_RUN_DIR``          ``run_dir``                 run directory (default ``./stability-runs/<id>``)
``STABILITY_REDIS_URL``        ``redis_url``               external Redis; unset = embedded Redis in run dir
``STABILITY_LAYER_EVERY``      ``layer_every``             per-layer grad norms every N steps (default 1)
``STABILITY_STATS_EVERY``      ``stats_every``             param/update/activation/Adam stats every N steps
``STABILITY_MAX_ACT_MODULES``  ``max_act_modules``         how many modules get activation statistics
``STABILITY_LOCAL_WORKER``     ``local_worker``            start a worker with the embedded Redis (1/0)
``STABILITY_QUEUE_SIZE``       ``queue_size``              bounded queue between training and emitter
``STABILITY_WANDB_PROJECT``    ``wandb_project``           W&B project for the diagnosis run
``STABILITY_QUIET=1``          ``quiet=True``              no stability lines in the training terminal
``STABILITY_TIMING=0``         ``timing=False``            no step-timing / memory signals, hang watchdog, profiler
=============================  ==========================  ==============================================
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from stability.errors import ConfigError
from stability.records import check_run_id
from stability.redis_url import check_url

__all__ = ["WatchConfig", "new_run_id"]


def new_run_id() -> str:
    """A fresh, sortable run id such as ``run-20261202-153011-a1b2c3``."""
    return time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchConfig:
    """What to capture and where to send it. Unknown keyword arguments raise ``TypeError``."""

    enabled: bool = True
    """False attaches nothing (``STABILITY_DISABLE=1``)."""
    run_id: str = field(default_factory=new_run_id)
    """Id of the training run; all ranks of one run must share it."""
    run_dir: Path | None = None
    """Run directory: embedded Redis data, spool, archive, findings. None: ``./stability-runs/<run_id>``."""
    redis_url: str | None = None
    """``redis://`` / ``rediss://`` / ``unix://`` URL of an external Redis, ``redis+cluster://host:port[,host:port]``
    for a Redis Cluster (see :mod:`stability.redis_url`); None starts an embedded one."""
    layer_every: int = 1
    """Per-layer gradient norms every N optimizer steps (0 = never)."""
    stats_every: int = 50
    """Parameter norms, update ratios, activation, logit and Adam statistics every N steps (0 = never)."""
    max_act_modules: int = 32
    """At most this many modules get activation statistics on sampled steps."""
    update_ratio_max_bytes: int = 512 * 1024 * 1024
    """Update ratios snapshot parameters on sampled steps; skipped when the model is larger than this."""
    local_worker: bool = True
    """With the embedded Redis, start one local worker process with the training process."""
    queue_size: int = 10_000
    """Bound of the queue between the training thread and the emitter thread (records dropped beyond it)."""
    redis_timeout_s: float = 0.5
    """Socket timeout of the emitter's Redis calls; on failure records go to the spool file."""
    wandb_project: str | None = None
    """W&B project for the worker's diagnosis run (None: from ``WANDB_PROJECT`` or the active ``wandb.run``)."""
    quiet: bool = False
    """True: print nothing in the training terminal (no start line, alerts or summary; ``STABILITY_QUIET=1``)."""
    timing: bool = True
    """Step timing and memory signals, the hang watchdog and on-demand profiling (:mod:`stability.hooks.timing`);
    False for records that must be reproducible bit for bit (the evaluation corpus)."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        for name in ("layer_every", "stats_every", "max_act_modules", "update_ratio_max_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {self.queue_size}")
        if not 0 < self.redis_timeout_s <= 10:
            raise ConfigError(f"redis_timeout_s must be in (0, 10], got {self.redis_timeout_s}")
        if self.redis_url is not None:
            check_url(self.redis_url, "redis_url")
        if self.run_dir is not None and not isinstance(self.run_dir, Path):
            object.__setattr__(self, "run_dir", Path(self.run_dir))

    @property
    def resolved_run_dir(self) -> Path:
        """The run directory, defaulting to ``./stability-runs/<run_id>``."""
        return self.run_dir if self.run_dir is not None else Path("stability-runs") / self.run_id

    def replace(self, **changes: Any) -> WatchConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WatchConfig:
        """Build a config from ``STABILITY_*`` variables; ``overrides`` win over the environment."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        names = {f.name for f in fields(cls)}
        for name in names:
            raw = env.get(f"STABILITY_{name.upper()}")
            if raw is not None and raw != "":
                values[name] = _parse(name, raw)
        if env.get("STABILITY_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
            values["enabled"] = False
        values.update(overrides)
        return cls(**values)


_INT_FIELDS = {"layer_every", "stats_every", "max_act_modules", "update_ratio_max_bytes", "queue_size"}
_BOOL_FIELDS = {"enabled", "local_worker", "quiet", "timing"}


def _parse(name: str, raw: str) -> Any:
    var = f"STABILITY_{name.upper()}"
    if name in _INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not an integer") from None
    if name in _BOOL_FIELDS:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={raw!r} is not a boolean (use 1/0)")
    if name == "redis_timeout_s":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a number") from None
    if name == "run_dir":
        return Path(raw)
    return raw
