"""Step boundaries of a training loop that has no ``torch.optim`` optimizer (hand-written updates).

pytorch/examples ``word_language_model`` updates its LSTM with ``p.data.add_(p.grad, alpha=-lr)`` after
``clip_grad_norm_`` and clears gradients with ``model.zero_grad()``: no optimizer ever steps, so no optimizer hook
can say where a step ends. Until an optimizer steps (it then takes over), the capture infers the boundaries from
what it can see on the training thread, without reading any tensor value:

* **zero_grad**: ``Module.zero_grad()`` (patched) on a module holding watched parameters ends the step in progress
  if it had a ``backward()`` (the gradients are still intact then and are measured first);
* at the start of a ``backward()`` that follows one of the step's ``backward()`` calls, the step ended if, since
  that previous ``backward()``:

  - **clip**: ``clip_grad_norm_`` ran (clipping is the last thing before an update; gradients were measured
    before clipping);
  - **reset**: a watched parameter's gradient was set to ``None``, replaced, or changed in place (``.zero_()``:
    its version counter moved), which is how tensor-level loops clear gradients; these gradients cannot be
    measured any more, so from then on they are measured after every ``backward()`` (the last one of a step wins);
  - **update**: a watched parameter changed in place (``p -= lr * p.grad`` under ``no_grad``; its version counter
    moved). ``p.data.add_`` leaves no such trace; loops using it end steps with ``zero_grad`` or a reset;

  otherwise the ``backward()`` belongs to the same step (gradient accumulation).
* **one backward per step**: when no module with gradients is known (raw tensors), each ``backward()`` is a
  step; when :data:`BLIND_AFTER` ``backward()`` calls passed without any boundary (gradients cleared through
  ``.data``, invisible to version counters), the pending calls are dropped and each later ``backward()`` is a step
  (the capture warns).

"Watched parameters" are those of the model found by gradients: the outermost modules that ran forward whose
parameters received gradients (all their parameters that require grad). Checks cost one pass over the parameter
list in Python per ``backward()`` (identity and ``_version`` of each tensor), no device work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["BLIND_AFTER", "Rhythm", "model_params"]

BLIND_AFTER = 256
"""``backward()`` calls without any visible step boundary after which each ``backward()`` is taken as one step."""


class Rhythm:
    """Infers step boundaries from the backward / clip / zero_grad / gradient-reset rhythm (see module docstring)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        """The watched parameters (empty: no model found)."""
        self.confirmed = False
        """A boundary was seen while no optimizer stepped: the loop has no optimizer."""
        self.eager = False
        """The loop clears gradients itself: measure them after every ``backward()``."""
        self.per_backward = False
        """No boundary is visible: every ``backward()`` is one step."""
        self.backwards = 0
        """``backward()`` calls in the step in progress."""
        self.clipped = False
        self.late = False
        """Steps end at the next ``backward()``, after the next step's forward pass (activation hooks go on a step
        early, and what they record after the last ``backward()`` moves to the next step)."""
        self._ids: frozenset[int] = frozenset()
        self._grad_marks: list[tuple[int, int] | None] = []
        self._param_marks: list[int] = []

    def watch(self, params: Sequence[torch.Tensor]) -> None:
        """Watch these parameters (the model's)."""
        self.params = list(params)
        self._ids = frozenset(id(p) for p in self.params)
        self._mark()

    def after_backward(self) -> None:
        """A ``backward()`` returned."""
        self.backwards += 1
        self.clipped = False
        self._mark()

    def after_clip(self) -> None:
        """``clip_grad_norm_`` returned (it scaled the gradients in place)."""
        self.clipped = True
        self._grad_marks = [_grad_mark(p) for p in self.params]

    def boundary_at_backward(self) -> str | None:
        """Before a ``backward()``: why the step in progress has ended (``"backward"``, ``"clip"``, ``"reset"``,
        ``"update"``), or None when this ``backward()`` belongs to it."""
        if self.backwards == 0:
            return None
        if self.per_backward or not self.params:
            return "backward"
        if self.clipped:
            return "clip"
        if any(_grad_mark(p) != m for p, m in zip(self.params, self._grad_marks, strict=True)):
            return "reset"
        if any(p._version != m for p, m in zip(self.params, self._param_marks, strict=True)):
            return "update"
        return None

    def boundary_at_zero_grad(self, module: torch.nn.Module) -> bool:
        """Before ``module.zero_grad()``: True if it ends the step in progress."""
        if self.backwards == 0:
            return False
        return not self.params or any(id(p) in self._ids for p in module.parameters())

    def blind(self) -> bool:
        """True when so many ``backward()`` calls passed without a boundary that none can be seen."""
        return not self.per_backward and self.backwards >= BLIND_AFTER

    def step_closed(self) -> None:
        """The step in progress was recorded (or dropped)."""
        self.backwards = 0
        self.clipped = False

    def _mark(self) -> None:
        self._grad_marks = [_grad_mark(p) for p in self.params]
        self._param_marks = [p._version for p in self.params]


def model_params(modules: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The model found by gradients: the parameters (requiring grad) of the outermost ``modules`` holding a
    parameter with a gradient, without duplicates."""
    with_grads = [m for m in modules if any(p.grad is not None for p in m.parameters())]
    roots = [r for r in with_grads if not any(o is not r and any(x is r for x in o.modules()) for o in with_grads)]
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    for root in roots:
        for p in root.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _grad_mark(p: torch.Tensor) -> tuple[int, int] | None:
    g = p.grad
    return None if g is None else (id(g), g._version)
