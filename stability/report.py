"""Post-mortem reports: a plain-text summary and one self-contained HTML file (inline CSS and SVG, no assets)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from stability.postmortem import PostmortemResult
from stability.records import StepRecord

__all__ = ["render_html", "render_text"]

_COLORS = {"info": "#6b7280", "warning": "#d97706", "error": "#dc2626"}


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _host(event: dict[str, Any]) -> str:
    return f", host {event['host']}" if event.get("host") else ""


def render_text(result: PostmortemResult) -> str:
    """A plain-text summary: events table, top causes, remedy and rollback step of each event."""
    events = result.events
    serious = [e for e in events if e["severity"] != "info"]
    lines = [f"run {result.run_id}: {_plural(result.steps, 'step')}, {_plural(len(events), 'event')} "
             f"({len(serious)} warning/error, {len(events) - len(serious)} info)"]
    if not events:
        lines.append("no instability detected")
        return "\n".join(lines) + "\n"
    header = ("severity", "kind", "rank", "onset", "step", "end", "top cause", "score")
    rows = [(e["severity"], e["kind"], str(e["rank"]), str(e["onset"]), str(e["step"]), _cell(e["end"]),
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
        lines.append(f"  remedy: {event['remedy']}")
        lines.append(f"  rollback step: {_cell(event['rollback_step'])}")
        if event["skip_batches"]:
            lines.append(f"  skip batches: {', '.join(event['skip_batches'])}")
    return "\n".join(lines) + "\n"


def _loss_points(records: Sequence[StepRecord]) -> list[tuple[int, float]]:
    points = [(r.step, r.get("loss")) for r in records if r.rank == min(x.rank for x in records)]
    return sorted((s, v) for s, v in points if math.isfinite(v) and v > 0)


def _svg(records: Sequence[StepRecord], events: list[dict[str, Any]], width: int = 900, height: int = 260) -> str:
    points = _loss_points(records) if records else []
    if len(points) < 2:
        return "<p>(no finite loss to plot)</p>"
    pad = 40
    x0, x1 = points[0][0], points[-1][0]
    logs = [math.log(v) for _, v in points]
    y0, y1 = min(logs), max(logs)
    span_x, span_y = max(x1 - x0, 1), max(y1 - y0, 1e-9)

    def sx(step: float) -> float:
        return pad + (step - x0) / span_x * (width - 2 * pad)

    def sy(logv: float) -> float:
        return height - pad - (logv - y0) / span_y * (height - 2 * pad)

    stride = max(1, len(points) // 2000)
    path = " ".join(f"{sx(s):.1f},{sy(ly):.1f}" for (s, _), ly in list(zip(points, logs, strict=True))[::stride])
    marks = []
    for event in events:
        x = sx(min(max(event["onset"], x0), x1))
        color = _COLORS.get(event["severity"], "#6b7280")
        title = html.escape(f"{event['kind']} ({event['severity']}) onset {event['onset']}, step {event['step']}")
        marks.append(f'<line x1="{x:.1f}" y1="{pad}" x2="{x:.1f}" y2="{height - pad}" stroke="{color}" '
                     f'stroke-width="1.5" stroke-dasharray="4 3"><title>{title}</title></line>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" class="chart" role="img" '
            f'aria-label="loss (log scale)"><rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>'
            f'<polyline fill="none" stroke="#2563eb" stroke-width="1" points="{path}"/>{"".join(marks)}'
            f'<text x="{pad}" y="{pad - 10}" font-size="12">loss (log scale), steps {x0}..{x1}; '
            f'max {math.exp(y1):.4g}, min {math.exp(y0):.4g}</text></svg>')


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#111}table{border-collapse:collapse}"
        "td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}"
        ".info{color:#6b7280}.warning{color:#d97706}.error{color:#dc2626;font-weight:bold}.chart{max-width:100%}")


def render_html(result: PostmortemResult, records: Sequence[StepRecord]) -> str:
    """One self-contained HTML page: summary, loss chart with incident markers, events and their causes."""
    esc = html.escape
    events = result.events
    rows = []
    for e in events:
        causes = "<br>".join(f"<b>{esc(c['cause'])}</b> ({c['score']:.2f}): {esc(c['evidence'])}"
                             for c in e["causes"][:3])
        rows.append(f'<tr><td class="{e["severity"]}">{e["severity"]}</td><td>{esc(e["kind"])}</td>'
                    f'<td>{e["rank"]}{esc(_host(e))}</td><td>{e["onset"]}</td><td>{e["step"]}</td><td>{_cell(e["end"])}</td>'
                    f'<td>{esc(e["message"])}</td><td>{causes}</td><td>{esc(e["remedy"])}</td>'
                    f'<td>{_cell(e["rollback_step"])}</td></tr>')
    table = ("<table><tr><th>severity</th><th>kind</th><th>rank</th><th>onset</th><th>step</th><th>end</th>"
             "<th>what</th><th>causes</th><th>remedy</th><th>rollback</th></tr>" + "".join(rows) + "</table>"
             if rows else "<p>No instability detected.</p>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>stability post-mortem: "
            f"{esc(result.run_id)}</title><style>{_CSS}</style></head><body>"
            f"<h1>Post-mortem of {esc(result.run_id)}</h1><p>{result.steps} steps &middot; "
            f"{_plural(len(result.ranks), 'rank')} ({', '.join(map(str, result.ranks))}) &middot; "
            f"{_plural(len(events), 'event')}</p>{_svg(records, events)}"
            f"<h2>Events</h2>{table}</body></html>\n")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
