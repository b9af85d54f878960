"""Megatron-core integration, trained for real on the CPU under the test-only shim (tests/megatron_cpu_shim.py).

A tiny megatron-core GPTModel (2 layers, hidden 32, vocab 128, seq 16) with megatron DDP, ``get_megatron_optimizer``
and ``get_forward_backward_func`` over gloo. The only stand-in is the CUDA-to-CPU shim (no GPU here).
Run as a script under torchrun (``python -m torch.distributed.run --nproc_per_node 2 tests/test_megatron.py OUT``)
it trains with pipeline parallelism 2 and writes each rank's records and reference values to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from megatron_cpu_shim import cpu_shim

from stability.config import WatchConfig
from stability.hooks import frameworks
from stability.hooks.capture import Capture
from stability.hooks.megatron import MegatronAdapter, parse_step_result, parse_train_step
from stability.testing import ListSink, torchrun

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
SEQ, BATCH, VOCAB, MICRO = 16, 2, 128, 2


@dataclass
class Run:
    """What a training run returned to the test (the reference values) and what stability recorded."""

    records: list[Any]
    step_results: list[Any] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    main_grad_norms: list[float] = field(default_factory=list)


def _free_port() -> int:
    from stability.embedded import free_port

    return free_port()


def _init(pp: int = 1) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        if "MASTER_PORT" in os.environ:  # under torchrun
            torch.distributed.init_process_group("gloo")
        else:
            url = f"tcp://127.0.0.1:{_free_port()}"
            torch.distributed.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, pp)
    model_parallel_cuda_manual_seed(1)


def _teardown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _batches(seed: int) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)


def _loss_func(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    loss = (output.float() * mask).sum()
    count = mask.sum()
    return loss, count.to(torch.int), {"lm loss": torch.cat([loss.detach().view(1), count.view(1)])}


def _forward_step(data: Iterator[torch.Tensor], model: Any) -> tuple[torch.Tensor, Any]:
    tokens = next(data)
    x, y = tokens[:, :-1], tokens[:, 1:]
    position = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return model(x, position, None, labels=y), partial(_loss_func, torch.ones(BATCH, SEQ))


def _build(fp16: bool, clip_grad: float, distributed: bool = False) -> tuple[Any, Any, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float16 if fp16 else torch.float32
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        fp16=fp16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    model: Any = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if fp16:
        model = Float16Module(cfg, model)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=model)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        clip_grad=clip_grad,
        fp16=fp16,
        params_dtype=dtype,
        initial_loss_scale=2.0**20,
        log_num_zeros_in_grad=True,
        use_distributed_optimizer=distributed,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    cfg.finalize_model_grads_func = finalize_model_grads
    if fp16:
        cfg.grad_scale_func = optimizer.scale_loss
    return cfg, model, optimizer


def _train(
    capture: Capture,
    *,
    steps: int = 3,
    fp16: bool = False,
    clip_grad: float = 1.0,
    auto: bool = False,
    inner: bool = False,
    distributed: bool = False,
) -> Run:
    """Train ``steps`` steps; ``auto`` builds through the patched factories, ``inner`` steps one FP32Optimizer."""
    import megatron.core.optimizer as mopt
    import megatron.core.pipeline_parallel as mpp

    if auto:  # the registry stability.auto uses; megatron.core is imported, so auto_attach runs at once
        frameworks.install(capture, {"megatron.core": "stability.hooks.megatron:auto_attach"})
    try:
        if auto:
            assert getattr(mopt.get_megatron_optimizer, "__stability_megatron__", False), "install() did not patch"
        _cfg, model, optimizer = _build(fp16, clip_grad, distributed)
        if inner:
            optimizer = optimizer.chained_optimizers[0]
        adapter = None if auto else MegatronAdapter(capture, optimizer, model=[model]).attach()
        forward_backward = mpp.get_forward_backward_func()
        if adapter is not None:
            forward_backward = adapter.wrap_forward_backward(forward_backward)
        run = Run(records=[])
        data = _batches(seed=int(os.environ.get("RANK", 0)) + 7)
        for _ in range(steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=MICRO,
                seq_length=SEQ,
                micro_batch_size=BATCH,
                forward_only=False,
            )
            run.losses.append([float(d["lm loss"][0] / d["lm loss"][1]) for d in losses])
            run.scales.append(float(optimizer.get_loss_scale()))
            grads = [p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None]
            run.main_grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            run.step_results.append(optimizer.step())
        if adapter is not None:
            adapter.close()
    finally:
        if auto:
            frameworks.uninstall()
            assert not getattr(mopt.get_megatron_optimizer, "__stability_megatron__", False)
    return run


SYNC_METHODS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def trap_adapter_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every host read of a tensor value made directly by hooks/megatron.py (Megatron itself may read)."""
    violations: list[str] = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def trapped(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith("hooks/megatron.py"):
                violations.append(f"{_name} in {caller}:{sys._getframe(1).f_lineno}")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, trapped)
    return violations


@pytest.fixture
def megatron_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with cpu_shim():
        _init()
        try:
            yield
        finally:
            _teardown()


def _capture(run_id: str, **config: Any) -> tuple[Capture, ListSink]:
    sink = ListSink()
    return Capture(WatchConfig(run_id=run_id, stats_every=0, **config), sink), sink


def _finish(capture: Capture, sink: ListSink, run: Run) -> Run:
    capture.close()
    run.records = sorted(sink.records, key=lambda r: r.step)
    return run


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_auto_install_records_megatron_values(
    megatron_world: None, monkeypatch: pytest.MonkeyPatch, distributed: bool
) -> None:
    """auto_attach (registered for stability.auto) wraps what the script builds: values equal Megatron's own."""
    violations = trap_adapter_host_reads(monkeypatch)
    capture, sink = _capture("mg-auto")
    capture.attach()
    run = _finish(capture, sink, _train(capture, steps=3, auto=True, distributed=distributed))
    assert violations == []

    assert [r.step for r in run.records] == [0, 1, 2]
    for record, result, losses in zip(run.records, run.step_results, run.losses, strict=True):
        ok, grad_norm, zeros = result
        assert ok is True and grad_norm > 0
        s = record.signals
        assert s["grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
        assert s["num_zeros"] == pytest.approx(float(zeros))
        assert s["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
        assert 4.0 < s["loss"] < 6.0  # ~ln(128) for random tokens
        assert s["tokens"] == MICRO * BATCH * SEQ
        assert s["lr"] == pytest.approx(1e-3)
        assert s["loss_scale"] == 1.0
        assert s["skipped"] == 0.0
        assert any(name.startswith("grad_norm/") for name in s)
        assert "nonfinite_grads" not in s  # the framework's norm is used: no second global pass
        expected = {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "tp_size": 1, "pp_size": 1, "pp_last": 1}
        assert expected.items() <= dict(record.coords).items()


def test_clip_zero_falls_back_to_capture_grad_norm(megatron_world: None) -> None:
    """A single FP32Optimizer with clip_grad=0 returns no grad norm; Capture measures main_grad itself."""
    capture, sink = _capture("mg-noclip")
    capture.attach()
    run = _finish(capture, sink, _train(capture, steps=2, clip_grad=0.0, inner=True))

    assert [r.step for r in run.records] == [0, 1]
    for record, result, reference in zip(run.records, run.step_results, run.main_grad_norms, strict=True):
        assert result[1] is None  # Megatron computed no norm
        assert record.signals["grad_norm"] == pytest.approx(reference, rel=1e-5)
        assert record.signals["nonfinite_grads"] == 0.0


def test_fp16_overflow_steps_are_recorded_as_skipped(megatron_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 with loss scale 2**20 overflows for real: update_successful False -> skipped=1, the scale backs off."""
    violations = trap_adapter_host_reads(monkeypatch)
    capture, sink = _capture("mg-fp16")
    capture.attach()
    run = _finish(capture, sink, _train(capture, steps=5, fp16=True))
    assert violations == []

    assert [r.step for r in run.records] == list(range(5))
    skipped = [r.signals["skipped"] for r in run.records]
    assert skipped == [0.0 if result[0] else 1.0 for result in run.step_results]
    assert 1.0 in skipped and skipped[0] == 1.0
    assert [r.signals["loss_scale"] for r in run.records] == run.scales  # the scale this step's grads used
    for record, result in zip(run.records, run.step_results, strict=True):
        if result[0]:
            assert record.signals["grad_norm"] == pytest.approx(result[1], rel=1e-6)
        else:
            assert "grad_norm" not in record.signals
        assert math.isfinite(record.signals["loss"])


def test_megatron_training_loop_functions(megatron_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron.training`` (Megatron-LM's loop) is not on PyPI: a stand-in module with its ``train_step`` and
    ``training_log`` signatures (Megatron-LM main) runs the real megatron-core step; training_log completes records."""
    import megatron.core.pipeline_parallel as mpp

    training = types.ModuleType("megatron.training.training")
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    state: dict[str, Any] = {}

    def train_step(forward_step_func: Any, data_iterator: Any, model: list[Any], optimizer: Any, *rest: Any) -> Any:
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        losses = mpp.get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        ok, grad_norm, zeros = optimizer.step()
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        state["loss"] = float(total[0] / total[1])
        return {"lm loss": total[0] / total[1]}, int(not ok), False, False, 0, grad_norm, zeros, None

    def training_log(*args: Any, **kwargs: Any) -> bool:
        return True

    training.train_step, training.training_log = train_step, training_log
    capture, sink = _capture("mg-training")
    capture.attach()
    frameworks.install(capture, {"megatron.core": "stability.hooks.megatron:auto_attach"})
    try:
        assert getattr(training.train_step, "__stability_megatron__", False)
        _cfg, model, optimizer = _build(False, 1.0)
        data, expected = _batches(seed=3), []
        for iteration in range(1, 4):
            loss_dict, skipped, _c, _e, _x, grad_norm, zeros, _m = training.train_step(
                _forward_step, data, [model], optimizer, None
            )
            params_norm = 10.0 + iteration
            training.training_log(
                loss_dict, {}, 1e-3, iteration, 1.0, True, skipped, grad_norm, params_norm, zeros, None
            )
            expected.append((state["loss"], grad_norm, params_norm))
    finally:
        frameworks.uninstall()
    assert training.train_step is train_step and training.training_log is training_log  # undone
    records = _finish(capture, sink, Run(records=[])).records

    assert [(r.step, r.batch) for r in records] == [(0, "1"), (1, "2"), (2, "3")]  # batch = Megatron iteration
    for record, (loss, grad_norm, params_norm) in zip(records, expected, strict=True):
        assert record.signals["params_norm"] == params_norm
        assert record.signals["grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
        assert record.signals["loss"] == pytest.approx(loss, rel=1e-5)
        assert record.signals["skipped"] == 0.0


def test_parsers_accept_the_shapes_of_several_megatron_versions() -> None:
    """Return values differ between versions (megatron.training is not on PyPI: its shapes are tested here)."""
    assert parse_step_result((True, 1.5, 3)).grad_norm == 1.5
    assert parse_step_result((False, None, None)).update_successful is False
    assert parse_step_result(True).grad_norm is None
    assert parse_step_result(("weird",)).update_successful is None
    newest = ({"lm loss": 1.0}, 0, False, False, 0, 2.5, 7, 3.0)
    older = ({"lm loss": 1.0}, 1, False, False, 0, 2.5, 7)
    oldest = ({"lm loss": 1.0}, 1, 2.5, 7)
    assert parse_train_step(newest)["grad_norm"] == 2.5 and parse_train_step(newest)["max_logit"] == 3.0
    assert parse_train_step(older)["skipped"] == 1 and parse_train_step(older)["num_zeros"] == 7
    assert parse_train_step(oldest)["grad_norm"] == 2.5
    assert parse_train_step(None) == {} and parse_train_step(("x",)) == {}


def test_pipeline_parallel_two_ranks(tmp_path: Path) -> None:
    """PP=2 over gloo under torchrun: only the last stage records a loss; both carry pp coordinates."""
    proc = torchrun(__file__, str(tmp_path), env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))

    for out, pp in ((first, 0), (last, 1)):
        assert [r["step"] for r in out["records"]] == [0, 1, 2]
        for record, result in zip(out["records"], out["step_results"], strict=True):
            assert record["coords"]["pp"] == pp and record["coords"]["pp_size"] == 2
            assert record["coords"]["pp_last"] == pp
            assert record["signals"]["grad_norm"] == pytest.approx(result[1], rel=1e-6)
    assert all("loss" not in r["signals"] for r in first["records"])
    for record, losses in zip(last["records"], last["losses"], strict=True):
        assert record["signals"]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # the grad norm is reduced over the pipeline: both stages report the same value
    assert [r[1] for r in first["step_results"]] == pytest.approx([r[1] for r in last["step_results"]])


def _pp_main(out_dir: Path) -> None:
    rank = int(os.environ["RANK"])
    capture, sink = _capture("mg-pp")
    capture.attach()
    with cpu_shim():
        _init(pp=2)
        try:
            run = _finish(capture, sink, _train(capture, steps=3))
        finally:
            _teardown()
    payload = {
        "records": [{"step": r.step, "signals": dict(r.signals), "coords": dict(r.coords)} for r in run.records],
        "step_results": [[r[0], r[1], r[2]] for r in run.step_results],
        "losses": run.losses,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(payload))


if __name__ == "__main__":
    _pp_main(Path(sys.argv[1]))
