"""PyTorch Lightning integration: a ``Callback`` that feeds a :class:`Capture`, and auto-attach for ``Trainer``.

::

    from stability.hooks.lightning import StabilityCallback
    trainer = L.Trainer(callbacks=[StabilityCallback()])   # stability.auto's capture, else stability.watch() per rank

    trainer = L.Trainer(callbacks=[StabilityCallback(handle.capture)])   # or feed an existing capture

With ``import stability.auto`` no edit is needed: :func:`auto_attach` (registered in
:mod:`stability.hooks.frameworks`) patches ``Trainer.__init__`` (``lightning.pytorch``
and ``pytorch_lightning``, whichever are installed) so every new ``Trainer`` gets the callback.

What is recorded, and from where:

* ``grad_norm`` (global L2, before clipping), ``nonfinite_grads`` and ``grad_norm/<module>``: Capture measures them
  at ``on_before_optimizer_step``, where Lightning has unscaled the gradients (AMP) and not yet clipped them. Lightning
  computes no grad norm of its own, and under automatic optimization ``optimizer.step(closure)`` runs forward and
  backward *inside* ``step()``, so the optimizer's own pre-step hook would be too early: the callback drives steps.
* ``loss``: ``outputs["loss"]`` of ``on_train_batch_end`` times ``accumulate_grad_batches`` (Lightning divides it),
  the mean over the micro-batches of one optimizer step; under manual optimization the returned loss as is.
* ``lr``: ``param_groups[0]["lr"]`` of the first optimizer at ``on_before_optimizer_step``.
* ``loss_scale`` and ``skipped`` with a ``GradScaler`` (``precision="16-mixed"``): the scale before the step, and 1
  when the scaler backed the scale off (it does so exactly when it skipped the step); device tensors, no sync.
* the batch: ``batch_idx`` (what Lightning's ``skip_batches.json`` lists); coordinates ``dp`` / ``dp_size`` from
  the trainer's global rank and world size.

Versions tested: lightning 2.6.6 and pytorch-lightning 2.6.6 (torch 2.13.0 CPU; one process, and DDP with two CPU
processes over gloo). Training-side module: Lightning is imported lazily, inside functions.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stability.hooks._safety import AdapterErrors
from stability.hooks.capture import Capture

__all__ = ["FRAMEWORK", "NAMESPACES", "auto_attach", "callback_class", "install"]

logger = logging.getLogger(__name__)

FRAMEWORK = "lightning"
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
"""The packages a ``Trainer`` may come from; each has its own ``Callback`` base class."""
_MARK = "__stability_lightning__"


class _Hooks:
    """The callback's behaviour, independent of which Lightning namespace provides the ``Callback`` base."""

    def __init__(self, capture: Capture | None = None) -> None:
        self.capture = capture
        self._handle: Any = None
        self._pending = False
        self._scale_before: torch.Tensor | None = None
        self._errors = AdapterErrors("Lightning")

    # ----------------------------------------------------------------------------------------- Lightning hooks

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over step boundaries from the capture for this fit."""
        self._guard("on_train_start", lambda: self._start(trainer, pl_module))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Gradients are final, unscaled and not yet clipped: measure them."""
        self._guard("on_before_optimizer_step", lambda: self._before_step(trainer, optimizer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The batch is done: its loss; if an optimizer step happened in it, complete the record."""
        self._guard("on_train_batch_end", lambda: self._batch_end(trainer, outputs, batch_idx))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Give step boundaries back to the capture; close the handle this callback started."""
        self._guard("on_train_end", self._stop)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed: the same clean-up as :meth:`on_train_end` (records so far are flushed)."""
        self._guard("on_exception", self._stop)

    # ------------------------------------------------------------------------------------------------ logic

    def _guard(self, where: str, fn: Callable[[], None]) -> None:
        self._errors.run(where, fn)

    def _start(self, trainer: Any, pl_module: Any) -> None:
        if self.capture is None:
            self.capture = _auto_capture()
        if self.capture is None:
            from stability._watch import watch

            self._handle = watch()
            self.capture = self._handle.capture
        capture = self.capture
        if capture is None:
            return
        if not capture.attached:
            capture.attach()
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        capture.use_framework(
            FRAMEWORK,
            model=pl_module,
            optimizer=optimizers[0] if optimizers and isinstance(optimizers[0], torch.optim.Optimizer) else None,
            drive_steps=True,
            own_loss=False,
        )
        rank, world = getattr(trainer, "global_rank", None), getattr(trainer, "world_size", None)
        if isinstance(rank, int) and isinstance(world, int):
            capture.set_coords({"dp": rank, "dp_size": world})

    def _before_step(self, trainer: Any, optimizer: Any) -> None:
        capture = self.capture
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if capture is None or (optimizers and _unwrap(optimizer) is not _unwrap(optimizers[0])):
            return  # only the first optimizer makes records
        capture.begin_step()
        groups = getattr(optimizer, "param_groups", None) or []
        lr = groups[0].get("lr") if groups else None
        if isinstance(lr, torch.Tensor):
            capture.observe("lr", lr.detach().reshape(-1)[:1])
        elif isinstance(lr, (int, float)):
            capture.observe("lr", float(lr))
        scale = _scaler_scale(trainer)
        self._scale_before = scale.clone() if scale is not None else None
        if self._scale_before is not None:
            capture.observe("loss_scale", self._scale_before)
        self._pending = True

    def _batch_end(self, trainer: Any, outputs: Any, batch_idx: int) -> None:
        capture = self.capture
        if capture is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() > 0:
            automatic = bool(getattr(getattr(trainer, "lightning_module", None), "automatic_optimization", True))
            factor = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if automatic else 1
            capture.observe_loss(loss.detach() * factor)
        capture.set_batch(batch_idx)
        if not self._pending:
            return
        self._pending = False
        before, self._scale_before = self._scale_before, None
        after = _scaler_scale(trainer)
        if before is not None and after is not None:
            capture.end_step(skipped=(after.reshape(-1)[:1] < before).to(torch.float32))
        else:
            capture.end_step(skipped=False)

    def _stop(self) -> None:
        if self.capture is not None:
            self.capture.release_framework(FRAMEWORK)
        handle, self._handle = self._handle, None
        if handle is not None:
            self.capture = None
            handle.close()


def _auto_capture() -> Capture | None:
    """The capture of ``import stability.auto``, when that is active (so a callback never starts a second one)."""
    auto = sys.modules.get("stability.auto")
    handle = getattr(auto, "handle", None) if auto is not None else None
    capture = getattr(handle, "capture", None)
    return capture if isinstance(capture, Capture) else None


def _unwrap(optimizer: Any) -> Any:
    """``LightningOptimizer`` wraps the torch optimizer in ``_optimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


def _scaler_scale(trainer: Any) -> torch.Tensor | None:
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or not getattr(scaler, "_enabled", True):
        return None
    scale = getattr(scaler, "_scale", None)
    return scale.detach().reshape(-1)[:1] if isinstance(scale, torch.Tensor) else None


_classes: dict[str, type] = {}


def callback_class(namespace: str = "lightning.pytorch") -> type:
    """The ``StabilityCallback`` class for ``namespace`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``).

    Raises:
        ImportError: the namespace is not installed.
    """
    cls = _classes.get(namespace)
    if cls is None:
        import importlib

        base = importlib.import_module(namespace).Callback
        cls = type("StabilityCallback", (_Hooks, base), {"__module__": __name__, "__doc__": _Hooks.__doc__})
        _classes[namespace] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name == "StabilityCallback":  # the lightning.pytorch variant, created on first use
        return callback_class("lightning.pytorch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(get_capture: Callable[[], Capture | None], namespaces: Sequence[str] = NAMESPACES) -> Callable[[], None]:
    """Patch ``Trainer.__init__`` in ``namespaces`` (those installed) so new trainers get a ``StabilityCallback``.

    Namespaces not imported yet are imported here (pass only the one just imported from a post-import hook).
    A trainer that already has one keeps its own. ``get_capture``
    returns the capture to feed (None: add nothing). Returns a function undoing the patches.
    """
    patched: list[tuple[type, Any]] = []
    for namespace in namespaces:
        try:
            import importlib

            trainer_cls = importlib.import_module(namespace).Trainer
        except Exception:  # not installed
            continue
        original = trainer_cls.__init__
        if getattr(original, _MARK, False):
            continue
        trainer_cls.__init__ = _patched_init(original, namespace, get_capture)
        patched.append((trainer_cls, original))

    def undo() -> None:
        for trainer_cls, original in reversed(patched):
            if getattr(trainer_cls.__init__, _MARK, False):
                trainer_cls.__init__ = original
        patched.clear()

    return undo


def _patched_init(
    original: Callable[..., None], namespace: str, get_capture: Callable[[], Capture | None]
) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            callbacks = getattr(self, "callbacks", None)
            if not isinstance(callbacks, list) or any(isinstance(c, _Hooks) for c in callbacks):
                return
            capture = get_capture()
            if capture is not None:
                callbacks.append(callback_class(namespace)(capture))
        except Exception:
            logger.exception("stability: could not add the Lightning callback (training continues)")

    setattr(__init__, _MARK, True)
    return __init__


def auto_attach(module: Any, capture: Capture) -> Callable[[], None]:
    """Auto mode (``stability.hooks.frameworks`` calls it when ``lightning.pytorch`` / ``pytorch_lightning`` is
    imported): new ``Trainer``s of that namespace get a callback feeding ``capture``. Returns the undo."""
    namespace = getattr(module, "__name__", "lightning.pytorch")
    return install(lambda: capture, (namespace,) if namespace in NAMESPACES else NAMESPACES)
