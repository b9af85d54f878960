"""A step's statistics on the device: gradient and parameter norms, update ratios, Adam's v ratio, activations, loss.

:class:`Measure` computes what a record carries about the measured parameters (a
:class:`~stability.hooks.layout.ParamLayout`) into the step's :class:`~stability.hooks.step_state.StepState`, and
keeps what carries over from one step to the next: the snapshot buffers (allocated once, reused on every sampled
step), the parameter norms after the last sampled update (the next snapshot's ``‖w before‖``) and the order that maps
``clip_grad_norm_``'s norms onto the layout. The capture decides *when* (which hook, which step is sampled); this
module decides *how*. Everything stays on the device: nothing here reads a value on the host.

``own_grad_norm`` / ``param_stats`` are the capture's ``use_framework(grad_norm=..., param_stats=...)``: with a
framework computing the global norm, only per-module gradient norms are measured; with parameters partitioned
outside forward (ZeRO-3), no parameter statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stability.hooks import stats
from stability.hooks.layout import ParamLayout
from stability.hooks.schedules import Schedule
from stability.hooks.staging import ABSENT
from stability.hooks.step_state import Snapshot, StepState, Unchanged

__all__ = ["Measure", "activation_stats", "adam_state", "device_of", "found_inf"]


def device_of(layout: ParamLayout | None) -> torch.device:
    """Where the measured parameters live (their statistics are computed there); CPU without any."""
    if layout is not None and layout.params:
        return layout.params[0].device
    return torch.device("cpu")


class Measure:
    """The capture's on-device statistics and the state they keep between steps."""

    __slots__ = ("_clip_order", "_layer_due", "_max_bytes", "_param_sq_norms", "_stats_due", "loss_divided",
                 "own_grad_norm", "own_loss", "param_stats", "snapshot_buffers")

    def __init__(self, layer_due: Schedule, stats_due: Schedule, max_bytes: int) -> None:
        self._layer_due = layer_due
        self._stats_due = stats_due
        self._max_bytes = max_bytes
        """``update_ratio_max_bytes``: parameters larger than this get no snapshot (no update ratios)."""
        self.own_grad_norm = True
        """The global grad norm and ``nonfinite_grads`` are measured here (not given by a framework)."""
        self.param_stats = True
        """``param_norm`` / ``update_ratio`` / ``adam_v_ratio`` are measured."""
        self.own_loss = True
        """The losses ``backward()`` ran on are the step's loss (else only the framework's / observed ones)."""
        self.loss_divided = True
        """Those losses are divided by the accumulation steps (their sum is the loss; else their mean)."""
        self.snapshot_buffers: tuple[ParamLayout, list[torch.Tensor]] | None = None
        """The layout and the buffers its parameters are copied into before a sampled step."""
        self._param_sq_norms: tuple[int, Unchanged] | None = None
        """Step and squared per-tensor parameter norms after the last sampled step's update."""
        self._clip_order: tuple[ParamLayout, tuple[int, ...], torch.Tensor | None] | None = None


    def release(self) -> None:
        """Drop the snapshot copy of the parameters and the cached per-layout tensors (the capture closed)."""
        self.snapshot_buffers = None
        self._param_sq_norms = None
        self._clip_order = None

    def grads(self, layout: ParamLayout, state: StepState, step: int, given: list[torch.Tensor | None] | None = None,
              *, layers: bool = True, norms: torch.Tensor | None = None) -> None:
        """Global and per-module gradient norms and the non-finite count, on the device.

        One fused pass gives the per-tensor norms (``norms``: already computed by the ``clip_grad_norm_`` patch,
        aligned with the layout's parameters); the global norm, the per-module norms and whether any element is
        non-finite all come from them (see :func:`stats.nonfinite_given_norm`). ``given``: the gradients, aligned
        with the layout's parameters (default ``param.grad``). Without :attr:`own_grad_norm` only the per-module
        norms are measured, on ``layer_every`` steps.
        """
        state.grads_measured = True
        state.grad_parts = []
        layer_due = layers and self._layer_due(step) and bool(layout.modules)
        if not self.own_grad_norm and not layer_due:
            return
        device = device_of(layout)
        grads = [p.grad for p in layout.params] if given is None else given
        if layout.sharded:
            grads = stats.local_shards(grads)
        if norms is None:
            norms = stats.tensor_norms(grads, device)
        if given is None and self._stats_due(step) and not layout.sharded:
            # (DTensor gradients: an in-place clip bumps no version counter, so a reuse could not be checked)
            state.grad_norms = Unchanged.now(norms, grads)
        if self.own_grad_norm:
            total = torch.linalg.vector_norm(norms).reshape(1)
            state.grad_parts.append((["grad_norm"], total))
            state.grad_parts.append((["nonfinite_grads"], stats.nonfinite_given_norm(grads, total, device)))
        if layer_due:
            per_module = stats.segment_sum(norms.square(), layout.index(device), len(layout.modules)).sqrt()
            state.grad_parts.append((layout.names("grad_norm"), per_module))

    def whole_grad_norm(self, state: StepState, total: torch.Tensor) -> None:
        """Sharded parameters: ``grad_norm`` becomes the whole model's norm a clip returned (FSDP1's plain tensor,
        or FSDP2's replicated ``DTensor``, whose local value is it: no collective here) instead of this rank's
        shard's. A ``DTensor`` that is not replicated is left alone."""
        placements = getattr(total, "placements", None)
        if placements is not None:
            if not all(type(p).__name__ == "Replicate" for p in placements):
                return
            [total] = stats.local_shards([total])
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            return
        for i, (names, _) in enumerate(state.grad_parts):
            if names == ["grad_norm"]:
                state.grad_parts[i] = (names, total.detach().reshape(1).to(torch.float32))
                return

    def clip_norms(self, layout: ParamLayout, params: list[torch.Tensor], norms: torch.Tensor) -> torch.Tensor | None:
        """``norms`` (aligned with ``params``) reordered to the layout's parameters; None when some are missing."""
        if norms.device != device_of(layout) or norms.numel() != len(params):
            return None
        mine = layout.params
        if len(mine) == len(params) and all(a is b for a, b in zip(mine, params, strict=True)):
            return norms
        key = tuple(id(p) for p in params)
        cached = self._clip_order
        if cached is None or cached[0] is not layout or cached[1] != key:
            position = {id(p): i for i, p in enumerate(params)}
            order = [position.get(id(p), -1) for p in mine]
            index = None if -1 in order else stats.to_device(torch.tensor(order, dtype=torch.int64), norms.device)
            cached = self._clip_order = (layout, key, index)
        return None if cached[2] is None else norms.index_select(0, cached[2])

    def clipped(self, state: StepState, step: int, clipped: tuple[torch.Tensor, float] | None) -> None:
        """``clip_grad_norm_`` returned after measuring the gradients with its own norms (``state.clip_measured``):
        those norms, scaled like the gradients, are the clipped gradients' (for Adam's statistic on sampled steps)."""
        state.clip_measured = False
        kept = state.grad_norms
        state.grad_norms = None
        if kept is not None and clipped is not None and self._stats_due(step):
            total, max_norm = clipped
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s own formula
            state.grad_norms = Unchanged.now(kept.values * coef.to(kept.values.device), kept.tensors)

    def snapshot_if_due(self, layout: ParamLayout, state: StepState, step: int) -> None:
        """Snapshot the parameters before a sampled step's update (once per step, when they fit the byte limit)."""
        if state.snapshot is None and self._stats_due(step) and layout.total_bytes <= self._max_bytes:
            state.snapshot = self._snapshot(layout, step)

    def _snapshot(self, layout: ParamLayout, step: int) -> Snapshot:
        """The parameters' values now, copied into buffers kept for the capture's life (allocating fresh memory on
        every sampled step cost several times the copy itself), and their norms (``‖w before‖`` of the update
        ratio): those the previous step measured after its update when it was sampled and the parameters did not
        change since (every step with ``stats_every=1``), else read right after the copy. Only the step just before
        counts, as a loop without an optimizer updates through ``p.data`` (which torch does not count as a change)
        between two sampled steps. Not seen: a change through ``p.data`` between the optimizer step and the next
        one (e.g. weight clipping written as ``p.data.clamp_()``); ``‖w before‖`` is then that of before it."""
        params = layout.local_params()
        kept = self.snapshot_buffers
        if kept is None or kept[0] is not layout or any(
            b.shape != p.shape or b.dtype != p.dtype or b.device != p.device
            for b, p in zip(kept[1], params, strict=True)
        ):
            kept = self.snapshot_buffers = (layout, [torch.empty_like(p, requires_grad=False) for p in params])
        with torch.no_grad():
            torch._foreach_copy_(kept[1], params)
        last = self._param_sq_norms
        if last is not None and last[0] == step - 1 and last[1].holds_for(layout.params):  # ‖w after‖ of that step
            return Snapshot(kept[1], last[1].values)
        return Snapshot(kept[1], stats.tensor_norms(kept[1], device_of(layout)).square())

    def sampled(self, layout: ParamLayout, state: StepState, step: int, optimizer: torch.optim.Optimizer | None,
                co: Sequence[torch.optim.Optimizer]) -> None:
        """A sampled step's statistics after its update: parameter norms, update ratios (with a snapshot), Adam's
        v ratio (``optimizer`` and the co-stepping ``co`` hold the Adam state), activations and ``logit_z``."""
        if not self.param_stats:
            activation_stats(state)
            return
        device, n = device_of(layout), len(layout.modules)
        index = layout.index(device)
        params, snapshot = layout.local_params(), state.snapshot
        with torch.no_grad():
            if snapshot is None:
                per_tensor = stats.tensor_norms(params, device).square()
                param_sq = stats.segment_sum(per_tensor, index, n)
            else:  # one pass makes -delta in the kept buffers, one fused norm pass reads the parameters and them
                torch._foreach_sub_(snapshot.buffers, params)
                both = stats.tensor_norms([*params, *snapshot.buffers], device).square()
                sums = stats.segment_sum(both, layout.index(device, repeat=2), 2 * n)
                before_sq = stats.segment_sum(snapshot.sq_norms, index, n)
                per_tensor, param_sq = both[: len(params)], sums[:n]
                # a module whose weights were all zero before the step (a zero-initialised positional embedding,
                # gate or bias-only module) is measured against its weights after it (1.0 when it just left zero)
                denom = torch.where(before_sq > 0, before_sq, sums[:n]).clamp_min(torch.finfo(before_sq.dtype).tiny)
                state.parts.append((layout.names("update_ratio"), (sums[n:] / denom).sqrt()))
                state.snapshot = None
        self._param_sq_norms = (step, Unchanged.now(per_tensor, layout.params))  # DTensors: theirs bump, shards' not
        state.parts.append((layout.names("param_norm"), param_sq.sqrt()))
        adam = adam_state([optimizer, *co] if optimizer is not None else [], layout.params)
        if adam is not None:
            vs, beta2, steps = adam
            grads = [p.grad for p in layout.params]
            if layout.sharded:
                vs, steps, grads = stats.local_shards(vs), stats.local_shards(steps), stats.local_shards(grads)
            known = state.grad_norms
            if known is not None and known.holds_for(grads):  # no 2nd pass over them
                g_sq, v_prev = stats.adam_lag(None, vs, beta2, steps, index, n, device, grad_norms=known.values)
            else:
                gs = [g if v is not None else None for g, v in zip(grads, vs, strict=True)]
                g_sq, v_prev = stats.adam_lag(gs, vs, beta2, steps, index, n, device)
            ratio = torch.where(v_prev > 0, g_sq / v_prev, torch.full_like(v_prev, ABSENT))
            state.parts.append((layout.names("adam_v_ratio"), ratio))
        activation_stats(state)

    def loss_and_scaler(self, layout: ParamLayout | None, state: StepState, optimizer: torch.optim.Optimizer | None,
                        skipped: float | None, scaler_call: tuple[Any, torch.optim.Optimizer, int] | None) -> None:
        """Every step's ``loss`` and ``micro_batches`` (the capture's loss rule), ``objectives``, and with an enabled
        ``GradScaler`` (``scaler_call``: the ``GradScaler.step`` in progress) ``loss_scale`` and ``skipped``."""
        framework = bool(state.framework_losses)
        own = state.framework_losses or (state.losses if self.own_loss else [])
        if own:
            device = own[0].device
            losses = torch.stack([x.to(device, non_blocking=True) for x in own])
            # a framework's micro-batch losses are not divided by the accumulation steps: their mean is the loss;
            # the tensors a plain loop calls backward() on are (nanoGPT, HF: loss / accumulation steps): their sum
            total = losses.mean() if framework or len(own) == 1 or not self.loss_divided else losses.sum()
            state.parts.append((["loss"], total.reshape(1)))
            state.host["micro_batches"] = float(len(own))
        if state.objectives > 1:
            state.host["objectives"] = float(state.objectives)
        scaler = scaler_call[0] if scaler_call is not None else state.scaler
        if scaler is None or not getattr(scaler, "_enabled", False):
            return
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            state.parts.append((["loss_scale"], scale.detach().reshape(-1)[:1].clone()))
        if skipped is not None:
            state.host["skipped"] = skipped
        elif (optimizer is not None and scaler_call is not None
              and getattr(optimizer, "_step_supports_amp_scaling", False)):
            state.parts.append((["skipped"], found_inf(scaler, optimizer, device_of(layout))))
        else:
            state.host["skipped"] = 0.0


def adam_state(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]) -> tuple[
        list[torch.Tensor | None], list[float], list[torch.Tensor | float | None]] | None:
    """Adam's ``exp_avg_sq``, ``beta2`` and ``step`` per parameter (None where a parameter has no such state),
    or None when no parameter has one (not an Adam-family optimizer). ``optimizers``: the tracked one and the
    co-stepping ones (each parameter's state is in the one that holds it)."""
    if not optimizers:
        return None
    groups = [g for o in optimizers for g in o.param_groups]
    betas = [float(g.get("betas", (0.9, 0.999))[1]) for g in groups]
    found = [next((o.state[p] for o in optimizers if p in o.state), None) for p in params]
    vs: list[torch.Tensor | None] = []
    steps: list[torch.Tensor | float | None] = []
    for st in found:
        v = None if st is None else st.get("exp_avg_sq")
        vs.append(v if isinstance(v, torch.Tensor) else None)
        steps.append(None if st is None else st.get("step"))
    if all(v is None for v in vs):
        return None
    if len(set(betas)) == 1:  # the usual case (a parameter outside the groups has no state: its beta2 is unused)
        return vs, [betas[0]] * len(params), steps
    beta2_of = {id(p): b for g, b in zip(groups, betas, strict=True) for p in g["params"]}
    return vs, [beta2_of.get(id(p), 0.999) for p in params], steps


def activation_stats(state: StepState) -> None:
    """``act_absmax`` / ``act_rms`` per hooked module and ``logit_z``, from what the step's forward hooks kept."""
    if state.acts:
        names = list(state.acts)
        absmax, rms = stats.activation_summary([state.acts[name] for name in names])
        state.parts.append(([f"act_absmax/{m}" for m in names], absmax))
        state.parts.append(([f"act_rms/{m}" for m in names], rms))
    if state.logit_z:
        state.parts.append((["logit_z"], torch.stack(state.logit_z).mean().reshape(1)))


def found_inf(scaler: Any, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
    """1.0 if the scaler found inf/NaN gradients for ``optimizer`` (fused optimizers skip internally)."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    flags = [t.to(device, dtype=torch.float32, non_blocking=True).reshape(1) for t in found.values()]
    return (torch.cat(flags).sum() > 0).to(torch.float32).reshape(1)
