"""Reversible process-wide patches of torch functions, shared by every attached capture.

Some of what the capture needs has no hook in torch, so a few functions are wrapped:

* ``torch.Tensor.backward`` and ``torch.autograd.backward``: the tensor ``backward()`` is called on is the loss.
  ``Tensor.backward`` calls ``torch.autograd.backward`` itself; a per-thread depth counter makes one call report
  once. For ``torch.autograd.backward(tensors=[a, b])`` the first tensor is reported. Listeners hear of the call
  before it runs too (a loop without an optimizer: the step in progress may have ended, see
  :mod:`stability.hooks.rhythm`).
* ``torch.nn.Module.zero_grad``: before it runs (the gradients are still there), for loops without an optimizer.
* ``torch.amp.GradScaler.scale`` (and ``ShardedGradScaler.scale`` when FSDP's module is imported: :func:`refresh`
  patches it when FSDP came later): which
  tensor is a scaled loss, so the capture can divide the scale out again.
* ``torch.amp.GradScaler.step``: around the call, so a step the scaler skipped (``optimizer.step()`` never ran,
  so no optimizer hook fired) still produces a record.
* FSDP1's ``FullyShardedDataParallel.clip_grad_norm_`` when FSDP's module is imported (the same): like
  ``clip_grad_norm_`` below, run as is; listeners hear the whole model's norm it returns.
* ``torch.nn.utils.clip_grad_norm_`` (the same function as ``torch.nn.utils.clip_grad.clip_grad_norm_``): gradient
  statistics are taken *before* clipping; listeners also hear when it returned. Code that bound the function
  before the patch (``from torch.nn.utils import clip_grad_norm_`` executed earlier) calls the original;
  gradients are then measured at the optimizer pre-step hook, i.e. after clipping. For the common call (L2,
  float32 gradients on one device, not ``DTensor`` shards) the wrapper computes the per-tensor norms once, hands
  them to the listeners and clips with torch's own ``clip_grads_with_norm_``: one pass over the gradients instead
  of two.

The patches are installed when the first :class:`PatchListener` subscribes and removed when the last one
unsubscribes; the wrappers call the original unchanged and report to the listeners, which must not raise. A
listener lacking one of the optional methods (``before_backward``, ``after_clip``, ``before_zero_grad``) is skipped
for that event.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stability.hooks import stats

__all__ = ["PatchListener", "installed", "refresh", "subscribe", "unsubscribe"]

logger = logging.getLogger(__name__)


class PatchListener(Protocol):
    """What the patched functions report to. Implementations must not raise."""

    def on_backward(self, tensor: torch.Tensor) -> None:
        """``backward()`` returned for ``tensor``."""

    def before_backward(self, tensor: torch.Tensor) -> None:
        """``backward()`` is about to run for ``tensor`` (optional)."""

    def before_zero_grad(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()`` is about to run (optional)."""

    def after_clip(self, parameters: torch.Tensor | Sequence[torch.Tensor],
                   clipped: tuple[torch.Tensor, float] | None = None, total: torch.Tensor | None = None) -> None:
        """``clip_grad_norm_(parameters, ...)`` returned (optional); ``clipped``: ``(total norm, max_norm)`` when
        the patch clipped with the norms it gave ``before_clip`` (the gradients were multiplied by
        ``clamp(max_norm / (total + 1e-6), max=1)``, torch's formula), else None. ``total``: the norm the clip
        returned when it ran as is (a ``DTensor`` for FSDP2's gradients; FSDP1's method returns the whole
        model's), else None."""

    def on_scale(self, scaler: Any, output: torch.Tensor) -> None:
        """``scaler.scale(loss)`` returned ``output``."""

    def before_clip(self, parameters: torch.Tensor | Sequence[torch.Tensor], norms: torch.Tensor | None) -> None:
        """``clip_grad_norm_(parameters, ...)`` is about to run; ``norms``: the per-tensor L2 norms of the
        gradients (aligned with ``parameters``, 0 for a missing gradient) that the clipping will use, when the patch
        computed them once for both (see :func:`_norms_once`), else None."""

    def before_scaler_step(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.step(optimizer)`` is about to run."""

    def after_scaler_step(self, scaler: Any, optimizer: torch.optim.Optimizer, completed: bool) -> None:
        """``scaler.step(optimizer)`` returned (``completed``) or raised."""


@dataclass
class _Patch:
    target: Any
    name: str
    original: Any
    wrapper: Any
    owned: bool
    """The attribute was in ``target.__dict__`` (else it was inherited and is deleted again on restore)."""


_lock = threading.Lock()
_listeners: list[PatchListener] = []
_patches: list[_Patch] = []
_depth = threading.local()


def subscribe(listener: PatchListener) -> None:
    """Start reporting to ``listener``; installs the patches for the first listener."""
    with _lock:
        if not _listeners:
            _install()
        if listener not in _listeners:
            _listeners.append(listener)


def unsubscribe(listener: PatchListener) -> None:
    """Stop reporting to ``listener``; restores the original functions after the last listener."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _patches:
            _uninstall()


def installed() -> list[str]:
    """Names of the functions currently patched (for tests and diagnostics)."""
    with _lock:
        return [f"{getattr(p.target, '__name__', p.target)}.{p.name}" for p in _patches]


def _notify(method: str, *args: Any) -> None:
    for listener in tuple(_listeners):
        try:
            call = getattr(listener, method, None)
            if call is not None:
                call(*args)
        except Exception:  # a listener must not raise; never let it reach the training loop
            logger.exception("stability: listener %r failed in %s", listener, method)


def _install() -> None:
    import torch.nn.utils.clip_grad as clip_module

    clip = _wrap_clip(clip_module.clip_grad_norm_)
    targets: list[tuple[Any, str, Any]] = [
        (torch.Tensor, "backward", _wrap_backward(torch.Tensor.backward, tensor_first=True)),
        (torch.autograd, "backward", _wrap_backward(torch.autograd.backward, tensor_first=False)),
        (torch.amp.GradScaler, "scale", _wrap_scale(torch.amp.GradScaler.scale)),
        (torch.amp.GradScaler, "step", _wrap_scaler_step(torch.amp.GradScaler.step)),
        (clip_module, "clip_grad_norm_", clip),
        (torch.nn.utils, "clip_grad_norm_", clip),
        (torch.nn.Module, "zero_grad", _wrap_zero_grad(torch.nn.Module.zero_grad)),
    ]
    _apply([*targets, *_fsdp_targets()])


def refresh() -> None:
    """Patch FSDP's functions too if FSDP was imported after the patches were installed (a script that imports
    ``stability.auto`` first); the capture calls this when it finds the model's parameters."""
    with _lock:
        if _listeners and _patches:
            _apply(_fsdp_targets())


def _fsdp_targets() -> list[tuple[Any, str, Any]]:
    """``ShardedGradScaler.scale`` and FSDP1's ``clip_grad_norm_``, when their modules are loaded and not patched."""
    done = {(id(p.target), p.name) for p in _patches}
    targets: list[tuple[Any, str, Any]] = []
    sharded = sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler")
    if sharded is not None and hasattr(sharded, "ShardedGradScaler"):
        cls = sharded.ShardedGradScaler
        targets.append((cls, "scale", _wrap_scale(cls.scale)))
    fsdp1 = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp1 is not None and callable(getattr(fsdp1, "FullyShardedDataParallel", None)):
        cls = fsdp1.FullyShardedDataParallel
        targets.append((cls, "clip_grad_norm_", _wrap_fsdp1_clip(cls.clip_grad_norm_)))
    return [t for t in targets if (id(t[0]), t[1]) not in done]


def _apply(targets: list[tuple[Any, str, Any]]) -> None:
    for target, name, wrapper in targets:
        owned = name in vars(target)
        _patches.append(_Patch(target, name, getattr(target, name), wrapper, owned))
        setattr(target, name, wrapper)


def _uninstall() -> None:
    for patch in reversed(_patches):
        current = vars(patch.target).get(patch.name)
        if current is not patch.wrapper:
            logger.warning(
                "stability: %s.%s was replaced by someone else after stability patched it; leaving it alone",
                getattr(patch.target, "__name__", patch.target),
                patch.name,
            )
            continue
        if patch.owned:
            setattr(patch.target, patch.name, patch.original)
        else:
            delattr(patch.target, patch.name)
    _patches.clear()


def _wrap_backward(original: Callable[..., Any], *, tensor_first: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        loss = None
        if depth == 0 and _listeners:
            loss = tensors if tensor_first or isinstance(tensors, torch.Tensor) else _first_tensor(tensors)
            if isinstance(loss, torch.Tensor):
                _notify("before_backward", loss)
        _depth.value = depth + 1
        try:
            result = original(tensors, *args, **kwargs)
        finally:
            _depth.value = depth
        if depth == 0 and _listeners and isinstance(loss, torch.Tensor):
            _notify("on_backward", loss)
        return result

    return backward


def _first_tensor(tensors: Any) -> torch.Tensor | None:
    if isinstance(tensors, (list, tuple)) and tensors and isinstance(tensors[0], torch.Tensor):
        return tensors[0]
    return None


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        result = original(self, outputs)
        if _listeners and isinstance(result, torch.Tensor):
            _notify("on_scale", self, result)
        return result

    return scale


def _wrap_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return original(self, optimizer, *args, **kwargs)
        _notify("before_scaler_step", self, optimizer)
        try:
            result = original(self, optimizer, *args, **kwargs)
        except BaseException:
            _notify("after_scaler_step", self, optimizer, False)
            raise
        _notify("after_scaler_step", self, optimizer, True)
        return result

    return step


def _wrap_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return original(parameters, *args, **kwargs)
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # a generator can be consumed only once
        shared = _norms_once(parameters, args, kwargs)
        _notify("before_clip", parameters, None if shared is None else shared[0])
        if shared is None:
            result = original(parameters, *args, **kwargs)
            _notify("after_clip", parameters, None, result)
            return result
        _norms, total, max_norm, foreach = shared
        assert _clip_with_norm is not None
        _clip_with_norm(parameters, max_norm, total, foreach)
        _notify("after_clip", parameters, (total, float(max_norm)), None)
        return total

    return clip_grad_norm_


_clip_with_norm: Callable[..., None] | None = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
_CLIP_PARAMS = ("max_norm", "norm_type", "error_if_nonfinite", "foreach")


def _norms_once(parameters: torch.Tensor | list[torch.Tensor], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float, bool | None] | None:
    """For the common call (L2 norm, ``error_if_nonfinite=False``, float32 gradients on one device, a torch with
    ``clip_grads_with_norm_``): the per-tensor gradient norms (aligned with ``parameters``, 0 where a gradient is
    None, one fused ``torch._foreach_norm``), their total as ``clip_grad_norm_`` computes it, ``max_norm`` and
    ``foreach``, so the listeners and the clipping share one pass over the gradients. None otherwise (the original
    function then runs as is)."""
    if _clip_with_norm is None or len(args) > len(_CLIP_PARAMS) or any(k not in _CLIP_PARAMS for k in kwargs):
        return None
    bound = dict(zip(_CLIP_PARAMS, args, strict=False))
    if any(k in bound for k in kwargs):
        return None
    bound.update(kwargs)
    if "max_norm" not in bound or bound.get("error_if_nonfinite", False) or float(bound.get("norm_type", 2.0)) != 2.0:
        return None
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    grads = [p.grad for p in params]
    present = [g for g in grads if g is not None]
    if not present:
        return None
    device = present[0].device
    if any(g.dtype != torch.float32 or g.device != device or g.is_sparse for g in present) or stats.is_sharded(present):
        return None  # DTensor shards (FSDP2): torch's own clipping, whose norm is the whole model's
    with torch.no_grad():
        norms = stats.tensor_norms(grads, device)
        total = torch.linalg.vector_norm(norms, 2.0)
    return norms, total, bound["max_norm"], bound.get("foreach")


def _wrap_fsdp1_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    """FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``: listeners measure this rank's gradient shards before
    it, and hear the whole model's norm it returns (it all-reduced them itself)."""
    @functools.wraps(original)
    def clip_grad_norm_(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return original(self, *args, **kwargs)
        parameters = [p for p in self.parameters() if p.requires_grad]
        _notify("before_clip", parameters, None)
        result = original(self, *args, **kwargs)
        _notify("after_clip", parameters, None, result)
        return result

    return clip_grad_norm_


def _wrap_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def zero_grad(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _listeners:
            _notify("before_zero_grad", self)
        return original(self, *args, **kwargs)

    return zero_grad
