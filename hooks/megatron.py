"""Megatron-core integration: read the values Megatron computes itself, one record per optimizer step.

::

    capture = Capture(config, sink).attach(model)                       # or stability.watch(...).capture
    adapter = MegatronAdapter(capture, optimizer, model=model_chunks).attach()
    forward_backward = adapter.wrap_forward_backward(get_forward_backward_func())
    ...train: forward_backward(...); optimizer.step()...
    adapter.close()

With ``import stability.auto`` nothing needs to change: :func:`auto_attach` (registered for ``megatron.core``
in :mod:`stability.hooks.frameworks`) patches ``get_megatron_optimizer`` and
``get_forward_backward_func`` (and ``megatron.training``'s ``train_step`` / ``training_log`` when that package is
importable), so the objects a script creates after the import are wrapped.

What is recorded, and from where (``MegatronOptimizer`` / ``ChainedOptimizer``):

* ``grad_norm``: the second value ``optimizer.step()`` returns, the global L2 norm *before* clipping, all-reduced
  by Megatron over the model-parallel group. A single ``FP32Optimizer`` / ``MixedPrecisionOptimizer`` computes it
  only when ``clip_grad > 0`` (else it returns None / 0.0); then Capture measures the norm itself from the
  gradients (``main_grad``) this rank holds, before the step — a local value that is not reduced over TP/PP.
  Per-layer ``grad_norm/<module>`` always come from this rank's ``main_grad`` buffers.
* ``num_zeros``: the third value (only with ``log_num_zeros_in_grad``).
* ``skipped``: 1 when ``update_successful`` is False (fp16 overflow: Megatron returns ``(False, None, None)``).
* ``loss_scale``: ``optimizer.get_loss_scale()`` before the step, i.e. the scale this step's gradients carry
  (a device tensor, read later without a sync; Megatron backs it off inside ``step()`` on overflow).
* ``lr``: ``param_groups[0]["lr"]`` (the group flagged ``default_config`` when there is one).
* ``loss``: mean over the micro-batches of the loss dicts ``forward_backward_func`` returns (one dict per
  micro-batch, only on the last pipeline stage); a 2-element value ``[sum, count]`` (``pretrain_gpt`` style) is
  read as ``sum / count``; ``tokens`` is the sum of the counts. Values are cloned before anything divides them.
  Other stages record no loss (the tensors their ``backward()`` runs on are activations, not losses).
* coordinates from ``megatron.core.parallel_state`` when it is initialized: ``tp``, ``pp``, ``dp``, ``cp``, ``ep``,
  ``vpp`` and ``*_size``, plus ``pp_last`` (1 on the last pipeline stage).
* with ``megatron.training`` (Megatron-LM's loop): ``params_norm`` and the iteration (as the batch id, which is what
  ``--iterations-to-skip`` takes) from ``training_log``; the step is then completed there.

Return values change between Megatron versions, so every tuple is parsed defensively (:func:`parse_step_result`,
:func:`parse_train_step`, :func:`parse_training_log`); anything unexpected is skipped, never raised.

Versions tested: megatron-core 0.16.1 (torch 2.13.0 CPU, gloo; world size 1, and 2 with pipeline parallelism),
GPTModel with ``get_megatron_optimizer`` (``ChainedOptimizer`` over ``FP32Optimizer``) and
``get_forward_backward_func``. ``megatron.training`` is not on PyPI and was not run; its wrappers follow Megatron-LM
main (2026-08: ``train_step`` returns 8 values, older releases 7) and are tested against those signatures only.

Training-side module: imports torch and :mod:`stability.hooks.capture`; Megatron is imported lazily.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stability.hooks._safety import AdapterErrors
from stability.hooks.capture import Capture

__all__ = [
    "FRAMEWORK",
    "MegatronAdapter",
    "StepResult",
    "auto_attach",
    "install",
    "parallel_coords",
    "parse_loss_dicts",
    "parse_step_result",
    "parse_train_step",
    "parse_training_log",
]

logger = logging.getLogger(__name__)

FRAMEWORK = "megatron"
_Number = float | torch.Tensor
_WRAPPED = "__stability_megatron__"
_Factory = Callable[["_Adapters", Callable[..., Any]], Callable[..., Any]]


# ---------------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What ``MegatronOptimizer.step()`` returned; None where a value is absent."""

    update_successful: bool | None = None
    grad_norm: _Number | None = None
    num_zeros: _Number | None = None


def _number(value: object) -> _Number | None:
    if isinstance(value, torch.Tensor):
        return value.detach() if value.numel() >= 1 else None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _flag(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    return None


def parse_step_result(result: object) -> StepResult:
    """Parse ``optimizer.step()``: ``(update_successful, grad_norm, num_zeros_in_grad)``, a bare bool, or more."""
    if isinstance(result, (tuple, list)):
        items = list(result) + [None] * 3
        return StepResult(update_successful=_flag(items[0]), grad_norm=_number(items[1]), num_zeros=_number(items[2]))
    return StepResult(update_successful=_flag(result))


def parse_train_step(result: object) -> dict[str, Any]:
    """Parse ``megatron.training.training.train_step``'s tuple into named values (missing ones left out).

    Megatron-LM main returns ``(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
    num_zeros_in_grad, max_attention_logit)``; older releases return the first 7, still older ones
    ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``.
    """
    if not isinstance(result, (tuple, list)) or not result or not isinstance(result[0], dict):
        return {}
    out: dict[str, Any] = {"loss_dict": result[0]}
    names: tuple[str, ...]
    if len(result) >= 7:
        names = ("skipped", "should_checkpoint", "should_exit", "exit_code", "grad_norm", "num_zeros", "max_logit")
    else:
        names = ("skipped", "grad_norm", "num_zeros")
    for name, value in zip(names, result[1:], strict=False):
        if value is not None:
            out[name] = value
    return out


_TRAINING_LOG_ARGS = (
    "loss_dict",
    "total_loss_dict",
    "learning_rate",
    "iteration",
    "loss_scale",
    "report_memory_flag",
    "skipped_iter",
    "grad_norm",
    "params_norm",
    "num_zeros_in_grad",
    "max_attention_logit",
)


def parse_training_log(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the arguments of ``training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
    report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit, ...)``."""
    named = dict(zip(_TRAINING_LOG_ARGS, args, strict=False))
    named.update({k: v for k, v in kwargs.items() if k in _TRAINING_LOG_ARGS})
    return named


def parse_loss_dicts(losses: object, key: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-micro-batch losses and token counts from ``forward_backward_func``'s list of dicts (cloned, detached).

    ``key`` picks the entry (default ``"lm loss"``, else the first). A 2-element tensor is ``[sum, count]``.
    """
    values: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    if not isinstance(losses, (list, tuple)):
        return values, counts
    for item in losses:
        if not isinstance(item, dict) or not item:
            continue
        name = key if key in item else ("lm loss" if "lm loss" in item else next(iter(item)))
        raw = item.get(name)
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            values.append(torch.tensor(float(raw)))
            continue
        if not isinstance(raw, torch.Tensor) or raw.numel() == 0 or not raw.is_floating_point():
            continue
        flat = raw.detach().reshape(-1).to(torch.float32)  # .to() copies only when it must: clone below
        if flat.numel() == 2:
            values.append(flat[0] / flat[1].clamp(min=1))  # new tensor
            counts.append(flat[1].clone())
        else:
            values.append(flat.mean())  # new tensor
    return values, counts


def parallel_coords() -> dict[str, int]:
    """This rank's coordinates from ``megatron.core.parallel_state`` ({} when it is not initialized)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not _call(ps, "model_parallel_is_initialized"):
        return {}
    coords: dict[str, int] = {}
    for short, name in (
        ("tp", "tensor_model_parallel"),
        ("pp", "pipeline_model_parallel"),
        ("dp", "data_parallel"),
        ("cp", "context_parallel"),
        ("ep", "expert_model_parallel"),
    ):
        rank, size = _call(ps, f"get_{name}_rank"), _call(ps, f"get_{name}_world_size")
        if isinstance(rank, int) and isinstance(size, int):
            coords[short], coords[f"{short}_size"] = rank, size
    vpp = _call(ps, "get_virtual_pipeline_model_parallel_rank")
    if isinstance(vpp, int):
        coords["vpp"] = vpp
    last = _call(ps, "is_pipeline_last_stage", ignore_virtual=True)
    if isinstance(last, bool):
        coords["pp_last"] = int(last)
    return coords


def _call(module: Any, name: str, **kwargs: Any) -> Any:
    fn = getattr(module, name, None)
    if fn is None:
        return None
    try:
        return fn(**kwargs)
    except Exception:  # not initialized, or a signature from another version
        return None


# ------------------------------------------------------------------------------------------------- adapter


def _modules(model: torch.nn.Module | Sequence[torch.nn.Module] | None) -> torch.nn.Module | None:
    if model is None or isinstance(model, torch.nn.Module):
        return model
    chunks = [m for m in model if isinstance(m, torch.nn.Module)]
    if not chunks:
        return None
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


class MegatronAdapter:
    """Feeds a :class:`Capture` from a Megatron optimizer and ``forward_backward_func``; see the module docstring.

    Args:
        capture: the capture to feed (its own step hooks stop driving steps while attached).
        optimizer: a ``MegatronOptimizer`` (``ChainedOptimizer``, ``FP32Optimizer``, ``DistributedOptimizer``...).
        model: the model chunks (measured per layer); None keeps what the capture found.
        loss_key: which entry of the loss dicts is the loss (default ``"lm loss"``, else the first).
    """

    def __init__(
        self,
        capture: Capture,
        optimizer: Any,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        loss_key: str | None = None,
    ) -> None:
        self.capture = capture
        self.optimizer = optimizer
        self.loss_key = loss_key
        self._model = _modules(model)
        self._original_step: Any = None
        self._attached = False
        self._coords_set = False
        self._framework_norm = _computes_grad_norm(optimizer)
        self.training_loop = False
        """True once ``megatron.training``'s ``train_step`` ran: ``training_log`` then completes each step."""
        self._pending = False
        self._lock = threading.Lock()
        self._errors = AdapterErrors("megatron")

    @property
    def attached(self) -> bool:
        """True between :meth:`attach` and :meth:`close`."""
        return self._attached

    def attach(self) -> MegatronAdapter:
        """Wrap ``optimizer.step`` and hand step boundaries to this adapter. Never raises."""
        if self._attached:
            return self
        try:
            self._original_step = self.optimizer.step
            self.optimizer.step = self._wrapped_step
            inner = getattr(self.optimizer, "optimizer", None)
            self.capture.use_framework(
                FRAMEWORK,
                model=self._model,
                optimizer=inner if isinstance(inner, torch.optim.Optimizer) else None,
                drive_steps=True,
                grad_norm=not self._framework_norm,
                own_loss=False,
            )
            self._attached = True
        except Exception:
            logger.exception("stability: could not attach to the Megatron optimizer (training continues)")
        return self

    def close(self) -> None:
        """Restore ``optimizer.step`` and give step boundaries back to the capture. Idempotent."""
        if not self._attached:
            return
        self._attached = False
        if vars(self.optimizer).get("step") is self._wrapped_step:
            del self.optimizer.step
        self.capture.release_framework(FRAMEWORK)

    def wrap_forward_backward(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a ``forward_backward_func`` so its per-micro-batch losses are recorded (training passes only)."""
        if getattr(func, _WRAPPED, False):
            return func

        @functools.wraps(func)
        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            result = func(*args, **kwargs)
            if self._attached and not kwargs.get("forward_only", False):
                self._on_losses(result)
            return result

        setattr(forward_backward, _WRAPPED, True)
        return forward_backward

    # ------------------------------------------------------------------------------------------ step logic

    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._before_step()
            result = self._original_step(*args, **kwargs)
            self._after_step(result)
        return result

    def _guard(self, where: str, fn: Callable[[], None]) -> None:
        self._errors.run(where, fn)

    def _before_step(self) -> None:
        def run() -> None:
            if self._pending:  # training_log never completed the last step
                self.capture.end_step()
                self._pending = False
            if not self._coords_set:
                coords = parallel_coords()
                if coords:
                    self.capture.set_coords(coords)
                self._coords_set = True
            grads = [_grad_of(p) for p in self.capture.measured_params]
            self.capture.begin_step(grads)
            lr = _lr(self.optimizer)
            if lr is not None:
                self.capture.observe("lr", lr)
            scale = _loss_scale(self.optimizer)  # the scale this step's gradients were computed with
            if scale is not None:
                self.capture.observe("loss_scale", scale)

        self._guard("before_step", run)

    def _after_step(self, result: object) -> None:
        def run() -> None:
            parsed = parse_step_result(result)
            if parsed.grad_norm is not None and self._framework_norm:
                self.capture.observe("grad_norm", parsed.grad_norm)
            if parsed.num_zeros is not None and _logs_zeros(self.optimizer):
                self.capture.observe("num_zeros", parsed.num_zeros)
            skipped = None if parsed.update_successful is None else not parsed.update_successful
            if self.training_loop:
                if skipped is not None:
                    self.capture.observe("skipped", float(skipped))
                self._pending = True
            else:
                self.capture.end_step(skipped=skipped)

        self._guard("after_step", run)

    def _on_losses(self, result: object) -> None:
        def run() -> None:
            values, counts = parse_loss_dicts(result, self.loss_key)
            for value in values:
                self.capture.observe_loss(value)
            if counts:
                self.capture.observe("tokens", torch.stack(counts).sum())

        self._guard("forward_backward", run)

    # ------------------------------------------------------------------------- megatron.training (optional)

    def on_train_step(self, result: object) -> None:
        """``megatron.training.training.train_step`` returned: from now on ``training_log`` completes steps."""
        self.training_loop = True
        parsed = parse_train_step(result)
        skipped = _flag(parsed.get("skipped"))  # Megatron's skipped_iter is a host int (ANDed over the MP group)
        if skipped is not None and self._pending:
            self._guard("train_step", lambda: self.capture.observe("skipped", float(skipped)))

    def on_training_log(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """``training_log`` was called (every iteration, every rank): add its values and complete the step."""

        def run() -> None:
            named = parse_training_log(args, kwargs)
            params_norm = _number(named.get("params_norm"))
            if params_norm is not None:
                self.capture.observe("params_norm", params_norm)
            iteration = named.get("iteration")
            if isinstance(iteration, int):
                self.capture.set_batch(iteration)
            if self._pending:
                self._pending = False
                self.capture.end_step()

        with self._lock:
            self._guard("training_log", run)


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    main = getattr(param, "main_grad", None)
    if isinstance(main, torch.Tensor):
        return main
    return param.grad


def _configs(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chained, (list, tuple)) and chained:
        return [getattr(o, "config", None) for o in chained]
    return [getattr(optimizer, "config", None)]


def _computes_grad_norm(optimizer: Any) -> bool:
    """Does ``optimizer.step()`` return a real grad norm? (ChainedOptimizer: always; others: ``clip_grad > 0``.)"""
    if getattr(optimizer, "chained_optimizers", None) and hasattr(optimizer, "get_grad_norm"):
        return True
    return any(float(getattr(c, "clip_grad", 0.0) or 0.0) > 0.0 for c in _configs(optimizer) if c is not None)


def _logs_zeros(optimizer: Any) -> bool:
    return any(bool(getattr(c, "log_num_zeros_in_grad", False)) for c in _configs(optimizer) if c is not None)


def _lr(optimizer: Any) -> float | torch.Tensor | None:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    group = next((g for g in groups if g.get("default_config", False)), groups[0])
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        return lr.detach().reshape(-1)[:1]
    return float(lr) if isinstance(lr, (int, float)) else None


def _loss_scale(optimizer: Any) -> torch.Tensor | float | None:
    get = getattr(optimizer, "get_loss_scale", None)
    if get is None:
        return None
    scale = get()
    if isinstance(scale, torch.Tensor) and scale.numel() >= 1:
        return scale.detach().reshape(-1)[:1].clone()
    return float(scale) if isinstance(scale, (int, float)) else None


# ------------------------------------------------------------------------------------------------ auto mode


def install(get_capture: Callable[[], Capture | None]) -> Callable[[], None]:
    """Patch Megatron's factories so what a script creates afterwards is recorded.

    Patches ``megatron.core.optimizer.get_megatron_optimizer`` (the returned optimizer gets a
    :class:`MegatronAdapter`), ``get_forward_backward_func`` in ``megatron.core.pipeline_parallel`` and its
    ``schedules`` module (the returned function is wrapped), and, when importable,
    ``megatron.training.training.train_step`` / ``training_log`` (module globals: install before ``pretrain()``).
    Modules not imported yet are imported here. ``get_capture`` returns the capture to feed (None: do nothing).
    Returns a function undoing the patches.
    """
    registry = _Adapters(get_capture)
    undo_core = _patch(registry, _CORE_TARGETS)
    undo_training = _patch(registry, _TRAINING_TARGETS)

    def undo() -> None:
        registry.close()
        undo_training()
        undo_core()

    return undo


def auto_attach(module: Any, capture: Capture) -> Callable[[], None]:
    """Auto mode (``stability.hooks.frameworks`` calls it once ``megatron.core`` is imported).

    Patches the megatron-core factories now, and ``megatron.training``'s loop functions when (if ever) that module
    is imported, without importing it here.
    """
    from stability.hooks import frameworks

    registry = _Adapters(lambda: capture)
    undo_core = _patch(registry, _CORE_TARGETS)
    undo_training: list[Callable[[], None]] = []
    unregister = frameworks.when_imported(
        "megatron.training.training", lambda _m: undo_training.append(_patch(registry, _TRAINING_TARGETS))
    )

    def undo() -> None:
        unregister()
        registry.close()
        for fn in undo_training:
            fn()
        undo_core()

    return undo


def _patch(registry: _Adapters, targets: tuple[tuple[str, str, _Factory], ...]) -> Callable[[], None]:
    patches: list[tuple[Any, str, Any]] = []
    for module_name, attr, make in targets:
        module = _import(module_name)
        original = getattr(module, attr, None) if module is not None else None
        if original is None or getattr(original, _WRAPPED, False):
            continue
        wrapper = functools.wraps(original)(make(registry, original))
        setattr(wrapper, _WRAPPED, True)
        setattr(module, attr, wrapper)
        patches.append((module, attr, original))

    def undo() -> None:
        for module, attr, original in reversed(patches):
            if getattr(getattr(module, attr, None), _WRAPPED, False):
                setattr(module, attr, original)
        patches.clear()

    return undo


class _Adapters:
    """The adapters created by the patched ``get_megatron_optimizer`` (the newest live one gets the values)."""

    def __init__(self, get_capture: Callable[[], Capture | None]) -> None:
        self.get_capture = get_capture
        self.adapters: list[MegatronAdapter] = []

    def current(self) -> MegatronAdapter | None:
        live = [a for a in self.adapters if a.attached]
        return live[-1] if live else None

    def close(self) -> None:
        for adapter in self.adapters:
            adapter.close()
        self.adapters.clear()


def _optimizer_factory(registry: _Adapters, original: Callable[..., Any]) -> Callable[..., Any]:
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        try:
            capture = registry.get_capture()
            if capture is not None:
                model = kwargs.get("model_chunks", args[1] if len(args) > 1 else None)
                registry.adapters.append(MegatronAdapter(capture, optimizer, model=model).attach())
        except Exception:
            logger.exception("stability: could not attach to the Megatron optimizer (training continues)")
        return optimizer

    return get_megatron_optimizer


def _fb_factory(registry: _Adapters, original: Callable[..., Any]) -> Callable[..., Any]:
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return _late_wrap(original(*args, **kwargs), registry.current)

    return get_forward_backward_func


def _train_step_wrapper(registry: _Adapters, original: Callable[..., Any]) -> Callable[..., Any]:
    def train_step(*args: Any, **kwargs: Any) -> Any:
        adapter = registry.current()
        if adapter is not None:
            adapter.training_loop = True  # before the optimizer step inside: training_log completes the record
        result = original(*args, **kwargs)
        adapter = registry.current()
        if adapter is not None:
            adapter.on_train_step(result)
        return result

    return train_step


def _training_log_wrapper(registry: _Adapters, original: Callable[..., Any]) -> Callable[..., Any]:
    def training_log(*args: Any, **kwargs: Any) -> Any:
        adapter = registry.current()
        if adapter is not None:
            adapter.on_training_log(args, kwargs)
        return original(*args, **kwargs)

    return training_log


_CORE_TARGETS: tuple[tuple[str, str, _Factory], ...] = (
    ("megatron.core.optimizer", "get_megatron_optimizer", _optimizer_factory),
    ("megatron.core.pipeline_parallel", "get_forward_backward_func", _fb_factory),
    ("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func", _fb_factory),
)
_TRAINING_TARGETS: tuple[tuple[str, str, _Factory], ...] = (
    ("megatron.training.training", "train_step", _train_step_wrapper),
    ("megatron.training.training", "training_log", _training_log_wrapper),
)


def _late_wrap(func: Callable[..., Any], current: Callable[[], MegatronAdapter | None]) -> Callable[..., Any]:
    """Wrap ``func`` for an adapter that may only exist later (the optimizer is often built after the schedule)."""

    @functools.wraps(func)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        adapter = current()
        if adapter is not None and not kwargs.get("forward_only", False):
            adapter._on_losses(result)
        return result

    setattr(forward_backward, _WRAPPED, True)
    return forward_backward


def _import(name: str) -> Any:
    try:
        import importlib

        return importlib.import_module(name)
    except Exception:  # not installed (megatron.training is not on PyPI), or fails to import
        return None
