"""The plain-text summary of a post-mortem (printed by ``stability postmortem``)."""

from __future__ import annotations

import time
from typing import Any

from stability.console import display_remedy
from stability.postmortem import PostmortemResult

__all__ = ["baseline_lines", "cell", "perf_lines", "phase_lines", "plural", "render_text", "rollback_words",
           "timeline_lines"]


def cell(value: Any) -> str:
    """``-`` for None, else ``str(value)``."""
    return "-" if value is None else str(value)


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _host(event: dict[str, Any]) -> str:
    return f", host {event['host']}" if event.get("host") else ""


def rollback_words(event: dict[str, Any]) -> str:
    """The rollback advice of an event in words."""
    step = event.get("rollback_step")
    if step is None:
        return "No rollback step: the records show no precursor before the onset"
    return (f"Resume from the last checkpoint at or before step {step} (the last step before the earliest "
            f"precursor; the onset was step {event['onset']})")


def timeline_lines(result: PostmortemResult) -> list[str]:
    """Segments (resumes) and log events (system faults, checkpoint loads, overflow counts) in words."""
    lines = []
    for seg in result.segments[1:]:
        lines.append(f"resume: segment {seg.index + 1} starts at step {seg.first_step} after step "
                     f"{seg.resumed_after} ({seg.reason}); steps {seg.first_step}-{seg.last_step}")
    kinds: dict[str, int] = {}
    for event in result.log_events:
        kinds[event.kind] = kinds.get(event.kind, 0) + 1
    shown = 0
    for event in result.log_events:
        if event.kind in ("overflow",) or shown >= 10:
            continue
        shown += 1
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(event.wall_time)) if event.wall_time else ""
        where = ", ".join(x for x in (f"step {event.step}" if event.step is not None else "", when) if x) or "undated"
        lines.append(f"log event: {event.kind} ({where}): {event.message[:160]}")
    if kinds.get("overflow"):
        lines.append(f"log events: {plural(kinds['overflow'], 'fp16 overflow')}")
    return lines


def perf_lines(result: PostmortemResult) -> list[str]:
    """Step time and memory per rank (when the records carry them) and the run directory's profiler traces and
    hang stack dumps (paths as found)."""
    lines = [f"performance: {line}" for line in result.performance]
    for artifact in result.artifacts:
        what = "profile trace" if artifact.kind == "profile" else "hang stacks"
        split = artifact.summary.get("split_s")
        extra = (" (" + ", ".join(f"{k} {v:.3g} s" for k, v in split.items()) + ")") if split else ""
        lines.append(f"{what}: {artifact.describe()}: {artifact.path}{extra}")
    return lines


def _g(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float | int) else str(value)


def phase_lines(result: PostmortemResult) -> list[str]:
    """The run's phases (warm-up, stable, degradation, divergence, restart) in one line each."""
    if not result.phases:
        return []
    lines = ["phases:"]
    for phase in result.phases:
        if phase.label == "restart":
            lines.append(f"  restart at step {phase.first_step}: {phase.evidence}")
            continue
        loss = (f", loss {phase.loss_start:.4g} -> {phase.loss_end:.4g}"
                if phase.loss_start is not None and phase.loss_end is not None else "")
        why = f" ({phase.evidence})" if phase.evidence else ""
        lines.append(f"  {phase.label:<11} steps {phase.first_step}-{phase.last_step}{loss}{why}")
    return lines


def baseline_lines(result: PostmortemResult) -> list[str]:
    """Where the run parts from its baseline (``--baseline``), signal by signal, earliest first."""
    base = result.baseline
    if base is None:
        return []
    names = list(base["compared"])
    more = f" (+{len(names) - 12} more)" if len(names) > 12 else ""
    lines = [f"baseline {base['baseline']}: {base['shared_steps']} shared steps "
             f"({base['first_step']}-{base['last_step']}), signals compared: {', '.join(names[:12])}{more}"]
    if base.get("parts_at") is None:
        lines.append("  the runs do not part: every shared signal stays within its early-step noise band")
        return lines
    lines.append(f"  the runs part at step {base['parts_at']}, first in {base['signals'][0]['signal']}")
    for row in base["signals"]:
        if row["parts_at"] is None:
            continue
        lines.append(f"  - {row['signal']}: from step {row['parts_at']}, {_g(row['ratio'])}x its noise band "
                     f"(median relative difference {_g(row['rel_diff'])} after, band {_g(row['band'])})")
    same = [row["signal"] for row in base["signals"] if row["parts_at"] is None]
    if same:
        more = f" (+{len(same) - 12} more)" if len(same) > 12 else ""
        lines.append(f"  within the band throughout: {', '.join(same[:12])}{more}")
    return lines


def render_text(result: PostmortemResult) -> str:
    """A plain-text summary: events table, top causes, remedy and rollback step of each event; step time and
    memory per rank (when recorded); the run directory's profiler traces and hang stack dumps."""
    events = result.events
    serious = [e for e in events if e["severity"] != "info"]
    lines = [f"run {result.run_id}: {plural(result.steps, 'step')}, {plural(len(events), 'event')} "
             f"({len(serious)} warning/error, {len(events) - len(serious)} info)"]
    lines.extend(timeline_lines(result))
    lines.extend(perf_lines(result))
    lines.extend(phase_lines(result))
    lines.extend(baseline_lines(result))
    if not events:
        lines.append("no instability detected")
        return "\n".join(lines) + "\n"
    header = ("severity", "kind", "rank", "onset", "step", "end", "top cause", "score")
    rows = [(e["severity"], e["kind"], str(e["rank"]), str(e["onset"]), str(e["step"]), cell(e["end"]),
             e["causes"][0]["cause"] if e["causes"] else "unknown",
             f"{e['causes'][0]['score']:.2f}" if e["causes"] else "-") for e in events]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    for event in serious or events[:5]:
        lines.append("")
        lines.append(f"[{event['severity'].upper()}] {event['kind']} at step {event['step']} "
                     f"(rank {event['rank']}{_host(event)}): {event['message']}")
        if len(event.get("kinds", ())) > 1:
            lines.append(f"  evidence from: {', '.join(event['kinds'])}")
        for cause in event["causes"][:3]:
            lines.append(f"  - {cause['cause']} ({cause['score']:.2f}): {cause['evidence']}")
        lines.append(f"  remedy: {display_remedy(event['remedy'], event['skip_batches'])}")
        lines.append(f"  rollback step: {cell(event['rollback_step'])}")
        if event["skip_batches"]:
            lines.append(f"  skip batches: {', '.join(event['skip_batches'])}")
    return "\n".join(lines) + "\n"
