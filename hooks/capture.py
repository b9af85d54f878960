"""Capture: instrument a plain PyTorch training loop and produce one :class:`StepRecord` per optimizer step.

::

    capture = Capture(WatchConfig(run_id="r1"), sink).attach()        # auto: find model and optimizer
    capture = Capture(config, sink).attach(model, optimizer)           # explicit
    ...train...
    capture.close()                                                   # removes every hook and patch, flushes

What is recorded (names as in :mod:`stability.records`):

* every step: ``loss`` and ``micro_batches`` (see *The loss rule* below), ``lr`` (``param_groups[0]``; none
  without an optimizer), ``grad_norm`` (global L2 norm before clipping) and ``nonfinite_grads``; with a
  ``GradScaler`` also ``loss_scale`` and ``skipped``; ``grad_norm/<module>`` every ``config.layer_every`` steps;
* every ``config.stats_every`` steps: ``param_norm/<module>``, ``update_ratio/<module>`` (‖Δw‖/‖w before the step‖,
  when the parameters fit ``config.update_ratio_max_bytes``), ``adam_v_ratio/<module>`` (Σg² / Σv̂ of the module's
  parameters with an ``exp_avg_sq`` state, v̂ = Adam's bias-corrected second moment *before* the step: ~1 when
  steady, ≫ 1 when v lags the gradient; omitted before a parameter's second step), ``act_absmax/<module>`` and
  ``act_rms/<module>`` for up to ``config.max_act_modules`` parameter-owning modules (forward hooks registered for
  that step only, and only forward passes with grad enabled count, so evaluation passes are ignored), and
  ``logit_z`` when the model output has a ``.logits`` attribute or a ``"logits"`` key;
* whatever the loop passes to :meth:`Capture.observe`.

Steps are 0-based: the first optimizer step is record step 0, and :attr:`Capture.step` counts the steps seen.
A step ``GradScaler`` skipped is a step too (``skipped=1``).

The loss rule: ``micro_batches`` is the number of tensors ``backward()`` was called on in the step (a loss scaled
by ``GradScaler.scale`` is divided by the scale again). With one, ``loss`` is its mean. With several (gradient
accumulation), ``loss`` is their **sum**: scripts that accumulate divide each micro-batch loss by the number of
micro-batches before ``backward()`` (nanoGPT, HF ``Trainer``, Lightning), so the sum is the step's true mean loss,
where a mean would read true_loss / N. Losses passed by a framework adapter (:meth:`Capture.observe_loss`) are not
divided: ``loss`` is their mean, and ``micro_batches`` their count. ``observe("loss", ...)`` overrides both rules.
Losses backpropagated just before an *ignored* optimizer steps were for it (a GAN: ``errG.backward();
optimizerG.step()`` between two discriminator steps) and are left out of the tracked step's loss; the record then
carries ``objectives`` (1 + such optimizers): its loss is one side of a game, whose slow rises are not divergence.

Loops without an optimizer (hand-written updates such as pytorch/examples ``word_language_model``): until an
optimizer steps, step boundaries are inferred from the ``backward()`` / ``clip_grad_norm_`` / ``zero_grad()`` /
gradient-reset rhythm (rules in :mod:`stability.hooks.rhythm`), the model is the module whose parameters received
gradients, gradients are measured before clipping or before ``zero_grad()`` clears them (or after each
``backward()`` when the loop clears them itself), parameter snapshots for update ratios are taken after a sampled
step's first ``backward()``, and there is no ``lr`` unless the loop passes it (``observe("lr", lr)``). The first
step of such a loop has no update ratio (it ends before the loop is known to have no optimizer). When steps end
at the next ``backward()``, the forward pass, activations, logits and ``set_batch`` seen after a step's last
``backward()`` belong to the next step (activation hooks go on a step early). :meth:`close` records the last
step. An optimizer that steps later takes over the boundaries. The capture logs once what it found (INFO with
an optimizer; WARNING without one, which names what it cannot see), and warns when
:data:`~stability.hooks.rhythm.BLIND_AFTER` ``backward()`` calls passed with nothing recorded.

Auto mode (``attach()``): ``torch.Tensor.backward``/``torch.autograd.backward`` are patched for the loss (see
:mod:`stability.hooks.torch_patches`); global optimizer step hooks follow the *first* optimizer that steps. Other
optimizers (rules in :mod:`stability.hooks.following`): one over the same parameters replaces it (a loop that
creates its optimizer again each epoch); those stepping right after it on the same gradients (no ``backward()``
between) join its record; one that steps :data:`~stability.hooks.following.HANDOVER_STEPS` times in a row on its
own losses while the tracked one does not starts a new phase (:meth:`Capture._new_phase`); the rest are ignored
(logged once). ``step(closure)`` is one step whose loss and gradients are the closure's first call's
(:meth:`Capture._closure_step`). Global module forward hooks (:mod:`stability.hooks.discovery`), active only until
that first step, note the outermost modules that ran forward, and those holding the optimizer's parameters are the
model (a ``torch.compile`` wrapper's ``_orig_mod.`` prefix is dropped from names). In auto mode the first step
therefore has no activation statistics. In a forked child the capture is off until the child trains (Hogwild:
forked processes train a shared model); then, with the session's sink, the child is recorded as a rank of its own
(:meth:`Capture._adopt_fork`). Explicit mode registers hooks on the given objects only.

Hot path: hooks never read a device value on the host. Statistics are computed on the device with fused ops
(:mod:`stability.hooks.stats`) and copied to the host once per step without blocking
(:mod:`stability.hooks.staging`); a reader thread builds the records. Every hook body is guarded: an exception is
counted, logged once per hook with its traceback and never reaches the training loop; after
:data:`MAX_ERRORS` errors the capture turns itself off with one warning. Under ``torch.compile`` tracing the hooks
do nothing.

Extension API for framework adapters (``stability.hooks.deepspeed``, ``.hf``, ``.megatron``, ``.lightning``):

* ``capture.use_framework(name, model=..., optimizer=..., drive_steps=..., grad_norm=..., param_stats=...)``
  declares that adapter ``name`` feeds this capture (:meth:`Capture.release_framework` undoes it). ``model`` becomes
  the measured model (all its parameters, per module). ``drive_steps=True``: the optimizer step hooks (and the
  ``GradScaler.step`` patch) no longer begin or end steps; the adapter calls :meth:`Capture.begin_step` when the
  step's gradients are final (before clipping / the optimizer step) and :meth:`Capture.end_step` after the step,
  also when the framework skipped it (DeepSpeed / Megatron fp16 overflow: ``optimizer.step()`` never runs).
  ``grad_norm=False``: the framework computes the global grad norm (and observes it), so Capture makes no
  global grad-norm / ``nonfinite_grads`` pass of its own; per-layer ``grad_norm/<module>`` are still measured on
  ``layer_every`` steps from ``param.grad`` or from the gradients the adapter passes to ``begin_step(grads)``
  (aligned with :attr:`Capture.measured_params`, ``None`` entries count as zero), which is how ZeRO-2/3 adapters
  supply ``safe_get_full_grad`` results on sampled steps only. ``param_stats=False``: no ``param_norm`` /
  ``update_ratio`` / ``adam_v_ratio`` (parameters that are partitioned outside forward, e.g. ZeRO-3).
* ``capture.observe(name, value)``: values observed for a step **win** over Capture's own values of the same
  name (``grad_norm``, ``loss_scale``, ``skipped``, ``lr``, ``loss``, ``tokens``, ``samples`` ...). Tensors stay on
  the device; the reader thread converts them.
* ``capture.observe_loss(tensor)``: one micro-batch loss computed by the framework (unscaled, not divided by the
  accumulation steps); when a step has any, the step's ``loss`` is their mean and the losses seen by the
  ``backward()`` patch for that step are ignored.
* ``capture.end_step(skipped=...)``: ``skipped`` may be a bool, a float or a device tensor (0/1).
* ``capture.begin_step(grads, layers=False)``: no per-layer gradient norms this step (gradients not available).
* ``use_framework(..., loss_divided=False)``: the tensors a torch-style ``loss.backward()`` runs on are *not* divided
  by the accumulation steps (DeepSpeed scales gradients itself): ``loss`` is their mean, not their sum.
* ``use_framework(..., own_loss=False)``: the ``backward()`` patch never supplies ``loss`` (Megatron's pipeline
  stages call ``backward()`` on activations); only :meth:`Capture.observe_loss` / ``observe("loss", ...)`` do.
* ``capture.set_coords({"dp": 1, "dp_size": 2, ...})``: parallel coordinates added to every later record.
* ``with hook_scope(): ...``: adapter code running on the training thread marks itself as hook code, so the tests'
  host-sync trap (``in_hook()``) covers it too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from stability._children import child_ordinal
from stability.config import WatchConfig
from stability.errors import RecordError
from stability.hooks import stats, torch_patches
from stability.hooks.discovery import Discovery
from stability.hooks.following import HANDOVER_STEPS as HANDOVER_STEPS  # re-exported: tests and scripts use it
from stability.hooks.following import Following, Role, closure_of, with_closure
from stability.hooks.layout import ParamLayout, build_layout, optimizer_params
from stability.hooks.measure import Measure, device_of
from stability.hooks.rhythm import BLIND_AFTER, Rhythm, model_params
from stability.hooks.schedules import every
from stability.hooks.staging import Reader, RecordSink, StagedStep, stage
from stability.hooks.step_state import StepState, forward_tail, observed_win
from stability.hooks.timing import Performance
from stability.records import FORK, MAX_ID_CHARS, MAX_NAME_CHARS, SHARDED

__all__ = ["MAX_ERRORS", "PENDING_LIMIT", "Capture", "RecordSink", "hook_scope", "in_hook"]

logger = logging.getLogger(__name__)

MAX_ERRORS = 20
"""After this many caught hook errors the capture disables itself."""
PENDING_LIMIT = 1024
"""Staged steps waiting for the reader thread before the oldest is dropped."""
_TRUE = frozenset({"1", "true", "yes", "on"})

_P = ParamSpec("_P")
_hook_state = threading.local()


def in_hook() -> bool:
    """True while stability hook code runs on the current thread (tests use it to forbid host syncs there)."""
    return bool(getattr(_hook_state, "active", False))


@contextlib.contextmanager
def hook_scope() -> Iterator[None]:
    """Mark framework-adapter code as stability hook code on this thread (:func:`in_hook` is True inside)."""
    previous = in_hook()
    _hook_state.active = True
    try:
        yield
    finally:
        _hook_state.active = previous


_HookTargets = tuple[tuple[tuple[str, torch.nn.Module], ...], tuple[torch.nn.Module, ...]]
"""The (name, module) pairs given activation hooks and the roots given the model-output hook."""

_COMPILE_CHECK: Callable[[], bool] | None = getattr(torch.compiler, "is_compiling", None)
"""Looked up once: every hook call asks it."""


def _is_compiling() -> bool:
    return _COMPILE_CHECK is not None and bool(_COMPILE_CHECK())


def _before_fork(ref: weakref.ref[Capture]) -> None:
    """``os.fork`` in the capturing process: count it (the child's ordinal) and, when the sink can serve forked
    children, start its session now: a Hogwild child connects to the Redis this process's session publishes."""
    capture = ref()
    if capture is None or not capture._live():
        return
    capture._forks += 1
    prepare = getattr(capture._sink, "prepare_fork", None)
    if callable(prepare) and hasattr(capture._sink, "fork_child") and not _forked_by_dataloader():
        try:
            prepare()
        except Exception as exc:  # a fork must never fail because of us
            logger.info("stability: could not start the session before a fork (%s: %s)", type(exc).__name__, exc)


def _forked_by_dataloader() -> bool:
    """Whether this fork starts a ``DataLoader`` worker (it never trains: no reason to start the session for it, or
    to import the session's modules on the training thread)."""
    frame = sys._getframe(1)
    while frame is not None:
        if "utils/data/dataloader" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _forked_child(ref: weakref.ref[Capture]) -> None:
    """``os.fork`` child: the capture's reader, watchdog and session threads are gone, so it turns off there until
    the child trains (:meth:`Capture._adopt_fork`: a Hogwild child is recorded as a rank of its own)."""
    capture = ref()
    if capture is not None and capture._live():
        capture._forked, capture._disabled = True, True
        capture._fork_ordinal = capture._forks


FORK_EXIT_FLUSH_S = 5.0
"""At a recorded forked child's exit, its records get at most this long to reach Redis ..."""
FORK_OPEN_WAIT_S = 60.0
"""... once its session is open, which it waits for at most this long (a child that ends while the parent's
embedded Redis is still starting must not lose its records)."""


def _close_at_child_exit(capture: Capture) -> None:
    """Flush a recorded forked child's records when it exits: a ``multiprocessing`` child ends with ``os._exit``
    after running its finalizers (atexit is skipped there); a bare ``os.fork`` child that returns runs atexit."""
    import atexit
    import multiprocessing.util

    done = threading.Event()

    def close() -> None:
        if not done.is_set():
            done.set()
            try:
                capture._close_forked(FORK_EXIT_FLUSH_S, FORK_OPEN_WAIT_S)
            except Exception as exc:  # never keep the child alive because the close failed
                logger.warning("stability: close of forked child %d failed (%s: %s)", os.getpid(),
                               type(exc).__name__, exc)

    multiprocessing.util.Finalize(None, close, exitpriority=100)
    atexit.register(close)


def _hook(method: Callable[Concatenate[Capture, _P], None]) -> Callable[Concatenate[Capture, _P], None]:
    """Run a hook body only while the capture is live; catch, count and log every exception."""

    def guarded(self: Capture, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        if not self._live() or _is_compiling():
            if self._forked and not self._fork_said:
                self._adopt_fork()
            if not self._live() or _is_compiling():
                return
        previous = in_hook()
        _hook_state.active = True
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self._record_error(exc, method.__name__)
        finally:
            _hook_state.active = previous

    functools.update_wrapper(guarded, method)
    return guarded


class Capture:
    """Training-side capture for one process; see the module docstring for what it records.

    Args:
        config: what to capture (``layer_every``, ``stats_every``, ``max_act_modules``, ...).
        sink: where records go (the transport's ``Emitter``, or :class:`stability.testing.ListSink`).
        rank: this process's rank (default: ``torch.distributed``, else ``RANK``, else 0).
        coords: parallel coordinates to add to every record (``dp``, ``tp``, ``pp``, ...).
    """

    def __init__(
        self,
        config: WatchConfig,
        sink: RecordSink,
        *,
        rank: int | None = None,
        coords: Mapping[str, int] | None = None,
    ) -> None:
        self.config = config
        self._sink = sink
        self._rank_arg = rank
        self._coords_arg = dict(coords or {})
        self._layer_due = every(config.layer_every)
        self._stats_due = every(config.stats_every)
        self._state = StepState()
        self._step = 0
        self._errors = 0
        self._error_sites: set[str] = set()
        self._error_lock = threading.Lock()
        self._attached = False
        self._closed = False
        self._disabled = False
        self._reader: Reader | None = None
        self._handles: list[RemovableHandle] = []
        self._discovery = Discovery()
        """Auto mode: the global forward hooks that find the model (hooks/discovery.py)."""
        self._step_hooks: list[RemovableHandle] = []
        self._step_hook_targets: _HookTargets | None = None
        """The (name, module) pairs and the roots ``_step_hooks`` were registered for."""
        self._roots: list[torch.nn.Module] = []
        self._follow = Following()
        """Which optimizer is tracked and what each optimizer step is to the records (hooks/following.py)."""
        self._layout: ParamLayout | None = None
        self._layout_has_optimizer = False
        self._scaled: tuple[weakref.ref[torch.Tensor], Any] | None = None
        self._scaler_call: tuple[Any, torch.optim.Optimizer, int] | None = None
        self._closure: Callable[..., Any] | None = None
        """The wrapped closure :meth:`_step_pre_hook` hands to the step in progress."""
        self._rediscover = False
        """After a new phase's first step the layout is built again, once the forward hooks saw its model."""
        self._forked = False
        """This is a forked child of the process that attached (the capture is off in it until it trains)."""
        self._fork_said = False
        self._forks = 0
        """``os.fork`` calls made by this process since attach (a forked child's ordinal is the count at its fork)."""
        self._fork_ordinal = 0
        self._meta: tuple[int, dict[str, int], str] | None = None
        self._framework: str | None = None
        self._drive_steps = False
        self._rhythm = Rhythm()
        self._backward_calls = 0
        self._warned_blind = False
        self._perf = Performance(config.run_id, config.resolved_run_dir, config.redis_url, self._emit_host,
                                 lambda: self._metadata()[0], enabled=config.timing)  # hooks/timing.py
        self._measure = Measure(self._layer_due, self._stats_due, config.update_ratio_max_bytes)
        """The step's statistics on the device and what they keep between steps (hooks/measure.py)."""

    # ----------------------------------------------------------------------------------------------- public API

    @property
    def step(self) -> int:
        """Number of optimizer steps observed so far (the next record's step)."""
        return self._step

    @property
    def errors(self) -> int:
        """Exceptions caught in hooks (and in the reader thread) so far."""
        return self._errors

    @property
    def dropped(self) -> int:
        """Steps lost because the reader fell behind, plus records the sink refused."""
        return self._reader.dropped if self._reader is not None else 0

    @property
    def attached(self) -> bool:
        """True between a successful :meth:`attach` and :meth:`close`."""
        return self._attached and not self._closed

    def attach(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> Capture:
        """Start capturing; ``model``/``optimizer`` None means discover them (auto mode).

        Does nothing when ``config.enabled`` is False or ``STABILITY_DISABLE`` is set, or when already attached.

        Returns:
            self, for ``capture = Capture(...).attach()``.
        """
        if self._attached or self._closed:
            logger.warning("stability: Capture.attach() called twice (or after close); ignored")
            return self
        if not self.config.enabled or os.environ.get("STABILITY_DISABLE", "").strip().lower() in _TRUE:
            logger.info("stability: capture disabled; nothing attached")
            return self
        self._reader = Reader(self._sink, self._record_error, PENDING_LIMIT)
        torch_patches.subscribe(self)
        self._attached = True
        if hasattr(os, "register_at_fork"):
            me = weakref.ref(self)
            os.register_at_fork(before=lambda: _before_fork(me), after_in_child=lambda: _forked_child(me))
        self._follow.start(optimizer)
        if optimizer is None:
            self._handles.append(register_optimizer_step_pre_hook(self._step_pre_hook))
            self._handles.append(register_optimizer_step_post_hook(self._on_post_step))
        else:
            self._handles.append(optimizer.register_step_pre_hook(self._step_pre_hook))
            self._handles.append(optimizer.register_step_post_hook(self._on_post_step))
        if model is None:
            self._discover()
        else:
            self._roots = [model]
            self._arm_step_hooks()
            self._perf.hooked.append(id(model))
            self._handles.append(model.register_forward_pre_hook(self._on_model_forward))
        return self

    def observe(self, name: str, value: torch.Tensor | float) -> None:
        """Add signal ``name`` to the current step. A tensor stays on its device (read later, no sync).

        A tensor with several elements is reduced to its maximum. Bad input is counted as an error, never raised.
        """
        self._observe(name, value)

    def set_batch(self, batch_id: str | int) -> None:
        """Record the identity of the current step's batch (for replay and skip lists)."""
        self._set_batch(batch_id)

    # ------------------------------------------------------------------ extension API for framework adapters

    @property
    def framework(self) -> str | None:
        """Name of the adapter feeding this capture (see :meth:`use_framework`), or None."""
        return self._framework

    @property
    def measured_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients are measured, in the order :meth:`begin_step` expects ``grads``."""
        self._ensure_layout(None)
        return list(self._layout.params) if self._layout is not None else []

    def use_framework(
        self,
        name: str,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        drive_steps: bool = False,
        grad_norm: bool = True,
        param_stats: bool = True,
        own_loss: bool = True,
        loss_divided: bool = True,
    ) -> None:
        """Let framework adapter ``name`` feed this capture; see the module docstring. Never raises."""
        self._measure.own_loss = own_loss
        self._measure.loss_divided = loss_divided
        self._use_framework(name, model, optimizer, drive_steps, grad_norm, param_stats)

    def release_framework(self, name: str) -> None:
        """Undo :meth:`use_framework` for adapter ``name`` (the optimizer step hooks drive steps again)."""
        if self._framework == name:
            self._framework = None
            self._drive_steps = False
            self._measure.own_grad_norm = True
            self._measure.param_stats = True
            self._measure.own_loss = True
            self._measure.loss_divided = True

    def begin_step(self, grads: Sequence[torch.Tensor | None] | None = None, *, layers: bool = True) -> None:
        """The current step's gradients are final: measure them (``grads`` aligned with :attr:`measured_params`,
        default ``param.grad``; ``layers=False``: no per-layer norms this step) and snapshot parameters on sampled
        steps. No host sync; never raises."""
        self._begin_external(grads, layers)

    def set_coords(self, coords: Mapping[str, int]) -> None:
        """Add parallel coordinates (``dp``, ``tp``, ``pp``, ``dp_size``, ...) to every later record."""
        self._coords_arg.update({str(k): int(v) for k, v in coords.items()})
        self._meta = None

    def end_step(self, *, skipped: bool | float | torch.Tensor | None = None) -> None:
        """Complete the current step (only with ``drive_steps=True``): sampled stats, loss, record. Never raises."""
        self._end_external(skipped)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch loss computed by the framework (a tensor, kept on the device). Never raises."""
        self._observe_loss(loss)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every completed step has been handed to the sink (at most ``timeout`` seconds)."""
        if self._reader is not None and not self._reader.flush(timeout):
            logger.warning("stability: capture flush timed out after %.1f s", timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Remove every hook and patch, then flush; idempotent. The step in progress, if any, is not recorded,
        except in a loop without an optimizer, whose last step has no later boundary: it is recorded if it had a
        ``backward()``."""
        if self._closed:
            return
        self._close_pending()
        self._closed = True
        if self._attached:
            torch_patches.unsubscribe(self)
        self._perf.close()
        self._discovery.stop()
        for handle in (*self._handles, *self._step_hooks):
            handle.remove()
        self._handles, self._step_hooks = [], []
        self._step_hook_targets = None
        if self._reader is not None and not self._reader.close(timeout):
            logger.warning("stability: capture closed with records still pending after %.1f s", timeout)
        self._release()

    def _release(self) -> None:
        """Drop every reference to the user's objects: the model, the optimizers, the parameters, their snapshot
        copy (one more copy of the weights on the device), the step's tensors. A capture sits in reference cycles
        (its bound methods are held by its reader and timing helpers), so whatever it held lived on until the
        garbage collector ran, after the user had let go of the model."""
        self._roots = []
        self._layout, self._layout_has_optimizer = None, False
        self._step_hook_targets = None
        self._state = StepState()
        self._scaled = self._scaler_call = None
        self._closure = None
        self._follow.release()
        self._measure.release()

    def __enter__(self) -> Capture:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- patch listener hooks

    @_hook
    def on_backward(self, tensor: torch.Tensor) -> None:
        """``backward()`` returned for ``tensor``: keep it (detached, on device) as a loss of this step."""
        if self._state.closure_done:  # a later call of a step(closure): a trial point, not the step's loss
            return
        loss = tensor.detach()
        scaled = self._scaled
        if scaled is not None and scaled[0]() is tensor:
            scale = getattr(scaled[1], "_scale", None)
            if isinstance(scale, torch.Tensor):
                loss = loss.to(torch.float32) / scale.to(loss.device, non_blocking=True)
            self._state.scaler = scaled[1]
        self._state.losses.append(loss.to(torch.float32).mean())  # a new tensor: later in-place edits don't leak
        if self._manual():
            self._after_manual_backward()

    @_hook
    def before_backward(self, tensor: torch.Tensor) -> None:
        """A ``backward()`` starts: with no optimizer, the step in progress may have ended (rhythm rules)."""
        if self._follow.finishing:  # a co-stepping optimizer did not step this time
            self._end_costep()
        self._backward_calls += 1
        self._perf.timing.backward()
        if not self._manual():
            if self._backward_calls == BLIND_AFTER and self._step == 0:
                logger.warning(
                    "stability: nothing recorded after %d backward() calls: %s",
                    BLIND_AFTER,
                    f"adapter {self._framework} never ended a step" if self._framework is not None
                    else f"{type(self._follow.optimizer).__name__}.step() never completed",
                )
            return
        rhythm = self._rhythm
        if rhythm.blind():
            self._go_blind()
            return
        reason = rhythm.boundary_at_backward()
        if reason is not None:
            self._close_manual(reason, grads_intact=reason == "update")

    @_hook
    def before_zero_grad(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()`` starts: with no optimizer, it ends the step in progress (gradients intact)."""
        if self._manual() and self._rhythm.boundary_at_zero_grad(module):
            self._close_manual("zero_grad", grads_intact=True)

    @_hook
    def after_clip(self, parameters: torch.Tensor | Sequence[torch.Tensor],
                   clipped: tuple[torch.Tensor, float] | None = None, total: torch.Tensor | None = None) -> None:
        """``clip_grad_norm_`` returned: the measured norms, scaled like the gradients, are those of the clipped
        gradients (for Adam's statistic on sampled steps); with no optimizer, the update comes next. With sharded
        parameters the norm the clip returned (the whole model's) replaces this rank's shard's as ``grad_norm``."""
        if self._state.clip_measured:
            self._measure.clipped(self._state, self._step, clipped)
        if total is not None and self._layout is not None and self._layout.sharded:
            self._measure.whole_grad_norm(self._state, total)
        if self._manual():
            self._rhythm.after_clip()

    @_hook
    def _close_pending(self) -> None:
        if self._follow.finishing:
            self._end_costep()
        if self._manual() and self._rhythm.confirmed and self._rhythm.backwards > 0:
            self._close_manual("close", grads_intact=True)

    @_hook
    def on_scale(self, scaler: Any, output: torch.Tensor) -> None:
        """``GradScaler.scale`` returned ``output``: remember it to unscale the loss at ``backward()``."""
        self._scaled = (weakref.ref(output), scaler)

    @_hook
    def before_clip(self, parameters: torch.Tensor | Sequence[torch.Tensor], norms: torch.Tensor | None = None) -> None:
        """Measure the gradients before ``clip_grad_norm_`` changes them; ``norms`` (per-tensor L2 norms of
        ``parameters``' gradients, computed once by the patch, which clips with them) are reused when they cover
        the measured parameters."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self._ensure_layout(params)
        layout = self._layout
        if layout is not None and not self._state.grads_measured:
            shared = None if norms is None else self._measure.clip_norms(layout, params, norms)
            self._measure_grads(norms=shared)
            # the clip scales exactly these gradients by one factor only when it covered the measured ones
            self._state.clip_measured = shared is not None

    @_hook
    def before_scaler_step(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.step`` starts: remember it, to tell a skipped step from a taken one."""
        self._scaler_call = (scaler, optimizer, self._step)

    @_hook
    def after_scaler_step(self, scaler: Any, optimizer: torch.optim.Optimizer, completed: bool) -> None:
        """``GradScaler.step`` returned; if no optimizer step happened inside, record a skipped step."""
        call, self._scaler_call = self._scaler_call, None
        if self._drive_steps:
            return
        if not completed or call is None or call[2] != self._step or not getattr(scaler, "_enabled", False):
            return
        if not self._adopt(optimizer):
            return
        self._state.scaler = scaler
        self._begin_step(optimizer)
        self._finish_step(optimizer, skipped=1.0)

    # ------------------------------------------------------------------------------------------- torch hooks

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any],
                       ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The optimizer pre-step hook: :meth:`_on_pre_step`; a tracked ``step(closure)`` gets its closure wrapped
        (torch passes the hook's returned arguments to ``step``) so the step begins after the closure's first
        call, which is the loss and gradient at the step's starting point (see :meth:`_closure_step`)."""
        self._on_pre_step(optimizer, args, kwargs)
        closure, self._closure = self._closure, None
        if closure is None:
            return None
        return with_closure(optimizer, args, kwargs, closure)

    @_hook
    def _on_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._drive_steps:
            return
        follow = self._follow
        if optimizer is follow.optimizer and follow.finishing:
            self._end_costep()  # a co-stepping optimizer skipped this step
        role = follow.pre_step(optimizer, self._backward_calls, self._rhythm.confirmed)
        if role is Role.JOINED:  # its parameters are measured from the next step on
            self._layout, self._layout_has_optimizer = None, False
        elif role is Role.PHASE:
            self._new_phase(optimizer)
        if role is Role.OURS or role is Role.PHASE:
            follow.stepping = True
            closure = closure_of(optimizer, args, kwargs)
            if callable(closure):
                self._closure = self._closure_step(optimizer, closure)
            else:
                self._begin_step(optimizer)
        elif role is Role.OTHER and self._state.losses:  # backpropagated since the tracked step: its loss (a GAN's G)
            self._state.losses.clear()
            self._state.objectives += 1

    def _closure_step(self, optimizer: torch.optim.Optimizer, closure: Callable[..., Any]) -> Callable[..., Any]:
        """``closure``, wrapped: after its first call the step begins (gradients measured, parameters snapshotted,
        which the optimizer has not changed yet), and the losses, activations and logits of its later calls (LBFGS
        evaluates up to ``max_iter`` trial points per step) are left out. The step's loss is thus the one
        ``LBFGS.step`` returns. A closure the optimizer never calls: the step begins at the post-step hook."""
        state = self._state
        state.closure = True

        def closure_seen_by_stability(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            if state is self._state and not state.closure_done:
                self._after_first_closure(optimizer, state)
            return result

        return closure_seen_by_stability

    @_hook
    def _after_first_closure(self, optimizer: torch.optim.Optimizer, state: StepState) -> None:
        state.closure_done = True
        self._begin_step(optimizer)

    @_hook
    def _on_post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        follow = self._follow
        if not self._drive_steps and optimizer is follow.optimizer:
            follow.stepping = False
            state = self._state
            if state.closure and not state.closure_done:
                state.closure_done = True
                self._begin_step(optimizer)
            if not follow.wait_for_costeps(self._backward_calls):
                self._finish_step(optimizer, skipped=None)
        elif follow.last_costep(optimizer):
            self._end_costep()

    def _end_costep(self) -> None:
        """The tracked step's record ends (every co-stepping optimizer stepped, or the next step began)."""
        self._follow.finishing = False
        self._finish_step(self._follow.optimizer, skipped=None)

    @_hook
    def _on_any_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._discovery.enter(module)

    @_hook
    def _on_any_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._discovery.leave()

    @_hook
    def _on_model_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._perf.timing.forward(args)

    def _emit_host(self, step: int, signals: dict[str, float]) -> None:
        """Send a record of host signals only (the watchdog's ``hang_s``; any thread)."""
        if self._reader is not None and self._live():
            rank, coords, host = self._metadata()
            self._reader.submit(StagedStep(run_id=self.config.run_id, step=step, rank=rank, wall_time=time.time(),
                                           host=host, coords=coords, batch=None, host_signals=dict(signals)))

    @_hook
    def _on_activation(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self._state.closure_done:
            x = stats.first_float_tensor(output)
            if x is not None:
                self._state.acts.setdefault(name, []).append(stats.activation_stats(x))

    @_hook
    def _on_model_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self._state.closure_done:
            logits = stats.logits_of(output)
            if logits is not None:
                self._state.logit_z.append(stats.logit_z(logits))

    @_hook
    def _observe(self, name: str, value: torch.Tensor | float) -> None:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise RecordError(f"observe(): signal name {name!r} is invalid (1-{MAX_NAME_CHARS} printable chars)")
        if isinstance(value, torch.Tensor):
            flat = value.detach().reshape(-1)
            if flat.numel() == 0:
                raise RecordError(f"observe({name!r}): the tensor is empty")
            kept = flat.amax(keepdim=True) if flat.numel() > 1 else flat.clone()
            self._state.observed.append((name, kept))
            self._state.observed_host.pop(name, None)
        else:
            self._state.observed_host[name] = float(value)
            self._state.observed = [(n, t) for n, t in self._state.observed if n != name]

    @_hook
    def _set_batch(self, batch_id: str | int) -> None:
        batch = str(batch_id)[:MAX_ID_CHARS]
        if self._manual() and self._rhythm.backwards > 0:  # may be the next step's (see _close_manual)
            self._state.next_batch = batch
        else:
            self._state.batch = batch

    @_hook
    def _use_framework(
        self,
        name: str,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        drive_steps: bool,
        grad_norm: bool,
        param_stats: bool,
    ) -> None:
        if self._framework not in (None, name):
            logger.info("stability: adapter %s replaces adapter %s", name, self._framework)
        self._framework = name
        self._drive_steps = drive_steps
        self._measure.own_grad_norm = grad_norm
        self._measure.param_stats = param_stats
        if optimizer is not None or model is not None:
            # an optimizer adopted before (e.g. stepped during framework setup) is dropped
            self._follow.optimizer = optimizer
        if model is not None:
            self._roots = [model]
            self._layout = None
            self._layout_has_optimizer = False
            self._ensure_layout(None)
            self._arm_step_hooks()

    @_hook
    def _begin_external(self, grads: Sequence[torch.Tensor | None] | None, layers: bool) -> None:
        self._ensure_layout(None)
        layout, state = self._layout, self._state
        if layout is None:
            return
        if not state.grads_measured:
            if grads is not None and len(grads) != len(layout.params):
                raise RecordError(f"begin_step(): {len(grads)} gradients for {len(layout.params)} parameters")
            self._measure_grads(None if grads is None else list(grads), layers=layers)
        if self._measure.param_stats:
            self._measure.snapshot_if_due(layout, state, self._step)

    @_hook
    def _end_external(self, skipped: bool | float | torch.Tensor | None) -> None:
        if not self._drive_steps:
            raise RecordError("end_step() needs use_framework(..., drive_steps=True)")
        if isinstance(skipped, torch.Tensor):
            self._state.observed.append(("skipped", skipped.detach().reshape(-1)[:1].to(torch.float32)))
        elif skipped is not None:
            self._state.observed_host["skipped"] = float(skipped)
        self._finish_step(self._follow.optimizer, skipped=None)

    @_hook
    def _observe_loss(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            raise RecordError(f"observe_loss(): expected a non-empty tensor, got {type(loss).__name__}")
        self._state.framework_losses.append(loss.detach().to(torch.float32).mean())

    # -------------------------------------------------------------------------------------------- step logic

    def _adopt_fork(self) -> None:
        """The first hook in a forked child (Hogwild: it trains; a DataLoader worker never reaches a hook). With a
        sink that serves forked children (:meth:`stability.session.LazySession.fork_child`) the child is recorded
        as a rank of its own, ``rank + world * ordinal`` with the coordinate ``fork=<ordinal>`` (its own cross-rank
        group: Hogwild processes are not replicas, their gradients differ by design), through its own reader and
        emitter, flushed when the child exits. Otherwise the capture stays off and says so once."""
        self._fork_said = True
        make = getattr(self._sink, "fork_child", None)
        if make is None or self._errors >= MAX_ERRORS:
            self._say_forked()
            return
        try:
            rank, coords, _host = self._metadata()
            ordinal = max(1, self._fork_ordinal)
            rank += max(1, coords.get("world_size", 1)) * ordinal
            sink = make(rank)
        except Exception as exc:
            self._record_error(exc, "_adopt_fork")
            self._say_forked()
            return
        self._sink = sink
        self._rank_arg = rank
        self._coords_arg[FORK] = ordinal
        self._meta = None
        self._reader = Reader(sink, self._record_error, PENDING_LIMIT)
        self._disabled = False
        self._forked = False
        _close_at_child_exit(self)
        logger.info("stability: process %d, forked from the captured process (Hogwild), is recorded as rank %d",
                    os.getpid(), rank)

    def _close_forked(self, flush_s: float, open_s: float) -> None:
        """Exit of a forked child that was recorded: its records reach Redis (``flush_s`` once its session is
        open, which takes at most ``open_s``); the run's end is the parent's to record."""
        self.close(timeout=flush_s)
        close = getattr(self._sink, "close", None)
        if callable(close):
            close(timeout=open_s, wait_drained=False, flush_s=flush_s)

    def _say_forked(self) -> None:
        """Once, in a forked child that trains but cannot be recorded (its sink serves no forked children)."""
        self._fork_said = True
        logger.warning("stability: process %d, forked from the captured process, trains but is not captured: the "
                       "capture's threads do not survive fork (Hogwild-style training); only the parent's steps "
                       "are recorded", os.getpid())

    def _live(self) -> bool:
        return self._attached and not self._closed and not self._disabled

    def _manual(self) -> bool:
        """True while step boundaries come from the backward rhythm: no optimizer stepped, no adapter drives."""
        return self._follow.optimizer is None and self._framework is None

    def _after_manual_backward(self) -> None:
        rhythm = self._rhythm
        if not rhythm.params and not rhythm.confirmed and rhythm.backwards == 0 and self._step == 0:
            modules = list(self._roots) or self._discovery.modules()
            rhythm.watch(model_params(modules))
        rhythm.after_backward()
        state = self._state
        state.forward_marks = ({n: len(v) for n, v in state.acts.items()}, len(state.logit_z))
        if not rhythm.confirmed or self._layout is None:
            return
        if rhythm.eager:
            self._measure_grads()
        self._measure.snapshot_if_due(self._layout, state, self._step)

    def _close_manual(self, reason: str, *, grads_intact: bool) -> None:
        """End the step in progress of a loop without an optimizer (see :mod:`stability.hooks.rhythm`)."""
        rhythm, state = self._rhythm, self._state
        if not rhythm.confirmed:
            rhythm.confirmed = True
            if rhythm.params:
                self._ensure_layout(rhythm.params)
            self._announce(None, reason)
        if reason == "reset" and not state.grads_measured and rhythm.params:
            rhythm.eager = True  # the loop clears gradients itself: measure after every backward() from now on
            logger.info("stability: gradients are cleared by the loop itself; measuring them after each backward()")
        if grads_intact and not state.grads_measured and self._layout is not None:
            self._measure_grads()
        rhythm.step_closed()
        carried: tuple[dict[str, list[stats.ActStat]], list[torch.Tensor]] = ({}, [])
        next_batch = None
        if reason not in ("zero_grad", "close"):  # ends at the next backward(): the next forward already ran
            rhythm.late = True
            carried = forward_tail(state)
            next_batch, state.next_batch = state.next_batch, None
        self._finish_step(None, skipped=None)
        self._state.acts, self._state.logit_z = carried
        self._state.batch = next_batch

    def _go_blind(self) -> None:
        """No step boundary in :data:`BLIND_AFTER` backward() calls: drop them; each backward() is a step now."""
        rhythm = self._rhythm
        rhythm.per_backward = True
        rhythm.eager = bool(rhythm.params)
        rhythm.step_closed()
        self._state = StepState(batch=self._state.batch)
        if not self._warned_blind:
            self._warned_blind = True
            logger.warning(
                "stability: nothing recorded after %d backward() calls: no optimizer stepped and no step boundary "
                "was visible (no zero_grad(), clip_grad_norm_() or gradient reset stability can see); they were "
                "dropped and from now on each backward() is recorded as one step",
                BLIND_AFTER,
            )
        if not rhythm.confirmed:
            rhythm.confirmed = True
            if rhythm.params:
                self._ensure_layout(rhythm.params)
            self._announce(None, "backward")

    def _announce(self, optimizer: torch.optim.Optimizer | None, boundary: str = "") -> None:
        """Say once per mode what the capture can and cannot see."""
        layout = self._layout
        if layout is None or not layout.params:
            logger.warning(
                "stability: capturing loss only: no module whose parameters received gradients was found (raw "
                "tensors?), so no gradient or parameter statistics; %s",
                f"steps from {type(optimizer).__name__}.step()" if optimizer is not None
                else "no optimizer seen: each backward() is one step; no lr (pass it with handle.observe('lr', lr))",
            )
            return
        model = ", ".join(type(r).__name__ for r in self._roots) or "(not found)"
        numel = sum(p.numel() for p in layout.params)
        size = f"{numel / 1e6:.1f}M" if numel >= 100_000 else f"{numel / 1e3:.1f}k"
        own = self._measure.own_grad_norm
        seen = ["loss", "grad_norm" if own else "", "nonfinite_grads" if own else ""]
        if self.config.layer_every:
            seen.append("per-layer grads")
        if self.config.stats_every and self._measure.param_stats:
            seen.append(f"param norms / update ratios every {self.config.stats_every} steps")
        if optimizer is not None:
            seen.insert(1, "lr")
            tail = f"steps from {type(optimizer).__name__}.step()"
        else:
            tail = (
                "no optimizer seen: step boundaries from the backward/zero_grad/clip rhythm (first boundary: "
                f"{boundary}), micro-batch losses summed; no lr (pass it with handle.observe('lr', lr))"
            )
        # without an optimizer the capture sees less (no lr, inferred boundaries): said at WARNING, shown by default
        logger.log(
            logging.INFO if optimizer is not None else logging.WARNING,
            "stability: capturing model %s (%d modules, %s params): %s; %s",
            model, len(layout.modules), size, ", ".join(x for x in seen if x), tail,
        )

    def _adopt(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if ``optimizer``'s step is the tracked step (see :meth:`Following.adopt`); a new phase starts when it
        just took over."""
        role = self._follow.adopt(optimizer, self._rhythm.confirmed)
        if role is Role.PHASE:
            self._new_phase(optimizer)
        return role is not Role.OTHER

    def _new_phase(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` took over (:data:`~stability.hooks.following.HANDOVER_STEPS` steps in a row while the
        tracked one did not): a new training phase. The layout is rebuilt over its parameters, and the phase's
        first record carries ``phase_start`` (the detectors re-baseline: another objective's loss is not a spike).
        When its parameters are not the model's, the model is found again from the next step's forward passes."""
        self._layout, self._layout_has_optimizer, self._measure.snapshot_buffers = None, False, None
        self._state.objectives = 1
        self._state.host["phase_start"] = 1.0
        owned = {id(p) for root in self._roots for p in root.parameters()}
        if any(id(p) not in owned for p in optimizer_params(optimizer)) and not self._discovery.active:
            self._roots = []  # its model is elsewhere: found again from the next step's forward passes
            self._rediscover = True
            self._discover()

    def _begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """At the optimizer pre-step: gradient statistics (unless taken at clipping), lr, parameter snapshot."""
        self._ensure_layout(None)
        state = self._state
        if not state.grads_measured:
            self._measure_grads()
        if not state.lr_recorded:
            state.lr_recorded = True
            lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
            if isinstance(lr, torch.Tensor):
                state.parts.append((["lr"], lr.detach().reshape(-1)[:1]))
            elif isinstance(lr, (int, float)):
                state.host["lr"] = float(lr)
        if self._layout is not None:
            self._measure.snapshot_if_due(self._layout, state, self._step)

    def _ensure_layout(self, params: list[torch.Tensor] | None) -> None:
        """Find the model (auto mode) and group the measured parameters by module, once."""
        optimizer = self._follow.optimizer
        if self._layout is not None and (self._layout_has_optimizer or optimizer is None):
            return
        wanted = optimizer_params(optimizer, *self._follow.co) if optimizer is not None else params
        if not self._roots:
            self._roots = self._discovery.roots({id(p) for p in wanted or []})
        previous = self._layout
        self._layout = build_layout(self._roots, wanted)
        self._layout_has_optimizer = optimizer is not None
        if self._layout.sharded and not self._coords_arg.get(SHARDED):  # FSDP: the norms are this rank's shard's
            self._coords_arg[SHARDED] = 1
            self._meta = None
            torch_patches.refresh()  # FSDP1's clip_grad_norm_ when FSDP was imported after us
        snapshot = self._state.snapshot
        if previous is not None and snapshot is not None and (
            len(snapshot.buffers) != len(self._layout.params)
            or any(a is not b for a, b in zip(previous.params, self._layout.params, strict=False))
        ):
            self._state.snapshot = None  # taken for another parameter list
        if self._rediscover:  # a new phase's first step: its model's forward passes are still to be seen
            return
        self._discovery.stop()
        if optimizer is not None:
            self._announce(optimizer)

    def _discover(self) -> None:
        """Auto mode: note the outermost modules running forward until the model is known (hooks/discovery.py)."""
        self._discovery.start(self._on_any_forward_pre, self._on_any_forward)

    def _device(self) -> torch.device:
        return device_of(self._layout)

    def _measure_grads(self, given: list[torch.Tensor | None] | None = None, *, layers: bool = True,
                       norms: torch.Tensor | None = None) -> None:
        """The step's gradient statistics (:meth:`Measure.grads`)."""
        layout = self._layout
        assert layout is not None
        self._measure.grads(layout, self._state, self._step, given, layers=layers, norms=norms)

    def _finish_step(self, optimizer: torch.optim.Optimizer | None, skipped: float | None) -> None:
        """Complete the step: sampled statistics, loss, scaler signals; stage the record; prepare the next step."""
        state, step = self._state, self._step
        self._follow.step_ended(self._backward_calls)
        if self._rediscover:  # the new phase's first step used the parameters without their modules
            self._rediscover = self._layout_has_optimizer = False
        try:
            if self._stats_due(step) and self._layout is not None:
                self._measure.sampled(self._layout, state, step, optimizer, self._follow.co)
            self._measure.loss_and_scaler(self._layout, state, optimizer, skipped, self._scaler_call)
            state.host.update(self._perf.end_step(step, self._device(), state.observed_host))
            self._submit(state, step)
        finally:
            self._step = step + 1
            self._state = StepState()
            self._arm_step_hooks()
            for root in self._roots:  # data / compute timing: a forward pre-hook on the model, once
                if id(root) not in self._perf.hooked:
                    self._perf.hooked.append(id(root))
                    self._handles.append(root.register_forward_pre_hook(self._on_model_forward))

    def _submit(self, state: StepState, step: int) -> None:
        assert self._reader is not None
        state.parts[:0] = state.grad_parts
        observed_win(state)
        rank, coords, host = self._metadata()
        staged = StagedStep(
            run_id=self.config.run_id,
            step=step,
            rank=rank,
            wall_time=time.time(),
            host=host,
            coords=coords,
            batch=state.batch if state.batch is not None else state.next_batch,
            host_signals=state.host,
        )
        stage(state.parts, staged)
        self._reader.submit(staged)

    def _arm_step_hooks(self) -> None:
        """Hook the activation modules (and the model's output) if the coming step is sampled, else unhook them.

        Hooks already on the same modules stay (with ``stats_every=1`` every step is sampled: removing and
        registering ~30 hooks per step was a measurable part of a step's hook time)."""
        due = self._stats_due(self._step)
        if self._manual() and self._rhythm.late:  # the next step's forward runs before this step ends
            due = due or self._stats_due(self._step + 1)
        due = due and self._live() and bool(self._roots)
        wanted: list[tuple[str, torch.nn.Module]] = []
        if due:
            layout = self._layout or build_layout(self._roots, None)
            wanted = layout.activation_modules(self.config.max_act_modules)
        targets = (tuple(wanted), tuple(self._roots))  # modules compare by identity
        if due and self._step_hook_targets is not None and targets == self._step_hook_targets:
            return
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks, self._step_hook_targets = [], None
        if not due:
            return
        for name, module in wanted:
            self._step_hooks.append(module.register_forward_hook(functools.partial(self._on_activation, name)))
        for root in self._roots:
            self._step_hooks.append(root.register_forward_hook(self._on_model_output))
        self._step_hook_targets = targets

    def _metadata(self) -> tuple[int, dict[str, int], str]:
        if self._meta is None:
            self._meta = (*_rank_and_coords(self._rank_arg, self._coords_arg, spawned=not self._forked),
                          socket.gethostname())
        return self._meta

    def _record_error(self, exc: BaseException, where: str) -> None:
        with self._error_lock:
            self._errors += 1
            count = self._errors
            first = where not in self._error_sites
            self._error_sites.add(where)
        if first:
            logger.error("stability: error in hook %s (training continues)", where, exc_info=exc)
        else:
            logger.debug("stability: error in hook %s: %r", where, exc)
        if count >= MAX_ERRORS and not self._disabled:
            self._disabled = True
            logger.warning("stability: %d errors in capture hooks; capture disabled for the rest of the run", count)
            try:  # no steps are recorded any more: the watchdog would report a hang
                self._perf.close()
            except Exception:
                logger.debug("stability: stopping the watchdog failed", exc_info=True)


def _rank_and_coords(rank: int | None, extra: Mapping[str, int], *, spawned: bool = True) -> tuple[int, dict[str, int]]:
    """Rank and coordinates from ``torch.distributed`` when initialized, else ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``,
    else (``spawned``: not a capture inherited by ``os.fork``, whose rank :meth:`Capture._adopt_fork` derives) the
    ordinal of a ``multiprocessing`` child (:func:`~stability._children.child_ordinal`)."""
    coords: dict[str, int] = {}
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        found_rank = dist.get_rank()
        coords["world_size"] = dist.get_world_size()
    else:
        found_rank = _env_int("RANK", 0)
        world = _env_int("WORLD_SIZE", -1)
        if world >= 1:
            coords["world_size"] = world
        ordinal = child_ordinal() if rank is None and spawned else None
        if ordinal is not None:  # a multiprocessing child training on its own (Hogwild started with spawn)
            found_rank, coords[FORK] = ordinal, ordinal
    local = _env_int("LOCAL_RANK", -1)
    if local >= 0:
        coords["local_rank"] = local
    coords.update(extra)
    return (found_rank if rank is None else rank), coords


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
