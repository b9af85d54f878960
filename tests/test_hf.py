"""HF Trainer adapter with a real ``transformers.Trainer`` training a tiny GPT-2 on the CPU (no hub access)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture
from stability.testing import ListSink

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

NAN_STEP = 4
STEPS = 10
GAS = 2


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(tmp_path: Path, **args: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class PoisonedTrainer(Trainer):  # type: ignore[misc]
        """Makes the loss *value* of one micro-batch NaN (gradients unchanged), as a bad batch would show."""

        def compute_loss(self, *a: Any, **kw: Any) -> Any:
            loss = super().compute_loss(*a, **kw)
            if self.state.global_step == NAN_STEP and not getattr(self, "_poisoned", False):
                self._poisoned = True
                loss = loss + loss.detach() * float("nan")
            return loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=32))
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": GAS,
        "learning_rate": 1e-3,
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    targs = TrainingArguments(**{**options, **args})
    return PoisonedTrainer(model=model, args=targs, train_dataset=Tokens(4 * GAS * STEPS))


def test_auto_attach_records_raw_loss_and_trainer_grad_norm(tmp_path: Path) -> None:
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="hf-test", stats_every=5), sink).attach()  # as auto mode does
    frameworks.install(capture, {"transformers.trainer": frameworks.ADAPTERS["transformers.trainer"]})
    try:
        trainer = make_trainer(tmp_path)
        callbacks = [type(c).__name__ for c in trainer.callback_handler.callbacks]
        assert "StabilityCallback" in callbacks
        trainer.train()
        capture.flush()
        assert capture.framework is None  # released at on_train_end
    finally:
        frameworks.uninstall()
        capture.close()
    from transformers.trainer import Trainer

    assert "_stability" not in Trainer.__init__.__module__  # the patch is gone
    assert "training_step" not in trainer.__dict__  # and so are the instance wrappers
    assert capture.errors == 0
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.step for r in records] == list(range(STEPS))
    assert sorted(logs) == list(range(1, STEPS + 1))  # the Trainer's steps are 1-based
    for rec in records:
        log = logs[rec.step + 1]
        s = rec.signals
        # the Trainer's logged grad_norm is the pre-clip norm it computed: the same number, no second pass
        assert s["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-6)
        assert "nonfinite_grads" not in s
        assert s["lr"] == pytest.approx(log["learning_rate"], rel=1e-6)
        if rec.step == NAN_STEP:
            assert math.isnan(s["loss"])
            assert math.isfinite(log["loss"])  # logging_nan_inf_filter hid it
        else:
            assert s["loss"] == pytest.approx(log["loss"], rel=1e-4)
        layers = [v for k, v in s.items() if k.startswith("grad_norm/")]
        assert layers and math.sqrt(sum(v * v for v in layers)) == pytest.approx(s["grad_norm"], rel=1e-3)
    assert s["grad_norm"] > 0.5  # above max_grad_norm: measured before clipping
    assert "act_absmax/transformer.h.0.attn.c_attn" in records[0].signals


def test_explicit_callback_without_patches(tmp_path: Path) -> None:
    """`attach_hf(trainer, capture)` on an unattached capture: it attaches to the model at train begin."""
    from stability.hooks.hf import attach_hf

    sink = ListSink()
    capture = Capture(WatchConfig(run_id="hf-explicit", stats_every=0), sink)
    trainer = make_trainer(tmp_path, max_steps=3)
    callback = attach_hf(trainer, capture)
    assert callback is not None and attach_hf(trainer, capture) is callback
    try:
        trainer.train()
        capture.flush()
    finally:
        capture.close()
        callback.detach()
    records = sorted(sink.records, key=lambda r: r.step)
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert [r.step for r in records] == [0, 1, 2]
    for rec in records:
        assert rec.signals["grad_norm"] == pytest.approx(logs[rec.step + 1]["grad_norm"], rel=1e-6)
        assert rec.signals["loss"] == pytest.approx(logs[rec.step + 1]["loss"], rel=1e-4)


def test_post_import_hook_runs_when_the_module_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's import hook: a hook for a not-yet-imported module runs right after its first import."""
    (tmp_path / "fake_framework_xyz.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []

    def hook(module: Any) -> None:
        module.VALUE += 1
        seen.append(module.__name__)

    unregister = frameworks.when_imported("fake_framework_xyz", hook)
    try:
        assert "fake_framework_xyz" in frameworks.installed()
        import fake_framework_xyz  # type: ignore[import-not-found]

        assert seen == ["fake_framework_xyz"] and fake_framework_xyz.VALUE == 42
        assert fake_framework_xyz.__spec__.loader.__class__.__name__ != "_HookedLoader"
    finally:
        unregister()
        sys.modules.pop("fake_framework_xyz", None)
    assert "fake_framework_xyz" not in frameworks.installed()
    assert not any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)


def test_adapter_never_reads_tensor_values_on_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU stand-in for a CUDA sync check (see tests/test_hooks.py): host reads of tensor values fail while the
    callback, its Trainer wrappers or the capture run on the training thread (the Trainer's own reads are fine)."""
    from stability.hooks.hf import attach_hf
    from tests.test_hooks import trap_host_reads

    violations = trap_host_reads(monkeypatch)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="hf-nosync", stats_every=1), sink).attach()
    trainer = make_trainer(tmp_path, max_steps=3)
    callback = attach_hf(trainer, capture)
    try:
        trainer.train()
        capture.flush()
    finally:
        callback.detach()
        capture.close()
    assert violations == [] and callback._adapter.errors == 0 and capture.errors == 0
    assert len(sink.records) == 3 and "act_rms/transformer.h.0.attn.c_attn" in sink.records[1].signals
