"""DeepSpeed adapter, with real ``DeepSpeedEngine`` objects on the CPU accelerator (gloo), tiny models, few steps.

fp16 is refused by DeepSpeed on a CPU; the fp16 test overrides the accelerator's ``is_fp16_supported`` (the only
stand-in here, because fp16 needs a GPU) and then runs DeepSpeed's real fp16 optimizers and loss scaler.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture, in_hook
from stability.records import StepRecord
from stability.testing import ListSink, torchrun

deepspeed = pytest.importorskip("deepspeed")

from stability.hooks.deepspeed import attach_deepspeed  # noqa: E402

GAS = 2
MICRO = 4


@pytest.fixture(scope="module", autouse=True)
def ds_dist() -> Iterator[None]:
    """One single-rank gloo process group for the module (DeepSpeed needs one), torn down afterwards."""
    saved = dict(os.environ)
    free = _free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # skip DeepSpeed's one-off g++ build of a shared-memory op (not needed for gloo, 40-70 s)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    importlib.import_module("deepspeed.comm.comm").cdb = None
    os.environ.clear()
    os.environ.update(saved)


def _free_port() -> int:
    from stability.embedded import free_port

    return free_port()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def ds_config(stage: int, dtype: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
        },
        "gradient_clipping": 0.05,
        "steps_per_print": 10_000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    cfg.update(extra)
    return cfg


def make_engine(stage: int, dtype: str, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage, dtype, **extra)
    )
    return engine


def batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(MICRO, 8, generator=g).to(dtype), torch.randn(MICRO, 1, generator=g).to(dtype)


def train(
    engine: Any, steps: int, *, poison: set[int] = frozenset(), torch_style: bool = False
) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps of ``GAS`` micro-batches; return what the engine reported after each step."""
    dtype = next(engine.module.parameters()).dtype
    seen = []
    for s in range(steps):
        losses = []
        for m in range(GAS):
            x, y = batch(s * GAS + m, dtype)
            loss = ((engine(x).float() - y.float()) ** 2).mean()
            if s in poison and m == 0:
                loss = loss * float("inf")
            losses.append(loss.detach().double().item())
            if torch_style:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        norm = engine.get_global_grad_norm()
        seen.append(
            {
                "loss": sum(losses) / len(losses),
                "grad_norm": None if norm is None else float(norm),
                "applied": engine.was_step_applied(),
                "lr": engine.get_lr()[0],
                "samples": engine.global_samples,
            }
        )
    return seen


def run_with(
    engine: Any, capture: Capture, sink: ListSink, steps: int, **kw: Any
) -> tuple[list[StepRecord], list[dict[str, Any]]]:
    attachment = attach_deepspeed(engine, capture)
    assert attachment is not None
    try:
        seen = train(engine, steps, **kw)
        capture.flush()
    finally:
        attachment.detach()
    assert "step" not in engine.__dict__ and "backward" not in engine.__dict__
    return sorted(sink.records, key=lambda r: r.step), seen


def close(a: float | None, b: float | None, rel: float = 1e-4) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def new_capture(**cfg: Any) -> tuple[Capture, ListSink]:
    sink = ListSink()
    config = WatchConfig(run_id="ds-test", **{"stats_every": 2, **cfg})
    return Capture(config, sink), sink  # attach_deepspeed attaches it to engine.module


@pytest.mark.parametrize(
    ("stage", "dtype"),
    [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")],
)
def test_records_carry_engine_values(stage: int, dtype: str) -> None:
    capture, sink = new_capture()
    engine = make_engine(stage, dtype)
    try:
        records, seen = run_with(engine, capture, sink, 3)
    finally:
        capture.close()
    assert [r.step for r in records] == [0, 1, 2]
    assert capture.errors == 0
    for rec, ref in zip(records, seen, strict=True):
        s = rec.signals
        assert close(s["loss"], ref["loss"], 1e-3), (s["loss"], ref["loss"])
        assert s["skipped"] == 0.0 and ref["applied"]
        assert close(s["lr"], ref["lr"]) and s["samples"] == ref["samples"] == (rec.step + 1) * MICRO * GAS
        assert rec.coords["dp"] == 0 and rec.coords["dp_size"] == 1 and rec.coords["world_size"] == 1
        layers = {k: v for k, v in s.items() if k.startswith("grad_norm/")}
        if ref["grad_norm"] is None:  # fp32 ZeRO-0: DeepSpeed has no norm; the capture measured it before clipping
            assert stage == 0 and dtype == "fp32"
            assert s["nonfinite_grads"] == 0.0 and s["grad_norm"] > 0.05  # > the clip threshold: pre-clip
        else:
            assert close(s["grad_norm"], ref["grad_norm"]), (s["grad_norm"], ref["grad_norm"])
            assert "nonfinite_grads" not in s  # no second pass over the gradients
        # per-layer norms: every step from param.grad on ZeRO-0; from safe_get_full_grad on sampled steps otherwise
        if stage == 0 or rec.step % 2 == 0:
            assert set(layers) == {"grad_norm/inp", "grad_norm/out"}
            total = math.sqrt(sum(v * v for v in layers.values()))
            assert close(total, s["grad_norm"], 2e-2 if dtype == "bf16" else 1e-4), (total, s["grad_norm"])
        else:
            assert layers == {}
        if rec.step % 2 == 0:
            assert ("param_norm/inp" in s) == (stage < 3)
            assert "act_absmax/inp" in s
        # Adam's second moment before the step exists from the second optimizer step on
        assert ("adam_v_ratio/inp" in s) == (stage == 0 and dtype == "fp32" and rec.step % 2 == 0 and rec.step > 0)


def test_auto_attach_wraps_initialize_and_torch_style_backward() -> None:
    """Auto mode: deepspeed is already imported, so install() wraps deepspeed.initialize at once; loss.backward()."""
    capture, sink = new_capture()
    capture.attach()  # as auto mode does: global hooks, before DeepSpeed exists
    original = deepspeed.initialize
    frameworks.install(capture, {"deepspeed": frameworks.ADAPTERS["deepspeed"]})
    try:
        assert deepspeed.initialize is not original
        engine = make_engine(1, "fp32")
        assert capture.framework == "deepspeed"
        seen = train(engine, 2, torch_style=True)
        capture.flush()
    finally:
        frameworks.uninstall()
        capture.close()
    assert deepspeed.initialize is original and "step" not in engine.__dict__
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.step for r in records] == [0, 1]
    for rec, ref in zip(records, seen, strict=True):
        assert close(rec.signals["loss"], ref["loss"], 1e-3)
        assert close(rec.signals["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_inf_loss_is_a_skipped_step(stage: int, dtype: str) -> None:
    capture, sink = new_capture()
    engine = make_engine(stage, dtype)
    try:
        records, seen = run_with(engine, capture, sink, 3, poison={1})
    finally:
        capture.close()
    assert [ref["applied"] for ref in seen] == [True, False, True]
    assert [r.signals["skipped"] for r in records] == [0.0, 1.0, 0.0]
    bad = records[1].signals
    assert math.isinf(bad["loss"]) and not math.isfinite(bad["grad_norm"])
    assert all(math.isfinite(r.signals["loss"]) for r in (records[0], records[2]))


def test_inf_loss_on_fp32_zero0_is_caught_as_nan() -> None:
    """fp32 ZeRO-0: DeepSpeed applies the step and the weights turn NaN; records show it, the diagnoser says nan."""
    from stability.detectors import RunDiagnoser

    capture, sink = new_capture()
    engine = make_engine(0, "fp32")
    try:
        records, seen = run_with(engine, capture, sink, 4, poison={2})
    finally:
        capture.close()
    assert all(ref["applied"] for ref in seen)
    assert all(r.signals["skipped"] == 0.0 for r in records)
    assert records[2].signals["nonfinite_grads"] > 0 and not math.isfinite(records[2].signals["grad_norm"])
    assert math.isnan(records[3].signals["loss"])
    assert not any(math.isfinite(p.detach().sum().item()) for p in engine.module.parameters())
    diag = RunDiagnoser()
    findings = [f for r in records for f in diag.update(r)] + diag.finish()
    assert [f.kind for f in findings][:1] == ["nan"], findings
    assert findings[0].onset == 2


@pytest.fixture
def fp16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in for a GPU: let DeepSpeed's CPU accelerator accept fp16 (refused on CPU otherwise)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_loss_scale_halves_on_overflow(stage: int, fp16_on_cpu: None) -> None:
    capture, sink = new_capture()
    engine = make_engine(stage, "fp16")
    try:
        records, seen = run_with(engine, capture, sink, 3, poison={1})
    finally:
        capture.close()
    assert [ref["applied"] for ref in seen] == [True, False, True]
    s = [r.signals for r in records]
    assert [x["skipped"] for x in s] == [0.0, 1.0, 0.0]
    assert [x["loss_scale"] for x in s] == [256.0, 128.0, 128.0]
    assert close(s[0]["grad_norm"], seen[0]["grad_norm"]) and close(s[2]["grad_norm"], seen[2]["grad_norm"])
    # per-layer norms from safe_get_full_grad, divided by the loss scale: they add up to the engine's unscaled norm
    layers = [v for k, v in s[0].items() if k.startswith("grad_norm/")]
    assert len(layers) == 2
    assert close(math.sqrt(sum(v * v for v in layers)), s[0]["grad_norm"], 1e-2)


def test_two_processes_under_torchrun(tmp_path: Path) -> None:
    """Two ranks (gloo) under torchrun: per-rank records with rank coordinates and the same global grad norm."""
    out = tmp_path / "records"
    out.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = torchrun(Path(__file__).with_name("_ds_worker.py"), str(out), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    by_rank = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(by_rank) == [0, 1]
    for rank, data in by_rank.items():
        recs = data["records"]
        assert [r["step"] for r in recs] == [0, 1, 2]
        for r, ref in zip(recs, data["seen"], strict=True):
            assert r["rank"] == rank
            assert r["coords"]["dp"] == rank and r["coords"]["dp_size"] == 2 and r["coords"]["world_size"] == 2
            assert close(r["signals"]["grad_norm"], ref["grad_norm"])
            assert close(r["signals"]["loss"], ref["loss"], 1e-3)
            assert r["signals"]["samples"] == ref["samples"]
    # the global grad norm agrees across ranks; the local losses do not (different data per rank)
    for a, b in zip(by_rank[0]["records"], by_rank[1]["records"], strict=True):
        assert close(a["signals"]["grad_norm"], b["signals"]["grad_norm"])
        assert a["signals"]["loss"] != b["signals"]["loss"]
    # ZeRO-2: per-layer norms from safe_get_full_grad (a collective) on the sampled steps 0 and 2 on both ranks
    for data in by_rank.values():
        assert ["grad_norm/inp" in r["signals"] for r in data["records"]] == [True, False, True]


def test_hf_trainer_with_deepspeed_reads_the_engine_norm(tmp_path: Path) -> None:
    """HF Trainer + DeepSpeed ZeRO-1 through auto-attach: the DeepSpeed adapter drives the records, grad_norm is the
    engine's (what the Trainer logs), the HF callback adds the raw loss (NaN kept, the Trainer's logged loss not)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.test_hf import NAN_STEP, STEPS, make_trainer

    sink = ListSink()
    capture = Capture(WatchConfig(run_id="hf-ds", stats_every=5), sink).attach()
    frameworks.install(capture)  # all built-in adapters, as auto mode does
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10_000,
    }
    try:
        trainer = make_trainer(tmp_path, deepspeed=ds, use_cpu=False)
        trainer.train()
        capture.flush()
    finally:
        frameworks.uninstall()
        capture.close()
    assert capture.errors == 0
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.step for r in records] == list(range(STEPS))
    for rec in records:
        s, log = rec.signals, logs[rec.step + 1]
        assert s["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-6)
        assert s["samples"] == (rec.step + 1) * 8 and rec.coords["dp_size"] == 1
        if rec.step == NAN_STEP:
            assert math.isnan(s["loss"]) and math.isfinite(log["loss"])
        else:
            assert s["loss"] == pytest.approx(log["loss"], rel=1e-5)


AUTO_SCRIPT = """
import importlib, json, os, sys
import torch
from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture, in_hook
from stability.testing import ListSink

sink = ListSink()
capture = Capture(WatchConfig(run_id="ds-auto"), sink).attach()
frameworks.install(capture)
assert "deepspeed" not in sys.modules and "deepspeed" in frameworks.installed()
import deepspeed  # the post-import hook wraps deepspeed.initialize now

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
wrapped = deepspeed.initialize.__code__.co_filename
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, "steps_per_print": 10000}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
norms = []
for i in range(3):
    x = torch.randn(2, 4)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    norms.append(float(engine.get_global_grad_norm()))
capture.close()
frameworks.uninstall()
print(json.dumps({"wrapped": wrapped, "norms": norms, "restored": deepspeed.initialize.__code__.co_filename,
                  "records": [r.signals.get("grad_norm") for r in sorted(sink.records, key=lambda r: r.step)]}))
"""


def test_auto_attach_through_the_import_hook(tmp_path: Path) -> None:
    """A fresh process: install() before `import deepspeed`; the import hook wraps initialize; records follow."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", AUTO_SCRIPT], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["wrapped"].endswith(os.path.join("hooks", "deepspeed.py"))
    assert out["restored"].endswith(os.path.join("deepspeed", "__init__.py"))
    assert len(out["records"]) == 3
    assert all(close(a, b) for a, b in zip(out["records"], out["norms"], strict=True))


@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (2, "bf16"), (3, "fp32")])
def test_adapter_never_reads_tensor_values_on_the_training_thread(
    stage: int, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU stand-in for a CUDA sync check (see tests/test_hooks.py): ``.item()``, ``float()``, ``bool()``... fail
    while adapter or capture code runs on the training thread, sampled steps included (stats_every=2)."""
    from tests.test_hooks import trap_host_reads

    violations = trap_host_reads(monkeypatch)
    capture, sink = new_capture()
    engine = make_engine(stage, dtype)
    attachment = attach_deepspeed(engine, capture)
    assert attachment is not None
    try:
        train(engine, 3)
        capture.flush()
    finally:
        attachment.detach()
        capture.close()
    assert violations == [] and attachment.errors == 0 and capture.errors == 0
    assert len(sink.records) == 3


def test_a_failing_adapter_read_never_reaches_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """If reading an engine value fails, training goes on; the error is counted and the next steps are recorded."""
    capture, sink = new_capture()
    engine = make_engine(1, "fp32")
    calls = {"n": 0}
    original = engine.get_global_grad_norm

    def flaky() -> Any:
        if in_hook():  # the adapter's read (the test's own reads below must work)
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
        return original()

    monkeypatch.setattr(engine, "get_global_grad_norm", flaky)
    records, seen = run_with(engine, capture, sink, 3)
    capture.close()
    assert [ref["applied"] for ref in seen] == [True, True, True]
    assert [r.step for r in records] == [0, 1, 2]  # the step is still recorded, without the value that failed
    assert "grad_norm" not in records[1].signals and records[1].signals["skipped"] == 0.0
    assert all(close(r.signals["grad_norm"], ref["grad_norm"]) for r, ref in zip(records[::2], seen[::2], strict=True))
    assert capture.errors == 0
