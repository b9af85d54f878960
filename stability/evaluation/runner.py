"""``python -m stability.evaluation [--full] [--json OUT]``: score stability and the baselines, print the table.

Steps: generate (or read from the cache) the synthetic corpus, load the real logs, run
:class:`~stability.detectors.engine.RunDiagnoser` and every baseline over each run, score them with
:mod:`stability.evaluation.scoring`, print one table per detector and the issue #4 targets with pass/fail.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.evaluation.baselines import BASELINES, maxz_causes
from stability.evaluation.corpus import GeneratedRun, ci_specs, full_specs, generate
from stability.evaluation.labels import default_data_dir, load_real
from stability.evaluation.scoring import Alarm, Protocol, RunResult, Score, percentile, score
from stability.records import StepRecord

__all__ = ["Evaluation", "Target", "evaluate", "main", "stability_alarms", "targets"]

STABILITY = "stability"
KIND_ORDER = ("loss_spike", "divergence", "nan", "bad_batch", "grad_explosion", "grad_vanishing",
              "loss_scale_collapse", "cross_rank")


def findings_to_alarms(findings: Iterable[Finding]) -> list[Alarm]:
    """Findings as alarms: severity, kind, ranked cause ids, and message plus top-cause evidence as text."""
    return [Alarm(step=f.step, rank=f.rank, severity=f.severity.value, kind=f.kind,
                  causes=tuple(c.cause for c in f.causes),
                  text=" ".join([f.message, *(c.evidence for c in f.causes[:1])])) for f in findings]


def stability_alarms(records: Sequence[StepRecord]) -> list[Alarm]:
    """Run a fresh :class:`RunDiagnoser` over ``records`` (by step, then rank) and return its alerted findings."""
    diagnoser = RunDiagnoser()
    found: list[Finding] = []
    for record in sorted(records, key=lambda r: (r.step, r.rank)):
        found.extend(diagnoser.update(record))
    found.extend(diagnoser.finish())
    return findings_to_alarms(f for f in found if not f.evidence.get("revised"))  # corrections, not new alarms


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxZ:
    """The max-z root-cause baseline at the labelled onset (an oracle detection time)."""

    events: int
    ac1: int
    ac3: int

    @property
    def ac1_rate(self) -> float:
        return self.ac1 / self.events if self.events else math.nan

    @property
    def ac3_rate(self) -> float:
        return self.ac3 / self.events if self.events else math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """Scores of every detector, the max-z RCA baseline and the corpus size."""

    scores: dict[str, Score]
    maxz: MaxZ
    runs: int
    records: int
    seconds: float
    alert_recall: float = math.nan
    """With ``Protocol.any_severity``: stability's recall counting warnings/errors only (for comparison)."""


def _result(run: GeneratedRun, alarms: list[Alarm]) -> RunResult:
    steps: dict[int, list[int]] = {}
    for record in run.records:
        steps.setdefault(record.rank, []).append(record.step)
    return RunResult(name=run.name, events=run.events, alarms=alarms, steps=steps, clean=run.clean,
                     count_false_alarms=run.source != "real-excerpt", source=run.source)


def evaluate(runs: Sequence[GeneratedRun], protocol: Protocol | None = None,
             detectors: dict[str, Callable[[Sequence[StepRecord]], list[Alarm]]] | None = None) -> Evaluation:
    """Score stability and the baselines (or ``detectors``) on ``runs``."""
    start = time.perf_counter()
    chosen = detectors if detectors is not None else {STABILITY: stability_alarms, **BASELINES}
    results: dict[str, list[RunResult]] = {name: [] for name in chosen}
    for run in runs:
        for name, detect in chosen.items():
            results[name].append(_result(run, detect(run.records)))
    n = a1 = a3 = 0
    for run in runs:
        for event in run.events:
            if event.cause is None:
                continue
            causes = maxz_causes(run.records, event.onset, rank=event.rank)
            n, a1, a3 = n + 1, a1 + (event.cause in causes[:1]), a3 + (event.cause in causes[:3])
    alert_recall = math.nan
    if protocol is not None and protocol.any_severity and STABILITY in results:
        alert_recall = score(results[STABILITY], replace(protocol, any_severity=False)).recall
    return Evaluation(scores={name: score(res, protocol) for name, res in results.items()},
                      maxz=MaxZ(events=n, ac1=a1, ac3=a3), runs=len(runs),
                      records=sum(len(r.records) for r in runs), seconds=time.perf_counter() - start,
                      alert_recall=alert_recall)


# ------------------------------------------------------------------------------------------------ targets
@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One issue #4 target and whether stability meets it."""

    name: str
    want: str
    got: str
    ok: bool


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def targets(ev: Evaluation) -> list[Target]:
    """The issue #4 targets, evaluated on stability's score."""
    s = ev.scores[STABILITY]
    out = []
    for kind in ("loss_spike", "divergence", "nan"):
        k = s.kinds.get(kind)
        rec = k.recall if k else math.nan
        out.append(Target(name=f"recall {kind}", want=">= 0.95", got=_fmt(rec), ok=rec >= 0.95))
    fa = 1e4 * s.clean_alarms / s.clean_steps if s.clean_steps else math.nan
    out.append(Target(name="false alarms / 10k steps (clean runs)", want="<= 1",
                      got=f"{_fmt(fa)} ({s.clean_alarms} in {s.clean_steps} steps)", ok=fa <= 1.0))
    for source, (alarms, steps) in sorted(s.clean_by_source.items()):
        fa = 1e4 * alarms / steps if steps else math.nan
        out.append(Target(name=f"  of which {source}", want="<= 1", got=f"{_fmt(fa)} ({alarms} in {steps} steps)",
                          ok=fa <= 1.0))
    spike = s.kinds.get("loss_spike")
    med = spike.median_delay if spike else math.nan
    out.append(Target(name="median loss_spike delay (steps)", want="<= 1", got=_fmt(med, 1), ok=med <= 1))
    out.append(Target(name="precursor hit rate / random", want=">= 3x",
                      got=f"{_fmt(s.precursor_ratio, 1)}x ({s.precursor_hits}/{s.precursor_events} vs "
                          f"{_fmt(s.random_hit_rate, 3)})", ok=s.precursor_ratio >= 3.0))
    out.append(Target(name="root cause AC@1", want=">= 0.9", got=f"{_fmt(s.ac1_rate)} (n={s.rca_events})",
                      ok=s.ac1_rate >= 0.9))
    out.append(Target(name="root cause AC@3", want=">= 0.95", got=f"{_fmt(s.ac3_rate)} (n={s.rca_events})",
                      ok=s.ac3_rate >= 0.95))
    out.append(Target(name="faulty rank named", want="every cross-rank event",
                      got=f"{s.ranks_named}/{s.rank_events}", ok=s.rank_events > 0 and s.ranks_named == s.rank_events))
    for name, b in ev.scores.items():
        if name == STABILITY:
            continue
        ok = s.recall >= b.recall and s.fa_clean_per_10k <= max(b.fa_clean_per_10k, 1.0)
        out.append(Target(name=f"beats {name}", want="recall >=, clean FA <= max(its FA, 1)",
                          got=f"recall {_fmt(s.recall)} vs {_fmt(b.recall)}, FA {_fmt(s.fa_clean_per_10k)} vs "
                              f"{_fmt(b.fa_clean_per_10k)}", ok=ok))
    out.append(Target(name="beats max-z RCA", want="AC@1 >", got=f"{_fmt(s.ac1_rate)} vs {_fmt(ev.maxz.ac1_rate)}",
                      ok=s.ac1_rate > ev.maxz.ac1_rate))
    return out


# ------------------------------------------------------------------------------------------------ printing
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def render(ev: Evaluation, goals: Sequence[Target] | None = None, title: str = "Targets (issue #4)") -> str:
    """The tables as plain text (monospace); ``goals`` replaces the issue #4 targets (with ``title``)."""
    kinds = [k for k in KIND_ORDER if any(k in s.kinds for s in ev.scores.values())]
    kinds += sorted({k for s in ev.scores.values() for k in s.kinds} - set(kinds))
    parts = [f"corpus: {ev.runs} runs, {ev.records} records; scored in {ev.seconds:.1f} s", "",
             "Recall per event kind (detected/events), delay = first alert - onset in steps (median / p90)"]
    rows = []
    for name, s in ev.scores.items():
        for kind in kinds:
            k = s.kinds.get(kind)
            if k is None:
                continue
            rows.append([name, kind, f"{k.detected}/{k.events}", _fmt(k.recall), _fmt(k.median_delay, 1),
                         _fmt(k.p90_delay, 1)])
    parts.append(_table(["detector", "event kind", "detected", "recall", "delay med", "delay p90"], rows))
    by_source = ev.scores[STABILITY].by_source()
    sources = sorted({src for _, src in by_source})
    rows = [[kind, *(f"{by_source[(kind, src)][0]}/{by_source[(kind, src)][1]}" if (kind, src) in by_source else "-"
                     for src in sources)] for kind in kinds if any((kind, src) in by_source for src in sources)]
    parts += ["", "stability recall by corpus source (detected/events)", _table(["event kind", *sources], rows)]
    parts += ["", "Overall (false alarms = warning/error incidents per 10k steps; precursor = events with an alert "
              "before the onset, lead in steps, vs random alarms at the same rate; AC@k on detected events with a "
              "known cause)"]
    rows = []
    for name, s in ev.scores.items():
        rows.append([name, _fmt(s.recall), f"{_fmt(s.fa_clean_per_10k)} ({s.clean_alarms})",
                     f"{_fmt(s.fa_per_10k('synthetic'))} / {_fmt(s.fa_per_10k('real-clean'))}",
                     f"{_fmt(s.fa_segments_per_10k)} ({s.segment_alarms})",
                     f"{s.precursor_hits}/{s.precursor_events}", _fmt(percentile(s.precursor_leads, 50), 1),
                     _fmt(s.random_hit_rate, 3),
                     _fmt(s.precursor_ratio, 1), _fmt(s.ac1_rate) if s.rca_events and name == STABILITY else "-",
                     _fmt(s.ac3_rate) if s.rca_events and name == STABILITY else "-",
                     f"{s.ranks_named}/{s.rank_events}"])
    rows.append(["max-z RCA (at onset)", "-", "-", "-", "-", "-", "-", "-", "-", _fmt(ev.maxz.ac1_rate),
                 _fmt(ev.maxz.ac3_rate), "-"])
    parts.append(_table(["detector", "recall", "FA clean", "synth / real", "FA segments", "precursor", "lead med",
                         "random", "ratio", "AC@1", "AC@3", "rank named"], rows))
    parts += ["", title]
    parts.append(_table(["target", "want", "got", "pass"],
                        [[t.name, t.want, t.got, "PASS" if t.ok else "FAIL"]
                         for t in (targets(ev) if goals is None else goals)]))
    return "\n".join(parts)


def render_misses(ev: Evaluation, detector: str = STABILITY) -> str:
    """Missed events, wrong root causes and false alarms of one detector (for the docs and for tuning)."""
    s = ev.scores[detector]
    lines = [f"Misses of {detector}:"]
    for o in s.outcomes:
        e = o.event
        if o.first is None:
            lines.append(f"  MISSED {e.kind} in {o.run} (onset {e.onset}, window {e.precursor_start}-{e.end})")
        elif o.ac1 is False:
            lines.append(f"  CAUSE {o.run} {e.kind}: true {e.cause}, got {list(o.first.causes[:3])} "
                         f"(alert {o.first.kind} at {o.first.step})")
        if o.rank_named is False:
            lines.append(f"  RANK {o.run}: faulty rank {e.rank} not (only) named")
    for run, step in s.false_alarm_runs:
        lines.append(f"  FALSE ALARM {run} step {step}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Command line entry point; returns 0, or 1 with ``--strict`` when a target fails."""
    parser = argparse.ArgumentParser(prog="stability eval", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--corpus", choices=("legacy", "families"), default="legacy",
                        help="legacy: the calibration corpus of issue #4 (default); families: issue #8's corpus of "
                             "other model families with a calibration and a frozen test split")
    parser.add_argument("--split", choices=("calib", "test", "all"), default="calib",
                        help="families corpus: which split (all: both, side by side)")
    parser.add_argument("--ci", action="store_true", help="families corpus: the small CI subset (seed 7)")
    parser.add_argument("--export-calib", type=Path, metavar="DIR",
                        help="families corpus: write the calibration runs (records + labels) to DIR")
    parser.add_argument("--full", action="store_true", help="the full corpus (more seeds/variants; slow)")
    parser.add_argument("--json", type=Path, help="write every number to this JSON file")
    parser.add_argument("--seeds", help="comma-separated seeds for the full corpus (e.g. 5,6,7: held-out runs); with "
                                        "--corpus families: a held-out split of new seeds (e.g. 400,401), no real logs")
    parser.add_argument("--cache", type=Path, help="cache directory of generated runs")
    parser.add_argument("--real-runs", type=Path, help="directory of the real logs (default: shared/data)")
    parser.add_argument("--no-real", action="store_true", help="skip the real logs")
    parser.add_argument("--misses", action="store_true", help="list stability's misses and false alarms")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    out = out or sys.stdout

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    if args.corpus == "families":
        return _main_families(args, out, progress)
    if args.seeds:
        specs = full_specs(tuple(int(x) for x in args.seeds.split(",")))
    else:
        specs = full_specs() if args.full else ci_specs()
    runs = generate(specs, args.cache, progress)
    if not args.no_real:
        runs += load_real(args.real_runs or default_data_dir())
    ev = evaluate(runs)
    print(render(ev), file=out)
    if args.misses:
        print("\n" + render_misses(ev), file=out)
    if args.json:
        corpus = f"seeds {args.seeds}" if args.seeds else "full" if args.full else "ci"
        args.json.write_text(json.dumps(_payload(ev, corpus, targets(ev)), indent=2, default=str) + "\n",
                             encoding="utf-8")
    return 1 if args.strict and not all(t.ok for t in targets(ev)) else 0


def _payload(ev: Evaluation, corpus: str, goals: Sequence[Target]) -> dict[str, object]:
    return {"corpus": corpus, "runs": ev.runs, "records": ev.records,
            "scores": {k: v.to_dict() for k, v in ev.scores.items()},
            "alert_recall": None if math.isnan(ev.alert_recall) else ev.alert_recall,
            "maxz_rca": {"events": ev.maxz.events, "ac1": ev.maxz.ac1_rate, "ac3": ev.maxz.ac3_rate},
            "targets": [{"name": t.name, "want": t.want, "got": t.got, "ok": t.ok} for t in goals]}


def _main_families(args: argparse.Namespace, out: TextIO, progress: Callable[[str], None]) -> int:
    """``--corpus families``: generate/score one split (or both, side by side), or the CI subset."""
    from stability.evaluation.families import calib_specs, generate_families, holdout_specs, test_specs
    from stability.evaluation.families import ci_specs as family_ci
    from stability.evaluation.family_eval import (
        export_calibration,
        family_targets,
        render_late,
        render_side_by_side,
    )

    protocol = Protocol(any_severity=True)
    splits = (["ci"] if args.ci else ["holdout"] if args.seeds else ["calib", "test"] if args.split == "all"
              else [args.split])
    done: dict[str, tuple[Evaluation, list[GeneratedRun]]] = {}
    ok = True
    for split in splits:
        if split == "holdout":
            try:
                specs = holdout_specs(tuple(int(x) for x in args.seeds.split(",")))
            except ValueError as exc:
                raise SystemExit(f"stability eval: --seeds {args.seeds}: {exc}") from None
        else:
            specs = {"ci": family_ci, "calib": calib_specs, "test": test_specs}[split]()
        runs = generate_families(specs, args.cache, progress)
        if split == "calib" and args.export_calib:
            progress(f"exported {export_calibration(runs, args.export_calib)} runs to {args.export_calib}")
        if not args.no_real and split in ("calib", "test"):
            runs += load_real(args.real_runs or default_data_dir(), split=split)
        ev = evaluate(runs, protocol)
        goals = family_targets(ev, runs)
        ok = ok and all(t.ok for t in goals)
        done[split] = (ev, runs)
        print(render(ev, goals, f"Targets (issue #8), families corpus, split {split}"), file=out)
        if args.misses:
            print("\n" + render_misses(ev) + "\n" + render_late(ev, runs), file=out)
        print(file=out)
    if len(done) > 1:
        print(render_side_by_side({"calibration" if k == "calib" else k: v for k, v in done.items()}), file=out)
    if args.json:
        payload = {split: _payload(ev, f"families {split}", family_targets(ev, runs))
                   for split, (ev, runs) in done.items()}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return 1 if args.strict and not ok else 0
