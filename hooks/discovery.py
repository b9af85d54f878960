"""Auto mode's search for the model: which modules ran forward, and which of them hold the optimizer's parameters.

Until the model is known (``attach()`` without a model, and again after a new training phase whose optimizer holds
parameters of another model), global module forward hooks note the *outermost* modules that run forward (up to
:data:`MAX_CANDIDATES`); :meth:`Discovery.roots` keeps those holding the measured parameters, minus any nested in
another. The hooks themselves are the capture's (guarded like all its hooks): they call :meth:`Discovery.enter` /
:meth:`Discovery.leave`.

torch warns that ``torch.compile(model)`` makes global module hooks fire once more (for its wrapper): harmless for
these, so that warning is silenced while they are registered, and only then.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["MAX_CANDIDATES", "Discovery"]

MAX_CANDIDATES = 64
"""Outermost modules noted at most."""

_COMPILE_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""Start of torch's warning when a compiled module runs while global module hooks are registered."""


class Discovery:
    """The global forward hooks of auto mode and the modules they noted."""

    __slots__ = ("_candidates", "_forward", "_handles", "_warning_filter")

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._candidates: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._forward = threading.local()
        """``depth``: forward calls in progress on this thread (0: the next module to run is an outermost one)."""
        self._warning_filter: Any = None
        """The warnings filter :meth:`start` added (removed by :meth:`stop`)."""

    @property
    def active(self) -> bool:
        """The global forward hooks are registered."""
        return bool(self._handles)

    def start(self, pre_hook: Callable[[torch.nn.Module, Any], None],
              hook: Callable[[torch.nn.Module, Any, Any], None]) -> None:
        """Register the global forward pre-hook and hook (the capture's, which call :meth:`enter` and
        :meth:`leave`); silence torch's warning about them under ``torch.compile``."""
        self._handles.append(register_module_forward_pre_hook(pre_hook))
        self._handles.append(register_module_forward_hook(hook, always_call=True))
        warnings.filterwarnings("ignore", message=_COMPILE_HOOKS_WARNING, category=UserWarning)
        self._warning_filter = warnings.filters[0]

    def stop(self) -> None:
        """Remove the hooks and the warnings filter, and forget the noted modules; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._candidates.clear()
        if self._warning_filter is not None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._warning_filter)  # type: ignore[attr-defined]
            self._warning_filter = None

    def enter(self, module: torch.nn.Module) -> None:
        """``module``'s forward starts: note it when it is an outermost one."""
        depth = getattr(self._forward, "depth", 0)
        self._forward.depth = depth + 1
        if depth == 0 and len(self._candidates) < MAX_CANDIDATES:
            self._candidates.setdefault(id(module), weakref.ref(module))

    def leave(self) -> None:
        """A module's forward returned (or raised)."""
        self._forward.depth = max(0, getattr(self._forward, "depth", 0) - 1)

    def modules(self) -> list[torch.nn.Module]:
        """The outermost modules noted so far that still exist."""
        return [m for ref in self._candidates.values() if (m := ref()) is not None]

    def roots(self, param_ids: set[int]) -> list[torch.nn.Module]:
        """The noted modules holding any of the parameters ``param_ids``, except those inside another one."""
        roots = [m for m in self.modules() if any(id(p) in param_ids for p in m.parameters())]
        return [r for r in roots if not any(o is not r and any(x is r for x in o.modules()) for o in roots)]
