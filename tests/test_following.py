"""The optimizer-following state machine on its own (hooks/following.py): which optimizer is tracked and what each
optimizer step is to the records. Capture-level behaviour (records, phases, co-stepping) is in
test_capture_training.py; here real CPU optimizers, no hooks."""

from __future__ import annotations

import torch

from stability.hooks.capture import HANDOVER_STEPS as CAPTURE_HANDOVER_STEPS
from stability.hooks.following import HANDOVER_STEPS, Following, Role, closure_of, with_closure


def _opt(*params: torch.nn.Parameter) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.1)


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2))


def test_handover_steps_is_still_importable_from_capture() -> None:
    assert CAPTURE_HANDOVER_STEPS is HANDOVER_STEPS


def test_first_optimizer_is_tracked_a_replacement_takes_over_and_others_are_ignored() -> None:
    w, v = _param(), _param()
    first, again, other = _opt(w), _opt(w), _opt(v)
    follow = Following()
    follow.start(None)
    assert follow.pre_step(first, 1, False) is Role.OURS and follow.optimizer is first
    follow.step_ended(1)
    assert follow.pre_step(again, 2, False) is Role.OURS and follow.optimizer is again  # same parameters
    follow.step_ended(2)
    assert follow.pre_step(other, 3, False) is Role.OTHER and follow.optimizer is again


def test_another_optimizer_takes_over_after_handover_steps_in_a_row_only() -> None:
    w, v = _param(), _param()
    tracked, other = _opt(w), _opt(v)
    follow = Following()
    follow.start(None)
    follow.adopt(tracked)
    for _ in range(HANDOVER_STEPS - 1):
        assert follow.adopt(other) is Role.OTHER
    follow.step_ended(0)  # the tracked one stepped: the run starts again
    roles = [follow.adopt(other) for _ in range(HANDOVER_STEPS)]
    assert roles == [Role.OTHER] * (HANDOVER_STEPS - 1) + [Role.PHASE]
    assert follow.optimizer is other
    assert follow.adopt(tracked) is Role.OTHER


def test_explicit_mode_never_replaces_nor_hands_over() -> None:
    w = _param()
    tracked, same = _opt(w), _opt(w)
    follow = Following()
    follow.start(tracked)
    assert [follow.pre_step(same, 0, False) for _ in range(HANDOVER_STEPS + 1)] == [Role.OTHER] * (HANDOVER_STEPS + 1)
    assert follow.optimizer is tracked and not follow.co


def test_costepping_inner_steps_and_the_wait_for_the_last_costep() -> None:
    w, v = _param(), _param()
    tracked, partner = _opt(w), _opt(v)
    follow = Following()
    follow.start(None)
    assert follow.pre_step(tracked, 5, False) is Role.OURS
    follow.stepping = True
    assert follow.pre_step(partner, 5, False) is Role.INNER  # stepped inside the tracked one's step
    follow.stepping = False
    assert not follow.wait_for_costeps(5)  # no co-stepping optimizer yet: the record ends now
    follow.step_ended(5)
    assert follow.pre_step(partner, 5, False) is Role.JOINED and follow.co == [partner]  # no backward() since
    follow.step_ended(6)
    assert follow.pre_step(tracked, 6, False) is Role.OURS
    assert follow.wait_for_costeps(6) and follow.finishing and follow.backward_at_end == 6
    assert follow.last_costep(partner) and not follow.last_costep(tracked)
    assert follow.pre_step(partner, 6, False) is Role.COSTEP
    assert follow.pre_step(partner, 7, False) is Role.OTHER  # a backward() since: its own step, ignored


def test_closure_is_found_and_replaced_positionally_or_by_keyword() -> None:
    opt = _opt(_param())

    def closure() -> None:
        return None

    def wrapped() -> None:
        return None

    assert closure_of(opt, (opt, closure), {}) is closure  # torch passes the optimizer first
    assert closure_of(opt, (closure,), {}) is closure
    assert closure_of(opt, (opt,), {"closure": closure}) is closure
    assert closure_of(opt, (opt,), {}) is None
    assert with_closure(opt, (opt, closure), {}, wrapped) == ((opt, wrapped), {})
    assert with_closure(opt, (opt,), {"closure": closure}, wrapped) == ((opt,), {"closure": wrapped})


def test_same_parameters_are_asked_of_the_tracked_optimizer_of_now() -> None:
    """Bug fixed: the "same parameters as the tracked one" answer was cached per optimizer only, so an optimizer that
    once replaced the tracked one replaced any later tracked one too (here the new phase's, over other parameters)
    at once, with no new phase and the layout of the other parameters kept."""
    w, v = _param(), _param()
    first, again, phase = _opt(w), _opt(w), _opt(v)
    follow = Following()
    follow.start(None)
    follow.adopt(first)
    assert follow.adopt(again) is Role.OURS  # the same parameters: a replacement
    follow.step_ended(0)
    assert [follow.adopt(phase) for _ in range(HANDOVER_STEPS)][-1] is Role.PHASE
    follow.step_ended(1)
    assert follow.adopt(again) is Role.OTHER and follow.optimizer is phase  # w is not the new phase's parameters
