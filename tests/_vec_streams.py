"""Record streams for the equivalence test of the vectorised per-module detectors (``tests/test_vectorised.py``).

Deterministic (numpy RNG, fixed seeds), quick to build, and shaped to reach every branch of the per-module
detectors: ``bench/_records.py`` records of a 40-module GPT with injected per-layer gradient jumps, update-ratio
jumps, a layer whose gradient vanishes (against its history and against the other layers), frozen updates,
activation / attention-logit growth and ``logit_z`` drift with a stalling loss, Adam lags (dense, sparse,
embedding), modules that appear and vanish mid-run, zero / non-finite / negative per-module values, a repeated
step, and sparse statistics (``stats_every``). ``python tests/_vec_streams.py`` rewrites the fixture
``tests/data/vectorised_findings.json`` with the findings of the detectors in this tree (run it only with the
reference implementation: the test compares against it).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _records import RecordFactory

from stability.detectors._stats import unpack_window
from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.detectors.growth import GrowthConfig, GrowthDetector
from stability.detectors.update import (
    LAYER_GRAD,
    UPDATE_RATIO,
    AdamLagConfig,
    AdamLagDetector,
    LayerJumpConfig,
    LayerJumpDetector,
)
from stability.detectors.vanish import GradVanishingDetector, VanishConfig
from stability.records import StepRecord

FIXTURE = Path(__file__).resolve().parent / "data" / "vectorised_findings.json"


def _mutate(rec: StepRecord, signals: dict[str, float]) -> StepRecord:
    return StepRecord(run_id=rec.run_id, step=rec.step, rank=rec.rank, wall_time=rec.wall_time, host=rec.host,
                      coords=rec.coords, signals=signals)


def stream(seed: int, *, steps: int = 420, modules: int = 40, stats_every: int = 1) -> list[StepRecord]:  # noqa: C901
    """One rank's records with every kind of per-module event injected (positions vary with ``seed``)."""
    rng = np.random.default_rng(1000 + seed)
    factory = RecordFactory(run_id="vec", rank=seed % 3, modules=modules, stats_every=stats_every, warmup=40,
                            total_steps=steps, seed=seed)
    names = [n.split("/", 1)[1] for n in factory._grad_keys]

    def nm(k: int) -> str:
        return names[k % len(names)]

    mid = names[len(names) // 2]
    off = int(rng.integers(0, 20))
    out: list[StepRecord] = []
    step = 0
    growth = 1.0
    for i in range(steps):
        anomaly = {150 + off: "layer_grad", 260 + off: "spike", 330 + off: "nan"}.get(step)
        rec = factory.record(step, 1000.0 + step, anomaly=anomaly)
        s = dict(rec.signals)
        # per-module gradient of one layer vanishes for 30 records (history rule), another is dead from the start
        if 180 + off <= step < 210 + off:
            s[f"grad_norm/{nm(3)}"] *= 1e-4
        s[f"grad_norm/{nm(-3)}"] *= 1e-6 if step < 120 else 1.0
        # update ratios jump on three layers (an LR spike the LR does not show)
        if step in (200 + off, 201 + off):
            for m in names[5:8]:
                if f"update_ratio/{m}" in s:
                    s[f"update_ratio/{m}"] *= 60.0
        # frozen updates of one layer
        if 230 <= step < 245 and f"update_ratio/{nm(9)}" in s:
            s[f"update_ratio/{nm(9)}"] = 1e-9
        # an expert that gets no tokens on some steps (exact zeros), a sparse Adam ratio
        if rng.random() < 0.2:
            s[f"grad_norm/{nm(11)}"] = 0.0
            if f"adam_v_ratio/{nm(11)}" in s:
                s[f"adam_v_ratio/{nm(11)}"] = 0.0
        if f"adam_v_ratio/{nm(11)}" in s and rng.random() < 0.05:
            s[f"adam_v_ratio/{nm(11)}"] = float(rng.uniform(30, 300))
        # Adam lags: a dense layer (loss normal), the embedding (sparse by name), several layers at once
        for lag_step, mods, value in ((240 + off, [mid], 50.0), (280 + off, [nm(0)], 500.0),
                                      (300 + off, names[12:15], 80.0), (302 + off, [mid], 5000.0)):
            if step == lag_step:
                for m in mods:
                    if f"adam_v_ratio/{m}" in s:
                        s[f"adam_v_ratio/{m}"] = value
        # non-finite and negative per-module values now and then
        if rng.random() < 0.03:
            s[f"grad_norm/{nm(13)}"] = math.nan
            if f"act_absmax/{nm(13)}" in s:
                s[f"act_absmax/{nm(13)}"] = math.inf
            if f"adam_v_ratio/{nm(14)}" in s:
                s[f"adam_v_ratio/{nm(14)}"] = -1.0
        # steady activation / attention-logit growth and logit_z drift from step 240, with the loss rising
        if step >= 240:
            growth *= 1.03 + 0.01 * (seed % 3)
            s["loss"] = 2.6 + 0.002 * (step - 240) + float(rng.normal(0, 0.01))
            if f"act_absmax/{nm(16)}" in s:
                s[f"act_absmax/{nm(16)}"] *= growth
        if step % max(1, stats_every) == 0:
            s[f"attn_logit_max/{nm(17)}"] = 6.0 * (growth if step >= 240 + 20 * (seed % 2) else 1.0) * float(
                np.exp(rng.normal(0, 0.03)))
            s["logit_z"] = 1.0 + (0.02 * (step - 240) if step >= 240 else 0.0) + float(rng.normal(0, 0.05))
        # modules that appear late and vanish early
        if step >= 100:
            s["grad_norm/late.block"] = 0.3 * float(np.exp(rng.normal(0, 0.1)))
            s["update_ratio/late.block"] = 1e-3 * float(np.exp(rng.normal(0, 0.1)))
        if step >= 250:
            for q in ("grad_norm", "update_ratio", "adam_v_ratio", "act_absmax"):
                s.pop(f"{q}/{nm(20)}", None)
        out.append(_mutate(rec, s))
        # a repeated step (a log written twice) once
        if i == 90 + off:
            out.append(_mutate(rec, dict(s)))
        step += 1
    return out


def streams() -> Iterator[tuple[str, list[StepRecord]]]:
    """The named streams of the fixture."""
    yield "s0", stream(0)
    yield "s1", stream(1)
    yield "s2-sparse", stream(2, stats_every=5)
    yield "s3-small", stream(3, modules=8)
    yield "s4-chaos", chaos(4)


def chaos(seed: int, *, steps: int = 260, modules: int = 10) -> list[StepRecord]:
    """Heavy-tailed per-module values: 3 % of them 10^U(-4, 4) off, some series gone for a while, steps that
    skip ahead: many decisions near every threshold (the tight configurations alarm often here)."""
    rng = np.random.default_rng(2000 + seed)
    factory = RecordFactory(run_id="vec", rank=1, modules=modules, stats_every=1, warmup=20, total_steps=steps,
                            seed=seed)
    out: list[StepRecord] = []
    step = 0
    for _ in range(steps):
        rec = factory.record(step, 1000.0 + step)
        s = dict(rec.signals)
        for name in list(s):
            if "/" in name and rng.random() < 0.03:
                s[name] *= float(10.0 ** rng.uniform(-4, 4))
            if "/" in name and rng.random() < 0.01:
                del s[name]
        s["logit_z"] = float(rng.normal(2.0, 1.5))
        s["attn_logit_max/h.0"] = float(np.exp(rng.normal(2.5, 0.8)))
        s["loss"] = float(np.exp(rng.normal(1.0, 0.05)))
        out.append(_mutate(rec, s))
        step += int(rng.choice((1, 1, 1, 2, 7)))
    return out


Factory = Callable[[], Any]

DETECTORS: dict[str, Factory] = {
    "update": lambda: LayerJumpDetector(UPDATE_RATIO),
    "layer_grad": lambda: LayerJumpDetector(LAYER_GRAD),
    "update_raw": lambda: LayerJumpDetector(LayerJumpConfig(factor=5.0, z_threshold=4.0, cooldown=3)),
    "update_cap": lambda: LayerJumpDetector(LayerJumpConfig(max_series=12, window=16, min_points=4)),
    "adam_lag": lambda: AdamLagDetector(),
    "adam_lag_tight": lambda: AdamLagDetector(AdamLagConfig(lag=3.0, own_window=32, cooldown=2)),
    "vanish": lambda: GradVanishingDetector(),
    "vanish_tight": lambda: GradVanishingDetector(VanishConfig(factor=20.0, layer_factor=1e3, persist=3,
                                                               rebaseline=20, max_series=30, window=24,
                                                               min_points=6)),
    "growth": lambda: GrowthDetector(),
    "growth_tight": lambda: GrowthDetector(GrowthConfig(window=64, mid_window=24, short_window=8, max_series=20,
                                                        warmup_gate=0.0)),
}


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return value if not math.isfinite(value) or value == 0 else float(f"{value:.10g}")
    return value


def plain(state: Any) -> Any:
    """``state`` with every window (packed or the former lists) as lists of float x and y values."""
    if isinstance(state, dict):
        if "yb" in state or ("x" in state and "y" in state and isinstance(state["x"], list)):
            xs, ys = unpack_window(state)
            return {"x": xs.tolist(), "y": ys.tolist()}
        return {k: plain(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain(v) for v in state]
    return state


def describe(finding: Finding) -> dict[str, Any]:
    """What the fixture keeps of a finding (evidence to 10 significant digits)."""
    return {"kind": finding.kind, "step": finding.step, "onset": finding.onset, "rank": finding.rank,
            "severity": finding.severity.value, "signal": finding.signal, "value": _round(finding.value),
            "message": finding.message, "end": finding.end, "score": _round(finding.score),
            "evidence": {k: _round(v) for k, v in sorted(finding.evidence.items())}}


def run_detector(factory: Factory, records: list[StepRecord], *, resume_at: int | None = None) -> list[dict[str, Any]]:
    """The findings of one detector over ``records`` (and its ``finish``); with ``resume_at`` its state is saved
    after that many records (msgpack round trip) and a fresh detector goes on from it."""
    det = factory()
    out: list[dict[str, Any]] = []
    for i, rec in enumerate(records):
        if resume_at is not None and i == resume_at:
            state = msgpack.unpackb(msgpack.packb(det.state_dict(), use_bin_type=True), raw=False,
                                    strict_map_key=False)  # (as the worker saves it)
            det = factory()
            det.load_state_dict(state)
        out += [describe(f) for f in det.update(rec)]
    return out + [describe(f) for f in det.finish()]


def run_engine(records: list[StepRecord]) -> list[dict[str, Any]]:
    """The alerts of the whole suite (the engine's fusion and ranking on top)."""
    diag = RunDiagnoser()
    out = [describe(f) for rec in records for f in diag.update(rec)]
    return out + [describe(f) for f in diag.finish()]


def compute() -> dict[str, Any]:
    """Every stream through every detector configuration, and the two-rank engine stream."""
    found: dict[str, Any] = {}
    for sname, records in streams():
        for dname, factory in DETECTORS.items():
            found[f"{sname}:{dname}"] = run_detector(factory, records)
    found["engine"] = run_engine(engine_stream())
    return found


def engine_stream() -> list[StepRecord]:
    """Two ranks (12 modules) interleaved: the whole suite's alerts."""
    return [r for pair in zip(stream(4, steps=360, modules=12), [_rank(r, 7) for r in stream(5, steps=360, modules=12)],
                              strict=True) for r in pair]


def _rank(rec: StepRecord, rank: int) -> StepRecord:
    return StepRecord(run_id=rec.run_id, step=rec.step, rank=rank, wall_time=rec.wall_time, host=rec.host,
                      coords=rec.coords, signals=rec.signals)


STATE_DETECTORS = ("update", "layer_grad", "adam_lag_tight", "vanish_tight", "growth_tight")
RESUME = 200


def resumed_tail(dname: str) -> list[dict[str, Any]]:
    """The findings of an uninterrupted run on the resume stream emitted after its first ``RESUME`` records."""
    det = DETECTORS[dname]()
    out: list[dict[str, Any]] = []
    for i, rec in enumerate(resume_stream()):
        found = [describe(f) for f in det.update(rec)]
        out += found if i >= RESUME else []
    return out + [describe(f) for f in det.finish()]


def resume_stream() -> list[StepRecord]:
    """The stream the stored states were taken from."""
    return stream(3, modules=4)


def old_states() -> dict[str, Any]:
    """State dicts of some detector configurations after 200 records of a 3-module stream (the format a worker
    upgraded mid-run loads)."""
    records = resume_stream()
    out = {}
    for dname in STATE_DETECTORS:
        det = DETECTORS[dname]()
        for rec in records[:RESUME]:
            det.update(rec)
        out[dname] = json.loads(json.dumps(det.state_dict()))
    return out


if __name__ == "__main__":
    data = {"findings": compute(), "states": old_states(),
            "resumed": {d: resumed_tail(d) for d in STATE_DETECTORS}}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    total = sum(len(v) for v in data["findings"].values())
    print(f"{FIXTURE}: {total} findings, {FIXTURE.stat().st_size} bytes")
    for key, value in data["findings"].items():
        print(f"  {key}: {len(value)} ({', '.join(sorted({f['kind'] for f in value}))})")
