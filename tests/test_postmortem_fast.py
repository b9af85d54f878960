"""The columnar post-mortem of a CSV (stability.fast_postmortem) gives the exact path's findings.

Each case writes a CSV, runs ``postmortem.run`` twice (``exact=True``: one record per row with every column, the
reference; default: columns, screened per-layer columns, exact replay) and compares the findings files.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stability import postmortem
from stability.detectors.engine import DiagnoserConfig, RunDiagnoser
from stability.errors import SourceError
from stability.fast_postmortem import _window, quiet_columns, skipped_rows
from stability.sources.columnar import read_columns

REAL_RUNS = Path("/work/shared/data/real-runs")
LAYERS = 12


def _rows(steps: int, *, seed: int = 0, every: int = 1, fault: str = "") -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    scale = 65536.0
    for s in range(steps):
        loss = 2.0 + 8.0 * math.exp(-s / 400) + rng.gauss(0, 0.02)
        grad = 1 + rng.gauss(0, 0.05)
        row = {"step": str(s), "loss": f"{loss:.5f}", "lr": f"{3e-4 * min(1.0, (s + 1) / 100):.6g}"}
        layers = [0.1 * (1 + 0.3 * math.exp(-s / 300)) + rng.random() * 0.01 for _ in range(LAYERS)]
        if fault == "layer_jump" and s >= 900:
            layers[3] *= 60.0
        if fault == "loss_spike" and 800 <= s < 803:
            loss *= 4.0
            grad *= 9.0
            row["loss"] = f"{loss:.5f}"
        if fault == "precursor" and s >= 795:
            layers = [x * 2.2 for x in layers]  # every layer's gradient up 2.2x (under the jump rule), then the loss
            if s < 803:
                loss *= 1.0 if s < 800 else 4.0
                row["loss"] = f"{loss:.5f}"
        if fault == "vanish" and s >= 700:
            layers[5] *= 1e-3
        if fault == "nan" and s == 900:
            layers[7] = math.nan
            row["loss"] = "nan"
        if fault == "fp16":
            if s % 97 == 50:
                scale /= 2
                grad = math.inf
                layers = [x * 1e3 for x in layers]
            elif s % 500 == 499:
                scale *= 2
            row["loss_scale"] = f"{scale:g}"
        row["grad_norm"] = f"{grad:.4f}"
        if s % every == 0:
            row.update({f"grad_norm/h.{k}": f"{v:.6g}" for k, v in enumerate(layers)})
            row.update({f"update_ratio/h.{k}": f"{1e-3 * (1 + rng.random() * 0.05):.6g}" for k in range(2)})
        rows.append(row)
    return rows


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    names = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w") as out:
        out.write(",".join(names) + "\n")
        for r in rows:
            out.write(",".join(r.get(n, "") for n in names) + "\n")
    return path


def _findings(source: Path, out: Path, *, exact: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    postmortem.run(source, json_out=out / "f.json", html_out=out / "r.html", exact=exact, progress=False)
    data: dict[str, Any] = json.loads((out / "f.json").read_text())
    return data


def _same(source: Path, tmp_path: Path) -> dict[str, Any]:
    exact = _findings(source, tmp_path / "exact", exact=True)
    fast = _findings(source, tmp_path / "fast", exact=False)
    assert fast == exact
    assert (tmp_path / "fast" / "r.html").stat().st_size > 0
    return fast


CASES: dict[str, dict[str, Any]] = {
    "clean": {}, "layer_jump": {"fault": "layer_jump"}, "loss_spike": {"fault": "loss_spike"},
    "vanish": {"fault": "vanish"}, "nan": {"fault": "nan"}, "fp16": {"fault": "fp16"},
    "sparse_layers": {"every": 10, "fault": "loss_spike"}, "precursor": {"fault": "precursor"}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_synthetic_faults_same_findings(case: str, tmp_path: Path) -> None:
    source = _write(tmp_path / f"{case}.csv", _rows(1500, **CASES[case]))
    found = _same(source, tmp_path)
    kinds = {i["kind"] for i in found["events"]}
    expected = {"layer_jump": "grad_explosion", "loss_spike": "loss_spike", "vanish": "grad_vanishing",
                "nan": "nan"}.get(CASES[case].get("fault", ""))
    if expected is not None and case != "sparse_layers":
        assert expected in kinds


def test_resumed_csv_same_findings(tmp_path: Path) -> None:
    rows = _rows(1200, fault="loss_spike")
    rows = rows[:1000] + _rows(1200, seed=1, fault="layer_jump")[700:]  # rolled back to 700: a second segment
    source = _write(tmp_path / "resumed.csv", rows)
    table = read_columns(source)
    assert table is not None and len(table.segments) == 2
    found = _same(source, tmp_path)
    assert len(found["segments"]) == 2


@pytest.mark.parametrize("name", sorted(p.name for p in REAL_RUNS.glob("*.csv")) if REAL_RUNS.is_dir() else [])
def test_real_runs_same_findings(name: str, tmp_path: Path) -> None:
    source = shutil.copy(REAL_RUNS / name, tmp_path / name)
    _same(Path(source), tmp_path)


def test_quiet_layers_are_not_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clean file's per-layer gradient columns are screened out: the detectors get records without them,
    and the row-by-row CSV reader is not used."""
    source = _write(tmp_path / "clean.csv", _rows(600))
    table = read_columns(source)
    assert table is not None
    quiet = quiet_columns(table, skipped_rows(table), DiagnoserConfig())
    assert quiet == {f"grad_norm/h.{k}" for k in range(LAYERS)}
    widest: list[int] = [0]
    update = RunDiagnoser.update

    def spy(self: RunDiagnoser, record):  # type: ignore[no-untyped-def]
        widest[0] = max(widest[0], len(record.signals))
        return update(self, record)

    def no_rows(*args: object, **kwargs: object) -> None:
        raise AssertionError("the row-by-row CSV reader was used")

    monkeypatch.setattr(RunDiagnoser, "update", spy)
    monkeypatch.setattr(postmortem, "_load_csv_logs", no_rows)
    postmortem.run(source, json_out=tmp_path / "f.json", progress=False)
    assert widest[0] == 5  # step-level signals and the two update-ratio columns


def test_layer_jump_column_is_kept(tmp_path: Path) -> None:
    table = read_columns(_write(tmp_path / "jump.csv", _rows(1500, fault="layer_jump")))
    assert table is not None
    quiet = quiet_columns(table, skipped_rows(table), DiagnoserConfig())
    assert "grad_norm/h.3" not in quiet and "grad_norm/h.4" in quiet


def test_unusual_csv_takes_the_row_reader(tmp_path: Path) -> None:
    """A rank column, a bad cell or a blank step: the row-by-row reader (and its error messages)."""
    (tmp_path / "ranks.csv").write_text("step,rank,loss\n1,0,2.0\n1,1,2.1\n")
    (tmp_path / "bad.csv").write_text("step,loss\n1,2.0\n2,oops\n")
    (tmp_path / "blank.csv").write_text("step,loss\n1,2.0\n,2.1\n")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfstep,loss\n1,2.0\n")
    (tmp_path / "cr.csv").write_bytes(b"step,loss\r1,2.0\r2,2.1\r")
    for name in ("ranks.csv", "bad.csv", "blank.csv", "bom.csv", "cr.csv"):
        assert read_columns(tmp_path / name) is None
    with pytest.raises(SourceError, match="line 3, column 'loss'"):
        postmortem.run(tmp_path / "bad.csv")


def test_text_columns_and_absent_cells(tmp_path: Path) -> None:
    """A text column is ignored, a column of numbers written oddly is read with ``float``, empty cells are
    absent, ``nan``/``inf`` are values: as the row reader does."""
    source = tmp_path / "odd.csv"
    source.write_text("step,loss,note,grad_norm\n1,2.0,hello,\n2,nan,x, 1.5\n3,inf,,Infinity\n")
    table = read_columns(source)
    assert table is not None
    assert table.names == ["loss", "grad_norm"]
    rows = postmortem.load_csv(source)
    for row in range(3):
        expected = rows[row].signals
        got = {n: float(v[row]) for n, v, m in zip(table.names, table.values, table.present, strict=True)
               if m is None or m[row]}
        assert set(got) == set(expected)
        assert all(np.isclose(got[k], expected[k], equal_nan=True) and np.isnan(got[k]) == np.isnan(expected[k])
                   for k in got)


def test_window_reduces_the_values_before_each_position() -> None:
    rng = np.random.default_rng(0)
    for n, w in [(1, 1), (40, 3), (200, 32), (90, 64)]:
        y = rng.normal(size=n)
        expected = [y[max(0, k - w):k].max() if k else -np.inf for k in range(n)]
        assert _window(y, w, np.maximum, -np.inf).tolist() == expected


def test_column_history_holds_what_the_engine_history_holds(tmp_path: Path) -> None:
    """The lazy per-module history gives ranking the same series and values as the engine's ring, with
    skipped steps (gradients absent) and layers logged every 10 steps."""
    from stability.detectors.history import TRACKED_QUANTITIES
    from stability.fast_postmortem import ColumnHistory, _Feed
    from stability.fast_postmortem import _rows as light_rows
    from stability.records import split_signal

    source = _write(tmp_path / "fp16.csv", _rows(700, fault="fp16", every=10))
    table = read_columns(source)
    assert table is not None
    full = postmortem.load_csv(source)
    quiet = quiet_columns(table, skipped_rows(table), DiagnoserConfig())
    assert quiet
    kept = [i for i, n in enumerate(table.names) if n not in quiet]
    light = list(light_rows(table, kept, "r"))
    tracked = [i for i, n in enumerate(table.names)
               if (q := split_signal(n))[1] is not None and q[0] in TRACKED_QUANTITIES]
    feed = _Feed(light, table, tracked)
    config = DiagnoserConfig()
    reference = RunDiagnoser(config)
    lazy = RunDiagnoser(config, history=lambda: ColumnHistory(feed, steps=config.history_steps,
                                                              module_steps=config.module_history_steps,
                                                              max_series=config.max_series))
    for n, (a, b) in enumerate(zip(full, light, strict=True)):
        reference.update(a)
        lazy.update(b)
        if n % 97 == 3 or n == len(full) - 1:
            ring, mine = reference._ranks[0].history.modules, lazy._ranks[0].history.modules
            assert list(mine.series) == list(ring.series)
            assert mine.ordered().tolist() == ring.ordered().tolist()
            for name in ring.series:
                assert np.array_equal(mine.ordered(name), ring.ordered(name), equal_nan=True)


def test_cli_exact_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stability postmortem --exact`` takes the row-by-row path; both write the same findings."""
    from stability import cli

    source = _write(tmp_path / "jump.csv", _rows(1200, fault="layer_jump"))
    calls: list[bool] = []
    run = postmortem.run

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["exact"])
        return run(*args, **kwargs)

    monkeypatch.setattr(postmortem, "run", spy)
    for flag, name in (([], "fast.json"), (["--exact"], "exact.json")):
        assert cli.main(["postmortem", str(source), "--json", str(tmp_path / name),
                         "--html", str(tmp_path / f"{name}.html"), *flag]) == 0
    assert calls == [False, True]
    assert json.loads((tmp_path / "fast.json").read_text()) == json.loads((tmp_path / "exact.json").read_text())


@pytest.mark.parametrize("seed", range(6))
def test_columns_equal_the_row_reader(seed: int, tmp_path: Path) -> None:
    """Random CSVs (resumes, absent cells, nan / inf / exponents, a Megatron loss interval): the columns hold
    exactly the row reader's records, in its order, with its segments."""
    rng = random.Random(seed)
    cells = ["nan", "inf", "-Infinity", "1e-3", "2.5E+2", "0", "-7", ".5", ""]
    lines = ["step,loss,grad_norm/a.0,consumed_samples,skipped_iters"]
    step = 0
    gaps = [1, 2, 10] if seed % 2 else [2, 10]  # (a log interval of 2: every row gets loss_steps)
    for _ in range(300):
        step = max(0, step - 2 * rng.randrange(20)) if rng.random() < 0.02 else step + rng.choice(gaps)
        line = [str(step)] + [rng.choice(cells) if rng.random() < 0.2 else f"{rng.uniform(0, 5):.6g}"
                              for _ in range(2)] + [str(step * 8), "0"]
        lines.append(",".join(line))
    source = tmp_path / "random.csv"
    source.write_text("\n".join(lines) + "\n")
    table = read_columns(source)
    log = postmortem.load_csv_log(source)
    assert table is not None
    assert [(s.start, s.stop, s.first_step, s.last_step, s.reason, s.resumed_after) for s in table.segments] == [
        (s.start, s.stop, s.first_step, s.last_step, s.reason, s.resumed_after) for s in log.segments]
    assert table.steps.tolist() == [r.step for r in log.records]
    for row, record in enumerate(log.records):
        got = {n: float(v[row]) for n, v, m in zip(table.names, table.values, table.present, strict=True)
               if m is None or m[row]}
        assert list(got) == list(record.signals)
        assert ("loss_steps" in got) == (seed % 2 == 0)
        assert all(got[k] == record.signals[k] or (math.isnan(got[k]) and math.isnan(record.signals[k]))
                   for k in got)
