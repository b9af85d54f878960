"""What the HTML report plots, as plain JSON-ready data: the overview time series, per-incident evidence windows and
per-layer robust z-score heat maps.

Long runs are thinned for the overview (min/max per bucket, so every spike stays visible); incident windows keep
every step. Non-finite values become ``None`` (gaps in the plots); non-finite losses are listed separately.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from stability.records import StepRecord

__all__ = ["MAX_POINTS", "PERF_RANKS", "heatmap", "incident_window", "latest_per_step", "overview", "performance",
           "series"]

MAX_POINTS = 4000
"""The overview plots at most about this many points per series."""
MAX_LAYERS = 40
"""Heat maps show at most this many layers (those that moved most)."""
MOVED_Z = 4.0
"""A layer has "moved" when its robust z-score reaches this."""
_BASE = ("loss", "lr", "grad_norm", "loss_scale", "skipped")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def by_rank(records: Sequence[StepRecord], rank: int) -> list[StepRecord]:
    """The records of one rank, by step."""
    return sorted((r for r in records if r.rank == rank), key=lambda r: r.step)


def latest_per_step(records: Sequence[StepRecord]) -> list[StepRecord]:
    """One record per (rank, step): the last one given (records of a resumed run come segment by segment, so the
    later process's values win where it re-logged steps)."""
    return list({(r.rank, r.step): r for r in records}.values())


def series(records: Sequence[StepRecord], name: str) -> tuple[list[int], list[float]]:
    """Steps and values of signal ``name`` where present (NaN/Inf kept)."""
    pairs = [(r.step, v) for r in records if (v := r.signals.get(name)) is not None]
    return [s for s, _ in pairs], [float(v) for _, v in pairs]


def _series_many(records: Sequence[StepRecord], names: Sequence[str]) -> dict[str, tuple[list[int], list[float]]]:
    """:func:`series` of each of ``names``, the steps read once (a signal every record carries needs no filter)."""
    steps = [r.step for r in records]
    signals = [r.signals for r in records]
    out = {}
    for name in names:
        values = [s.get(name) for s in signals]
        if None in values:
            out[name] = series(records, name)
        else:
            out[name] = (list(steps), list(map(float, values)))  # type: ignore[arg-type]  # no None left
    return out


class RankIndex:
    """The records of each rank by step (as :func:`by_rank` sorts them), grouped in one pass, with the records of a
    step range found by bisection: the report reads a 1M-record run's rank once, not once per chart."""

    def __init__(self, records: Sequence[StepRecord]) -> None:
        groups: dict[int, list[StepRecord]] = {}
        for record in records:
            groups.setdefault(record.rank, []).append(record)
        self._ranks = {rank: sorted(group, key=lambda r: r.step) for rank, group in groups.items()}
        self._steps: dict[int, list[int]] = {}

    def of(self, rank: int) -> list[StepRecord]:
        """The records of ``rank``, by step."""
        return self._ranks.get(rank, [])

    def between(self, rank: int, lo: int, hi: int) -> list[StepRecord]:
        """The records of ``rank`` with ``lo <= step <= hi``, by step."""
        recs = self.of(rank)
        if rank not in self._steps:
            self._steps[rank] = [r.step for r in recs]
        steps = self._steps[rank]
        return recs[bisect.bisect_left(steps, lo):bisect.bisect_right(steps, hi)]


def _thin(steps: Sequence[int], values: Sequence[float] | np.ndarray, limit: int = MAX_POINTS
          ) -> tuple[list[int], list[float | None]]:
    """At most ``limit`` points: min and max of each bucket, in step order (spikes survive).

    Vectorised over the buckets (a 1M-step series in milliseconds): the first finite minimum and maximum of each
    bucket, as ``min`` / ``max`` over its finite points would pick them; a bucket with none gives its first step and
    a gap."""
    if len(steps) <= limit:
        return list(steps), [_finite(v) for v in (values.tolist() if isinstance(values, np.ndarray) else values)]
    buckets = max(1, limit // 2)
    size = math.ceil(len(steps) / buckets)
    count = math.ceil(len(steps) / size)
    pad = count * size - len(steps)
    s = np.asarray(steps, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    low = np.concatenate([np.where(finite, v, np.inf), np.full(pad, np.inf)]).reshape(count, size).argmin(axis=1)
    high = np.concatenate([np.where(finite, v, -np.inf), np.full(pad, -np.inf)]).reshape(count, size).argmax(axis=1)
    has = np.asarray(np.concatenate([finite, np.zeros(pad, dtype=bool)]).reshape(count, size).any(axis=1))
    starts = np.arange(count) * size
    out_s: list[int] = []
    out_v: list[float | None] = []
    nonempty: list[bool] = has.tolist()
    for start, lo, hi, ok in zip(starts.tolist(), (starts + low).tolist(), (starts + high).tolist(), nonempty,
                                 strict=True):
        if not ok:
            out_s.append(int(s[start]))
            out_v.append(None)
            continue
        for step, value in sorted({(int(s[lo]), float(v[lo])), (int(s[hi]), float(v[hi]))}):
            out_s.append(step)
            out_v.append(value)
    return out_s, out_v


DIRECT_SMOOTHING = 250_000_000
"""Points x window up to which the moving average is a direct convolution (a run of up to ~150k logged losses);
above, running sums (a 1M-step run: milliseconds instead of seconds; the same means to ~1e-12, relative)."""


def _moving_sum(values: np.ndarray, window: int) -> np.ndarray:
    """Centred sums over ``window`` (odd, at most ``len(values)``) points, clipped at the ends, from running sums
    (what ``np.convolve(values, ones(window), "same")`` computes)."""
    half = window // 2
    total = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(len(values))
    out: np.ndarray = total[np.minimum(len(values), index + half + 1)] - total[np.maximum(0, index - half)]
    return out


def _moving_mean(values: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Centred moving sums / counts of the finite values and the counts."""
    arr = np.asarray(values, dtype=float)
    ok = np.isfinite(arr)
    filled = np.where(ok, arr, 0.0)
    if len(arr) * window <= DIRECT_SMOOTHING or window > len(arr) or window % 2 == 0:
        kernel = np.ones(window)
        sums = np.convolve(filled, kernel, mode="same")
        counts = np.convolve(ok.astype(float), kernel, mode="same")
    else:  # counts are exact either way; the sums are taken about the mean, so running sums stay small
        counts = _moving_sum(ok.astype(np.float64), window)
        centre = float(filled[ok].mean()) if ok.any() else 0.0
        sums = _moving_sum(np.where(ok, arr - centre, 0.0), window) + centre * counts
    with np.errstate(invalid="ignore", divide="ignore"):
        out: np.ndarray = sums / counts
    return out, counts


def smoothed(values: list[float], window: int) -> list[float | None]:
    """Centred moving average over finite values (None where a window holds none)."""
    out, counts = _moving_mean(values, window)
    return [float(v) if c > 0 else None for v, c in zip(out, counts, strict=True)]


def _smoothed(values: Sequence[float], window: int) -> np.ndarray:
    """:func:`smoothed` as an array, NaN for None."""
    out, counts = _moving_mean(values, window)
    filled: np.ndarray = np.where(counts > 0, out, np.nan)
    return filled


def overview(records: Sequence[StepRecord], rank: int, *, index: RankIndex | None = None) -> dict[str, Any]:
    """The run's aligned time series of one rank: loss (raw + smoothed), LR, grad norm, loss scale + skipped steps,
    step time (from record wall times). Absent signals are left out. ``index``: ``records`` grouped by rank (the
    report builds it once)."""
    recs = index.of(rank) if index is not None else by_rank(records, rank)
    out: dict[str, Any] = {"rank": rank, "series": {}}
    found = _series_many(recs, ("loss", "lr", "grad_norm", "loss_scale", "skipped"))
    steps, loss = found["loss"]
    if steps:
        window = max(5, len(steps) // 100) | 1
        out["series"]["loss"] = _thin(steps, loss)
        out["series"]["loss_smoothed"] = _thin(steps, _smoothed(loss, window))
        out["smooth_window"] = window
        bad = np.flatnonzero(~np.isfinite(np.asarray(loss, dtype=np.float64)))[:500]
        out["nonfinite_loss"] = [steps[i] for i in bad.tolist()]
    for name in ("lr", "grad_norm", "loss_scale"):
        s, v = found[name]
        if s:
            out["series"][name] = _thin(s, v)
    s, v = found["skipped"]
    skipped = [step for step, value in zip(s, v, strict=True) if value >= 0.5]
    if skipped:
        out["skipped"] = skipped[:2000]
    times = [(r.step, r.wall_time) for r in recs if r.wall_time > 0]
    if len(times) > 2:
        pairs = [(a, b) for a, b in itertools.pairwise(times) if b[0] > a[0]]
        dt_steps = [b[0] for _a, b in pairs]
        dt = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pairs]
        if dt and max(dt) > 0:
            out["series"]["step_time"] = _thin(dt_steps, dt)
    return out


_SIGNAL_TOKEN = re.compile(r"[A-Za-z_][\w.]*(?:/[\w.\-]+)?")


def evidence_signals(event: Mapping[str, Any], finding_evidence: Iterable[str], available: set[str]) -> list[str]:
    """Signals worth plotting around an incident: the base signals, the triggering signal, the findings' evidence
    keys and any signal named in the causes' evidence text; only those present in the records."""
    names: list[str] = ["loss", "grad_norm", "lr", str(event.get("signal", "")), *finding_evidence]
    for cause in event.get("causes", []):
        names += [t for t in _SIGNAL_TOKEN.findall(str(cause.get("evidence", ""))) if "/" in t or t in available]
    return [n for n in dict.fromkeys(names) if n in available][:8]


def event_span(event: Mapping[str, Any], before: int = 40, after: int = 20) -> tuple[int, int]:
    """The steps an incident's charts cover: ``before`` steps before the onset to ``after`` after its end."""
    return (int(event["onset"]) - before,
            int(event["end"] if event.get("end") is not None else event["step"]) + after)


def incident_window(records: Sequence[StepRecord], event: Mapping[str, Any], names: Sequence[str],
                    before: int = 40, after: int = 20) -> dict[str, Any]:
    """Every step of ``names`` on the incident's rank from ``before`` steps before the onset to ``after`` steps
    after its end."""
    recs = by_rank(records, int(event["rank"]))
    lo, hi = event_span(event, before, after)
    inside = [r for r in recs if lo <= r.step <= hi]
    out: dict[str, Any] = {"lo": lo, "hi": hi, "series": {}}
    for name in names:
        s, v = series(inside, name)
        if s:
            out["series"][name] = (s, [_finite(x) for x in v])
    return out


def heatmap(records: Sequence[StepRecord], event: Mapping[str, Any], prefix: str, before: int = 40,
            after: int = 20) -> dict[str, Any] | None:
    """Robust z-scores of ``<prefix>/<layer>`` (log scale) around the incident: layers x steps.

    The baseline of each layer is its median and MAD over the window's steps before the onset. Layers are ordered
    by the step at which they first reached :data:`MOVED_Z` (earliest first; those that never did follow, by their
    largest |z|), at most :data:`MAX_LAYERS`. None when the records hold no such signal in the window.
    """
    recs = by_rank(records, int(event["rank"]))
    onset = int(event["onset"])
    lo, hi = event_span(event, before, after)
    inside = [r for r in recs if lo <= r.step <= hi]
    start = prefix + "/"
    layers = sorted({n for r in inside for n in r.signals if n.startswith(start)})
    if not layers:
        return None
    steps = sorted({r.step for r in inside if any(n.startswith(start) for n in r.signals)})
    if len(steps) < 2:
        return None
    index = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(layers), len(steps)), np.nan)
    for r in inside:
        if r.step not in index:
            continue
        for row, name in enumerate(layers):
            value = r.signals.get(name)
            if value is not None and math.isfinite(value) and value > 0:
                grid[row, index[r.step]] = math.log(value)
    base_cols = [i for i, s in enumerate(steps) if s < onset] or list(range(len(steps)))
    rows = []
    for row, name in enumerate(layers):
        base = grid[row, base_cols]
        base = base[np.isfinite(base)]
        if base.size == 0:
            continue
        median = float(np.median(base))
        scale = max(1.4826 * float(np.median(np.abs(base - median))), 0.02)
        z = (grid[row] - median) / scale
        finite = np.isfinite(z)
        moved = np.flatnonzero(finite & (np.abs(np.where(finite, z, 0.0)) >= MOVED_Z))
        peak = float(np.nanmax(np.abs(z))) if finite.any() else 0.0
        rows.append((steps[int(moved[0])] if len(moved) else math.inf, -peak, name, z))
    if not rows:
        return None
    rows.sort(key=lambda t: (t[0], t[1]))
    rows = rows[:MAX_LAYERS]
    first = rows[0]
    zvals = [[round(x, 2) if ok else None for x, ok in zip(np.clip(z, -50, 50).tolist(), np.isfinite(z).tolist(),
                                                            strict=True)] for *_, z in rows]
    return {
        "prefix": prefix,
        "steps": steps,
        "layers": [name[len(prefix) + 1:] for _, _, name, _ in rows],
        "z": zvals,
        "first": None if first[0] == math.inf else {"layer": first[2][len(prefix) + 1:], "step": int(first[0]),
                                                    "z": round(float(-first[1]), 1)},
        "onset": onset,
    }


def base_signals() -> tuple[str, ...]:
    """Signals the overview plots."""
    return _BASE


TIMING_SIGNALS = ("step_time", "data_time", "compute_time", "device_step_time")
"""Step-time timeline signals (seconds, :mod:`stability.hooks.timing`)."""
MEMORY_SIGNALS = ("host_rss", "host_mem_limit", "mem_allocated", "mem_reserved", "mem_peak", "mem_limit")
"""Memory timeline signals (bytes): host RSS and its limit, CUDA allocated / reserved / peak and the device total."""
PERF_RANKS = 8
"""The step-time and memory timelines show at most this many ranks (those with performance incidents first)."""


def performance(records: Sequence[StepRecord], ranks: Sequence[int], *, index: RankIndex | None = None,
                available: set[str] | None = None) -> dict[str, Any] | None:
    """The step-time and memory timelines of ``ranks`` (``{"ranks": [...], "series": {rank: {name: [steps,
    values]}}}``, thinned like the overview); None when no record carries a timing or memory signal (a run without
    the timing hooks: the report stays as it was). ``index``: ``records`` by rank; ``available``: every signal
    name the records carry (names outside it are not looked for)."""
    names = tuple(n for n in (*TIMING_SIGNALS, *MEMORY_SIGNALS) if available is None or n in available)
    if not names:
        return None
    out: dict[str, Any] = {"ranks": [], "series": {}}
    for rank in ranks:
        recs = index.of(rank) if index is not None else by_rank(records, rank)
        per: dict[str, Any] = {}
        for name in names:
            s, v = series(recs, name)
            if s:
                per[name] = _thin(s, v)
        if per:
            out["ranks"].append(rank)
            out["series"][str(rank)] = per
    return out if out["ranks"] else None


def perf_summary(records: Sequence[StepRecord]) -> list[str]:
    """One line per rank (at most :data:`PERF_RANKS`): median and worst step time, data-time share, host RSS first
    -> last and peak device memory, for the text report; empty without timing or memory signals."""
    lines = []
    for rank in sorted({r.rank for r in records})[:PERF_RANKS]:
        recs = by_rank(records, rank)
        parts = []
        steps, times = series(recs, "step_time")
        ok = [(s, t) for s, t in zip(steps, times, strict=True) if math.isfinite(t)]
        if ok:
            worst = max(ok, key=lambda p: p[1])
            parts.append(f"step time median {float(np.median([t for _, t in ok])):.3g} s, max {worst[1]:.3g} s at "
                         f"step {worst[0]}")
            _, data = series(recs, "data_time")
            total = sum(t for _, t in ok)
            if data and total > 0:
                parts.append(f"data wait {100 * sum(d for d in data if math.isfinite(d)) / total:.0f} %")
        _, rss = series(recs, "host_rss")
        if rss:
            parts.append(f"host RSS {rss[0] / 2**20:.0f} -> {rss[-1] / 2**20:.0f} MiB")
        _, peak = series(recs, "mem_peak")
        if peak:
            parts.append(f"device peak {max(peak) / 2**30:.2f} GiB")
        if parts:
            lines.append(f"rank {rank}: " + ", ".join(parts))
    return lines
