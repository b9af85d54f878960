"""Capture building blocks and guarantees: schedules, on-device statistics, parameter layout, reversible patches,
error containment, the bounded reader queue and the no-host-sync rule. Training here is real but tiny (CPU)."""

from __future__ import annotations

import gc
import logging
import math
import threading
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stability.config import WatchConfig
from stability.errors import ConfigError
from stability.hooks import capture as capture_module
from stability.hooks import rhythm, stats, torch_patches
from stability.hooks.capture import MAX_ERRORS, Capture, in_hook
from stability.hooks.layout import build_layout
from stability.hooks.schedules import every, never
from stability.hooks.staging import Reader, StagedStep
from stability.testing import ListSink, TinyGPT, TinyGPTConfig

VOCAB = 32


def tiny_gpt(return_dict: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(vocab=VOCAB, block=8, d_model=16, n_layer=1, n_head=2, return_dict=return_dict))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, clip: float | None = 1.0) -> None:
    for step in range(steps):
        data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
        out = model(data[:, :-1])
        logits = out["logits"] if isinstance(out, dict) else out
        F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def originals() -> dict[str, object]:
    import torch.nn.utils.clip_grad as clip_module

    return {
        "Tensor.backward": torch.Tensor.backward,
        "autograd.backward": torch.autograd.backward,
        "clip_grad.clip_grad_norm_": clip_module.clip_grad_norm_,
        "utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "GradScaler.scale": vars(torch.amp.GradScaler)["scale"],
        "GradScaler.step": vars(torch.amp.GradScaler)["step"],
        "Module.zero_grad": vars(nn.Module)["zero_grad"],
    }


def global_hook_counts() -> tuple[int, ...]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (
        len(optimizer._global_optimizer_pre_hooks),
        len(optimizer._global_optimizer_post_hooks),
        len(module._global_forward_pre_hooks),
        len(module._global_forward_hooks),
    )


# ------------------------------------------------------------------------------------------------- schedules


def test_every_samples_multiples_from_offset_and_zero_means_never():
    assert [s for s in range(10) if every(3)(s)] == [0, 3, 6, 9]
    assert [s for s in range(10) if every(4, offset=2)(s)] == [2, 6]
    assert every(0) is never and not any(every(0)(s) for s in range(5))
    with pytest.raises(ConfigError, match="n and offset"):
        every(-1)


# ------------------------------------------------------------------------------------------------ statistics


def test_tensor_norms_fill_missing_tensors_with_zero():
    a, b = torch.tensor([3.0, 4.0]), torch.ones(2, 2, dtype=torch.bfloat16)
    norms = stats.tensor_norms([a, None, b], torch.device("cpu"))
    assert norms.dtype == torch.float32
    assert norms.tolist() == pytest.approx([5.0, 0.0, 2.0])
    assert stats.tensor_norms([a], torch.device("cpu"), ord=1.0).tolist() == [7.0]


def test_nonfinite_count_counts_nan_and_inf_across_chunks(monkeypatch):
    monkeypatch.setattr(stats, "COUNT_CHUNK_ELEMENTS", 5)
    a = torch.zeros(4)
    a[1] = float("nan")
    b = torch.full((3, 3), 1e30)
    b[0, 0], b[2, 1] = float("inf"), -float("inf")  # 1e30 is finite even though b's L2 norm overflows
    c = torch.ones(7, dtype=torch.bfloat16)
    c[6] = float("nan")
    count = stats.nonfinite_count([a, None, b, c], torch.device("cpu"))
    assert count.dtype == torch.int64 and int(count) == 4
    assert int(stats.nonfinite_count([torch.ones(3)], torch.device("cpu"))) == 0


def test_first_float_tensor_skips_masks_ints_and_odd_types():
    x = torch.randn(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert stats.first_float_tensor(x) is x
    assert stats.first_float_tensor(mask) is None
    assert stats.first_float_tensor(torch.arange(3)) is None
    assert stats.first_float_tensor((mask, 3, x)) is x
    assert stats.first_float_tensor({"ids": torch.arange(2), "h": x}) is x
    assert stats.first_float_tensor(object()) is None
    assert stats.first_float_tensor(torch.empty(0)) is None


def test_logits_are_taken_only_where_the_output_exposes_them():
    logits = torch.randn(2, 5, 7)

    class Output:
        def __init__(self) -> None:
            self.logits = logits

    assert stats.logits_of({"logits": logits}) is logits
    assert stats.logits_of(Output()) is logits
    assert stats.logits_of(logits) is None  # a bare tensor is not assumed to be logits
    assert stats.logits_of({"hidden": logits}) is None
    assert float(stats.logit_z(logits)) == pytest.approx(float(torch.logsumexp(logits, -1).mean()))


def test_activation_stats_are_absmax_and_mean_square():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.0]])
    got = stats.activation_stats(x)
    assert [float(got.low), float(got.high), float(got.sum_sq), got.numel] == pytest.approx([-3.0, 2.0, 14.0, 4])
    y = torch.tensor([4.0, 0.0])
    absmax, rms = stats.activation_summary([[stats.activation_stats(x)], [stats.activation_stats(y)]])
    assert absmax.tolist() == [3.0, 4.0] and rms.tolist() == pytest.approx([(14.0 / 4) ** 0.5, 8.0**0.5])
    absmax, rms = stats.activation_summary([[stats.activation_stats(x), stats.activation_stats(y)]])  # two calls
    assert absmax.tolist() == [4.0] and rms.tolist() == pytest.approx([((14.0 / 4 + 8.0) / 2) ** 0.5])
    mixed = [[stats.activation_stats(x)], [stats.activation_stats(y), stats.activation_stats(-y)]]
    absmax, rms = stats.activation_summary(mixed)
    assert absmax.tolist() == [3.0, 4.0] and rms.tolist() == pytest.approx([(14.0 / 4) ** 0.5, 8.0**0.5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_nonfinite_activation_element_shows_in_both_statistics(dtype, bad):
    """Both passes read every element: one NaN or Inf anywhere (also in a non-contiguous view) reaches
    ``act_absmax`` and ``act_rms`` exactly, never averaged or sampled away."""
    for x in (torch.randn(8, 64, 32), torch.randn(8, 64, 32).transpose(0, 1)):
        x = x.to(dtype)
        x[5, 7, 3] = bad
        absmax, rms = stats.activation_summary([[stats.activation_stats(x)], [stats.activation_stats(x[:1] * 0)]])
        assert not math.isfinite(float(absmax[0])) and not math.isfinite(float(rms[0]))
        assert math.isnan(float(absmax[0])) == math.isnan(bad) and math.isnan(float(rms[0])) == math.isnan(bad)
        assert float(absmax[1]) == 0.0 and float(rms[1]) == 0.0


# ---------------------------------------------------------------------------------------------------- layout


def test_layout_groups_by_owning_module_with_tied_root_and_other_parameters():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.detach().t().clone())
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))  # owned by the root itself
    tied = nn.Linear(2, 2, bias=False)
    tied.weight = model[0].weight  # shared with model[0]
    extra = nn.Parameter(torch.zeros(1))  # in the optimizer, in no module
    layout = build_layout([model], [*model.parameters(), extra])
    assert layout.modules == ["root", "0", "1", "_other"]
    assert layout.owners == [0, 1, 1, 2, 3]
    assert layout.names("grad_norm")[1] == "grad_norm/0"
    assert layout.index(torch.device("cpu")).tolist() == layout.owners
    two = build_layout([nn.Linear(1, 1), tied], None)
    assert two.modules == ["root0", "root1"]


def test_activation_modules_are_spread_over_depth():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    layout = build_layout([model], None)
    assert [n for n, _ in layout.activation_modules(3)] == ["0", "4", "9"]
    assert len(layout.activation_modules(100)) == 10
    assert layout.activation_modules(0) == []


# ----------------------------------------------------------------------------------------------------- rhythm


def test_rhythm_names_each_boundary_from_python_level_traces_only():
    model = nn.Linear(3, 1)
    other = nn.Linear(3, 1)

    def backward() -> None:
        model(torch.ones(2, 3)).sum().backward()

    r = rhythm.Rhythm()
    r.watch(list(model.parameters()))
    assert r.boundary_at_backward() is None  # nothing in progress
    backward()
    r.after_backward()
    assert r.boundary_at_backward() is None  # a second backward() is accumulation
    assert not r.boundary_at_zero_grad(other) and r.boundary_at_zero_grad(model)
    r.after_clip()
    assert r.boundary_at_backward() == "clip"
    r.step_closed()
    for clear, reason in ((lambda p: setattr(p, "grad", None), "reset"), (lambda p: p.grad.zero_(), "reset"),
                          (lambda p: p.data.add_(1.0), None), (lambda p: p.add_(1.0), "update")):
        backward()
        r.after_backward()
        with torch.no_grad():
            clear(model.weight)
        assert r.boundary_at_backward() == reason
        r.step_closed()
    assert not r.blind()
    r.backwards = rhythm.BLIND_AFTER
    assert r.blind()
    unwatched = rhythm.Rhythm()
    unwatched.after_backward()
    assert unwatched.boundary_at_backward() == "backward"  # no model known: one backward() per step


def test_model_params_are_those_of_the_outermost_modules_with_gradients():
    inner, frozen = nn.Linear(2, 2), nn.Linear(2, 2)
    outer = nn.Sequential(inner, nn.Linear(2, 1))
    outer[1].bias.requires_grad_(False)
    outer(torch.ones(1, 2)).sum().backward()
    assert rhythm.model_params([inner, frozen, outer]) == [inner.weight, inner.bias, outer[1].weight]


# ------------------------------------------------------------------------------------ attach / close / patches


def test_close_removes_every_hook_and_patch():
    if torch_patches.installed():
        pytest.skip("a capture elsewhere in this process is still attached, so the patches must stay")
    before, hooks_before = originals(), global_hook_counts()
    first = Capture(WatchConfig(run_id="a"), ListSink()).attach()
    second = Capture(WatchConfig(run_id="b"), ListSink()).attach()
    patched = originals()
    assert all(patched[name] is not before[name] for name in before)
    assert torch_patches.installed()
    assert global_hook_counts() == tuple(n + 2 for n in hooks_before)
    first.close()
    assert originals()["Tensor.backward"] is patched["Tensor.backward"]  # still needed by `second`
    second.close()
    second.close()  # idempotent
    assert originals() == before
    assert torch.Tensor.backward is before["Tensor.backward"]
    assert torch_patches.installed() == []
    assert global_hook_counts() == hooks_before
    model = tiny_gpt()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)  # training after close is untouched


def _reaches(root: object, targets: list[object]) -> list[str]:
    """Type names along a path of references from ``root`` to any of ``targets`` (empty: none); modules, classes
    and functions' globals are not followed (everything is reachable through them), closures are."""
    ids = {id(t) for t in targets}
    seen: set[int] = set()
    todo: list[tuple[object, list[str]]] = [(root, [])]
    while todo:
        obj, path = todo.pop()
        if id(obj) in ids:
            return [*path, type(obj).__name__]
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            children: list[object] = [c.cell_contents for c in obj.__closure__ or ()]
        else:
            children = [c for c in gc.get_referents(obj) if not (isinstance(c, dict) and "__builtins__" in c)]
        todo += [(child, [*path, type(obj).__name__]) for child in children]
    return []


def test_a_closed_capture_keeps_nothing_of_the_users_alive():
    """After ``close`` the model, the optimizer, the parameters and their snapshot copy are not reachable from the
    capture: it sits in reference cycles (its bound methods are held by its own helpers) that only the garbage
    collector frees, and what it held lived as long (an FSDP1 model's process group then died during interpreter
    teardown and aborted the process)."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cap = Capture(WatchConfig(run_id="rel", stats_every=1), ListSink()).attach(model, opt)
    train(model, opt, 3)
    targets: list[object] = [model, opt, *model.parameters()]
    assert _reaches(cap, targets)  # while attached: the model, the snapshot buffers' layout, the optimizer
    cap.close()
    assert _reaches(cap, targets) == []
    assert cap.step == 3  # what it counted stays readable


def test_explicit_mode_hooks_go_on_the_given_objects_and_are_removed():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks_before = global_hook_counts()
    capture = Capture(WatchConfig(run_id="x", stats_every=1, max_act_modules=2), ListSink()).attach(model, opt)
    assert global_hook_counts() == hooks_before
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert sum(len(m._forward_hooks) for m in model.modules()) == 3
    capture.close()
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


@pytest.mark.parametrize("how", ["config", "env"])
def test_disabled_capture_attaches_nothing(monkeypatch, how):
    before = originals()
    if how == "env":
        monkeypatch.setenv("STABILITY_DISABLE", "1")
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="off", enabled=how != "config"), sink).attach()
    assert not capture.attached
    assert originals() == before
    model = tiny_gpt()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    capture.close()
    assert len(sink) == 0


def test_hooks_do_nothing_while_torch_compile_traces(monkeypatch):
    monkeypatch.setattr(capture_module, "_is_compiling", lambda: True)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="compiled"), sink).attach()
    model = tiny_gpt()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    capture.close()
    assert len(sink) == 0 and capture.errors == 0 and capture.step == 0


# ----------------------------------------------------------------------------------------- errors never escape


class RaisingSink:
    def __init__(self) -> None:
        self.calls = 0

    def put(self, record) -> bool:
        self.calls += 1
        raise RuntimeError("sink is broken")


def test_a_raising_sink_never_breaks_training_and_is_counted(caplog):
    sink = RaisingSink()
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capture = Capture(WatchConfig(run_id="broken"), sink).attach()
    with caplog.at_level(logging.ERROR, logger="stability.hooks.capture"):
        train(model, opt, 3)
        capture.flush()
    capture.close()
    assert sink.calls == 3 and capture.errors == 3 and capture.step == 3
    logged = [r for r in caplog.records if "error in hook sink.put" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # logged once, with the traceback


def test_odd_module_outputs_are_skipped_and_a_raising_output_is_contained():
    class Odd:
        """A model output whose ``logits`` property raises."""

        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        @property
        def logits(self) -> torch.Tensor:
            raise ValueError("no logits today")

    class MaskMaker(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor):
            return (x > 0, 7, "text")  # no float tensor at all: nothing to measure, no error

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.masks = MaskMaker()
            self.body = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> Odd:
            self.masks(x)
            return Odd(self.body(x))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="odd", stats_every=1), sink).attach(model, opt)
    for _ in range(3):
        model(torch.randn(5, 4)).x.square().mean().backward()
        opt.step()
        opt.zero_grad()
    capture.close()
    assert capture.errors == 3  # the raising .logits, once per step
    records = sink.records
    assert len(records) == 3
    assert "act_rms/body" in records[0].signals and "act_rms/masks.lin" not in records[0].signals
    assert "logit_z" not in records[0].signals


def test_too_many_errors_disable_the_capture_with_one_warning(caplog, tmp_path):
    sink = RaisingSink()
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capture = Capture(WatchConfig(run_id="many", run_dir=tmp_path), sink).attach()
    with caplog.at_level(logging.WARNING, logger="stability.hooks.capture"):
        for _ in range(MAX_ERRORS + 5):
            train(model, opt, 1)
            capture.flush()
    watchdog = capture._perf.watchdog
    assert watchdog is not None and watchdog._stop.is_set()  # no steps any more: no hang to report
    capture.close()
    assert capture.errors == MAX_ERRORS
    assert capture.step == MAX_ERRORS  # no further steps once disabled
    assert sum("capture disabled" in r.getMessage() for r in caplog.records) == 1


def test_bad_observe_input_is_counted_not_raised():
    capture = Capture(WatchConfig(run_id="obs"), ListSink()).attach()
    capture.observe("", 1.0)
    capture.observe("x", torch.empty(0))
    capture.close()
    assert capture.errors == 2


# --------------------------------------------------------------------------------------- reader and the sink


def test_reader_queue_is_bounded_and_drops_the_oldest():
    entered, release = threading.Event(), threading.Event()
    got = []

    class SlowSink:
        def put(self, record) -> bool:
            entered.set()
            release.wait(10)
            got.append(record.step)
            return True

    errors: list[BaseException] = []
    reader = Reader(SlowSink(), lambda exc, where: errors.append(exc), limit=2)

    def staged(step: int) -> StagedStep:
        return StagedStep(run_id="q", step=step, rank=0, wall_time=0.0, host="h", coords={}, batch=None)

    reader.submit(staged(0))
    assert entered.wait(10)  # step 0 is in the sink; 1..4 queue behind it
    for step in range(1, 5):
        reader.submit(staged(step))
    release.set()
    assert reader.close(10)
    assert got == [0, 3, 4] and reader.dropped == 2 and not errors


def test_refused_records_are_counted_as_dropped():
    model = tiny_gpt()
    capture = Capture(WatchConfig(run_id="full"), ListSink(accept=False)).attach()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    capture.close()
    assert capture.dropped == 3 and capture.errors == 0


# ------------------------------------------------------------------------------------------ no host-device sync


SYNC_METHODS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def trap_host_reads(monkeypatch) -> list[str]:
    """Make every host read of a tensor value fail while stability hook code runs on this (training) thread.

    The capture reads CPU values where that waits for nothing (``stats.host_reads_free``: whether to count
    non-finite gradient elements); the trap turns that off, so the code paths of an accelerator run here."""
    monkeypatch.setattr(stats, "CPU_READS_FREE", False)
    violations: list[str] = []
    training_thread = threading.current_thread()
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def trapped(self, *args, _name=name, _original=original):
            if in_hook() and threading.current_thread() is training_thread:
                violations.append(_name)
                raise AssertionError(f"host sync via Tensor.{_name} inside a stability hook")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, trapped)
    return violations


def amp_training(model: nn.Module, steps: int, capture: Capture | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(steps):
        data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
        logits = model(data[:, :-1])["logits"]
        if capture is not None:
            capture.observe("attn_logit_max/h.0.attn", logits.detach().amax())
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_hooks_never_read_tensor_values_on_the_training_thread(monkeypatch):
    """CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")`` (no CUDA here): on the CPU nothing ever waits
    for a device, so instead every Python-level way to read a tensor value on the host (``.item()``, ``float()``,
    ``bool()``, ``.tolist()``, ...) is made to fail while stability hook code runs on the training thread. Every
    hook path runs: auto discovery, backward, GradScaler with a skipped step, clipping, sampled statistics with
    activation and logit hooks, ``observe()``. The reader thread may read values (that is its job)."""
    violations = trap_host_reads(monkeypatch)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="nosync", stats_every=1), sink).attach()
    amp_training(tiny_gpt(return_dict=True), 4, capture)
    capture.close()
    assert violations == [] and capture.errors == 0
    records = sink.records
    assert len(records) == 4 and records[2].get("skipped") == 1.0
    assert "act_rms/h.0.attn.c_attn" in records[1].signals and "logit_z" in records[1].signals


def test_rhythm_inference_of_a_loop_without_optimizer_reads_no_tensor_value(monkeypatch):
    """Loops without an optimizer: boundaries come from ``_version`` counters and ``grad is None`` checks only, and
    gradients measured after every backward (a loop clearing them itself) stay on the device too."""
    violations = trap_host_reads(monkeypatch)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="nosync-hand", stats_every=1), sink).attach()
    model = tiny_gpt(return_dict=True)
    for step in range(4):
        data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
        for _micro in range(2):
            logits = model(data[:, :-1])["logits"]
            (F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1)) / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    capture.close()
    assert violations == [] and capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.get("micro_batches") for r in records] == [2, 2, 2, 2]
    assert all(math.isfinite(r.get("grad_norm")) for r in records[1:])
    assert "update_ratio/h.0.attn.c_attn" in records[2].signals


def test_the_host_read_trap_catches_a_syncing_hook(monkeypatch):
    """The trap above can fail: a statistic that calls ``.item()`` is caught (and contained by the guard)."""
    violations = trap_host_reads(monkeypatch)
    monkeypatch.setattr(stats, "logit_z", lambda logits: torch.tensor(logits.mean().item()))
    capture = Capture(WatchConfig(run_id="sync", stats_every=1), ListSink()).attach()
    amp_training(tiny_gpt(return_dict=True), 3, capture)  # auto mode: output hooks from step 1 on
    capture.close()
    assert violations == ["item", "item"] and capture.errors == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU stand-in is the test above")
def test_one_cuda_training_step_has_no_sync_in_hooks():
    model = tiny_gpt().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="cuda", stats_every=1), sink).attach(model, opt)
    data = torch.randint(0, VOCAB, (2, 9), device="cuda")

    def train_step() -> None:
        F.cross_entropy(model(data[:, :-1]).reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()

    train_step()  # warm-up: lazy state and the layout's index copy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    capture.close()
    assert capture.errors == 0 and len(sink) == 2
    assert math.isfinite(sink.records[1].get("grad_norm"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU stand-in is the rhythm test above")
def test_a_cuda_loop_without_optimizer_has_no_sync_in_hooks():
    """Hand-written SGD that clears gradients itself (measured after every backward) under sync debug mode."""
    model = tiny_gpt().cuda()
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="cuda-hand", stats_every=1), sink).attach()
    data = torch.randint(0, VOCAB, (2, 9), device="cuda")

    def train_step() -> None:
        for _micro in range(2):
            (F.cross_entropy(model(data[:, :-1]).reshape(-1, VOCAB), data[:, 1:].reshape(-1)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None

    for _ in range(2):  # warm-up: the first steps find the model, the rhythm and the layout index
        train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step()
        train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    capture.close()
    assert capture.errors == 0 and len(sink) == 4
    assert all(math.isfinite(r.get("grad_norm")) for r in sink.records)


# ------------------------------------------------------------------------------ cost: no extra pass on normal steps


@pytest.mark.parametrize("cpu_reads", [True, False], ids=["cpu-reads", "accelerator-path"])
def test_nonfinite_count_is_exact_and_runs_only_on_flagged_steps_where_reads_are_free(monkeypatch, cpu_reads):
    """The global norm says whether any gradient element is NaN/Inf; the elements are counted only then (on the
    CPU), or on every step where reading the flag would be a host sync (the accelerator path). Exact either way."""
    monkeypatch.setattr(stats, "CPU_READS_FREE", cpu_reads)
    original = stats.nonfinite_count
    counted: list[int] = []
    monkeypatch.setattr(stats, "nonfinite_count", lambda ts, out: counted.append(len(ts)) or original(ts, out))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="flag", stats_every=0), sink).attach()
    expected = []
    try:
        for step in range(4):
            model(torch.randn(6, 4)).sum().backward()
            if step == 1:
                model[0].weight.grad[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            if step == 2:
                model[2].bias.grad.fill_(float("inf"))  # Inf only: the norm is Inf, not NaN
            expected.append(sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters()))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.nan_to_num_(0.0, 0.0, 0.0)  # healthy again for the next step
    finally:
        capture.close()
    assert expected == [0, 3, 1, 0]
    assert [r.get("nonfinite_grads") for r in sink.records] == expected
    assert len(counted) == (2 if cpu_reads else 4)  # CPU: only the two flagged steps pay for the count


def clip_loop(model: nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    totals = []
    for step in range(steps):
        data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
        logits = model(data[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
        totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
    return totals


def test_clip_grad_norm_path_computes_the_gradient_norms_once_and_clips_like_torch(monkeypatch):
    """With the capture attached, ``clip_grad_norm_`` reads each gradient once for its norm (the capture and the
    clipping share the per-tensor norms; torch's ``clip_grads_with_norm_`` clips), and returns the same total and
    the same clipped parameters as plain torch."""
    torch.manual_seed(0)
    plain = tiny_gpt()
    watched = tiny_gpt()
    watched.load_state_dict(plain.state_dict())
    expected = clip_loop(plain, 3)

    per_grad_norms = [0]
    real_foreach, real_vector = torch._foreach_norm, torch.linalg.vector_norm

    def grads_now() -> set[int]:
        return {id(p.grad) for p in watched.parameters() if p.grad is not None}

    def foreach_norm(tensors, *args, **kwargs):
        per_grad_norms[0] += len(grads_now() & {id(t) for t in tensors})
        return real_foreach(tensors, *args, **kwargs)

    def vector_norm(x, *args, **kwargs):
        per_grad_norms[0] += id(x) in grads_now()
        return real_vector(x, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", foreach_norm)
    monkeypatch.setattr(torch.linalg, "vector_norm", vector_norm)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="clip", stats_every=0), sink).attach()
    try:
        got = clip_loop(watched, 3)
    finally:
        capture.close()
    n = len(list(watched.parameters()))
    assert per_grad_norms[0] == 3 * n  # once per gradient and step (before: twice, the capture's and torch's)
    assert [float(t) for t in got] == pytest.approx([float(t) for t in expected], rel=1e-6)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert [r.get("grad_norm") for r in sink.records] == pytest.approx([float(t) for t in got], rel=1e-6)
    assert all(float(t) > 0.05 for t in got)  # the clipping acted


def test_clip_calls_torch_unchanged_when_the_norms_cannot_be_shared(monkeypatch):
    """Other norm types, ``error_if_nonfinite`` or unknown arguments go to torch's own function as they are."""
    calls: list[tuple] = []
    original = torch.nn.utils.clip_grad_norm_
    capture = Capture(WatchConfig(run_id="clip-other", stats_every=0), ListSink()).attach()
    try:
        model = tiny_gpt()
        model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        wrapped = torch.nn.utils.clip_grad_norm_
        assert wrapped is not original
        monkeypatch.setattr(torch_patches, "_clip_with_norm", lambda *a: calls.append(a))
        largest = max(float(p.grad.abs().max()) for p in model.parameters())
        total_inf = wrapped(model.parameters(), 1.0, norm_type=float("inf"))
        total_err = wrapped(model.parameters(), 1.0, 2.0, True)
        assert calls == []  # neither took the shared-norm path
        assert float(total_inf) == pytest.approx(largest)
        assert math.isfinite(float(total_err))
        wrapped(model.parameters(), 1.0)
        assert len(calls) == 1
    finally:
        capture.close()


def test_snapshot_buffers_are_reused_across_sampled_steps():
    """Update ratios copy the parameters into buffers kept by the capture, not into fresh tensors each time."""
    model = tiny_gpt()
    capture = Capture(WatchConfig(run_id="snap", stats_every=1), ListSink()).attach(model)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seen = []
        for step in range(3):
            data = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
            F.cross_entropy(model(data[:, :-1]).reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            kept = capture._measure.snapshot_buffers
            assert kept is not None
            seen.append([t.data_ptr() for t in kept[1]])
        capture.flush()
    finally:
        capture.close()
    assert seen[0] == seen[1] == seen[2]
