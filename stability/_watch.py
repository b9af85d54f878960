"""``stability.watch``: the explicit way to attach, returning a handle that owns capture and transport."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture
from stability.session import Session, rank_from_env

if TYPE_CHECKING:
    from stability.hooks.guard import Guard

__all__ = ["Handle", "watch"]

log = logging.getLogger(__name__)


class Handle:
    """What :func:`watch` returns: use as a context manager, or call :meth:`close` at the end of training."""

    def __init__(self, config: WatchConfig, session: Session | None, capture: Capture | None) -> None:
        self.config = config
        self.session = session
        self.capture = capture
        self.owns_frameworks = False
        """True when this handle installed the framework auto-attach hooks (auto mode)."""

    @property
    def run_id(self) -> str:
        """Id of the training run."""
        return self.config.run_id

    @property
    def run_dir(self) -> Path | None:
        """Run directory (None when disabled)."""
        return self.session.run_dir if self.session is not None else None

    @property
    def redis_url(self) -> str | None:
        """Redis the records go to (None when disabled)."""
        return self.session.redis_url if self.session is not None else None

    @property
    def active(self) -> bool:
        """True while capturing."""
        return self.capture is not None

    def observe(self, name: str, value: torch.Tensor | float) -> None:
        """Add a signal to the current step, e.g. ``observe("attn_logit_max/h.0.attn", t)`` (no host sync)."""
        if self.capture is not None:
            self.capture.observe(name, value)

    def set_batch(self, batch_id: str | int) -> None:
        """Record the identity of the current batch (for replay and skip lists)."""
        if self.capture is not None:
            self.capture.set_batch(batch_id)

    def guard(self, **config: Any) -> Guard:
        """An opt-in :class:`stability.guard.Guard` for this run (reads the worker's advice for it)."""
        from stability.hooks.guard import Guard, GuardConfig

        return Guard.for_handle(self, GuardConfig(**config))

    def flush(self, timeout: float = 10.0) -> None:
        """Hand every completed step to the transport."""
        if self.capture is not None:
            self.capture.flush(timeout)
        if self.session is not None:
            self.session.emitter.flush(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Detach all hooks, flush every record, and stop the embedded Redis and local worker if we own them."""
        capture, self.capture = self.capture, None
        session, self.session = self.session, None
        if capture is not None:
            if self.owns_frameworks:
                frameworks.uninstall()
            capture.close(timeout=min(timeout, 10.0))
        if session is not None:
            session.close(timeout=timeout)
            self._closed_session = session

    def __enter__(self) -> Handle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def default_run_id() -> str | None:
    """A run id shared by all ranks of a multi-process launch when the user set none (None: generate one)."""
    _rank, _local, world = rank_from_env()
    if world <= 1:
        return None
    seed = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if seed == "none":
        seed = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return "run-" + hashlib.sha1(seed.encode()).hexdigest()[:12]


def watch(
    model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **config: Any
) -> Handle:
    """Attach stability to a training loop.

    Args:
        model: the model (None: discovered from the first forward pass).
        optimizer: the optimizer (None: the first optimizer that steps).
        **config: :class:`~stability.config.WatchConfig` fields; they override ``STABILITY_*`` variables.

    Returns:
        A :class:`Handle`; ``close()`` it (or use ``with``) to flush everything.
    """
    if "run_id" not in config and "STABILITY_RUN_ID" not in os.environ:
        shared = default_run_id()
        if shared is not None:
            config["run_id"] = shared
    cfg = WatchConfig.from_env(**config)
    if not cfg.enabled:
        return Handle(cfg, None, None)
    session = Session.open(cfg)
    # processes this one launches later (Lightning's DDP launcher, multiprocessing) join the same run
    os.environ.setdefault("STABILITY_RUN_ID", cfg.run_id)
    os.environ.setdefault("STABILITY_RUN_DIR", str(session.run_dir))
    try:
        capture = Capture(cfg, session.emitter, rank=session.rank).attach(model, optimizer)
        handle = Handle(cfg, session, capture)
        if model is None and optimizer is None:  # auto mode: also attach to frameworks as they get imported
            frameworks.install(capture)
            handle.owns_frameworks = True
    except Exception:
        session.close()
        raise
    return handle
