"""Cross-rank disagreement: 4 data-parallel ranks, one of them off (synthetic, deterministic)."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import numpy as np
import pytest

from stability.detectors import CrossRankDetector, RunDiagnoser, Severity
from stability.detectors.base import Finding
from stability.postmortem import analyze
from stability.records import SHARDED, StepRecord
from stability.testing import diagnose, diagnose_split

N, RANKS = 400, 4


def run_records(*, grad_fault: tuple[int, float] | None = None, loss_fault: tuple[int, int, float] | None = None,
                nan_at: int | None = None, world: bool = False, bad: int = 2) -> dict[int, list[StepRecord]]:
    """Per rank: its own noisy loss, the same (post-reduce) grad norm on every rank."""
    rng = np.random.default_rng(0)
    t = np.arange(N)
    grad = np.exp(rng.normal(0, 0.1, N))
    out: dict[int, list[StepRecord]] = {}
    for rank in range(RANKS):
        loss = (2.5 + 2.0 * np.exp(-t / 150.0)) * np.exp(rng.normal(0, 0.02, N))
        g = grad.copy()
        if rank == bad and grad_fault is not None:
            g[grad_fault[0]] *= grad_fault[1]
        if rank == bad and loss_fault is not None:
            loss[loss_fault[0]:loss_fault[1]] *= loss_fault[2]
        if rank == bad and nan_at is not None:
            loss[nan_at] = np.nan
        coords = {"dp": rank, "world_size": RANKS} if world else {"dp": rank}
        out[rank] = [StepRecord(run_id="r", step=s, rank=rank, host=f"node-{rank // 2}-gpu{rank % 2}", coords=coords,
                                signals={"loss": float(loss[s]), "grad_norm": float(g[s]), "lr": 1e-3})
                     for s in range(N)]
    return out


def round_robin(per_rank: dict[int, list[StepRecord]]) -> list[StepRecord]:
    return [per_rank[r][s] for s in range(N) for r in sorted(per_rank)]


def chunked(per_rank: dict[int, list[StepRecord]], chunk: int, order: list[int]) -> list[StepRecord]:
    """Each rank's stream in order, ranks taking turns by ``chunk`` records (how a worker drains streams)."""
    return [rec for start in range(0, N, chunk) for r in order for rec in per_rank[r][start:start + chunk]]


def shuffled(per_rank: dict[int, list[StepRecord]], seed: int) -> list[StepRecord]:
    """Random interleaving that keeps each rank's order (ranks drift apart by up to tens of steps)."""
    rng = random.Random(seed)
    cursors = dict.fromkeys(per_rank, 0)
    out = []
    while any(c < N for c in cursors.values()):
        rank = rng.choice([r for r, c in cursors.items() if c < N])
        out.append(per_rank[rank][cursors[rank]])
        cursors[rank] += 1
    return out


def disagreements(alerts: list[Finding]) -> list[tuple]:
    return sorted((a.step, a.rank, a.host, a.signal, a.severity) for a in alerts if a.kind == "rank_disagreement")


def test_one_rank_with_a_different_grad_norm_is_named_with_its_host() -> None:
    alerts, _ = diagnose(round_robin(run_records(grad_fault=(250, 1.8))))
    assert disagreements(alerts) == [(250, 2, "node-1-gpu0", "grad_norm", Severity.ERROR)]
    [alert] = [a for a in alerts if a.kind == "rank_disagreement"]
    assert "rank 2 (host node-1-gpu0)" in alert.message
    assert alert.causes[0].cause == "hardware_fault" and "rank 2" in alert.causes[0].evidence
    [event] = [e for e in analyze(round_robin(run_records(grad_fault=(250, 1.8))), "r").events
               if e["kind"] == "rank_disagreement"]
    assert (event["rank"], event["host"], event["causes"][0]["cause"]) == (2, "node-1-gpu0", "hardware_fault")


def test_sharded_ranks_norms_are_not_compared_but_their_losses_are() -> None:
    """FSDP2 ranks each norm their own shard of the parameters (coordinate ``sharded``): norms that differ 2x by
    rank, every step, are no disagreement; a loss that does is still found."""
    def shard(per_rank: dict[int, list[StepRecord]]) -> dict[int, list[StepRecord]]:
        return {r: [dataclasses.replace(rec, coords={**rec.coords, SHARDED: 1},
                                        signals={**rec.signals, "grad_norm": rec.signals["grad_norm"] * (1 + r)})
                    for rec in recs] for r, recs in per_rank.items()}

    assert disagreements(diagnose(round_robin(shard(run_records())))[0]) == []
    jump = run_records(grad_fault=(250, 1.8))  # one rank's norm off at one step: unsharded, a disagreement
    assert disagreements(diagnose(round_robin(jump))[0])
    assert disagreements(diagnose(round_robin(shard(jump)))[0]) == []
    found = disagreements(diagnose(round_robin(shard(run_records(loss_fault=(250, 260, 3.0)))))[0])
    assert found and {(step, rank, signal) for step, rank, _, signal, _ in found} <= {
        (s, 2, "loss") for s in range(250, 260)}, found


def test_clean_ranks_agree() -> None:
    alerts, _ = diagnose(round_robin(run_records()))
    assert disagreements(alerts) == []


@pytest.mark.parametrize("order", ["chunk10", "reversed", "shuffle1", "shuffle2", "world"])
def test_interleaved_arrival_gives_the_same_result(order: str) -> None:
    per_rank = run_records(grad_fault=(250, 1.8), loss_fault=(300, 304, 1.8), world=order == "world")
    expected, _ = diagnose(round_robin(per_rank))
    recs = {"chunk10": lambda: chunked(per_rank, 10, [0, 1, 2, 3]),
            "reversed": lambda: chunked(per_rank, 7, [3, 2, 1, 0]),
            "shuffle1": lambda: shuffled(per_rank, 1), "shuffle2": lambda: shuffled(per_rank, 2),
            "world": lambda: chunked(per_rank, 150, [1, 0, 3, 2])}[order]()
    alerts, _ = diagnose(recs)
    assert disagreements(alerts) == disagreements(expected)
    assert [(s, r, sig) for s, r, _, sig, _ in disagreements(alerts)] == [(250, 2, "grad_norm"),
                                                                         (301, 2, "loss")]


def test_loss_needs_persistence_but_a_lone_nan_does_not() -> None:
    alerts, _ = diagnose(round_robin(run_records(loss_fault=(200, 201, 2.0))))
    assert disagreements(alerts) == []  # one odd batch on one rank: not a hardware fault
    alerts, _ = diagnose(round_robin(run_records(loss_fault=(200, 203, 2.0))))
    assert [(s, r, sig) for s, r, _, sig, _ in disagreements(alerts)] == [(201, 2, "loss")]
    alerts, _ = diagnose(round_robin(run_records(nan_at=220)))
    assert [(s, r, sig) for s, r, _, sig, _ in disagreements(alerts)] == [(220, 2, "loss")]
    # a NaN loss on one rank: a faulty device first, a bad batch on that rank second
    [nan] = [a for a in alerts if a.kind == "rank_disagreement"]
    assert [c.cause for c in nan.causes[:2]] == ["hardware_fault", "bad_batch"], nan.causes


@pytest.mark.parametrize("split", [500, 1001, 1003, 1203])
def test_state_round_trip_mid_stream(split: int) -> None:
    recs = shuffled(run_records(grad_fault=(250, 1.8), loss_fault=(300, 304, 1.8)), 3)
    full_alerts, _ = diagnose(recs)
    assert diagnose_split(recs, split) == full_alerts


def test_state_stays_bounded_when_a_rank_stops_reporting() -> None:
    per_rank = run_records()
    detector = CrossRankDetector()
    for rec in round_robin(per_rank):
        if rec.rank != 3 or rec.step < 20:
            detector.update(rec)
    assert len(detector.state_dict()["pending"]) <= detector.config.lag + 1


@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_first_alert_of_the_faulty_rank_already_names_the_hardware(bad: int) -> None:
    # the faulty replica's own loss is up too, so its own grad detector alarms at once (a huge norm with a normal
    # loss waits for the next record: it may be a one-step bad batch)
    alerts, diag = diagnose(round_robin(run_records(grad_fault=(250, 100.0), loss_fault=(250, 251, 2.0), bad=bad)))
    first = next(a for a in alerts if a.rank == bad)
    assert first.kind == "grad_explosion" and first.step == 250
    host = f"node-{bad // 2}-gpu{bad % 2}"
    # rank 0 reports step 250 before any other replica: its finding waits for the step to be complete
    assert first.causes[0].cause == "hardware_fault" and f"rank {bad}" in first.causes[0].evidence
    [incident] = [i for i in diag.incidents if i.rank == bad]
    assert incident.kinds[:2] == ["grad_explosion", "rank_disagreement"]  # then the loss spike's INFO (reverted)
    assert incident.headline.kind == "rank_disagreement" and incident.headline.host == host
    assert incident.headline.causes[0].cause == "hardware_fault"
    assert [a.rank for a in alerts if a.severity is not Severity.INFO] == [bad, bad]  # the other ranks are quiet


def test_faulty_rank_0_first_is_alerted_once_the_step_is_complete() -> None:
    """Rank 0 reports first: its grad-norm alert is held (not ranked ``unknown``) until ranks 1-3 report step 250,
    and is returned by the update of the last of them (no delay in steps)."""
    diag = RunDiagnoser()
    when: list[tuple[int, int, Finding]] = []
    for rec in round_robin(run_records(grad_fault=(250, 100.0), loss_fault=(250, 251, 2.0), bad=0)):
        when += [(rec.step, rec.rank, a) for a in diag.update(rec) if a.severity is not Severity.INFO]
    step, rank, first = when[0]
    assert (step, rank, first.rank, first.kind) == (250, 3, 0, "grad_explosion")
    assert first.causes[0].cause == "hardware_fault"
    assert diag.state_dict()["held"] == []


def test_held_finding_is_released_when_the_other_ranks_lag() -> None:
    """Ranks drained in chunks of 50 records: rank 0's finding does not wait for ranks that are 50 steps behind,
    only ``hold_steps`` steps of its own; the held finding survives a state round trip."""
    per_rank = run_records(grad_fault=(220, 100.0), loss_fault=(220, 221, 2.0), bad=0)
    recs = chunked(per_rank, 50, [0, 1, 2, 3])
    diag = RunDiagnoser()
    hold = diag.config.hold_steps
    out: list[tuple[int, int, Finding]] = []
    for rec in recs:
        if rec.rank == 0 and rec.step == 221:  # held now: round-trip the state
            state = msgpack.unpackb(msgpack.packb(diag.state_dict(), use_bin_type=True), raw=False)
            assert [f["kind"] for _, f in state["held"]] == ["grad_explosion"]
            diag = RunDiagnoser()
            diag.load_state_dict(state)
        out += [(rec.step, rec.rank, a) for a in diag.update(rec) if a.kind == "grad_explosion"]
    [(step, rank, alert)] = out
    assert rank == 0 and step == 220 + hold and alert.step == 220
