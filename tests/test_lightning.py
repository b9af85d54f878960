"""Lightning integration: real Trainers on the CPU (one process, and DDP with two processes over gloo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.testing import ListSink

L = pytest.importorskip("lightning.pytorch")

from stability.hooks import frameworks  # noqa: E402
from stability.hooks.lightning import callback_class  # noqa: E402


class Regressor(L.LightningModule):
    """A tiny MLP; keeps the reference loss and pre-clip grad norm of every micro-batch / step it sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))  # reference only (a host sync is fine in the test)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack(grads))))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


SYNC_METHODS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def trap_adapter_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every host read of a tensor value made directly by adapter code (hooks/lightning.py, megatron.py).

    The CPU stand-in for CUDA's sync debug mode: the framework and the test may read values, the adapters may not.
    """
    violations: list[str] = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def trapped(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith(("hooks/lightning.py", "hooks/megatron.py")):
                violations.append(f"{_name} in {caller}")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, trapped)
    return violations


def loader() -> torch.utils.data.DataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, 10 * x.sum(1, keepdim=True)), batch_size=4)


def _trainer(module: Any, namespace: Any, **kwargs: Any) -> Any:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return namespace.Trainer(**options, **kwargs)


def test_auto_attach_records_loss_grad_norm_lr_and_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto_attach (registered for stability.auto) adds the callback to a new Trainer; values match the reference."""
    violations = trap_adapter_host_reads(monkeypatch)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="pl-auto", stats_every=0), sink).attach()
    frameworks.install(capture, {"lightning.pytorch": "stability.hooks.lightning:auto_attach"})
    try:
        module = Regressor()
        trainer = _trainer(module, L, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.01)
        assert sum(type(c).__name__ == "StabilityCallback" for c in trainer.callbacks) == 1
        trainer.fit(module, loader())
    finally:
        frameworks.uninstall()
        capture.close()
    assert getattr(L.Trainer.__init__, "__stability_lightning__", False) is False  # undone

    assert violations == []
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.batch for r in records] == ["1", "3", "5"]  # the batch whose end completed the step
    for i, record in enumerate(records):
        s = record.signals
        micro = module.losses[2 * i : 2 * i + 2]
        assert s["loss"] == pytest.approx(sum(micro) / 2, rel=1e-5)
        assert s["grad_norm"] == pytest.approx(module.grad_norms[i], rel=1e-5)
        assert s["grad_norm"] > 0.01  # measured before Lightning clipped to 0.01
        assert s["lr"] == pytest.approx(0.1 * 0.5**i)
        assert s["skipped"] == 0.0 and s["nonfinite_grads"] == 0.0
        assert "grad_norm/net.0" in s
        assert dict(record.coords)["dp"] == 0 and dict(record.coords)["dp_size"] == 1


def test_grad_scaler_overflow_is_a_skipped_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 AMP with a real CPU GradScaler (Lightning's MixedPrecision plugin) and an inf loss at batch 1."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from stability.hooks.lightning import StabilityCallback

    class Spiky(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx == 1 else loss

    violations = trap_adapter_host_reads(monkeypatch)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="pl-amp", stats_every=0), sink).attach()
    module = Spiky()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = _trainer(module, L, max_steps=4, plugins=[plugin], callbacks=[StabilityCallback(capture)])
    trainer.fit(module, loader())
    capture.close()

    assert violations == []
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.signals["skipped"] for r in records] == [0.0, 1.0, 0.0, 0.0]
    assert [r.signals["loss_scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0]  # scale the step used
    assert math.isinf(records[1].signals["loss"]) and records[1].signals["nonfinite_grads"] > 0
    for i in (0, 2, 3):  # unscaled by Lightning before on_before_optimizer_step
        assert records[i].signals["grad_norm"] == pytest.approx(module.grad_norms[i], rel=1e-5)
        assert records[i].signals["loss"] == pytest.approx(module.losses[i], rel=1e-2)  # fp16 autocast loss


def test_pytorch_lightning_namespace() -> None:
    """The same callback for a ``pytorch_lightning.Trainer`` (its own Callback base class)."""
    pl = pytest.importorskip("pytorch_lightning")
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="pl-ns", stats_every=0), sink).attach()
    module = _as_pl_module(pl)
    trainer = _trainer(module, pl, max_steps=2, callbacks=[callback_class("pytorch_lightning")(capture)])
    trainer.fit(module, loader())
    capture.close()
    records = sorted(sink.records, key=lambda r: r.step)
    assert [r.step for r in records] == [0, 1]
    for record, loss, norm in zip(records, module.losses, module.grad_norms, strict=True):
        assert record.signals["loss"] == pytest.approx(loss, rel=1e-5)
        assert record.signals["grad_norm"] == pytest.approx(norm, rel=1e-5)


def _as_pl_module(pl: Any) -> Any:
    cls = type(
        "PLRegressor", (pl.LightningModule,), {k: v for k, v in vars(Regressor).items() if not k.startswith("__")}
    )
    module = cls.__new__(cls)
    pl.LightningModule.__init__(module)
    torch.manual_seed(0)
    module.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    module.losses, module.grad_norms = [], []
    return module


def test_ddp_two_cpu_processes(tmp_path: Path) -> None:
    """strategy="ddp", devices=2 on the CPU: one record per step per rank; grad norms agree after the all-reduce."""
    script = Path(__file__).with_name("_lightning_ddp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, out in enumerate(outs):
        assert [r["step"] for r in out["records"]] == [0, 1, 2]
        for record, loss, norm in zip(out["records"], out["losses"], out["grad_norms"], strict=True):
            assert record["rank"] == rank
            assert record["coords"]["dp"] == rank and record["coords"]["dp_size"] == 2
            assert record["coords"]["world_size"] == 2
            assert record["signals"]["loss"] == pytest.approx(loss, rel=1e-5)
            assert record["signals"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert outs[0]["losses"] != outs[1]["losses"]  # each rank saw its own shard of the data
    norms = [[r["signals"]["grad_norm"] for r in out["records"]] for out in outs]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # DDP all-reduced the gradients


def test_ddp_under_stability_auto_with_embedded_redis(tmp_path: Path) -> None:
    """The one-import path with Lightning DDP: both ranks land in one run, in their own streams, all steps kept."""
    from stability import supervisor
    from stability.postmortem import load_run_dir

    script = Path(__file__).with_name("_lightning_ddp_auto.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", STABILITY_RUN_DIR=str(tmp_path / "run"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert supervisor.wait_stopped(tmp_path / "run", 240)  # the local worker drains after the fast exit
    records = load_run_dir(tmp_path / "run")
    assert sorted((r.rank, r.step) for r in records) == [(rank, s) for rank in (0, 1) for s in range(5)]
    assert {r.run_id for r in records} == {records[0].run_id}
    assert all("loss" in r.signals and "grad_norm" in r.signals for r in records)
