"""Skipping an optimizer update without a host sync: the update runs, scaled by a 0/1 factor on the device.

Used by :class:`stability.hooks.guard.Guard` (see its module docstring for the trade-offs):

* :func:`factor_adam_step`: ``torch.optim.Adam`` / ``AdamW`` recomputed with a *step factor* ``f = 1 - skip``
  applied to the step count, both moments, weight decay and the update (OLMo-core's method): a skipped step leaves
  parameters, moments and step count bit-identical, a taken one matches torch's AdamW to float rounding, and the
  state keeps torch's layout (checkpoints stay compatible).
* :func:`snapshot_step`: any other optimizer steps normally, then parameters and state are restored from a
  snapshot where ``skip`` is set (exact, but a full copy of parameters and state every step).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["factor_adam_step", "snapshot_step"]


@torch.no_grad()
def factor_adam_step(optimizer: torch.optim.Optimizer, *, skip: torch.Tensor) -> None:
    """Adam/AdamW update scaled by the 0/1 factor ``1 - skip`` (see the module docstring); no host reads."""
    masks: dict[torch.device, torch.Tensor] = {}
    factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    decoupled_default = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        hyper = _AdamHyper(
            beta1=float(group["betas"][0]),
            beta2=float(group["betas"][1]),
            lr=group["lr"],
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", False)) or decoupled_default,
            maximize=bool(group.get("maximize", False)),
        )
        amsgrad = bool(group.get("amsgrad", False))
        for p in group["params"]:
            if p.grad is None:
                continue
            mask = masks.setdefault(p.device, skip.to(p.device))
            f = factors.setdefault((p.device, p.dtype), (~mask).to(p.dtype))
            _adam_update(p, _adam_state(optimizer, p, amsgrad), mask, f, hyper)


@dataclass(frozen=True, slots=True)
class _AdamHyper:
    beta1: float
    beta2: float
    lr: float | torch.Tensor
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool


def _adam_update(p: torch.Tensor, state: dict[str, Any], skip: torch.Tensor, f: torch.Tensor, h: _AdamHyper) -> None:
    """One parameter's Adam(W) update times the factor ``f`` (two temporaries of the parameter's size)."""
    assert p.grad is not None
    g = torch.where(skip, 0.0, p.grad)  # NaN * 0 is NaN: zero the gradient itself where skipped
    if h.maximize:
        g.neg_()
    if h.weight_decay != 0:
        if h.decoupled:
            p.mul_(1 - h.lr * h.weight_decay * f)
        else:
            g.add_(p, alpha=h.weight_decay)
    step = state["step"]
    step.add_(f.to(step.dtype))
    state["exp_avg"].lerp_(g, (1 - h.beta1) * f)
    state["exp_avg_sq"].lerp_(g.mul_(g), (1 - h.beta2) * f)
    one = torch.ones_like(step)
    bias1 = torch.where(step > 0, 1 - h.beta1**step, one).to(p.dtype)
    bias2 = torch.where(step > 0, 1 - h.beta2**step, one).to(p.dtype)
    v = state["exp_avg_sq"]
    if "max_exp_avg_sq" in state:
        torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
        v = state["max_exp_avg_sq"]
    denom = v.sqrt().div_(bias2.sqrt()).add_(h.eps)
    update = torch.div(state["exp_avg"], denom, out=denom)
    p.sub_(update.mul_(h.lr * f / bias1))


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
    """The parameter's Adam state in torch's layout, created if missing; ``step`` moved to the device."""
    state: dict[str, Any] = optimizer.state[p]
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    step = state["step"]
    if not isinstance(step, torch.Tensor):
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
    elif step.device != p.device:
        state["step"] = step.to(device=p.device, dtype=torch.float32)
    if amsgrad and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def snapshot_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """The optimizer's own step, undone on the device where ``skip`` (costs a copy of params and state)."""
    before = [(t, t.detach().clone()) for t in _tensors(optimizer)]
    optimizer.step()
    for tensor, saved in before:
        tensor.copy_(torch.where(skip.to(tensor.device), saved, tensor))


def _tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Parameters with a gradient, and every tensor of their optimizer state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            yield p
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield value


# -- skip-list files ---------------------------------------------------------------------------------------------
