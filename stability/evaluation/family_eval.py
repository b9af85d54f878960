"""Scoring of the families corpus: the issue #8 targets, both splits side by side, and the calibration export.

The protocol is :mod:`stability.evaluation.scoring` with ``any_severity=True`` (an event is detected by any
finding in its window, INFO included; false alarms are still warnings and errors). The targets (issue #8):

* recall >= 0.95 at any severity; <= 1 warning/error false alarm per 10k clean steps;
* AC@1 >= 0.9 and AC@3 >= 0.95 on the first finding of each event;
* median delay <= 1 step for one-step faults (bad batch, LR spike, NaN in data, a corrupted replica);
* an out-of-schedule LR rise (``lr_drift``) warned (warning/error) within 20 steps of the LR's departure;
* slow divergence (events with a ``rise``) alerted within 50 steps of the loss's first sustained rise;
* the faulty replica named at 2, 4 and 8 replicas.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack

from stability.evaluation.corpus import GeneratedRun
from stability.evaluation.families import FamilySpec, calib_specs
from stability.evaluation.runner import STABILITY, Evaluation, Target, _fmt, _table
from stability.evaluation.scoring import EventOutcome, percentile
from stability.records import encode

__all__ = ["ONE_STEP_FAULTS", "export_calibration", "family_targets", "render_late", "render_side_by_side"]

ONE_STEP_FAULTS = frozenset({"bad_batch", "lr_spike", "nan_data", "dp_rank"})


def _specs(runs: Sequence[GeneratedRun]) -> dict[str, FamilySpec]:
    return {r.name: r.spec for r in runs if isinstance(r.spec, FamilySpec)}


def _of_fault(ev: Evaluation, runs: Sequence[GeneratedRun], faults: frozenset[str]) -> list[EventOutcome]:
    specs = _specs(runs)
    return [o for o in ev.scores[STABILITY].outcomes if o.run in specs and specs[o.run].fault in faults]


def _within(outcomes: Sequence[EventOutcome], start: Any, limit: int) -> tuple[int, int, list[int]]:
    """(on time, events, delays) of the first warning/error measured from ``start(event)``."""
    delays = [o.first_alert.step - start(o.event) for o in outcomes if o.first_alert is not None]
    return sum(d <= limit for d in delays), len(outcomes), delays


def family_targets(ev: Evaluation, runs: Sequence[GeneratedRun]) -> list[Target]:
    """The issue #8 targets on one split of the families corpus."""
    s = ev.scores[STABILITY]
    out = [Target(name="recall (any severity)", want=">= 0.95",
                  got=f"{_fmt(s.recall)} ({s.detected}/{s.events}; warning/error only {_fmt(ev.alert_recall)})",
                  ok=s.recall >= 0.95)]
    fa = s.fa_clean_per_10k
    out.append(Target(name="false alarms / 10k clean steps", want="<= 1",
                      got=f"{_fmt(fa)} ({s.clean_alarms} in {s.clean_steps} steps)", ok=fa <= 1.0))
    for source, (alarms, steps) in sorted(s.clean_by_source.items()):
        rate = 1e4 * alarms / steps if steps else math.nan
        out.append(Target(name=f"  of which {source}", want="<= 1", got=f"{_fmt(rate)} ({alarms} in {steps})",
                          ok=rate <= 1.0))
    out.append(Target(name="root cause AC@1 (first finding)", want=">= 0.9",
                      got=f"{_fmt(s.ac1_rate)} (n={s.rca_events})", ok=s.ac1_rate >= 0.9))
    out.append(Target(name="root cause AC@3 (first finding)", want=">= 0.95",
                      got=f"{_fmt(s.ac3_rate)} (n={s.rca_events})", ok=s.ac3_rate >= 0.95))
    one = [o.delay for o in _of_fault(ev, runs, ONE_STEP_FAULTS) if o.delay is not None]
    med = percentile(one, 50)
    out.append(Target(name="median delay, one-step faults", want="<= 1 step", got=f"{_fmt(med, 1)} (n={len(one)})",
                      ok=med <= 1))
    ok, n, delays = _within(_of_fault(ev, runs, frozenset({"lr_drift"})), lambda e: e.precursor_start, 20)
    out.append(Target(name="LR rise warned <= 20 steps after departure", want="every lr_drift event",
                      got=f"{ok}/{n} (median {_fmt(percentile(delays, 50), 1)})", ok=n > 0 and ok == n))
    slow = [o for o in s.outcomes if o.event.rise is not None]
    ok, n, delays = _within(slow, lambda e: e.rise, 50)
    out.append(Target(name="slow divergence alerted <= 50 steps after rise", want="every slow divergence",
                      got=f"{ok}/{n} (median {_fmt(percentile(delays, 50), 1)})", ok=n > 0 and ok == n))
    specs = _specs(runs)
    for ranks in (2, 4, 8):
        rank = [o for o in s.outcomes if o.rank_named is not None and o.run in specs and specs[o.run].ranks == ranks]
        named = sum(bool(o.rank_named) for o in rank)
        out.append(Target(name=f"faulty replica named, {ranks} replicas", want="every event",
                          got=f"{named}/{len(rank)}", ok=bool(rank) and named == len(rank)))
    return out


def render_late(ev: Evaluation, runs: Sequence[GeneratedRun]) -> str:
    """Events detected but later than their timing target (LR rise > 20 steps, slow divergence > 50 steps)."""
    lines = ["Late (timing targets of issue #8):"]
    for o in _of_fault(ev, runs, frozenset({"lr_drift"})):
        alert = o.first_alert
        if alert is None or alert.step - o.event.precursor_start > 20:
            when = "no warning/error" if alert is None else f"first warning/error {alert.kind} at {alert.step}"
            lines.append(f"  LR-RISE {o.run}: LR left its schedule at {o.event.precursor_start}, {when}")
    for o in ev.scores[STABILITY].outcomes:
        rise, alert = o.event.rise, o.first_alert
        if rise is not None and (alert is None or alert.step - rise > 50):
            when = "no warning/error" if alert is None else f"first warning/error {alert.kind} at {alert.step}"
            lines.append(f"  SLOW-DIVERGENCE {o.run}: loss rose from {rise} (1.5x at {o.event.onset}), {when}")
    return "\n".join(lines)


def render_side_by_side(splits: Mapping[str, tuple[Evaluation, Sequence[GeneratedRun]]]) -> str:
    """Stability's totals, per-kind recall and targets of each split in one table (columns = splits)."""
    names = list(splits)
    rows: list[list[str]] = []

    def row(label: str, values: Sequence[str]) -> None:
        rows.append([label, *values])

    evs = [splits[n][0] for n in names]
    row("runs / records", [f"{e.runs} / {e.records}" for e in evs])
    row("recall, any severity", [f"{_fmt(e.scores[STABILITY].recall)} ({e.scores[STABILITY].detected}/"
                                 f"{e.scores[STABILITY].events})" for e in evs])
    row("recall, warning/error", [_fmt(e.alert_recall) for e in evs])
    row("FA / 10k clean (synth / real)", [f"{_fmt(e.scores[STABILITY].fa_clean_per_10k)} ("
                                          f"{_fmt(e.scores[STABILITY].fa_per_10k('synthetic'))} / "
                                          f"{_fmt(e.scores[STABILITY].fa_per_10k('real-clean'))})" for e in evs])
    row("AC@1 / AC@3", [f"{_fmt(e.scores[STABILITY].ac1_rate)} / {_fmt(e.scores[STABILITY].ac3_rate)}" for e in evs])
    row("max-z AC@1 / AC@3", [f"{_fmt(e.maxz.ac1_rate)} / {_fmt(e.maxz.ac3_rate)}" for e in evs])
    kinds = sorted({k for e in evs for k in e.scores[STABILITY].kinds})
    for kind in kinds:
        vals = []
        for e in evs:
            k = e.scores[STABILITY].kinds.get(kind)
            vals.append("-" if k is None else f"{k.detected}/{k.events} (delay {_fmt(k.median_delay, 1)})")
        row(f"  {kind}", vals)
    goals = [{t.name: t for t in family_targets(*splits[n])} for n in names]
    for name in dict.fromkeys(t for g in goals for t in g):
        row(f"target: {name}", [f"{g[name].got} {'PASS' if g[name].ok else 'FAIL'}" if name in g else "-"
                                 for g in goals])
    return "Families corpus, stability by split\n" + _table(["", *names], rows)


def export_calibration(runs: Sequence[GeneratedRun], dest: Path) -> int:
    """Write every *calibration* run to ``dest/<name>.msgpack`` (one ``stability.records.encode`` frame per
    record, length-prefixed by msgpack: a msgpack array of bytes) and ``dest/<name>.labels.json``; refuses any run
    outside the calibration split (the test split never leaves the cache). Returns the number of runs written."""
    allowed = {s.name: s.key() for s in calib_specs()}
    dest.mkdir(parents=True, exist_ok=True)
    for run in runs:
        spec = run.spec
        if not isinstance(spec, FamilySpec) or allowed.get(spec.name) != spec.key():
            raise ValueError(f"{run.name} is not a calibration run: refusing to export it")
        (dest / f"{run.name}.msgpack").write_bytes(msgpack.packb([encode(r) for r in run.records],
                                                                 use_bin_type=True))
        labels = {"name": run.name, "clean": run.clean, "spec": asdict(spec),
                  "events": [asdict(e) for e in run.events]}
        (dest / f"{run.name}.labels.json").write_text(json.dumps(labels, indent=1) + "\n", encoding="utf-8")
    return len(runs)

