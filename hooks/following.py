"""Which optimizer a :class:`~stability.hooks.capture.Capture` follows, and what each optimizer step is to its records.

:class:`Following` is the small state machine the capture's optimizer step hooks ask. It only decides; the capture
acts on its answer (a :class:`Role`) and keeps everything that goes into a record. The rules:

* the *tracked* optimizer is the first one that steps (or the one given to ``attach`` / ``use_framework``); each
  of its steps is a record (:attr:`Role.OURS`);
* auto mode only (global step hooks, every optimizer's steps are seen):

  - a new optimizer over exactly the tracked one's parameters *replaces* it (a loop that creates its optimizer
    again each epoch or stage: before, every step after the first optimizer's was silently lost);
  - optimizers stepping right after the tracked one with no ``backward()`` between *co-step* on the same
    gradients (modded-nanogpt's Adam for the embeddings and head plus Muon for the matrices): they join its
    record (:attr:`Role.JOINED` the first time, the capture then measures their parameters too; later
    :attr:`Role.COSTEP`). The record waits (:attr:`Following.finishing`) until the last of them stepped, or until
    the next ``backward()`` / tracked step when one skipped;
  - one that steps :data:`HANDOVER_STEPS` times in a row while the tracked one does not takes over: a new training
    phase (:attr:`Role.PHASE`; the capture rebuilds its layout and marks the record ``phase_start``);
* an optimizer stepped from inside the tracked one's ``step`` (a wrapper's inner optimizer) is not a step
  (:attr:`Role.INNER`);
* every other optimizer is ignored (:attr:`Role.OTHER`, logged once): the losses backpropagated just before it
  steps were its own (a GAN's generator), not the tracked step's.

``step(closure)``: :func:`closure_of` finds the closure in a step hook's arguments and :func:`with_closure` puts the
capture's wrapped closure in its place (torch passes a pre-step hook's returned arguments on to ``step``).

Per optimizer step the hooks make one or two method calls here; nothing is allocated on the usual path.
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Any

import torch

from stability.hooks.layout import optimizer_params

__all__ = ["HANDOVER_STEPS", "Following", "Role", "closure_of", "with_closure"]

logger = logging.getLogger("stability.hooks.capture")
"""The capture's logger: what the capture follows is part of what it says it sees (one logger to configure)."""

HANDOVER_STEPS = 20
"""Steps in a row of another optimizer (other parameters), with none of the tracked one, that make it the tracked
one (auto mode): a new training phase. A GAN's generator, or a WGAN critic's 5 steps per generator step, stays
ignored."""


class Role(enum.Enum):
    """What a step of some optimizer is to the capture's records."""

    OTHER = "other"
    """Not the tracked optimizer: ignored (the losses since the tracked step were its own)."""
    OURS = "ours"
    """The tracked optimizer's step: a record."""
    PHASE = "phase"
    """The tracked optimizer's step, and it just took over: a new training phase starts with this record."""
    COSTEP = "costep"
    """Steps on the tracked step's gradients: part of that record."""
    JOINED = "joined"
    """Co-steps for the first time: its parameters are measured in the records from now on."""
    INNER = "inner"
    """Stepped from inside the tracked optimizer's step: not a step of its own."""


class Following:
    """The tracked optimizer and the co-stepping ones, and the state that tells what the next step of any is.

    Methods take the capture's ``backward()`` count where it matters: no ``backward()`` since the tracked step ended
    is what makes a co-stepping window."""

    __slots__ = ("_auto", "_foreign_run", "_ignored", "_same_params", "backward_at_end", "co", "finishing",
                 "optimizer", "stepping")

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        """The tracked optimizer (None: none stepped yet). Explicit mode and framework adapters set it."""
        self.co: list[torch.optim.Optimizer] = []
        """Other optimizers that step right after the tracked one on the same backward: their parameters are
        measured in the same record (:func:`~stability.hooks.layout.optimizer_params` of all of them)."""
        self.stepping = False
        """The tracked optimizer's ``step`` is running (between its pre- and post-step hooks)."""
        self.finishing = False
        """The tracked optimizer stepped; the record ends when the last co-stepping optimizer has stepped too."""
        self.backward_at_end = -1
        """The ``backward()`` count when the tracked step's record ended (no backward since: a co-stepping
        window)."""
        self._auto = False
        """Auto mode: every optimizer's steps reach the hooks (so another one can replace or take over)."""
        self._ignored: set[int] = set()
        self._same_params: dict[
            int, tuple[weakref.ref[torch.optim.Optimizer], weakref.ref[torch.optim.Optimizer], bool]] = {}
        """id of another optimizer -> (it, the tracked one when asked, whether it holds exactly its parameters)."""
        self._foreign_run: tuple[int, int] = (0, 0)
        """id of the other optimizer that stepped since the tracked one last did, and how many times in a row."""

    def release(self) -> None:
        """Forget the optimizers (the capture closed: nothing of the user's may stay reachable from it)."""
        self.optimizer, self.co = None, []
        self._same_params.clear()

    def start(self, optimizer: torch.optim.Optimizer | None) -> None:
        """``attach``: ``optimizer`` is the only one followed; None: auto mode (every optimizer's steps are seen)."""
        self._auto = optimizer is None
        if optimizer is not None:
            self.optimizer = optimizer

    def pre_step(self, optimizer: torch.optim.Optimizer, backward_calls: int, boundaries_known: bool) -> Role:
        """What the step of ``optimizer`` starting now is. With :attr:`Role.OURS` / :attr:`Role.PHASE` the caller
        sets :attr:`stepping` once it began the step. ``boundaries_known``: a loop without an optimizer had its
        step boundaries inferred so far (an optimizer that now steps says so)."""
        if self.stepping and optimizer is not self.optimizer:
            return Role.INNER
        if (self._auto and self.optimizer is not None and optimizer is not self.optimizer
                and backward_calls == self.backward_at_end):
            if optimizer in self.co:
                return Role.COSTEP
            logger.info("stability: optimizer %s steps right after the tracked one on the same gradients; its "
                        "parameters are measured in the same records", type(optimizer).__name__)
            self.co.append(optimizer)
            return Role.JOINED
        return self.adopt(optimizer, boundaries_known)

    def adopt(self, optimizer: torch.optim.Optimizer, boundaries_known: bool = False) -> Role:
        """:attr:`Role.OURS` if ``optimizer`` is the tracked one (the first to step becomes it; in auto mode one over
        exactly its parameters replaces it), :attr:`Role.PHASE` if it takes over after :data:`HANDOVER_STEPS`
        steps in a row, else :attr:`Role.OTHER` (logged once per optimizer)."""
        if self.optimizer is None:
            self.optimizer = optimizer
            if boundaries_known:
                logger.info("stability: optimizer %s now steps; it sets the step boundaries", type(optimizer).__name__)
        if optimizer is self.optimizer:
            return Role.OURS
        if self._auto and not self.stepping:
            if self._replaces(optimizer):
                logger.info("stability: a new %s over the same parameters steps; it replaces the tracked optimizer",
                            type(optimizer).__name__)
                self.optimizer = optimizer
                self._ignored.discard(id(optimizer))
                return Role.OURS
            run = self._foreign_run
            self._foreign_run = run = (id(optimizer), run[1] + 1 if run[0] == id(optimizer) else 1)
            if run[1] >= HANDOVER_STEPS:
                self._hand_over(optimizer)
                return Role.PHASE
        if id(optimizer) not in self._ignored:
            self._ignored.add(id(optimizer))
            logger.info(
                "stability: ignoring optimizer %s; only the first one to step is tracked (the losses "
                "backpropagated just before it steps are not the tracked step's loss)", type(optimizer).__name__
            )
        return Role.OTHER

    def wait_for_costeps(self, backward_calls: int) -> bool:
        """The tracked optimizer's step returned: True when its record waits for the co-stepping optimizers."""
        if self.co:
            self.finishing, self.backward_at_end = True, backward_calls
            return True
        return False

    def last_costep(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer``'s step was the last co-stepping one of the record that waits for it."""
        return self.finishing and bool(self.co) and optimizer is self.co[-1]

    def step_ended(self, backward_calls: int) -> None:
        """A record ended (at ``backward_calls`` backward() calls): the handover count and co-stepping window
        start again."""
        self._foreign_run = (0, 0)
        self.backward_at_end = backward_calls

    def _hand_over(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` (other parameters) stepped :data:`HANDOVER_STEPS` times in a row while the tracked one did
        not: a new training phase (forward-forward trains one layer after the other, each with its own optimizer;
        a fine-tuning stage with a new optimizer over part of the model). It becomes the tracked optimizer."""
        logger.info("stability: optimizer %s stepped %d times in a row while the tracked one did not: a new "
                    "training phase; it now sets the step boundaries", type(optimizer).__name__, HANDOVER_STEPS)
        self.optimizer = optimizer
        self._ignored.discard(id(optimizer))
        self._foreign_run = (0, 0)

    def _replaces(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds exactly the tracked optimizer's parameters (cached per optimizer, for as long
        as the tracked one is the same: after a replacement or a new phase the answer is another one's)."""
        tracked = self.optimizer
        if tracked is None:
            return False
        known = self._same_params.get(id(optimizer))
        if known is None or known[0]() is not optimizer or known[1]() is not tracked:
            same = {id(p) for p in optimizer_params(optimizer)} == {id(p) for p in optimizer_params(tracked)}
            known = self._same_params[id(optimizer)] = (weakref.ref(optimizer), weakref.ref(tracked), same)
        return known[2]


def _closure_index(optimizer: torch.optim.Optimizer, args: tuple[Any, ...]) -> int:
    """Where a step hook's ``args`` hold the closure: torch passes ``step``'s arguments with the optimizer first."""
    return 1 if args and args[0] is optimizer else 0


def closure_of(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The closure a ``step(closure)`` call passes (None or whatever else was passed when it has none)."""
    at = _closure_index(optimizer, args)
    return kwargs.get("closure") or (args[at] if len(args) > at else None)


def with_closure(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any],
                 closure: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A pre-step hook's arguments with ``closure`` in place of the one the call passed."""
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": closure}
    at = _closure_index(optimizer, args)
    return (*args[:at], closure, *args[at + 1 :]), kwargs
