"""The self-contained HTML report: one file, plotly.js inlined (opens offline), data embedded as JSON.

Sections: the verdict; the run's aligned, zoomable time series (loss raw + smoothed, LR, grad norm before
clipping, loss scale with skipped steps, step time) with incidents shaded from onset to end and their rollback
steps marked; when the records carry the timing hooks' signals, the step-time (step, data, compute, device time)
and memory (host RSS vs its limit, CUDA allocated / reserved / peak vs the device total) timelines per rank with the
performance incidents shaded, and links to the profiler traces and hang stack dumps of the run directory; per
warning/error incident the ranked causes, the remedy, the batches to skip and the rollback step in words, the
evidence signals around the onset and per-layer heat maps of robust z-scores (grad norm, update ratio) ordered
by which layer moved first; all events; the run's metadata.
"""

from __future__ import annotations

import html
import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stability import __version__
from stability.console import display_remedy
from stability.detectors.steptime import PERF_KINDS
from stability.postmortem import PostmortemResult
from stability.records import StepRecord
from stability.report import _data
from stability.report._text import cell, plural, rollback_words
from stability.report.artifacts import Artifact

__all__ = ["plotly_js", "render_html"]

log = logging.getLogger(__name__)

MAX_DETAILED = 20
"""Incidents with a detailed section (warning/error first, by onset); all are in the events table."""
_COLORS = {"info": "#6b7280", "warning": "#d97706", "error": "#dc2626"}


@cache
def plotly_js() -> str | None:
    """The plotly.js bundle shipped in the ``plotly`` wheel (``plotly/package_data/plotly.min.js``), or None."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("plotly")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        log.warning("plotly.min.js not found at %s; the report has no charts", path)
        return None


def _json_for_script(data: Any) -> str:
    return json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def _detailed(events: list[dict[str, Any]]) -> list[int]:
    serious = [i for i, e in enumerate(events) if e["severity"] != "info"]
    return serious[:MAX_DETAILED]


def _incident_data(index: _data.RankIndex, result: PostmortemResult, event: dict[str, Any], incident: Any,
                   available: set[str]) -> dict[str, Any]:
    keys = [k for f in incident.findings for k in f.evidence]
    names = _data.evidence_signals(event, keys, available)
    near = index.between(int(event["rank"]), *_data.event_span(event))  # the only records the charts read
    heatmaps = [hm for prefix in ("grad_norm", "update_ratio")
                if (hm := _data.heatmap(near, event, prefix)) is not None]
    return {"window": _data.incident_window(near, event, names), "heatmaps": heatmaps}


def _signal_names(records: Sequence[StepRecord]) -> set[str]:
    """Every signal name the records carry."""
    return set(itertools.chain.from_iterable(r.signals for r in records))


def _payload(result: PostmortemResult, records: Sequence[StepRecord], available: set[str]) -> dict[str, Any]:
    events = result.events
    shown_rank = min(result.ranks) if result.ranks else 0
    incidents = [{"n": i + 1, "onset": e["onset"], "end": e["end"] if e["end"] is not None else e["step"],
                  "step": e["step"], "rollback": e["rollback_step"], "kind": e["kind"], "severity": e["severity"],
                  "rank": e["rank"], "color": _COLORS.get(e["severity"], "#6b7280")} for i, e in enumerate(events)]
    others = list(dict.fromkeys(e["rank"] for e in events if e["rank"] != shown_rank and e["severity"] != "info"))
    # a resumed run re-logged steps: chart what the later process logged there (the resume is marked)
    plotted = _data.latest_per_step(records) if len(result.segments) > 1 else records
    by_rank = _data.RankIndex(records)
    plotted_by_rank = _data.RankIndex(plotted) if plotted is not records else by_rank
    out = {
        "overview": _data.overview(plotted, shown_rank, index=plotted_by_rank),
        "other_ranks": [_data.overview(plotted, rank, index=plotted_by_rank) for rank in others[:4]],
        "resumes": [{"step": seg.first_step, "after": seg.resumed_after} for seg in result.segments[1:]],
        "phases": [{"first": p.first_step, "last": p.last_step, "label": p.label, "color": _PHASE_COLORS[p.label]}
                   for p in result.phases if p.label in _PHASE_COLORS],
        "incidents": incidents,
        "details": {str(i + 1): _incident_data(by_rank, result, events[i], result.incidents[i], available)
                    for i in _detailed(events)},
    }
    perf_events = [i for i, e in enumerate(events) if _is_perf(e)]
    involved = list(dict.fromkeys([*(events[i]["rank"] for i in perf_events), shown_rank, *result.ranks]))
    perf = _data.performance(plotted, involved[:_data.PERF_RANKS], index=plotted_by_rank, available=available)
    if perf is not None:
        perf["incidents"] = [incidents[i] for i in perf_events]
        out["perf"] = perf
    return out


def _is_perf(event: Mapping[str, Any]) -> bool:
    """A step-time / straggler / hang / memory incident (marked on the performance timelines)."""
    return bool({event["kind"], *event.get("kinds", ())} & PERF_KINDS)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0 auto;max-width:1280px;padding:1.5em;color:#111}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #e5e7eb}
h3{font-size:1.05em;margin:1.2em 0 .4em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top;font-size:.92em}
th{background:#f9fafb}.info{color:#6b7280}.warning{color:#b45309;font-weight:600}
.error{color:#dc2626;font-weight:700}.verdict{padding:.8em 1em;border-radius:6px;background:#f3f4f6;margin:1em 0}
.verdict.bad{background:#fef2f2;border-left:4px solid #dc2626}
.verdict.warn{background:#fffbeb;border-left:4px solid #d97706}
.verdict.ok{background:#f0fdf4;border-left:4px solid #16a34a}.incident{border:1px solid #e5e7eb;border-radius:6px;
padding:0 1em 1em;margin:1em 0}.muted{color:#6b7280;font-size:.9em}.plot{width:100%}code{font-size:.92em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:600}dd{margin:0}
"""

_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('stability-data').textContent);
const CFG = {displaylogo:false, responsive:true, scrollZoom:false};
function shapesFor(incidents, withLabels){
  const shapes = [], notes = [];
  for (const inc of incidents){
    shapes.push({type:'rect', xref:'x', yref:'paper', x0:inc.onset - 0.5, x1:Math.max(inc.end, inc.onset) + 0.5,
                 y0:0, y1:1, fillcolor:inc.color, opacity:0.18, line:{width:0}, layer:'below'});
    const info = inc.severity === 'info';
    if (inc.rollback !== null && !info){
      shapes.push({type:'line', xref:'x', yref:'paper', x0:inc.rollback, x1:inc.rollback, y0:0, y1:1,
                   line:{color:inc.color, width:1.5, dash:'dash'}});
    }
    if (withLabels && !info){
      notes.push({x:inc.onset, y:1, xref:'x', yref:'paper', yanchor:'bottom', xanchor:'left', showarrow:false,
                  font:{size:11, color:inc.color}, text:'#' + inc.n + ' ' + inc.kind + ' (onset ' + inc.onset +
                  (inc.rollback !== null ? ', rollback ' + inc.rollback : '') + ')'});
    }
  }
  for (const p of (D.phases || [])){
    shapes.push({type:'rect', xref:'x', yref:'paper', x0:p.first - 0.5, x1:p.last + 0.5, y0:0, y1:1,
                 fillcolor:p.color, opacity:0.07, line:{width:0}, layer:'below'});
  }
  for (const r of (D.resumes || [])){
    shapes.push({type:'line', xref:'x', yref:'paper', x0:r.step, x1:r.step, y0:0, y1:1,
                 line:{color:'#7c3aed', width:1.5, dash:'dot'}});
    if (withLabels){
      notes.push({x:r.step, y:0, xref:'x', yref:'paper', yanchor:'bottom', xanchor:'left', showarrow:false,
                  font:{size:11, color:'#7c3aed'}, text:'resume at ' + r.step + ' (after ' + r.after + ')'});
    }
  }
  return [shapes, notes];
}
function positive(ys){ return ys.every(v => v === null || v > 0) && ys.some(v => v !== null); }
function stacked(id, rows, incidents, title){
  const el = document.getElementById(id);
  if (!el || rows.length === 0) return;
  const n = rows.length, gap = 0.045, h = (1 - gap * (n - 1)) / n;
  const data = [], layout = {height: 150 * n + 110, margin:{l:80, r:30, t:50, b:50}, hovermode:'x unified',
    legend:{orientation:'h', x:0, y:1.0, yanchor:'bottom', xanchor:'left'}, title:{text:title, x:0, font:{size:14}},
    xaxis:{title:{text:'step'}, anchor:'y' + (n > 1 ? n : ''), showspikes:true, spikemode:'across'}};
  rows.forEach((row, i) => {
    const ax = i === 0 ? '' : String(i + 1), top = 1 - i * (h + gap);
    layout['yaxis' + ax] = {domain:[Math.max(0, top - h), top], title:{text:row.title, font:{size:11}},
      type: row.log ? 'log' : 'linear', tickformat: row.fmt || (row.log ? '~g' : ''), exponentformat:'e',
      automargin:true};
    for (const t of row.traces){
      data.push(Object.assign({type:'scatter', mode:'lines', xaxis:'x', yaxis:'y' + ax}, t));
    }
  });
  const [shapes, notes] = shapesFor(incidents, true);
  layout.shapes = shapes; layout.annotations = notes;
  Plotly.newPlot(el, data, layout, CFG);
}
function line(name, xy, extra){ return Object.assign({name:name, x:xy[0], y:xy[1], connectgaps:false}, extra || {}); }
function overviewRows(o, others){
  const s = o.series, rows = [];
  const extra = (name, color) => others.filter(r => r.series[name]).map(r => line('rank ' + r.rank + ' ' + name,
    r.series[name], {line:{width:1.2, dash:'dot'}}));
  if (s.loss){
    const t = [line('loss', s.loss, {line:{color:'#60a5fa', width:1.2}})];
    if (s.loss_smoothed) t.push(line('loss, smoothed (' + o.smooth_window + ' steps)', s.loss_smoothed,
                                      {line:{color:'#1e3a8a', width:1.6}}));
    if (o.nonfinite_loss && o.nonfinite_loss.length){
      const fin = s.loss[1].filter(v => v !== null), top = fin.length ? Math.max(...fin) : 1;
      t.push({name:'non-finite loss', x:o.nonfinite_loss, y:o.nonfinite_loss.map(() => top), mode:'markers',
              marker:{symbol:'x', color:'#dc2626', size:9}});
    }
    rows.push({title:'loss', log: positive(s.loss[1]), traces:t.concat(extra('loss'))});
  }
  if (s.lr) rows.push({title:'learning rate', log:false, traces:[line('lr', s.lr, {line:{color:'#059669'}})]});
  if (s.grad_norm) rows.push({title:'grad norm (pre-clip)', log: positive(s.grad_norm[1]),
                              traces:[line('grad norm', s.grad_norm, {line:{color:'#7c3aed'}})]
                                .concat(extra('grad_norm'))});
  if (s.loss_scale || o.skipped){
    const t = [];
    if (s.loss_scale) t.push(line('loss scale', s.loss_scale, {line:{color:'#0891b2'}, line_shape:'hv'}));
    if (o.skipped) t.push({name:'skipped step', x:o.skipped, y:o.skipped.map(() => 1), mode:'markers',
                           marker:{symbol:'triangle-down', color:'#dc2626', size:8}});
    rows.push({title:'loss scale / skipped', log: !!s.loss_scale && positive(s.loss_scale[1]), traces:t});
  }
  if (s.step_time) rows.push({title:'step time (s)', log:false,
                              traces:[line('step time', s.step_time, {line:{color:'#6b7280', width:1}})]});
  return rows;
}
const PALETTE = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#4b5563'];
function perfRows(P){
  const rows = [];
  const traces = (names, styles) => {
    const t = [];
    P.ranks.forEach((rank, k) => {
      const s = P.series[String(rank)] || {};
      names.forEach((name, j) => {
        if (s[name]) t.push(line('rank ' + rank + ' ' + name, s[name],
                                 {line:Object.assign({color:PALETTE[k % PALETTE.length], width:1.2}, styles[j])}));
      });
    });
    return t;
  };
  const add = (title, names, styles, fmt) => {
    const t = traces(names, styles);
    if (t.length) rows.push({title:title, log:false, fmt:fmt, traces:t});
  };
  add('step time (s)', ['step_time', 'device_step_time'], [{}, {dash:'dot'}], '');
  add('data / compute (s)', ['data_time', 'compute_time'], [{dash:'dash'}, {}], '');
  add('host memory (B)', ['host_rss', 'host_mem_limit'], [{}, {dash:'dash', width:1}], '~s');
  add('device memory (B)', ['mem_allocated', 'mem_reserved', 'mem_peak', 'mem_limit'],
      [{}, {dash:'dot'}, {dash:'dashdot'}, {dash:'dash', width:1}], '~s');
  return rows;
}
function heat(id, hm, inc){
  const el = document.getElementById(id);
  if (!el) return;
  const layout = {height: Math.min(900, 120 + 16 * hm.layers.length), margin:{l:180, r:30, t:40, b:50},
    title:{text:hm.prefix + ' robust z-score by layer (baseline: steps before the onset)', x:0, font:{size:13}},
    xaxis:{title:{text:'step'}}, yaxis:{autorange:'reversed', automargin:true, tickfont:{size:10}},
    shapes:[{type:'line', xref:'x', yref:'paper', x0:hm.onset, x1:hm.onset, y0:0, y1:1,
             line:{color:'#111', width:1.5, dash:'dot'}}]};
  Plotly.newPlot(el, [{type:'heatmap', x:hm.steps, y:hm.layers, z:hm.z, zmid:0, zmin:-10, zmax:10,
    colorscale:'RdBu', colorbar:{title:{text:'z'}},
    hovertemplate:'%{y}<br>step %{x}<br>z %{z}<extra></extra>'}], layout, CFG);
}
function render(){
  if (typeof Plotly === 'undefined') return;
  const ranks = [D.overview.rank].concat(D.other_ranks.map(r => r.rank)).join(', ');
  stacked('overview', overviewRows(D.overview, D.other_ranks), D.incidents,
          'rank ' + ranks + ' - drag to zoom, double-click to reset');
  for (const [n, det] of Object.entries(D.details)){
    const inc = D.incidents[Number(n) - 1];
    const rows = Object.entries(det.window.series).map(([name, xy]) => ({title:name, log:positive(xy[1]),
      traces:[line(name, xy, {mode:'lines+markers', marker:{size:3}})]}));
    stacked('evidence-' + n, rows, [inc],
            'evidence around the onset (steps ' + det.window.lo + ' to ' + det.window.hi + ')');
    det.heatmaps.forEach((hm, k) => heat('heat-' + n + '-' + k, hm, inc));
  }
  if (D.perf) stacked('perf', perfRows(D.perf), D.perf.incidents,
                      'step time and memory, rank ' + D.perf.ranks.join(', ') + ' (dashed: limits)');
}
render();
})();
"""


def _meta_rows(result: PostmortemResult, records: Sequence[StepRecord], available: set[str]
               ) -> list[tuple[str, str]]:
    hosts = sorted({r.host for r in records if r.host})
    steps = [r.step for r in records]
    rows = [("run id", result.run_id), ("steps analysed", f"{result.steps} ({min(steps)} to {max(steps)})" if steps
                                         else "0"),
            ("ranks", f"{len(result.ranks)} ({', '.join(map(str, result.ranks[:32]))}"
                      f"{' …' if len(result.ranks) > 32 else ''})"),
            ("hosts", ", ".join(hosts[:32]) + (" …" if len(hosts) > 32 else "") or "-"),
            ("signals", str(len(available)))]
    meta: Mapping[str, str] = result.meta
    labels = {"run_dir": "run directory", "source": "source", "started": "started", "command": "command",
              "world_size": "world size", "python": "python", "torch": "torch", "stability": "stability",
              "wandb_project": "W&B project", "wandb_url": "W&B diagnosis run", "wandb_run_id": "W&B training run",
              "config": "capture config"}
    for key, label in labels.items():
        if meta.get(key):
            rows.append((label, str(meta[key])))
    return rows


def _verdict(result: PostmortemResult) -> str:
    counts = result.counts
    events = result.events
    serious = [e for e in events if e["severity"] != "info"]
    if not serious:
        cls, text = "ok", "No warning or error: no instability detected."
    else:
        first = serious[0]
        cls = "bad" if counts["error"] else "warn"
        cause = first["causes"][0]["cause"] if first["causes"] else "unknown"
        text = (f"{plural(len(serious), 'incident')} needing attention ({counts['error']} error, {counts['warning']} "
                f"warning). First: <b>{html.escape(first['kind'])}</b> on rank {first['rank']} at step "
                f"{first['onset']}, most likely <b>{html.escape(cause)}</b>. {html.escape(rollback_words(first))}.")
    return f'<div class="verdict {cls}">{text}<br><span class="muted">{counts["info"]} info events.</span></div>'


def _incident_section(n: int, event: dict[str, Any], detail: dict[str, Any]) -> str:
    esc = html.escape
    where = f"rank {event['rank']}" + (f" on {esc(event['host'])}" if event.get("host") else "")
    end = cell(event["end"])
    causes = "".join(
        f"<tr><td>{i}</td><td><b>{esc(c['cause'])}</b></td><td>{c['score']:.2f}</td><td>{esc(c['evidence'])}</td></tr>"
        for i, c in enumerate(event["causes"], start=1))
    causes_table = (f"<table><tr><th>#</th><th>cause</th><th>score</th><th>evidence</th></tr>{causes}</table>"
                    if causes else "<p>No structural rule matched (cause unknown).</p>")
    skip = (", ".join(esc(b) for b in event["skip_batches"]) if event["skip_batches"]
            else "none recorded (the records carry no batch ids; call <code>handle.set_batch(id)</code> to get one)")
    heat_text = []
    for k, hm in enumerate(detail.get("heatmaps", [])):
        first = hm.get("first")
        if first:
            lead = hm["onset"] - first["step"]
            when = (f"{plural(lead, 'step')} before the onset" if lead > 0 else
                    "at the onset" if lead == 0 else f"{plural(-lead, 'step')} after the onset")
            heat_text.append(f"<p>First {esc(hm['prefix'])} layer to move: <b>{esc(first['layer'])}</b> at step "
                             f"{first['step']} ({when}; peak |z| {first['z']}).</p>")
        heat_text.append(f'<div class="plot" id="heat-{n}-{k}"></div>')
    kinds = ", ".join(esc(k) for k in event.get("kinds", []))
    return (f'<section class="incident" id="incident-{n}"><h3><span class="{event["severity"]}">#{n} '
            f'{event["severity"].upper()}</span> {esc(event["kind"])} on {where}: onset step {event["onset"]}, '
            f'detected at step {event["step"]}, end {end}</h3>'
            f"<p>{esc(event['message'])}</p><p class=\"muted\">Evidence from: {kinds}</p>"
            f"<h4>Ranked causes</h4>{causes_table}"
            f"<dl><dt>Remedy</dt><dd>{esc(display_remedy(event['remedy'], event['skip_batches']))}</dd>"
            f"<dt>Rollback</dt><dd>{esc(rollback_words(event))}</dd>"
            f"<dt>Batches to skip</dt><dd>{skip}</dd></dl>"
            f'<div class="plot" id="evidence-{n}"></div>{"".join(heat_text)}</section>')


def _timeline_section(result: PostmortemResult) -> str:
    """Resumes (segments) and the events the logs state (system faults, checkpoint loads, fp16 overflows)."""
    esc = html.escape
    if len(result.segments) <= 1 and not result.log_events:
        return ""
    rows = "".join(
        f"<tr><td>{seg.index + 1}</td><td>{seg.first_step}</td><td>{seg.last_step}</td><td>{seg.stop - seg.start}</td>"
        f"<td>{esc(seg.reason)}</td><td>{cell(seg.resumed_after)}</td></tr>" for seg in result.segments)
    segments = ("<h3>Segments</h3><p class=\"muted\">A resume (a step going back, or a new start-up banner) starts a "
                "new segment; each is analysed on its own baseline and re-logged steps are counted once.</p>"
                "<table><tr><th>#</th><th>first step</th><th>last step</th><th>records</th><th>why</th>"
                f"<th>resumed after step</th></tr>{rows}</table>") if len(result.segments) > 1 else ""
    shown = [e for e in result.log_events if e.kind != "overflow"][:200]
    overflows = sum(e.kind == "overflow" for e in result.log_events)
    erows = "".join(
        f"<tr><td>{esc(e.kind)}</td><td>{cell(e.step)}</td><td>{esc(e.host) or '-'}</td><td>{cell(e.rank)}</td>"
        f"<td>{esc(e.message)}</td><td class=\"muted\">{esc(e.source)}</td></tr>" for e in shown)
    events = (f"<h3>Log events</h3><p class=\"muted\">{overflows} fp16 overflow messages.</p>" if overflows else
              "<h3>Log events</h3>")
    if erows:
        events += ("<table><tr><th>kind</th><th>step</th><th>host</th><th>rank</th><th>line</th><th>where</th></tr>"
                   f"{erows}</table>")
    return f"<h2>Timeline</h2>{segments}{events if result.log_events else ''}"


def _perf_section(payload: Mapping[str, Any], artifacts: Sequence[Artifact], base: Path | None) -> str:
    """The step-time and memory timelines (when the records carry them) and links to the run directory's profiler
    traces and hang stack dumps; empty for a run with neither."""
    esc = html.escape
    chart = ""
    if "perf" in payload:
        marked = len(payload["perf"]["incidents"])
        chart = (f'<p class="muted">Per rank: step, data and compute time; host RSS against the host limit; CUDA '
                 f'allocated / reserved / peak against the device total. Shaded: '
                 f'{plural(marked, "performance incident")} (slowdowns, stragglers, data-loader stalls, memory '
                 f'leaks, hangs).</p><div class="plot" id="perf"></div>')
    table = ""
    if artifacts:
        rows = []
        for a in artifacts:
            link = esc(quote(a.link(base).replace(os.sep, "/")))
            detail = ""
            if a.summary.get("split_s"):
                detail = ", ".join(f"{esc(k)} {v:.3g} s" for k, v in a.summary["split_s"].items())
            if a.summary.get("top_ops"):
                detail += ("; top: " if detail else "top: ") + ", ".join(
                    f"{esc(o['name'])} {o['self_s']:.3g} s" for o in a.summary["top_ops"][:3])
            what = "profiler trace (Chrome JSON, gzipped)" if a.kind == "profile" else "Python stacks"
            rows.append(f"<tr><td>{esc(a.describe())}</td><td>{what}</td><td><a href=\"{link}\">"
                        f"{esc(a.path.name)}</a></td><td>{detail or '-'}</td></tr>")
        table = ('<h3>Profiler traces and hang stack dumps</h3><p class="muted">Found in the run directory; open a '
                 'trace in Perfetto (ui.perfetto.dev) or chrome://tracing.</p><table><tr><th>what</th><th>kind</th>'
                 f'<th>file</th><th>summary</th></tr>{"".join(rows)}</table>')
    if not chart and not table:
        return ""
    return f'<h2 id="performance">Step time and memory</h2>{chart}{table}'


_PHASE_COLORS = {"warm-up": "#2563eb", "degradation": "#d97706", "divergence": "#dc2626"}
"""Phases shaded on the charts (stable is not shaded; restarts are the resume lines)."""


def _phases_section(result: PostmortemResult) -> str:
    """The run's phases (:mod:`stability.phases`) as a table, and where it parts from ``--baseline``."""
    esc = html.escape
    out = ""
    if result.phases:
        rows = "".join(
            f"<tr><td>{esc(p.label)}</td><td>{p.first_step}</td><td>{p.last_step}</td><td>{p.segment + 1}</td>"
            f"<td>{cell(p.loss_start)}</td><td>{cell(p.loss_end)}</td><td>{esc(p.evidence)}</td></tr>"
            for p in result.phases)
        out += ("<h2>Phases</h2><p class=\"muted\">Change points of the smoothed log-loss (PELT), labelled: warm-up "
                "(LR rising / first steep loss drop; shaded blue), stable, degradation (loss above its best so far; "
                "amber), divergence (far above, or non-finite; red), restart (a resume).</p><table><tr><th>phase"
                "</th><th>first step</th><th>last step</th><th>segment</th><th>loss at start</th><th>loss at end"
                f"</th><th>why</th></tr>{rows}</table>")
    base = result.baseline
    if base is not None:
        rows = "".join(
            f"<tr><td>{esc(str(r['signal']))}</td><td>{cell(r['parts_at'])}</td><td>{cell(r['ratio'])}</td>"
            f"<td>{cell(r['rel_diff'])}</td><td>{cell(r['band'])}</td><td>{cell(r['run_value'])}</td>"
            f"<td>{cell(r['baseline_value'])}</td></tr>" for r in base["signals"])
        where = (f"The runs part at step {base['parts_at']}, first in {esc(str(base['signals'][0]['signal']))}."
                 if base["parts_at"] is not None else "The runs do not part (every signal within its noise band).")
        out += (f'<h2 id="baseline">Baseline comparison</h2><p>Against {esc(str(base["baseline"]))}: '
                f"{base['shared_steps']} shared steps ({base['first_step']}-{base['last_step']}). {where}</p>"
                '<p class="muted">Relative difference per step vs the noise band of the early shared steps; a signal '
                "parts where it stays above its band. Earliest first.</p><table><tr><th>signal</th><th>parts at"
                "</th><th>x band</th><th>median rel. diff after</th><th>band</th><th>run</th><th>baseline</th></tr>"
                f"{rows}</table>")
    return out


def _events_table(events: list[dict[str, Any]]) -> str:
    if not events:
        return "<p>No instability detected.</p>"
    esc = html.escape
    rows = "".join(
        f'<tr><td>{i}</td><td class="{e["severity"]}">{e["severity"]}</td><td>{esc(e["kind"])}</td>'
        f'<td>{e["rank"]}{esc(", host " + e["host"]) if e.get("host") else ""}</td><td>{e["onset"]}</td>'
        f'<td>{e["step"]}</td><td>{cell(e["end"])}</td>'
        f'<td>{esc(e["causes"][0]["cause"]) if e["causes"] else "unknown"}</td><td>{cell(e["rollback_step"])}</td>'
        f'<td>{esc(e["message"])}</td></tr>' for i, e in enumerate(events, start=1))
    return ("<table><tr><th>#</th><th>severity</th><th>kind</th><th>rank</th><th>onset</th><th>step</th><th>end</th>"
            f"<th>top cause</th><th>rollback</th><th>what</th></tr>{rows}</table>")


def render_html(result: PostmortemResult, records: Sequence[StepRecord], *, base: Path | None = None) -> str:
    """The report of ``result`` over ``records`` as one self-contained HTML page; links to the run directory's
    files are relative to ``base`` (the directory the page is written to), absolute without it."""
    esc = html.escape
    events = result.events
    available = _signal_names(records)
    payload = _payload(result, records, available)
    js = plotly_js()
    charts = (f"<script>{js}</script>" if js is not None else
              '<p class="muted">(plotly is not installed: charts are omitted; <code>pip install plotly</code>)</p>')
    sections = "".join(_incident_section(int(n), events[int(n) - 1], d) for n, d in payload["details"].items())
    hidden = len([e for e in events if e["severity"] != "info"]) - len(payload["details"])
    more = f"<p class=\"muted\">{hidden} more warning/error incidents are in the table below.</p>" if hidden > 0 else ""
    meta = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _meta_rows(result, records, available))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>stability post-mortem: {esc(result.run_id)}</title><style>{_CSS}</style></head><body>"
        f"<h1>Post-mortem of {esc(result.run_id)}</h1>"
        f'<p class="muted">{result.steps} steps · {plural(len(result.ranks), "rank")} · '
        f"{plural(len(events), 'event')} · generated by stability {__version__}</p>"
        f"{_verdict(result)}"
        f'<h2>Time series</h2><p class="muted">Shaded: incidents from onset to end (red: error, amber: warning, '
        f'grey: info); dashed: rollback steps; dotted purple: resumes (where a resume re-logged steps the later '
        f'values are charted). All rows share the step axis.</p><div class="plot" id="overview"></div>'
        f"{_perf_section(payload, result.artifacts, base)}"
        f"<h2>Incidents</h2>{sections or '<p>No warning or error incident.</p>'}{more}"
        f"<h2>All events</h2>{_events_table(events)}{_timeline_section(result)}"
        f"{_phases_section(result)}"
        f"<h2>Run</h2><table>{meta}</table>"
        f'<script type="application/json" id="stability-data">{_json_for_script(payload)}</script>'
        f"{charts}<script>{_JS}</script></body></html>\n"
    )
