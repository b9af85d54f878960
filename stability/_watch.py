"""``stability.watch``: the explicit way to attach, returning a handle that owns capture and transport."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from stability import _sigterm
from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture
from stability.session import LazySession, Session, rank_from_env

if TYPE_CHECKING:
    from stability.hooks.guard import Guard

__all__ = ["Handle", "watch"]

log = logging.getLogger(__name__)


class Handle:
    """What :func:`watch` returns: use as a context manager, or call :meth:`close` at the end of training."""

    def __init__(self, config: WatchConfig, session: Session | LazySession | None, capture: Capture | None) -> None:
        self.config = config
        self._session = session
        self.capture = capture
        self.owns_frameworks = False
        """True when this handle installed the framework auto-attach hooks (auto mode)."""

    @property
    def session(self) -> Session | None:
        """The open session (None when disabled, closed, or, with ``lazy``, before the first training step)."""
        src = self._session
        return src.session if isinstance(src, LazySession) else src

    @property
    def run_id(self) -> str:
        """Id of the training run."""
        return self.config.run_id

    @property
    def run_dir(self) -> Path | None:
        """Run directory (None when disabled); with ``lazy`` it is created on the first training step."""
        src = self._session
        if isinstance(src, LazySession):
            return self.config.resolved_run_dir.resolve()
        return src.run_dir if src is not None else None

    @property
    def redis_url(self) -> str | None:
        """Redis the records go to (None when disabled). With ``lazy``, asking for it starts the session now (and
        waits until Redis is up): the caller wants to talk to that Redis."""
        src = self._session
        if isinstance(src, LazySession):
            opened = src.wait()
            return opened.redis_url if opened is not None else None
        return src.redis_url if src is not None else None

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
        src = self._session
        if isinstance(src, LazySession):
            src = src.wait(timeout) if src.started else None
        if src is not None:
            src.emitter.flush(timeout)

    def close(self, timeout: float = 60.0, *, died: str | None = None, wait_drained: bool = True,
              flush_s: float | None = None) -> None:
        """Detach all hooks, flush every record, and stop the embedded Redis and local worker if we own them.

        ``died``: the process is ending abnormally (e.g. ``"ValueError: ..."`` of an uncaught exception); the run
        is then recorded as died at its last step instead of finished.
        ``wait_drained=False`` (what ``import stability.auto`` does at exit): wait only for the records to reach
        Redis (at most ``flush_s`` seconds, default :data:`stability.session.EXIT_FLUSH_S`); the local worker
        finishes the run after this process has gone (findings.json and report.html a little later), then stops.
        """
        _sigterm.uninstall()
        capture, self.capture = self.capture, None
        session, self._session = self._session, None
        if capture is not None:
            if self.owns_frameworks:
                frameworks.uninstall()
            capture.close(timeout=min(timeout, 10.0))
        if session is not None:
            closed = session.close(timeout=timeout, died=died, wait_drained=wait_drained, flush_s=flush_s)
            self._closed_session = closed if isinstance(session, LazySession) else session

    def terminate(self, reason: str, timeout: float = 5.0) -> None:
        """The process is being killed: hand the captured steps to the transport, flush it, record the run as died.

        Bounded (about ``3 * timeout``) and without waiting for the diagnosis: the local supervisor lets the worker
        finish the run once this process is gone. Called by the SIGTERM handler (:mod:`stability._sigterm`).
        """
        capture, self.capture = self.capture, None
        session, self._session = self._session, None
        if capture is not None:
            capture.close(timeout=timeout)
        if session is not None:
            session.terminate(reason, timeout=timeout)

    def __enter__(self) -> Handle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(died=None if exc is None else f"{type(exc).__name__}: {exc}"[:300])


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
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    lazy: bool = False,
    **config: Any,
) -> Handle:
    """Attach stability to a training loop.

    Args:
        model: the model (None: discovered from the first forward pass).
        optimizer: the optimizer (None: the first optimizer that steps).
        lazy: create the run directory and start Redis and the worker on the first training step instead of now
            (what ``import stability.auto`` does, so that a process that never trains starts nothing).
        **config: :class:`~stability.config.WatchConfig` fields; they override ``STABILITY_*`` variables.

    Returns:
        A :class:`Handle`; ``close()`` it (or use ``with``) to flush everything. When called from the main thread of
        a process with no SIGTERM handler, a SIGTERM flushes the records and records the run as died before the
        process terminates as it would have (see :mod:`stability._sigterm`).
    """
    if "run_id" not in config and "STABILITY_RUN_ID" not in os.environ:
        shared = default_run_id()
        if shared is not None:
            config["run_id"] = shared
    cfg = WatchConfig.from_env(**config)
    if not cfg.enabled:
        return Handle(cfg, None, None)
    session: Session | LazySession
    if lazy:
        session = LazySession(cfg)
        sink: Any = session
        rank: int | None = None  # the capture asks torch.distributed when it builds its first record
        run_dir = cfg.resolved_run_dir.resolve()
    else:
        session = Session.open(cfg)
        sink, rank, run_dir = session.emitter, session.rank, session.run_dir
    # processes this one launches later (Lightning's DDP launcher, multiprocessing) join the same run
    os.environ.setdefault("STABILITY_RUN_ID", cfg.run_id)
    os.environ.setdefault("STABILITY_RUN_DIR", str(run_dir))
    try:
        capture = Capture(cfg, sink, rank=rank).attach(model, optimizer)
        handle = Handle(cfg, session, capture)
        if model is None and optimizer is None:  # auto mode: also attach to frameworks as they get imported
            frameworks.install(capture)
            handle.owns_frameworks = True
    except Exception:
        session.close()
        raise
    _sigterm.install(handle.terminate)
    return handle
