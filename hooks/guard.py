"""The guard: let the training loop skip a bad step without a host-device sync, and read the worker's advice.

Opt-in: nothing is guarded unless the loop creates a :class:`Guard` and calls it::

    guard = Guard(GuardConfig())                       # or GuardConfig(run_id=..., redis_url=...) for advice
    for step, batch in enumerate(loader):
        loss = model(batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guard.check(loss, grad_norm, batch=batch_id)   # 0-d bool tensor on the device; no sync
        guard.step(optimizer)                          # the update is applied with factor (1 - skip), on device
        optimizer.zero_grad()
    guard.write_skip_lists("ckpt/")                    # iterations_to_skip.txt (Megatron), skip_batches.json

or, when one sync per step is acceptable, ``if not guard.should_skip(loss, grad_norm): optimizer.step()``.

**Decision** (:meth:`Guard.check`): skip when the loss or the grad norm is NaN/Inf, or when either is a spike:
robust z = (x - median) / (1.4826 MAD) >= ``z_threshold`` (6, OLMo-core's 6 sigma) *and* x / median >=
``ratio`` (1.5, the gate that keeps flat low-noise phases quiet), against the last ``window`` (128) accepted values,
once ``warmup`` values were accepted. The window lives on the device (a NaN-padded ring read with ``nanmedian``);
skipped points never enter it, so a NaN does not poison it (the bug of early OLMo-core versions). After
``max_skips_in_row`` consecutive spike skips the level is taken as the new normal: the window is cleared and the
step is applied (a guard must not freeze a run whose loss legitimately moved; divergence is the worker's job).
Non-finite steps are always skipped. Under ``torch.distributed`` each rank decides on its own values and ONE
``all_reduce(MAX)`` of the per-rank code (0 ok, 1 spike, 2 non-finite) makes every rank take the same decision
(a skip decided on one rank only would let its spike into the others' all-reduced gradients).

**Skipping the update** (:meth:`Guard.step`, :meth:`Guard.wrap`) without a sync, two ways:

* ``torch.optim.Adam`` / ``AdamW`` (the common case): the update is recomputed here with a 0/1 *step factor* f
  on the device, OLMo-core's sync-free approach: ``step += f``, ``m.lerp_(g, (1 - beta1) f)``,
  ``v.lerp_(g^2, (1 - beta2) f)``, ``p -= f lr m_hat / (sqrt(v_hat) + eps)``, weight decay times f; the gradient is
  zeroed where skipped first (a NaN times 0 is still NaN). A skipped step leaves parameters, moments and the step
  count exactly as they were; a taken one matches torch's own AdamW to float rounding. The optimizer's state keeps
  torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so checkpoints stay compatible;
  ``step`` is kept on the parameter's device. The optimizer's step hooks run as usual (so capture still sees the
  step). Cost: two temporaries of a parameter's size at a time, a per-tensor loop instead of torch's foreach/fused
  kernels (measured on the CPU, 3.7M-parameter TinyGPT: check + step 40 ms vs torch AdamW's 30 ms).
* any other optimizer: its own ``step()`` runs, and parameters and state tensors are restored from a snapshot with
  ``torch.where(skip, before, after)``. Exact except for state the optimizer creates on its very first step, but it
  costs a full copy of the parameters *and* the optimizer state every step (3x the parameter memory for Adam-like
  optimizers): fine for small models, too costly at scale; there, skip on the host with :meth:`should_skip`.

The only waits are the ones the user opts into: :meth:`should_skip`, :meth:`skipped` and :meth:`write_skip_lists`
read flags on the host. The skip flags go to the host through one non-blocking copy per step into a pinned ring
(CUDA), and the guard's background thread (started by the first :meth:`Guard.check`) resolves them into the list
of skipped steps every ``RESOLVE_S``.

**Advice**: with ``run_id`` and ``redis_url`` the same thread polls ``keys.advice(run_id)`` (written by the
worker's :class:`~stability.worker.advice.AdviceSink`: the latest error finding's rollback step and batches to
skip); :meth:`Guard.advice` returns the last value read, never touching Redis on the training thread.

Training-side module: stdlib, torch, redis only.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from stability import keys
from stability.errors import ConfigError
from stability.hooks.skip_step import factor_adam_step, snapshot_step
from stability.records import check_run_id

__all__ = [
    "LIGHTNING_FILE",
    "MEGATRON_FILE",
    "Advice",
    "Guard",
    "GuardConfig",
    "GuardedOptimizer",
    "SkippedStep",
]

logger = logging.getLogger(__name__)

MEGATRON_FILE = "iterations_to_skip.txt"
"""Space-separated 1-indexed iterations: ``--iterations-to-skip $(cat iterations_to_skip.txt)``."""
LIGHTNING_FILE = "skip_batches.json"
"""JSON list of batch indices, as Lightning's ``SpikeDetection`` writes it."""

RESOLVE_S = 0.25
"""Seconds between two readings of the skip flags by the guard's background thread."""

_OK, _SPIKE, _NONFINITE = 0.0, 1.0, 2.0
_MAD_TO_SIGMA = 1.4826
_FACTOR_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardConfig:
    """Settings of :class:`Guard`."""

    window: int = 128
    """Accepted values (per signal) the robust baseline is computed from."""
    z_threshold: float = 6.0
    """Robust z (median / MAD) at or above which a value is a spike."""
    ratio: float = 1.5
    """A spike must also be at least this many times the median (1 disables the gate)."""
    warmup: int = 32
    """Accepted values needed before spikes are judged (non-finite values are always skipped)."""
    max_skips_in_row: int = 8
    """After this many consecutive spike skips the baseline restarts and the step is applied (0: never)."""
    rel_sigma_floor: float = 1e-3
    """The robust sigma is at least this fraction of the median (flat signals)."""
    all_reduce: bool = True
    """Agree across ranks with one ``all_reduce(MAX)`` when ``torch.distributed`` is initialized."""
    run_id: str | None = None
    """Training run whose advice to poll (with ``redis_url``)."""
    redis_url: str | None = None
    """Redis the worker writes advice to; None: no advice."""
    poll_s: float = 2.0
    """Seconds between background polls (advice and skip flags)."""
    ring: int = 4096
    """Skip flags in flight to the host; older unresolved ones are dropped (and counted) beyond it."""

    def __post_init__(self) -> None:
        if self.window < 4:
            raise ConfigError(f"window must be >= 4, got {self.window}")
        if not 0 <= self.warmup <= self.window:
            raise ConfigError(f"warmup must be in [0, window={self.window}], got {self.warmup}")
        if not self.z_threshold > 0:
            raise ConfigError(f"z_threshold must be > 0, got {self.z_threshold}")
        if not self.ratio >= 1:
            raise ConfigError(f"ratio must be >= 1, got {self.ratio}")
        if self.max_skips_in_row < 0:
            raise ConfigError(f"max_skips_in_row must be >= 0, got {self.max_skips_in_row}")
        if not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0, got {self.poll_s}")
        if self.ring < 16:
            raise ConfigError(f"ring must be >= 16, got {self.ring}")
        if self.run_id is not None:
            check_run_id(self.run_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class SkippedStep:
    """One step the guard skipped."""

    step: int
    """0-based optimizer step (Megatron iteration ``step + 1``)."""
    batch: str | None
    """Batch identity given to :meth:`Guard.check` (None: not given)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Advice:
    """The worker's latest advice for the run (from its latest error finding)."""

    step: int
    kind: str
    rank: int
    message: str
    rollback_step: int | None
    """Last step before the earliest precursor: the checkpoint to roll back to."""
    skip_batches: tuple[str, ...]
    """Batch identities to skip when replaying from ``rollback_step``."""
    causes: tuple[str, ...] = ()
    """Ranked cause ids, best first."""
    updated: float = 0.0
    """Wall time the worker wrote it."""

    @classmethod
    def from_json(cls, raw: bytes | str) -> Advice:
        """Parse the JSON the worker stores (unknown fields are ignored)."""
        data = json.loads(raw)
        rollback = data.get("rollback_step")
        return cls(
            step=int(data["step"]),
            kind=str(data["kind"]),
            rank=int(data.get("rank", 0)),
            message=str(data.get("message", "")),
            rollback_step=int(rollback) if rollback is not None else None,
            skip_batches=tuple(str(b) for b in data.get("skip_batches", ())),
            causes=tuple(str(c) for c in data.get("causes", ())),
            updated=float(data.get("updated", 0.0)),
        )


class _RunInfo(Protocol):
    """What :meth:`Guard.for_handle` needs of a watch handle."""

    @property
    def run_id(self) -> str: ...
    @property
    def redis_url(self) -> str | None: ...


@dataclass(slots=True)
class _Baseline:
    """Device state of the detector: a NaN-padded ring per signal (loss, grad norm) and counters."""

    values: torch.Tensor
    """(2, window) float32, NaN where empty."""
    slots: torch.Tensor
    """(window,) int64: 0..window-1."""
    pos: torch.Tensor
    """Next slot to write (int64)."""
    count: torch.Tensor
    """Accepted values in the ring (int64, capped at window)."""
    streak: torch.Tensor
    """Consecutive spike skips (int64)."""


@dataclass(slots=True)
class _Flags:
    """Skip flags on their way to the host: a ring of host slots, and what each pending slot stands for."""

    host: torch.Tensor
    pending: deque[tuple[int, int, str | None, Any]] = field(default_factory=deque)
    """(slot, step, batch, cuda event or None)."""
    calls: int = 0
    dropped: int = 0


class Guard:
    """Decide on the device whether to skip a step, skip it without a sync, record it; see the module docstring.

    Args:
        config: thresholds, distributed agreement and where the worker's advice is (all optional).
    """

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self._state: _Baseline | None = None
        self._flags: _Flags | None = None
        self._last: torch.Tensor | None = None
        self._step = 0
        self._lock = threading.Lock()
        self._resolving = threading.Lock()
        self._skipped: list[SkippedStep] = []
        self._advice: Advice | None = None
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.config.run_id is not None and self.config.redis_url is not None:
            self._start_thread()  # else started by the first check()

    @classmethod
    def for_handle(cls, handle: _RunInfo, config: GuardConfig | None = None) -> Guard:
        """A guard polling the advice of ``handle``'s run (a :class:`stability.Handle` from ``watch``)."""
        base = config or GuardConfig()
        values = {f: getattr(base, f) for f in GuardConfig.__dataclass_fields__}
        values["run_id"] = base.run_id or handle.run_id
        values["redis_url"] = base.redis_url or handle.redis_url
        return cls(GuardConfig(**values))

    # -- deciding ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def check(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
        *,
        step: int | None = None,
        batch: str | int | None = None,
    ) -> torch.Tensor:
        """Whether to skip this step: a 0-d bool tensor on ``loss``'s device; never reads a value on the host.

        Call once per optimizer step, after backward (and clipping, whose return value is the grad norm).

        Args:
            loss: this step's loss (a tensor with several elements is averaged).
            grad_norm: the global gradient norm before clipping, if known.
            step: 0-based optimizer step (default: one more than the last one).
            batch: identity of the step's batch, for the skip lists (default: none; the step is used).
        """
        if step is not None:
            self._step = step
        try:
            skip = self._decide(loss, grad_norm)
        except Exception as exc:  # fail open: a broken guard must not stop or stall training
            self._warn_once(f"check:{type(exc).__name__}", f"Guard.check failed ({type(exc).__name__}: {exc}); "
                            "the step is not skipped")  # fmt: skip
            skip = torch.zeros((), dtype=torch.bool, device=loss.device)
        self._last = skip
        self._stage(skip, self._step, None if batch is None else str(batch))
        self._step += 1
        return skip

    def _decide(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        device = loss.device
        norm = _scalar(grad_norm).to(device, non_blocking=True) if grad_norm is not None else _nan_like(loss)
        x = torch.stack([_scalar(loss), norm])
        state = self._state if self._state is not None else self._init_state(device)
        finite = torch.isfinite(x[0]) if grad_norm is None else torch.isfinite(x).all()
        code = torch.where(finite, self._spike(state, x).to(x.dtype), torch.full_like(x[0], _NONFINITE))
        return self._update(state, x, self._agree(code))

    def should_skip(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
        *,
        step: int | None = None,
        batch: str | int | None = None,
    ) -> bool:
        """:meth:`check`, read on the host: ONE device sync per call (the opt-in, syncing form)."""
        return bool(self.check(loss, grad_norm, step=step, batch=batch).item())

    def _init_state(self, device: torch.device) -> _Baseline:
        w = self.config.window
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self._state = _Baseline(
            values=torch.full((2, w), math.nan, dtype=torch.float32, device=device),
            slots=torch.arange(w, device=device),
            pos=zero.clone(),
            count=zero.clone(),
            streak=zero.clone(),
        )
        return self._state

    def _spike(self, state: _Baseline, x: torch.Tensor) -> torch.Tensor:
        """True when the loss or the grad norm is a spike against the baseline (0-d bool)."""
        cfg = self.config
        med = torch.nanmedian(state.values, dim=1).values
        mad = torch.nanmedian((state.values - med[:, None]).abs(), dim=1).values
        sigma = torch.maximum(_MAD_TO_SIGMA * mad, cfg.rel_sigma_floor * med.abs() + 1e-12)
        z = (x - med) / sigma
        spike = (z >= cfg.z_threshold) & (x >= cfg.ratio * med)  # NaN median (no baseline) compares False
        return spike.any() & (state.count >= max(cfg.warmup, 2))

    def _agree(self, code: torch.Tensor) -> torch.Tensor:
        """MAX of the per-rank codes over all ranks (one all-reduce), when distributed."""
        if not self.config.all_reduce:
            return code
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return code
        code = code.clone()
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return code

    def _update(self, state: _Baseline, x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Apply the agreed code to the baseline; return the final skip flag."""
        spike = code == _SPIKE
        streak = (state.streak + 1) * spike
        skip = code > _OK
        if self.config.max_skips_in_row:
            restart = streak > self.config.max_skips_in_row
            skip = skip & ~restart
            streak = torch.where(restart, torch.zeros_like(streak), streak)
            state.values.masked_fill_(restart, math.nan)
            state.pos.masked_fill_(restart, 0)
            state.count.masked_fill_(restart, 0)
        state.streak.copy_(streak)
        accept = ~skip
        write = (state.slots == state.pos) & accept
        state.values.copy_(torch.where(write, x[:, None], state.values))
        state.pos.copy_((state.pos + accept.long()) % self.config.window)
        state.count.copy_(torch.clamp(state.count + accept.long(), max=self.config.window))
        return skip

    # -- skipping ----------------------------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``optimizer``'s step with the last :meth:`check`'s decision applied on the device (no sync).

        Without a :meth:`check` since the last step, the step is taken normally.
        """
        skip, self._last = self._last, None
        if skip is None:
            self._warn_once("nocheck", "Guard.step() without Guard.check() since the last step: step taken")
            return optimizer.step() if closure is None else optimizer.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if type(optimizer) in _FACTOR_OPTIMIZERS and not _group_flag(optimizer, "differentiable"):
            update = functools.partial(factor_adam_step, skip=skip)
            torch.optim.Optimizer.profile_hook_step(update)(optimizer)  # runs the step hooks around the update
            optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler checks
        else:
            self._warn_once(
                type(optimizer).__name__,
                f"Guard.step({type(optimizer).__name__}): snapshot-and-restore skip, costs a copy of the parameters "
                "and optimizer state per step (only Adam/AdamW get the copy-free step factor)",
            )
            snapshot_step(optimizer, skip)
        return loss

    def wrap(self, optimizer: torch.optim.Optimizer) -> GuardedOptimizer:
        """``optimizer`` whose ``step()`` goes through :meth:`step`; every other attribute is the optimizer's."""
        return GuardedOptimizer(self, optimizer)

    # -- recording ---------------------------------------------------------------------------------------------

    def _stage(self, skip: torch.Tensor, step: int, batch: str | None) -> None:
        """Start the flag's copy to the host (non-blocking on CUDA) and queue it for the resolver."""
        flags = self._flags
        if flags is None:
            pin = skip.device.type == "cuda"
            flags = self._flags = _Flags(host=torch.zeros(self.config.ring, dtype=torch.bool, pin_memory=pin))
        slot = flags.calls % self.config.ring
        flags.calls += 1
        event = None
        flags.host[slot].copy_(skip, non_blocking=skip.device.type == "cuda")
        if skip.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        if self._thread is None:
            self._start_thread()
        with self._lock:
            if len(flags.pending) >= self.config.ring:
                flags.pending.popleft()
                flags.dropped += 1
            flags.pending.append((slot, step, batch, event))

    def _resolve(self) -> None:
        """Read the pending flags (waits for their copies: background thread, or a user call that asked).

        The wait happens outside the lock :meth:`_stage` takes, so the training thread never waits for it.
        """
        flags = self._flags
        if flags is None:
            return
        with self._resolving:
            while True:
                with self._lock:
                    if not flags.pending:
                        return
                    entry = flags.pending[0]
                slot, step, batch, event = entry
                if event is not None:
                    event.synchronize()
                skipped = bool(flags.host[slot])
                with self._lock:
                    if flags.pending and flags.pending[0] is entry:  # else dropped meanwhile (ring overflow)
                        flags.pending.popleft()
                        if skipped:
                            self._skipped.append(SkippedStep(step=step, batch=batch))

    def skipped(self) -> list[SkippedStep]:
        """Every step skipped so far, in order (waits for the latest flags: call it outside the hot loop)."""
        self._resolve()
        with self._lock:
            return list(self._skipped)

    @property
    def dropped(self) -> int:
        """Skip flags lost because more than ``config.ring`` were waiting to be read."""
        return self._flags.dropped if self._flags is not None else 0

    def write_skip_lists(self, directory: str | Path) -> dict[str, Path]:
        """Write the skipped steps as ``iterations_to_skip.txt`` (Megatron) and ``skip_batches.json`` (Lightning).

        Entries already in the files (an earlier segment of the run) are kept. Megatron: 1-indexed iterations
        (step + 1), space separated, for ``--iterations-to-skip $(cat iterations_to_skip.txt)``. Lightning: a JSON
        list of batch indices (the batch given to :meth:`check`, else the step). Call it on one rank.

        Returns:
            ``{"megatron": path, "lightning": path}``.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        skipped = self.skipped()
        megatron, lightning = out / MEGATRON_FILE, out / LIGHTNING_FILE
        iterations = set(_read_ints(megatron)) | {s.step + 1 for s in skipped}
        _atomic_write(megatron, " ".join(str(i) for i in sorted(iterations)) + "\n")
        batches = _read_json_list(lightning)
        for s in skipped:
            ident = _batch_index(s.batch if s.batch is not None else str(s.step))
            if ident not in batches:
                batches.append(ident)
        _atomic_write(lightning, json.dumps(batches, indent=2) + "\n")
        return {"megatron": megatron, "lightning": lightning}

    # -- advice ------------------------------------------------------------------------------------------------

    def advice(self) -> Advice | None:
        """The worker's latest advice read by the background thread (None: none yet, or no Redis configured)."""
        return self._advice

    def _start_thread(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._background, name="stability-guard", daemon=True)
            self._thread.start()

    def _background(self) -> None:
        """Resolve skip flags every ``RESOLVE_S``; poll the advice every ``poll_s`` when Redis is configured."""
        poller = _AdvicePoller(self.config) if self.config.redis_url and self.config.run_id else None
        next_poll = 0.0
        try:
            while not self._stop.is_set():
                if poller is not None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self.config.poll_s
                    self._advice = poller.poll() or self._advice
                try:
                    self._resolve()
                except Exception as exc:
                    self._warn_once("resolve", f"guard: reading skip flags failed ({type(exc).__name__}: {exc})")
                self._stop.wait(min(RESOLVE_S, self.config.poll_s))
        finally:
            if poller is not None:
                poller.close()

    def poll_now(self) -> Advice | None:
        """Read the advice once, on the calling thread (for scripts and tests; not for the training loop)."""
        if self.config.redis_url is None or self.config.run_id is None:
            return None
        poller = _AdvicePoller(self.config)
        try:
            self._advice = poller.poll() or self._advice
        finally:
            poller.close()
        return self._advice

    def close(self) -> None:
        """Stop the background thread and resolve the last flags."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._resolve()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("stability: %s", message)


class _AdvicePoller:
    """Reads ``keys.advice(run_id)`` with short timeouts and no retries (background thread only)."""

    def __init__(self, config: GuardConfig) -> None:
        assert config.redis_url is not None and config.run_id is not None
        self._url = config.redis_url
        self._key = keys.advice(config.run_id)
        self._client: Any = None  # made on the first poll: a Redis Cluster client contacts a node when made
        self._failing = False

    def _connect(self) -> Any:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from stability.redis_url import connect  # redis:// or redis+cluster://

        return connect(self._url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))

    def poll(self) -> Advice | None:
        """The stored advice (None: none stored, or Redis unreachable: logged once per outage)."""
        try:
            if self._client is None:
                self._client = self._connect()
            raw: Any = self._client.get(self._key)
            advice = Advice.from_json(raw) if raw is not None else None
        except Exception as exc:
            if not self._failing:
                logger.warning("stability guard: cannot read advice (%s: %s)", type(exc).__name__, exc)
            self._failing = True
            return None
        self._failing = False
        return advice

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class GuardedOptimizer:
    """An optimizer whose ``step()`` applies the guard's last decision (see :meth:`Guard.wrap`)."""

    def __init__(self, guard: Guard, optimizer: torch.optim.Optimizer) -> None:
        self.guard = guard
        self.optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """:meth:`Guard.step` on the wrapped optimizer."""
        return self.guard.step(self.optimizer, closure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


# -- device helpers ----------------------------------------------------------------------------------------------


def _scalar(value: torch.Tensor) -> torch.Tensor:
    t = value.detach()
    if t.numel() != 1:
        t = t.float().mean()
    return t.reshape(()).to(torch.float32)


def _nan_like(ref: torch.Tensor) -> torch.Tensor:
    return torch.full((), math.nan, dtype=torch.float32, device=ref.device)


def _group_flag(optimizer: torch.optim.Optimizer, name: str) -> bool:
    return any(bool(g.get(name, False)) for g in optimizer.param_groups)


def _batch_index(batch: str) -> int | str:
    try:
        return int(batch)
    except ValueError:
        return batch


def _read_ints(path: Path) -> Iterable[int]:
    if not path.exists():
        return []
    return [int(tok) for tok in path.read_text().split() if tok.strip().lstrip("-").isdigit()]


def _read_json_list(path: Path) -> list[int | str]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text() or "[]")
    except json.JSONDecodeError:
        logger.warning("stability: %s is not JSON; rewriting it", path)
        return []
    return [x for x in data if isinstance(x, (int, str))] if isinstance(data, list) else []


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{time.monotonic_ns()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
