"""Hugging Face ``transformers.Trainer`` adapter: the raw per-step loss and the Trainer's own pre-clip grad norm.

::

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    attach_hf(trainer, capture)          # explicit; in auto mode every Trainer gets it from Trainer.__init__
    trainer.train()

What it reads, per optimizer step (one record per optimizer step, ended by the optimizer step hook as usual):

* ``loss``: the **raw** loss of every micro-batch, from the tensor ``Trainer.training_step`` returns (wrapped on
  the instance; with DeepSpeed the same tensor as ``accelerator.backward`` gets it), times the accumulation steps
  the Trainer divided it by; the step's loss is their mean, i.e. the value the Trainer would log for that step
  (observed as ``loss``, so it wins over the ``backward()`` patch). The Trainer's own logged loss is filtered: with
  the default ``logging_nan_inf_filter=True`` a NaN/Inf step is replaced by the running average, so the NaN never
  shows in ``log_history``; the record keeps it.
* ``grad_norm``: the pre-clip global norm the Trainer computed (the value ``Trainer._get_grad_norm`` returns, which
  it logs as ``grad_norm``; with DeepSpeed it is ``engine.get_global_grad_norm()``). The capture then makes no
  global grad-norm pass of its own; per-layer ``grad_norm/<module>`` still come from ``param.grad`` before clipping
  (measured when ``Trainer._clip_grad_norm`` starts, or at the optimizer pre-step without clipping). If this
  transformers version has no ``_get_grad_norm``/``_clip_grad_norm``, the
  capture measures the norm itself.
* ``lr`` from the optimizer's param group (what the Trainer logs as ``learning_rate``); ``loss_scale``/``skipped``
  with fp16 AMP through the capture's ``GradScaler`` patches.

With DeepSpeed (``TrainingArguments(deepspeed=...)``) the DeepSpeed adapter drives the records (it attaches to the
engine accelerate creates, and ``grad_norm`` is ``engine.get_global_grad_norm()``, the same value the Trainer logs);
this adapter then only supplies the raw loss (the Trainer hands DeepSpeed a loss already divided by the accumulation
steps), so nothing is counted twice.

The callback class subclasses ``transformers.TrainerCallback`` and is created on first use, so importing this
module does not import transformers. Nothing here raises into training.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from stability.hooks._safety import AdapterErrors
from stability.hooks.capture import Capture

__all__ = ["StabilityCallback", "attach_hf", "auto_attach"]  # noqa: F822 (StabilityCallback: module __getattr__)

logger = logging.getLogger(__name__)

FRAMEWORK = "transformers"
_MARK = "_stability_callback"


def _capture_of(target: Any) -> Capture | None:
    if isinstance(target, Capture):
        return target
    found = getattr(target, "capture", None)
    return found if isinstance(found, Capture) else None


class _Adapter:
    """State shared by the callback and the instance wrappers of one Trainer."""

    def __init__(self, capture: Capture, trainer: Any) -> None:
        self.capture = capture
        self.trainer = trainer
        self.active = False
        self.loss_only = False
        """Another adapter (DeepSpeed) drives the records; this one only supplies the raw loss."""
        self._loss_step = -1
        self._losses: list[torch.Tensor] = []
        self._errors = AdapterErrors("transformers")
        self._wrapped: dict[str, tuple[Any, Callable[..., Any]]] = {}
        if trainer is not None:
            self._wrap(trainer, "training_step", self._training_step)
            if callable(getattr(trainer, "_clip_grad_norm", None)):
                self._wrap(trainer, "_clip_grad_norm", self._clip)
            if callable(getattr(trainer, "_get_grad_norm", None)):
                self._wrap(trainer, "_get_grad_norm", self._grad_norm)
            accelerator = getattr(trainer, "accelerator", None)
            if callable(getattr(accelerator, "backward", None)):
                self._wrap(accelerator, "backward", self._backward)

    @property
    def reads_grad_norm(self) -> bool:
        return "_get_grad_norm" in self._wrapped or "_clip_grad_norm" in self._wrapped

    def _wrap(self, target: Any, name: str, body: Callable[..., Any]) -> None:
        original = getattr(target, name)
        wrapper = functools.partial(body, original)
        functools.update_wrapper(wrapper, original)
        target.__dict__[name] = wrapper  # an instance attribute shadows the method; deleting it restores it
        self._wrapped[name] = (target, wrapper)

    def unwrap(self) -> None:
        for name, (target, wrapper) in list(self._wrapped.items()):
            if target.__dict__.get(name) is wrapper:
                del target.__dict__[name]
        self._wrapped.clear()

    def _training_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loss = original(*args, **kwargs)
        if self.active:
            self._guard("training_step", self._observe_loss, loss)
        return loss

    def _backward(self, original: Callable[..., Any], loss: Any, *args: Any, **kwargs: Any) -> Any:
        # With DeepSpeed, accelerate's backward also runs engine.step(), which ends the record: observe the loss
        # (the tensor training_step returns, detached) before it.
        if self.loss_only:
            self._guard("accelerator.backward", self._observe_loss, loss)
        return original(loss, *args, **kwargs)

    def _clip(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.active:  # per-layer norms before clipping (accelerate bound clip_grad_norm_ before the patch)
            self._guard("clip", self.capture.begin_step)
        norm = original(*args, **kwargs)
        if self.active and "_get_grad_norm" not in self._wrapped:
            self._guard("grad_norm", self._observe_norm, norm)
        return norm

    def _grad_norm(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        norm = original(*args, **kwargs)
        if self.active:
            self._guard("grad_norm", self._observe_norm, norm)
        return norm

    def _observe_loss(self, loss: Any) -> None:
        """Observe the running mean of the step's raw micro-batch losses as ``loss`` (the last observed one wins)."""
        if not isinstance(loss, torch.Tensor):
            return
        steps = getattr(self.trainer, "current_gradient_accumulation_steps", None)
        if not isinstance(steps, int):
            steps = int(getattr(self.trainer.args, "gradient_accumulation_steps", 1) or 1)
        if self._loss_step != self.capture.step:
            self._loss_step, self._losses = self.capture.step, []
        self._losses.append((loss.detach() * steps if steps != 1 else loss.detach()).to(torch.float32).reshape(()))
        self.capture.observe("loss", torch.stack(self._losses).mean())

    def _observe_norm(self, norm: Any) -> None:
        if isinstance(norm, (torch.Tensor, int, float)):
            self.capture.observe("grad_norm", norm)

    def _guard(self, where: str, fn: Callable[..., None], *args: Any) -> None:
        self._errors.run(where, fn, *args)

    @property
    def errors(self) -> int:
        """Exceptions swallowed by the adapter so far."""
        return self._errors.count

    # -------------------------------------------------------------------------------------- callback events

    def train_begin(self, model: Any, optimizer: Any) -> None:
        capture = self.capture
        if not capture.attached:
            if not isinstance(model, torch.nn.Module):
                return
            capture.attach(model)
            if not capture.attached:
                return
        if capture.framework not in (None, FRAMEWORK):
            logger.info(
                "stability: %s adapter drives the capture; the Trainer callback adds the raw loss", capture.framework
            )
            self.loss_only = True
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the real one
        capture.use_framework(
            FRAMEWORK,
            model=model if isinstance(model, torch.nn.Module) else None,
            optimizer=inner if isinstance(inner, torch.optim.Optimizer) else None,
            grad_norm=not self.reads_grad_norm,
        )
        self.active = True

    def train_end(self) -> None:
        self.loss_only = False
        if self.active:
            self.active = False
            self.capture.release_framework(FRAMEWORK)


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback

    class StabilityCallback(TrainerCallback):  # type: ignore[misc]
        """A ``TrainerCallback`` feeding a stability capture; see :mod:`stability.hooks.hf`.

        Args:
            capture: a :class:`~stability.hooks.capture.Capture` or a ``stability.watch`` handle.
            trainer: the Trainer (lets the callback read the raw loss and the Trainer's grad norm); without it the
                capture's own measurements are used (the loss seen by ``backward()``, its own grad-norm pass).
        """

        def __init__(self, capture: Any, trainer: Any = None) -> None:
            found = _capture_of(capture)
            if found is None:
                raise TypeError(f"StabilityCallback needs a Capture or a watch handle, got {type(capture)!r}")
            self._adapter = _Adapter(found, trainer)

        @property
        def capture(self) -> Capture:
            return self._adapter.capture

        @property
        def active(self) -> bool:
            """True while training with this callback feeding the capture."""
            return self._adapter.active

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
        ) -> None:
            self._adapter._guard("on_train_begin", self._adapter.train_begin, model, optimizer)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._adapter._guard("on_train_end", self._adapter.train_end)

        def detach(self) -> None:
            """Remove the Trainer wrappers and release the capture."""
            self._adapter.train_end()
            self._adapter.unwrap()

    return StabilityCallback


def __getattr__(name: str) -> Any:
    if name == "StabilityCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attach_hf(trainer: Any, capture: Any) -> Any:
    """Add a ``StabilityCallback`` bound to ``trainer`` (idempotent); returns it, or None if attaching failed."""
    existing = getattr(trainer, _MARK, None)
    if existing is not None:
        return existing
    try:
        callback = _callback_class()(capture, trainer)
        trainer.add_callback(callback)
        trainer.__dict__[_MARK] = callback
        return callback
    except Exception:
        logger.exception("stability: could not attach to the Trainer (training continues without it)")
        return None


def auto_attach(module: ModuleType, capture: Any) -> Callable[[], None] | None:
    """Auto mode: patch ``transformers.trainer.Trainer.__init__`` so every Trainer gets a ``StabilityCallback``.

    Returns:
        The undo function (restores ``Trainer.__init__`` and detaches the callbacks added so far).
    """
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or "__init__" not in vars(trainer_cls):
        return None
    original = trainer_cls.__init__
    callbacks: list[Any] = []

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, _MARK, None) is None:
            callback = attach_hf(self, capture)
            if callback is not None:
                callbacks.append(callback)

    trainer_cls.__init__ = __init__

    def undo() -> None:
        if vars(trainer_cls).get("__init__") is __init__:
            trainer_cls.__init__ = original
        for callback in callbacks:
            callback.detach()
        callbacks.clear()

    return undo
