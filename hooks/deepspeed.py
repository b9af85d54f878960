"""DeepSpeed adapter: one record per optimizer step of a ``DeepSpeedEngine``, from the values the engine computed.

::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    attachment = attach_deepspeed(engine, capture)        # explicit; auto mode wraps deepspeed.initialize instead
    ...engine(x); engine.backward(loss); engine.step()...
    attachment.detach()

The engine's ``backward`` and ``step`` are wrapped on the instance (``detach()`` removes the wrappers). The adapter
drives the capture's step boundaries (``Capture.use_framework(drive_steps=True)``), because DeepSpeed's inner
optimizer does not step on an fp16/bf16 overflow, and ZeRO's optimizers are not ``torch.optim`` optimizers.

Per optimizer step (``engine.step()`` at a gradient-accumulation boundary, i.e. ``global_steps`` advanced):

* ``loss``: mean of the micro-batch losses given to ``engine.backward(loss)`` (unscaled, not divided by the
  accumulation steps); with torch-style ``loss.backward()`` the capture's ``backward()`` patch sees the same loss;
* ``grad_norm``: ``engine.get_global_grad_norm()``, the pre-clip, unscaled global norm (``inf`` on an overflow
  step); for fp32 ZeRO-0 DeepSpeed computes none, and the capture measures it (and ``nonfinite_grads``) from
  ``param.grad`` before the step, i.e. before clipping;
* ``skipped`` (``not engine.was_step_applied()``), ``loss_scale`` (fp16: the optimizer's current scale), ``lr``
  (``engine.get_lr()[0]``), ``samples`` (``engine.global_samples``);
* coordinates ``dp``, ``dp_size`` and, with model parallelism, ``mp_size`` (the capture adds ``world_size``).

Per-layer gradient norms (``grad_norm/<module>``), by ZeRO stage:

* ZeRO-0 (fp32, bf16): from ``param.grad`` at the boundary, every ``layer_every`` steps, no copy.
* ZeRO-1 and ZeRO-2: ``param.grad`` is None at the boundary (gradients live in flat partitions, sharded over DP
  ranks under ZeRO-2), so per-layer norms come from ``deepspeed.utils.safe_get_full_grad`` (a gather per parameter,
  a collective across DP ranks) on the sampled steps only: every ``full_grad_every`` steps (default
  ``config.stats_every``); other steps have none.
* ZeRO-3: the same, and in addition parameters are partitioned outside forward, so no ``param_norm`` /
  ``update_ratio`` / ``adam_v_ratio``.
* fp16: per-layer norms also come from ``safe_get_full_grad`` on sampled steps; under ZeRO >= 1 it returns
  gradients still multiplied by the loss scale, so they are divided by the current scale first (at ZeRO-0 DeepSpeed
  0.19 has already unscaled ``param.grad`` at the boundary).

``adam_v_ratio`` is measured only where the engine's optimizer is a plain ``torch.optim`` optimizer over the model's
parameters (fp32 ZeRO-0); ZeRO keeps optimizer state per flat partition. Activation statistics use forward hooks on
``engine.module`` and work on every stage.

All values are read after ``engine.step()`` returned; tensors (``get_global_grad_norm()`` under ZeRO-1/2/3) are
handed to the capture without ``.item()``. Nothing here raises into training: errors are logged once and counted.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from stability.hooks._safety import AdapterErrors
from stability.hooks.capture import Capture
from stability.hooks.schedules import every

__all__ = ["DeepSpeedAttachment", "attach_deepspeed", "auto_attach"]

logger = logging.getLogger(__name__)

FRAMEWORK = "deepspeed"


def _capture_of(target: Any) -> Capture | None:
    """A :class:`Capture`, or the capture of a ``stability.watch`` handle."""
    if isinstance(target, Capture):
        return target
    found = getattr(target, "capture", None)
    return found if isinstance(found, Capture) else None


class DeepSpeedAttachment:
    """The wrappers installed on one engine; see the module docstring. Create with :func:`attach_deepspeed`."""

    def __init__(self, engine: Any, capture: Capture, *, full_grad_every: int | None = None) -> None:
        self.engine = engine
        self.capture = capture
        self._lock = threading.Lock()
        self._wrapped: dict[str, Callable[..., Any]] = {}
        self._errors = AdapterErrors("DeepSpeed")
        """Exceptions caught in the wrappers (training went on)."""
        self.stage = int(_call(engine, "zero_optimization_stage", 0) or 0)
        self.fp16 = bool(_call(engine, "fp16_enabled", False))
        self.bf16 = bool(_call(engine, "bfloat16_enabled", False))
        optimizer = getattr(engine, "optimizer", None)
        self.own_grad_norm = not hasattr(optimizer, "_global_grad_norm")
        """True where DeepSpeed computes no global grad norm (fp32 ZeRO-0): the capture measures it."""
        self.full_grads = self.stage >= 1 or self.fp16
        """True where per-layer gradients come from ``safe_get_full_grad`` (sampled steps only)."""
        period = capture.config.stats_every if full_grad_every is None else full_grad_every
        self._full_grad_due = every(period)
        self._steps_before: int | None = None
        plain = isinstance(optimizer, torch.optim.Optimizer)
        capture.use_framework(
            FRAMEWORK,
            model=engine.module,
            optimizer=optimizer if plain else None,
            drive_steps=True,
            grad_norm=self.own_grad_norm,
            param_stats=self.stage < 3,
            loss_divided=False,  # the engine divides gradients by the accumulation steps itself
        )
        capture.set_coords(self._coords())
        self._wrap("backward", self._backward)
        self._wrap("step", self._step)
        logger.info(
            "stability: attached to DeepSpeedEngine (ZeRO-%d, %s, grad norm from %s, per-layer grads from %s)",
            self.stage,
            "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32",
            "the capture" if self.own_grad_norm else "the engine",
            "safe_get_full_grad on sampled steps" if self.full_grads else "param.grad",
        )

    # ------------------------------------------------------------------------------------------- public API

    @property
    def attached(self) -> bool:
        """True until :meth:`detach`."""
        return bool(self._wrapped)

    def detach(self) -> None:
        """Remove the wrappers from the engine and give step boundaries back to the capture; idempotent."""
        for name, wrapper in list(self._wrapped.items()):
            if self.engine.__dict__.get(name) is wrapper:
                del self.engine.__dict__[name]
        self._wrapped.clear()
        self.capture.release_framework(FRAMEWORK)

    # ------------------------------------------------------------------------------------------- wrappers

    def _wrap(self, name: str, body: Callable[..., Any]) -> None:
        original = getattr(self.engine, name)
        wrapper = functools.partial(body, original)
        functools.update_wrapper(wrapper, original)
        self.engine.__dict__[name] = wrapper  # an instance attribute shadows the class method; del restores it
        self._wrapped[name] = wrapper

    def _backward(self, original: Callable[..., Any], loss: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(loss, *args, **kwargs)
        self._guard("backward", self._after_backward, loss)
        return result

    def _step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._guard("step (before)", self._before_step)
        result = original(*args, **kwargs)
        self._guard("step (after)", self._after_step)
        return result

    def _guard(self, where: str, fn: Callable[..., None], *args: Any) -> None:
        if self._wrapped and self.capture.attached:
            self._errors.run(where, fn, *args)

    @property
    def errors(self) -> int:
        """Exceptions swallowed by the adapter so far."""
        return self._errors.count

    # ------------------------------------------------------------------------------------------- step logic

    def _after_backward(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self.capture.observe_loss(loss)

    def _boundary(self) -> bool:
        engine = self.engine
        if not bool(_call(engine, "managed_gradient_accumulation", True)):
            return True
        return bool(engine.is_gradient_accumulation_boundary())

    def _before_step(self) -> None:
        engine = self.engine
        self._steps_before = int(engine.global_steps)
        if not self._boundary():
            return
        capture = self.capture
        if not self.full_grads:
            capture.begin_step()
            return
        if self._full_grad_due(capture.step):
            capture.begin_step(self._full_grads())
        else:
            capture.begin_step(layers=False)

    def _full_grads(self) -> list[torch.Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        scale = self._loss_scale() if self.fp16 and self.stage >= 1 else None  # ZeRO keeps fp16 grads scaled
        grads: list[torch.Tensor | None] = []
        for p in self.capture.measured_params:
            g = safe_get_full_grad(p)
            if g is not None and scale is not None:
                g = g.float() / scale
            grads.append(g)
        return grads

    def _loss_scale(self) -> Any:
        optimizer = getattr(self.engine, "optimizer", None)
        config = getattr(optimizer, "loss_scale_config", None)
        if config is not None and hasattr(config, "cur_scale"):
            return config.cur_scale
        return getattr(optimizer, "cur_scale", None)

    def _after_step(self) -> None:
        engine = self.engine
        before, self._steps_before = self._steps_before, None
        if before is None or int(engine.global_steps) == before:
            return  # not an accumulation boundary: no optimizer step
        skipped: bool | None = None
        try:  # a failed read costs that value only: the step is always completed
            skipped = not bool(engine.was_step_applied())
            self._observe_step_values()
        finally:
            self.capture.end_step(skipped=skipped)

    def _observe_step_values(self) -> None:
        engine, capture = self.engine, self.capture
        if not self.own_grad_norm:
            norm = engine.get_global_grad_norm()
            if isinstance(norm, (torch.Tensor, int, float)):
                capture.observe("grad_norm", norm)
        if self.fp16:
            scale = self._loss_scale()
            if isinstance(scale, (torch.Tensor, int, float)):
                capture.observe("loss_scale", scale)
        lrs = engine.get_lr()
        if lrs:
            capture.observe("lr", lrs[0])
        capture.observe("samples", float(engine.global_samples))

    def _coords(self) -> dict[str, int]:
        engine = self.engine
        coords: dict[str, int] = {}
        dp_size = getattr(engine, "dp_world_size", None)
        if isinstance(dp_size, int):
            coords["dp_size"] = dp_size
        group = getattr(engine, "data_parallel_group", None)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            try:
                coords["dp"] = dist.get_rank(group) if group is not None else dist.get_rank()
            except (RuntimeError, ValueError):
                pass
        mp_size = getattr(engine, "mp_world_size", None)
        if isinstance(mp_size, int) and mp_size > 1:
            coords["mp_size"] = mp_size
        return coords


def _call(obj: Any, name: str, default: Any) -> Any:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return default
    try:
        return fn()
    except Exception:
        return default


def attach_deepspeed(engine: Any, capture: Any, *, full_grad_every: int | None = None) -> DeepSpeedAttachment | None:
    """Attach ``capture`` (a :class:`Capture` or a ``stability.watch`` handle) to a ``DeepSpeedEngine``.

    An unattached capture is attached to ``engine.module`` first.

    Args:
        engine: what ``deepspeed.initialize`` returned first.
        capture: where the records go.
        full_grad_every: under ZeRO >= 1 or fp16, per-layer gradient norms via ``safe_get_full_grad`` every N steps
            (default ``config.stats_every``; 0 = never).

    Returns:
        The attachment (``detach()`` it to remove the wrappers), or None when stability is disabled or attaching
        failed (logged; training is never affected).
    """
    found = _capture_of(capture)
    if found is None:
        logger.warning("stability: attach_deepspeed() needs a Capture or a watch handle, got %r", type(capture))
        return None
    try:
        if not found.attached:
            found.attach(engine.module)
        if not found.attached:
            return None
        return DeepSpeedAttachment(engine, found, full_grad_every=full_grad_every)
    except Exception:
        logger.exception("stability: could not attach to the DeepSpeed engine (training continues without it)")
        return None


def auto_attach(module: ModuleType, capture: Any) -> Callable[[], None] | None:
    """Auto mode: wrap ``deepspeed.initialize`` so every engine it returns is attached to ``capture``.

    Returns:
        The undo function (restores ``deepspeed.initialize`` and detaches the engines attached so far).
    """
    original = getattr(module, "initialize", None)
    if not callable(original):
        return None
    attachments: list[DeepSpeedAttachment] = []

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        found = _capture_of(capture)
        if found is not None:  # DeepSpeed may step its inner optimizer while it sets up: no record for that
            found.use_framework(FRAMEWORK, drive_steps=True)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            if found is not None:
                found.release_framework(FRAMEWORK)
            raise
        if found is not None:
            _attach_result(result, found, attachments)
        return result

    module.initialize = initialize  # type: ignore[attr-defined]

    def undo() -> None:
        if getattr(module, "initialize", None) is initialize:
            module.initialize = original  # type: ignore[attr-defined]
        for attachment in attachments:
            attachment.detach()
        attachments.clear()

    return undo


def _attach_result(result: Any, capture: Capture, attachments: list[DeepSpeedAttachment]) -> None:
    """Attach to the engine ``deepspeed.initialize`` returned (training engines only); never raises."""
    try:
        engine = result[0] if isinstance(result, tuple) and result else result
        if hasattr(engine, "module") and hasattr(engine, "step") and getattr(engine, "optimizer", None) is not None:
            attachment = attach_deepspeed(engine, capture)
            if attachment is not None:
                attachments.append(attachment)
                return
        capture.release_framework(FRAMEWORK)
    except Exception:
        logger.exception("stability: auto-attach to the DeepSpeed engine failed (training continues)")
