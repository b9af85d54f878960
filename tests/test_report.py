"""The HTML report of a real CPU training run with an LR spike, opened in a real headless Chromium: the page loads
offline, every plot renders (plotly's SVG in the DOM), and the browser logs no uncaught error."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.postmortem import analyze, write_outputs
from stability.records import StepRecord
from stability.report import _data, render_html
from stability.testing import ListSink

STEPS, FAULT = 160, 100


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def spiked_run() -> list[StepRecord]:
    from stability.demo import train

    sink = ListSink()
    capture = Capture(WatchConfig(run_id="report-run", stats_every=10), sink).attach()
    try:
        train(steps=STEPS, fault="lr-spike", fault_step=FAULT)
    finally:
        capture.close()
    assert len(sink.records) == STEPS
    return list(sink.records)


def _browser(html: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; `make test` installs it)")
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=15000", "--window-size=1300,2400", *args, html.as_uri()],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_report_renders_in_headless_chromium_without_errors(spiked_run: list[StepRecord], tmp_path: Path) -> None:
    result = analyze(spiked_run, "report-run", meta={"host": "test-host"})
    serious = [e for e in result.events if e["severity"] != "info"]
    assert serious and FAULT <= serious[0]["onset"] <= FAULT + 3, result.events
    html = tmp_path / "report.html"
    write_outputs(result, spiked_run, html_out=html)
    proc = _browser(html, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "Uncaught" in line or ":ERROR:CONSOLE" in line]
    assert errors == [], errors
    dom = proc.stdout
    # the overview, one evidence plot per detailed incident and the heat maps were drawn by plotly
    plots = 1 + len(serious[:20]) + dom.count('id="heat-') + dom.count('id="perf"')  # (+ step time and memory)
    assert dom.count('class="plot js-plotly-plot"') == plots, re.findall(r'<div class="plot[^>]*>', dom)
    assert dom.count('class="main-svg"') >= plots
    assert dom.count('class="hm"') == dom.count('id="heat-') >= 2  # grad norm and update ratio heat maps
    assert dom.count("trace scatter") >= 5
    # axis titles are real text in the SVG
    for title in ("loss", "learning rate", "grad norm (pre-clip)", "step"):
        assert f">{title}</text>" in dom, title


def test_screenshot_is_drawn(spiked_run: list[StepRecord], tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    write_outputs(analyze(spiked_run, "report-run"), spiked_run, html_out=html)
    shot = tmp_path / "shot.png"
    proc = _browser(html, f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.stat().st_size > 50_000, proc.stderr[-2000:]


def test_heatmap_orders_layers_by_which_moved_first() -> None:
    records = []
    for step in range(100):
        signals = {"loss": 2.0, "grad_norm/a": 1.0 + 0.01 * (step % 3), "grad_norm/b": 1.0 + 0.01 * (step % 5),
                   "grad_norm/c": 1.0 + 0.01 * (step % 4)}
        if step >= 60:
            signals["grad_norm/c"] *= 30.0  # c moves two steps before b
        if step >= 62:
            signals["grad_norm/b"] *= 30.0
        records.append(StepRecord(run_id="r", step=step, signals=signals))
    hm = _data.heatmap(records, {"rank": 0, "onset": 62, "end": 70, "step": 62}, "grad_norm")
    assert hm is not None
    assert hm["layers"][:2] == ["c", "b"] and hm["first"] == {"layer": "c", "step": 60, "z": hm["first"]["z"]}
    assert hm["first"]["z"] > 50


def test_long_runs_are_thinned_but_keep_every_spike() -> None:
    steps = list(range(100_000))
    values = [1.0 + 0.001 * math.sin(s) for s in steps]
    values[54_321] = 1000.0
    values[77_777] = math.nan
    records = [StepRecord(run_id="r", step=s, signals={"loss": v}) for s, v in zip(steps, values, strict=True)]
    data = _data.overview(records, 0)
    xs, ys = data["series"]["loss"]
    assert len(xs) <= _data.MAX_POINTS + 2 and 54_321 in xs and max(y for y in ys if y is not None) == 1000.0
    assert data["nonfinite_loss"] == [77_777]
    json.dumps(data, allow_nan=False)  # strict JSON: non-finite values are gaps


def test_empty_skip_list_is_not_called_a_list() -> None:
    records = [StepRecord(run_id="r", step=s, signals={"loss": 3.0 * (1.0 + 0.01 * (s % 7)) * (8.0 if s == 150 else 1)})
               for s in range(300)]
    result = analyze(records, "r")
    page = render_html(result, records)
    assert result.events and result.events[0]["causes"][0]["cause"] == "bad_batch"
    assert "Skip the listed batches" not in page and "none recorded" in page


def _thin_reference(steps: list[int], values: list[float], limit: int) -> tuple[list[int], list[float | None]]:
    """The thinning rule written point by point: per bucket the first finite minimum and maximum, in step order."""
    size = math.ceil(len(steps) / max(1, limit // 2))
    out_s: list[int] = []
    out_v: list[float | None] = []
    for start in range(0, len(steps), size):
        chunk = [(s, v) for s, v in zip(steps[start:start + size], values[start:start + size], strict=True)
                 if math.isfinite(v)]
        if not chunk:
            out_s.append(steps[start])
            out_v.append(None)
            continue
        for s, v in sorted({min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])}):
            out_s.append(s)
            out_v.append(v)
    return out_s, out_v


def test_vectorised_thinning_and_rank_index_match_the_point_by_point_rules() -> None:
    import random

    rng = random.Random(3)
    for n, limit in ((10_007, 400), (5_000, 4000), (333, 100), (4001, 4000)):
        values = [rng.choice([rng.gauss(0, 1), 0.0, -0.0, math.nan, math.inf, 2.5]) for _ in range(n)]
        values[-7:] = [math.nan] * 7  # a last bucket with no finite value
        steps = sorted(rng.sample(range(3 * n), n))
        want = _thin_reference(steps, values, limit) if n > limit else (steps, [
            v if math.isfinite(v) else None for v in values])
        assert _data._thin(steps, values, limit) == want
    records = [StepRecord(run_id="r", step=s, rank=rng.randrange(3), signals={}) for s in rng.sample(range(500), 300)]
    index = _data.RankIndex(records)
    for rank in range(4):
        assert index.of(rank) == _data.by_rank(records, rank)
        assert index.between(rank, 100, 250) == [r for r in _data.by_rank(records, rank) if 100 <= r.step <= 250]


def test_running_sum_smoothing_matches_the_convolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long runs smooth the overview's loss with running sums: the same counts, the same means to 1e-12."""
    import numpy as np

    rng = np.random.default_rng(5)
    n, window = 30_001, 301
    values = 3 + np.exp(-np.arange(n) / 3000) + rng.normal(0, 0.05, n)
    values[rng.integers(0, n, 40)] = np.nan
    values[:3] = np.inf
    direct, direct_counts = _data._moving_mean(values.tolist(), window)
    monkeypatch.setattr(_data, "DIRECT_SMOOTHING", 0)
    running, counts = _data._moving_mean(values.tolist(), window)
    assert np.array_equal(counts, direct_counts)
    assert np.allclose(running, direct, rtol=1e-12, atol=0, equal_nan=True)
