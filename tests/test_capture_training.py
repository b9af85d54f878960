"""Real CPU training loops with a Capture attached; every recorded value is checked against a reference the loop
computes itself (plain torch: ``get_total_norm``, parameter snapshots, the optimizer state)."""

from __future__ import annotations

import itertools
import logging
import math
import socket

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stability.config import WatchConfig
from stability.hooks import capture as capture_module
from stability.hooks import rhythm as rhythm_module
from stability.hooks.capture import Capture
from stability.testing import ListSink, TinyGPT, TinyGPTConfig

VOCAB = 64


def make_gpt(*, return_dict: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(vocab=VOCAB, block=16, d_model=32, n_layer=2, n_head=2, return_dict=return_dict))


def tokens(step: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 17), generator=torch.Generator().manual_seed(step))


def logits_of(out: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out


def lm_loss(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model(data[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))


def by_module(model: nn.Module, value) -> dict[str, float]:
    """Reference per-module L2 norm of ``value(param)`` over the parameters each module owns directly."""
    out = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            out[name or "root"] = math.sqrt(sum(float(value(p).detach().double().norm()) ** 2 for p in own))
    return out


def per_module(record, quantity: str) -> dict[str, float]:
    prefix = quantity + "/"
    return {k[len(prefix) :]: v for k, v in record.signals.items() if k.startswith(prefix)}


def assert_close(got: dict[str, float], want: dict[str, float], rel: float = 1e-5) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=rel), name


def test_auto_mode_plain_loop_records_loss_lr_and_grad_norms_before_clipping():
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="auto-1", stats_every=0), sink).attach()
    want = []
    try:
        for step in range(5):  # the loop itself is unchanged; the reference lines only read values
            loss = lm_loss(model, tokens(step))
            loss.backward()
            total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            want.append((loss.item(), opt.param_groups[0]["lr"], total.item(), by_module(model, lambda p: p.grad)))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == list(range(5)) and capture.step == 5
    for record, (loss, lr, total, modules) in zip(records, want, strict=True):
        assert (record.run_id, record.rank, record.host) == ("auto-1", 0, socket.gethostname())
        assert record.get("loss") == pytest.approx(loss, rel=1e-6)
        assert record.get("lr") == pytest.approx(lr, rel=1e-12)
        assert total > 0.1  # clipped every step, so an after-clip measurement would read 0.1
        assert record.get("grad_norm") == pytest.approx(total, rel=1e-5)
        assert record.get("nonfinite_grads") == 0
        assert_close(per_module(record, "grad_norm"), modules)
        assert "h.0.attn.c_attn" in per_module(record, "grad_norm")
        assert not per_module(record, "param_norm")  # stats_every=0
    assert [r.get("lr") for r in records] == sorted((r.get("lr") for r in records), reverse=True)
    assert all(a.wall_time <= b.wall_time for a, b in itertools.pairwise(records))


@pytest.mark.parametrize("accum", [1, 4])
def test_gradient_accumulation_records_the_true_loss_and_the_micro_batch_count(accum):
    """nanoGPT / HF style: each micro-batch loss is divided by the accumulation steps before ``backward()``. The
    record's ``loss`` is the sum of the tensors backward() ran on, i.e. the mean micro-batch loss (not loss / 4)."""
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="accum", stats_every=0, layer_every=0), sink).attach()
    want = []
    try:
        for step in range(3):
            true_losses = []
            for micro in range(accum):
                loss = lm_loss(model, tokens(100 * step + micro))
                true_losses.append(loss.item())
                (loss / accum).backward()
            want.append(sum(true_losses) / accum)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        capture.close()
    records = sink.records
    assert capture.errors == 0
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.get("loss") for r in records] == pytest.approx(want, rel=1e-6)
    assert [r.get("micro_batches") for r in records] == [accum] * 3
    assert not per_module(records[0], "grad_norm")  # layer_every=0


def test_framework_micro_batch_losses_keep_their_mean():
    """Adapters pass undivided micro-batch losses (``observe_loss``): their mean is the step's loss."""
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="fw", stats_every=0, layer_every=0), sink).attach()
    capture.use_framework("test")
    try:
        losses = []
        for micro in range(4):
            loss = lm_loss(model, tokens(micro))
            capture.observe_loss(loss)
            losses.append(loss.item())
            (loss / 4).backward()
        opt.step()
        opt.zero_grad()
    finally:
        capture.close()
    (record,) = sink.records
    assert record.get("loss") == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert record.get("micro_batches") == 4


def test_grad_scaler_on_cpu_unscales_the_loss_and_records_scale_and_skipped_steps():
    """``torch.amp.GradScaler("cpu")`` runs with fp32 on the CPU, so the real scaler is used (no stand-in)."""
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="amp", stats_every=0), sink).attach()
    losses, scales, norms = [], [], []
    try:
        for step in range(4):
            loss = lm_loss(model, tokens(step))
            if step == 2:
                loss = loss * float("inf")  # overflow: the scaler must skip this step
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert scales == [1024.0, 1024.0, 1024.0, 512.0]
    assert [r.get("loss_scale") for r in records] == scales
    assert [r.get("skipped") for r in records] == [0.0, 0.0, 1.0, 0.0]
    for i in (0, 1, 3):
        assert records[i].get("loss") == pytest.approx(losses[i], rel=1e-6)  # true loss, not loss * scale
        assert records[i].get("grad_norm") == pytest.approx(norms[i], rel=1e-5)
    assert math.isinf(records[2].get("loss"))
    assert not math.isfinite(records[2].get("grad_norm"))
    assert records[2].get("nonfinite_grads") > 0


def test_sampled_statistics_and_activation_hooks_exist_only_on_sampled_steps():
    model = make_gpt(return_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = ListSink()
    config = WatchConfig(run_id="sampled", stats_every=3, max_act_modules=4)
    capture = Capture(config, sink).attach(model, opt)
    hooks, logit_z = [], {}
    try:
        for step in range(7):
            hooks.append(sum(len(m._forward_hooks) for m in model.modules()))
            data = tokens(step)
            logits = logits_of(model(data[:, :-1]))
            logit_z[step] = torch.logsumexp(logits.detach(), -1).mean().item()
            F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    assert hooks == [5, 0, 0, 5, 0, 0, 5]  # 4 activation hooks + 1 output hook (logit_z), only on sampled steps
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    records = sink.records
    assert len(records) == 7
    for record in records:
        sampled = record.step % 3 == 0
        for quantity in ("param_norm", "update_ratio", "adam_v_ratio", "act_absmax", "act_rms"):
            first_adam = quantity == "adam_v_ratio" and record.step == 0  # no second moment before step 0
            assert bool(per_module(record, quantity)) == (sampled and not first_adam), (record.step, quantity)
        assert ("logit_z" in record.signals) == sampled
        assert per_module(record, "grad_norm")  # layer_every=1: every step
        if sampled:
            assert len(per_module(record, "act_rms")) == 4
            assert record.get("logit_z") == pytest.approx(logit_z[record.step], rel=1e-5)


def test_activation_hooks_stay_while_every_step_is_sampled():
    """With ``stats_every=1`` the activation and output hooks are registered once, not again on every step; the
    output hook (``logit_z``) is there even when no module gets activation statistics."""
    for max_act, expected in ((4, 5), (0, 1)):
        model = make_gpt(return_dict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sink = ListSink()
        capture = Capture(WatchConfig(run_id="every", stats_every=1, max_act_modules=max_act), sink).attach(model, opt)
        seen: list[list[object]] = []  # the hook objects themselves (kept alive: no id reuse)
        try:
            for step in range(4):
                seen.append([h for m in model.modules() for h in m._forward_hooks.values()])
                data = tokens(step)
                F.cross_entropy(logits_of(model(data[:, :-1])).reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
        finally:
            capture.close()
        assert capture.errors == 0
        assert [len(s) for s in seen] == [expected] * 4
        assert all(a is b for later in seen[1:] for a, b in zip(seen[0], later, strict=True))  # registered once
        assert sum(len(m._forward_hooks) for m in model.modules()) == 0
        assert all("logit_z" in r.signals for r in sink.records) and len(sink.records) == 4
        assert all(len(per_module(r, "act_rms")) == max_act for r in sink.records)


def _clip_then_edit(model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    for p in list(model.parameters())[::3]:  # the loop changes some clipped gradients in place before the step
        p.grad.mul_(0.5)


def _shrink_some_parameters(model: nn.Module) -> None:
    with torch.no_grad():  # between two sampled steps: ‖w before‖ is not the last step's ‖w after‖ any more
        for p in list(model.parameters())[1::4]:
            p.mul_(0.9)


@pytest.mark.parametrize("before_step", [
    lambda model: None,
    lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05),  # clips: Adam sees scaled gradients
    lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6),  # no clipping (factor 1)
    _clip_then_edit,
    _shrink_some_parameters,
], ids=["plain", "clipped", "clip-noop", "clip-then-edit", "params-edited"])
def test_update_ratio_param_norm_adam_and_activation_stats_match_references(before_step):
    """The reference is computed from the gradients the optimizer used: the capture's reuse of the norms it took
    before clipping (scaled by the clip factor) must give the same Adam statistic, and must notice an edit."""
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="ratios", stats_every=1, max_act_modules=100), sink).attach(model, opt)
    outputs: dict[str, torch.Tensor] = {}
    names = {m: n for n, m in model.named_modules()}
    mine = [
        m.register_forward_hook(lambda m, a, o: outputs.__setitem__(names[m], o.detach().clone()))
        for m in model.modules()
        if list(m.parameters(recurse=False))
    ]
    want = []
    try:
        for step in range(3):
            outputs.clear()
            lm_loss(model, tokens(step)).backward()
            before_step(model)
            before = {p: p.detach().clone() for p in model.parameters()}
            v_before = {p: opt.state[p]["exp_avg_sq"].double().clone() for p in model.parameters() if p in opt.state}
            opt.step()
            delta = by_module(model, lambda p, before=before: p.detach() - before[p])
            size = by_module(model, lambda p, before=before: before[p])
            adam = {}
            for name, module in model.named_modules():
                own = list(module.parameters(recurse=False))
                if own and step > 0:  # Adam's bias-corrected second moment before this step (none at the first)
                    g2 = sum(float(p.grad.double().square().sum()) for p in own)
                    v = sum(float(v_before[p].sum()) for p in own) / (1 - 0.999**step)
                    adam[name] = g2 / v
            acts = {n: (float(o.abs().max()), math.sqrt(float(o.double().square().mean()))) for n, o in outputs.items()}
            want.append(({n: delta[n] / size[n] for n in delta}, by_module(model, lambda p: p), adam, acts))
            opt.zero_grad()
    finally:
        capture.close()
        for handle in mine:
            handle.remove()
    assert capture.errors == 0
    for record, (ratio, norm, adam, acts) in zip(sink.records, want, strict=True):
        assert_close(per_module(record, "update_ratio"), ratio, rel=1e-4)
        assert_close(per_module(record, "param_norm"), norm)
        assert_close(per_module(record, "adam_v_ratio"), adam, rel=1e-4)
        assert_close(per_module(record, "act_absmax"), {n: a for n, (a, _) in acts.items()})
        assert_close(per_module(record, "act_rms"), {n: r for n, (_, r) in acts.items()}, rel=1e-4)


def test_nan_in_a_batch_shows_as_nonfinite_loss_grad_norm_and_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="nan", stats_every=0), sink).attach()
    counts = []
    try:
        for step in range(4):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[3, 5] = float("nan")
            loss = F.mse_loss(model(x), torch.ones(16, 1))
            loss.backward()
            counts.append(sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters()))
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    records = sink.records
    assert counts[:2] == [0, 0] and counts[2] > 0
    for record in records[:2]:
        assert math.isfinite(record.get("loss")) and math.isfinite(record.get("grad_norm"))
        assert record.get("nonfinite_grads") == 0
    assert math.isnan(records[2].get("loss"))
    assert math.isnan(records[2].get("grad_norm"))
    assert records[2].get("nonfinite_grads") == counts[2]
    assert records[3].get("nonfinite_grads") == counts[3]  # the NaN weights keep every gradient NaN
    assert set(per_module(records[2], "grad_norm")) == {"0", "2"}


def test_observe_set_batch_rank_and_coords(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="meta", stats_every=0), sink, coords={"dp": 3}).attach(model, opt)
    try:
        for step in range(2):
            capture.set_batch(f"shard0:{step}")
            logits = logits_of(model(tokens(step)[:, :-1]))
            capture.observe("attn_logit_max/h.0.attn", logits.detach().abs())  # a tensor: reduced to its max
            capture.observe("tokens", 64.0)
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens(step)[:, 1:].reshape(-1)).backward()
            expected_max = logits.detach().abs().max().item()
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    first, second = sink.records
    assert (first.rank, dict(first.coords)) == (3, {"world_size": 4, "local_rank": 1, "dp": 3})
    assert (first.batch, second.batch) == ("shard0:0", "shard0:1")
    assert second.get("attn_logit_max/h.0.attn") == pytest.approx(expected_max)
    assert second.get("tokens") == 64.0


def test_auto_mode_tracks_only_the_first_optimizer_that_steps():
    torch.manual_seed(0)
    main, probe = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_main = torch.optim.SGD(main.parameters(), lr=0.1)
    opt_probe = torch.optim.SGD(probe.parameters(), lr=0.1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="two-opt", stats_every=0), sink).attach()
    norms = []
    try:
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            main(x).square().mean().backward()
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in main.parameters()]).item())
            opt_main.step()
            opt_main.zero_grad()
            probe(x).square().mean().backward()
            opt_probe.step()
            opt_probe.zero_grad()
    finally:
        capture.close()
    records = sink.records
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.get("grad_norm") for r in records] == pytest.approx(norms, rel=1e-5)
    assert set(per_module(records[0], "grad_norm")) == {"root"}  # nn.Linear owns its parameters itself


# --------------------------------------------------------------------------- loops without torch.optim (rhythm)


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 16)
        self.rnn = nn.LSTM(16, 16)
        self.decoder = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, hidden=None):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(out), hidden


def lstm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (9, 4), generator=torch.Generator().manual_seed(step))
    return data[:-1], data[1:]


def lstm_loss(model: LSTMLM, step: int) -> torch.Tensor:
    x, y = lstm_batch(step)
    out, _ = model(x)
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


@pytest.mark.parametrize("accum", [1, 4])
def test_hand_sgd_loop_without_optimizer_is_captured_step_by_step(accum, caplog):
    """word_language_model's loop: ``model.zero_grad()`` first, backward, clip, ``p.data.add_(p.grad, alpha=-lr)``."""
    torch.manual_seed(0)
    model = LSTMLM()
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="hand", stats_every=2), sink).attach()
    want = []
    with caplog.at_level(logging.INFO, logger="stability.hooks.capture"):
        try:
            for step in range(5):
                model.zero_grad()
                true_losses = []
                for micro in range(accum):
                    loss = lstm_loss(model, 10 * step + micro)
                    true_losses.append(loss.item())
                    (loss / accum).backward()
                grads = by_module(model, lambda p: p.grad)
                total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
                before = {p: p.detach().clone() for p in model.parameters()}
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-1.0)
                ratio = by_module(model, lambda p, before=before: p.detach() - before[p])
                size = by_module(model, lambda p, before=before: before[p])
                capture.observe("lr", 1.0)
                want.append((sum(true_losses) / accum, total, grads, {n: ratio[n] / size[n] for n in ratio},
                             by_module(model, lambda p: p)))
        finally:
            capture.close()  # the last step has no later boundary: close() records it
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == list(range(5))
    for record, (loss, total, grads, ratios, norms) in zip(records, want, strict=True):
        assert record.get("loss") == pytest.approx(loss, rel=1e-6)
        assert record.get("micro_batches") == accum
        assert total > 0.1 and record.get("grad_norm") == pytest.approx(total, rel=1e-5)  # before clipping
        assert record.get("nonfinite_grads") == 0
        assert record.get("lr") == 1.0  # only what the loop observes: there is no optimizer to read it from
        assert_close(per_module(record, "grad_norm"), grads)
        if record.step % 2 == 0:
            assert_close(per_module(record, "param_norm"), norms)
            if record.step > 0:  # step 0 ends before the loop is known to have no optimizer: no snapshot
                assert_close(per_module(record, "update_ratio"), ratios, rel=1e-4)
            assert set(per_module(record, "act_rms")) == {"encoder", "rnn", "decoder"} or record.step == 0
        else:
            assert not per_module(record, "param_norm")
    said = [r.getMessage() for r in caplog.records if "capturing model" in r.getMessage()]
    assert len(said) == 1, said
    assert "LSTMLM (3 modules" in said[0] and "no optimizer seen" in said[0] and "no lr" in said[0]


@pytest.mark.parametrize("clear", ["set_to_none", "zero_", "module_zero_grad"])
def test_tensor_level_loops_end_steps_where_gradients_are_cleared(clear):
    """The tutorial loop: ``p -= lr * p.grad`` under ``no_grad`` then the gradients are cleared (``p.grad = None``,
    ``p.grad.zero_()`` or ``model.zero_grad(set_to_none=True)``), no clipping, no optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="tensor", stats_every=0), sink).attach()
    want = []
    try:
        for step in range(6):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            want.append((loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()))
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            if clear == "module_zero_grad":
                model.zero_grad(set_to_none=True)
            for p in model.parameters():
                if clear == "set_to_none":
                    p.grad = None
                elif clear == "zero_":
                    p.grad.zero_()
    finally:
        capture.close()
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == list(range(6))
    assert [r.get("loss") for r in records] == pytest.approx([loss for loss, _ in want], rel=1e-6)
    # a loop that clears gradients itself is recognised at its first step: from then on they are measured after
    # every backward(); with zero_grad() they are measured before it clears them, from the first step on
    first = 0 if clear == "module_zero_grad" else 1
    assert all("grad_norm" not in r.signals for r in records[:first])
    assert [r.get("grad_norm") for r in records[first:]] == pytest.approx([g for _, g in want[first:]], rel=1e-5)
    assert set(per_module(records[-1], "grad_norm")) == {"0", "2"}


def test_an_optimizer_that_appears_later_takes_over_the_step_boundaries(caplog):
    torch.manual_seed(0)
    model = LSTMLM()
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="takeover", stats_every=1), sink).attach()
    with caplog.at_level(logging.INFO, logger="stability.hooks.capture"):
        try:
            for step in range(3):  # hand-written SGD first
                model.zero_grad()
                lstm_loss(model, step).backward()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
            model.zero_grad()  # ends the last hand-written step
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            lrs = []
            for step in range(3, 6):
                for micro in range(2):
                    (lstm_loss(model, 10 * step + micro) / 2).backward()
                opt.step()
                lrs.append(opt.param_groups[0]["lr"])
                opt.zero_grad()
        finally:
            capture.close()
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == list(range(6))
    assert [r.get("micro_batches") for r in records] == [1, 1, 1, 2, 2, 2]
    assert all("lr" not in r.signals for r in records[:3])
    assert [r.get("lr") for r in records[3:]] == lrs
    assert per_module(records[4], "adam_v_ratio") and per_module(records[4], "update_ratio")
    assert any("AdamW now steps" in r.getMessage() for r in caplog.records)


def test_a_loop_with_no_visible_boundary_is_recorded_per_backward_with_a_warning(monkeypatch, caplog):
    """Gradients cleared through ``.data`` and updates through ``.data`` leave no trace stability can see."""
    monkeypatch.setattr(rhythm_module, "BLIND_AFTER", 6)
    monkeypatch.setattr(capture_module, "BLIND_AFTER", 6)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="blind", stats_every=0), sink).attach()
    losses, norms = [], []
    with caplog.at_level(logging.WARNING, logger="stability.hooks.capture"):
        try:
            for step in range(10):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
                loss = model(x).square().mean()
                loss.backward()
                losses.append(loss.item())
                norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
                for p in model.parameters():
                    p.data.add_(p.grad.data, alpha=-0.01)
                    p.grad.data.zero_()
        finally:
            capture.close()
    assert capture.errors == 0
    records = sink.records
    assert len(records) == 4  # the first 6 backward() calls are dropped, then one step each
    assert [r.get("loss") for r in records] == pytest.approx(losses[6:], rel=1e-6)
    assert [r.get("grad_norm") for r in records] == pytest.approx(norms[6:], rel=1e-5)
    warned = [r.getMessage() for r in caplog.records if "nothing recorded after 6 backward() calls" in r.getMessage()]
    assert len(warned) == 1 and "no step boundary" in warned[0]


def test_raw_tensor_loop_records_the_loss_of_each_backward_and_says_so(caplog):
    w = torch.zeros(4, requires_grad=True)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="raw"), sink).attach()
    losses = []
    with caplog.at_level(logging.WARNING, logger="stability.hooks.capture"):
        try:
            for step in range(4):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
                loss = (x @ w - 1).square().mean()
                loss.backward()
                losses.append(loss.item())
                with torch.no_grad():
                    w -= 0.1 * w.grad
                w.grad = None
        finally:
            capture.close()
    assert capture.errors == 0
    assert [r.get("loss") for r in sink.records] == pytest.approx(losses, rel=1e-6)
    assert all("grad_norm" not in r.signals for r in sink.records)
    assert sum("capturing loss only" in r.getMessage() for r in caplog.records) == 1


def test_steps_ending_at_the_next_backward_keep_their_own_activations_and_batch_ids():
    """In a loop whose steps end at the next ``backward()`` (gradients set to None, no zero_grad/clip), the next
    step's forward pass and ``set_batch`` run before the step in progress is known to end: they go to the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="late", stats_every=2, max_act_modules=8), sink).attach()
    outputs: dict[int, float] = {}
    mine = model[0].register_forward_hook(lambda m, a, o: outputs.__setitem__(step, float(o.detach().abs().max())))
    try:
        for step in range(7):
            capture.set_batch(f"b{step}")
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step)) * (1 + step)
            model(x).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.001 * p.grad
                    p.grad = None
    finally:
        capture.close()
        mine.remove()
    assert capture.errors == 0
    records = sink.records
    assert [r.step for r in records] == list(range(7))
    assert [r.batch for r in records] == [f"b{s}" for s in range(7)]
    for record in records[1:]:
        sampled = record.step % 2 == 0
        assert ("act_absmax/0" in record.signals) == sampled, record.step
        if sampled:
            assert record.get("act_absmax/0") == pytest.approx(outputs[record.step], rel=1e-6)


def test_a_negative_loss_is_said_once_in_the_console(caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="negative"), sink).attach(model, opt)
    with caplog.at_level(logging.WARNING, logger="stability.hooks.staging"):
        try:
            for step in range(6):  # a policy-gradient-like loss: positive first, then negative
                loss = model(torch.randn(4, 8)).mean().abs() * (1.0 if step < 2 else -1.0)
                loss.backward()
                opt.step()
                opt.zero_grad()
        finally:
            capture.close()
    assert [r.get("loss") < 0 for r in sink.records] == [False, False, True, True, True, True]
    said = [r.getMessage() for r in caplog.records if "loss is negative" in r.getMessage()]
    assert len(said) == 1 and "at step 2" in said[0] and "stop judging" in said[0], said


@pytest.mark.parametrize("auto", [True, False])
def test_lbfgs_closure_step_records_the_first_evaluation_only(auto):
    """``LBFGS.step(closure)`` calls the closure up to ``max_iter`` times per step: the step's loss is the first
    call's (what ``step`` returns), its gradients those of that call, not the sum of ~20 trial points'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5)
    x, y = torch.randn(256, 6, dtype=torch.double), torch.randn(256, 1, dtype=torch.double)  # noise: no exact fit
    sink = ListSink()
    config = WatchConfig(run_id="lbfgs", stats_every=1, max_act_modules=10)
    capture = Capture(config, sink).attach() if auto else Capture(config, sink).attach(model, opt)
    want = []
    try:
        for _ in range(4):
            calls: list[tuple[float, float, float]] = []

            def closure(calls=calls):
                opt.zero_grad()
                out = model(x)
                loss = F.mse_loss(out, y)
                loss.backward()
                grad = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                calls.append((loss.item(), grad.item(), out.detach().abs().max().item()))
                return loss

            before = {p: p.detach().clone() for p in model.parameters()}
            returned = opt.step(closure)
            delta = by_module(model, lambda p, before=before: p.detach() - before[p])
            size = by_module(model, lambda p, before=before: before[p])
            assert len(calls) == 5 and returned.item() == calls[0][0]
            want.append((calls[0], {n: delta[n] / size[n] for n in delta}))
    finally:
        capture.close()
    assert capture.errors == 0
    assert [r.step for r in sink.records] == [0, 1, 2, 3]
    for record, ((loss, grad, out_max), ratio) in zip(sink.records, want, strict=True):
        assert record.get("micro_batches") == 1
        assert record.get("loss") == pytest.approx(loss, rel=1e-6)
        assert record.get("grad_norm") == pytest.approx(grad, rel=1e-6)
        assert_close(per_module(record, "update_ratio"), ratio, rel=1e-4)  # over the whole step's update
        if record.step or not auto:  # auto mode finds the model in step 0, so no activation hooks then
            assert record.get("act_absmax/2") == pytest.approx(out_max, rel=1e-6)  # the first call's output only


def test_a_closure_on_an_ordinary_optimizer_is_called_once_and_recorded_as_without_one():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="closure-sgd", stats_every=1), sink).attach()
    want = []
    try:
        for step in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                want.append((loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()))
                return loss

            opt.step(closure=closure) if step % 2 else opt.step(closure)  # keyword and positional
    finally:
        capture.close()
    assert capture.errors == 0
    assert [(r.get("loss"), r.get("grad_norm")) for r in sink.records] == [
        (pytest.approx(loss, rel=1e-6), pytest.approx(grad, rel=1e-6)) for loss, grad in want
    ]


def test_a_float64_model_is_captured_with_every_signal():
    """Double-precision models (scientific ML, the LBFGS examples): torch refuses a float32 norm of a float64
    tensor, which once made every hook fail and the capture turn itself off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="f64", stats_every=1, max_act_modules=10), sink).attach(model, opt)
    want = []
    try:
        for step in range(4):
            x = torch.randn(16, 8, dtype=torch.double)
            if step == 3:
                x[0, 0] = float("nan")
            out = model(x)
            loss = out.square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
            want.append((loss.item(), by_module(model, lambda p: p.grad), float(out.detach().abs().max())))
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    for record, (loss, grads, out_max) in zip(sink.records[:3], want[:3], strict=True):
        assert record.get("loss") == pytest.approx(loss, rel=1e-6)
        assert_close(per_module(record, "grad_norm"), grads)
        assert record.get("act_absmax/2") == pytest.approx(out_max, rel=1e-6)
        assert {"update_ratio/0", "param_norm/2"} <= set(record.signals)
        assert record.get("nonfinite_grads") == 0
    last = sink.records[3]
    assert math.isnan(last.get("loss")) and math.isnan(last.get("grad_norm")) and last.get("nonfinite_grads") > 0


def test_an_optimizer_created_again_each_epoch_keeps_being_tracked(caplog):
    """``opt = SGD(model.parameters(), lr=...)`` inside the epoch loop: each new optimizer over the same parameters
    replaces the tracked one (before, every step after the first epoch was silently lost)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="recreated", stats_every=0), sink).attach()
    losses = []
    with caplog.at_level(logging.INFO, logger="stability.hooks.capture"):
        try:
            for epoch in range(3):
                opt = torch.optim.SGD(model.parameters(), lr=0.1 * 0.5**epoch)
                for _ in range(4):
                    loss = model(torch.randn(8, 6)).square().mean()
                    losses.append(loss.item())
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        finally:
            capture.close()
    assert capture.errors == 0
    assert [r.step for r in sink.records] == list(range(12))
    assert [r.get("loss") for r in sink.records] == pytest.approx(losses, rel=1e-6)
    assert [r.get("lr") for r in sink.records] == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4)
    assert sum("replaces the tracked optimizer" in r.getMessage() for r in caplog.records) == 2


class _Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_sequential_optimizers_over_other_parameters_start_a_new_phase():
    """Forward-forward style: stage 0 trains with its own optimizer, then stage 1 with another. After
    HANDOVER_STEPS steps in a row of the second, it is tracked; the phase's first record says ``phase_start`` and
    the per-module signals name the new stage's modules (found again from its forward passes)."""
    torch.manual_seed(0)
    stages = [_Stage(6), _Stage(6)]
    opts = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in stages]
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="phases", stats_every=0), sink).attach()
    n = capture_module.HANDOVER_STEPS + 10
    try:
        for stage, opt in zip(stages, opts, strict=True):
            for _ in range(n):
                loss = stage(torch.randn(8, 6)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        capture.close()
    assert capture.errors == 0
    records = sink.records
    first = n  # the second phase's first tracked step: its HANDOVER_STEPS-th step (the earlier ones are not seen)
    assert [r.step for r in records] == list(range(2 * n - capture_module.HANDOVER_STEPS + 1))
    assert [r.step for r in records if r.signals.get("phase_start")] == [first]
    assert "grad_norm/lin" in records[first - 1].signals and "grad_norm/lin" in records[first + 1].signals
    want = torch.nn.utils.get_total_norm([p.grad for p in stages[1].parameters()]).item()
    assert records[-1].get("grad_norm") == pytest.approx(want, rel=1e-5)  # the second stage's gradients


def test_alternating_optimizers_never_hand_over():
    """A WGAN critic stepping 5 times per generator step (both after the critic's first step): the first
    optimizer to step stays tracked, whichever steps more often."""
    torch.manual_seed(0)
    gen, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.RMSprop(gen.parameters(), lr=1e-3)
    opt_c = torch.optim.RMSprop(critic.parameters(), lr=1e-3)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="wgan", stats_every=0), sink).attach()
    try:
        for _ in range(capture_module.HANDOVER_STEPS + 5):
            gen(torch.randn(8, 4)).square().mean().backward()  # the generator steps first: tracked
            opt_g.step()
            opt_g.zero_grad()
            for _ in range(5):
                critic(torch.randn(8, 4)).mean().backward()
                opt_c.step()
                opt_c.zero_grad()
    finally:
        capture.close()
    assert len(sink.records) == capture_module.HANDOVER_STEPS + 5
    assert not [r for r in sink.records if r.signals.get("phase_start")]
    assert all(r.signals.get("objectives", 1.0) > 1 for r in sink.records[1:])  # one side of a game


def test_a_compiled_model_keeps_its_module_names_and_no_hook_warning_is_shown():
    """``torch.compile(model)`` (backend "eager": dynamo's wrapper and tracing, no C++ build): signals are named
    after the user's modules, not ``_orig_mod.*``, and torch's warning about global hooks firing once more for the
    wrapper (caused by the capture's discovery hooks) is not shown."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = ListSink()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # every warning shown, as a fresh interpreter shows this one
        capture = Capture(WatchConfig(run_id="compiled", stats_every=1), sink).attach()
        try:
            for _ in range(3):
                loss = compiled(torch.randn(4, 8)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            capture.close()
        assert not [f for f in warnings.filters if f[1] is not None and "global hooks" in f[1].pattern]  # removed
    assert capture.errors == 0
    assert not [w for w in seen if "global hooks" in str(w.message)], [str(w.message) for w in seen]
    assert set(per_module(sink.records[-1], "grad_norm")) == {"0", "2"}


def _train_in_fork(model: nn.Module, done, capture: Capture | None = None) -> None:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("stability.hooks.capture").addHandler(handler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    logging.getLogger("stability.hooks.capture").removeHandler(handler)
    done.put((said, capture is not None and capture._forked))


def test_a_forked_child_that_trains_is_off_and_says_so_once(caplog):
    """Hogwild (pytorch/examples mnist_hogwild): forked processes train a shared model. The capture's threads do not
    survive fork, so in the child it turns off (no hook work, nothing piling up) and says so once; the parent goes
    on being captured."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    model = nn.Linear(6, 1)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="fork", stats_every=0), sink).attach()
    done = ctx.Queue()
    try:
        child = ctx.Process(target=_train_in_fork, args=(model, done, capture))
        child.start()
        said, off = done.get(timeout=120)
        assert off and len(said) == 1 and "forked from the captured process" in said[0], said
        child.join(timeout=120)
        assert child.exitcode == 0
        _train_in_fork(model, ctx.Queue())  # the parent trains too: captured
    finally:
        capture.close()
    assert [r.step for r in sink.records] == [0, 1, 2]  # the parent's three steps only
    assert capture.errors == 0 and not capture._forked


class _ForkingSink(ListSink):
    """A sink that serves forked children as the session's does, counting what the capture asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared = 0

    def prepare_fork(self) -> None:
        self.prepared += 1

    def fork_child(self, rank: int) -> ListSink:  # never reached here: the children below do not train
        raise AssertionError(rank)


def test_the_session_is_prepared_for_a_forked_trainer_but_not_for_dataloader_workers():
    """Before a fork the capture starts the session a Hogwild child will connect to (``prepare_fork``), but not
    for ``DataLoader`` workers, which never train (no session modules imported on the training thread for them)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    sink = _ForkingSink()
    capture = Capture(WatchConfig(run_id="forks", stats_every=0), sink).attach()
    try:
        data = torch.utils.data.TensorDataset(torch.randn(8, 6))
        batches = list(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=ctx))
        assert len(batches) == 2 and sink.prepared == 0 and capture._forks == 2
        child = ctx.Process(target=len, args=((),))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 0 and sink.prepared == 1 and capture._forks == 3
    finally:
        capture.close()
    assert capture.errors == 0


def test_optimizers_stepping_together_are_one_record_over_all_their_parameters(caplog):
    """modded-nanogpt steps an Adam for the embeddings, one for the head and Muon for the matrices, one after the
    other on the same gradients. The first optimizer sets the step boundary; the others step in its window (no
    ``backward()`` between), so the record covers every parameter: the global gradient norm, per-module norms
    and update ratios over all three updates (before: the embeddings only). A co-stepping optimizer that skips a
    step ends the record at the next ``backward()``."""
    torch.manual_seed(0)
    model = make_gpt()
    embed = [model.wte.weight, model.wpe.weight]
    head = [p for n, p in model.named_parameters() if n.startswith("ln_f")]
    rest = [p for p in model.parameters() if all(p is not q for q in (*embed, *head))]
    opts = [torch.optim.Adam(embed, lr=3e-3), torch.optim.Adam(head, lr=2e-3),
            torch.optim.SGD(rest, lr=0.05, momentum=0.9)]  # stands in for Muon (no exp_avg_sq)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="co", stats_every=1), sink).attach()
    want = []
    with caplog.at_level(logging.INFO, logger="stability.hooks.capture"):
        try:
            for step in range(5):
                lm_loss(model, tokens(step)).backward()
                total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
                before = {p: p.detach().clone() for p in model.parameters()}
                for i, opt in enumerate(opts):
                    if not (step == 3 and i == 2):  # step 3: the matrices' optimizer skips
                        opt.step()
                delta = by_module(model, lambda p, before=before: p.detach() - before[p])
                size = by_module(model, lambda p, before=before: before[p])
                want.append((total, {n: delta[n] / size[n] for n in delta}))
                for opt in opts:
                    opt.zero_grad()
        finally:
            capture.close()
    assert capture.errors == 0
    assert [r.step for r in sink.records] == list(range(5))
    assert sum("steps right after the tracked one" in r.getMessage() for r in caplog.records) == 2
    for record, (total, ratio) in list(zip(sink.records, want, strict=True))[1:]:  # step 0: the embeddings only
        assert record.get("grad_norm") == pytest.approx(total, rel=1e-5), record.step
        assert record.get("lr") == pytest.approx(3e-3)
        got = per_module(record, "update_ratio")
        assert set(got) == set(ratio)
        for name, value in ratio.items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-12), (record.step, name)
        assert set(per_module(record, "adam_v_ratio")) <= {"wte", "wpe", "ln_f"}
    assert per_module(sink.records[3], "update_ratio")["h.0.attn.c_attn"] == 0.0  # its optimizer skipped


class _ZeroPos(nn.Module):
    """minGPT's shape: a positional embedding owned by the root module, initialised to zeros, and a gate that
    stays zero (no gradient reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4, 8))
        self.body = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8, bias=False)
        nn.init.zeros_(self.gate.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.pos) + 0.0 * self.gate.weight.sum().detach()


def test_a_module_whose_weights_are_all_zero_has_a_finite_update_ratio():
    """‖Δw‖ / ‖w before‖ of a zero-initialised module was inf at its first step (and 0/0 = NaN for one that stays
    zero): an ERROR ``nan`` at step 0 of a clean minGPT-style run. Such a module is measured against its weights
    after the step: 1.0 when it just left zero, 0 while it stays there."""
    torch.manual_seed(0)
    model = _ZeroPos()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="zero", stats_every=1), sink).attach(model, opt)
    want = []
    try:
        for _ in range(3):
            before = {p: p.detach().clone() for p in model.parameters()}
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            delta = by_module(model, lambda p, before=before: p.detach() - before[p])
            size = by_module(model, lambda p, before=before: before[p])
            want.append({n: delta[n] / size[n] for n in delta if size[n] > 0})
    finally:
        capture.close()
    assert capture.errors == 0
    first, *rest = sink.records
    assert first.get("update_ratio/root") == pytest.approx(1.0)  # pos left zero: Δw = w after
    assert first.get("update_ratio/body") == pytest.approx(want[0]["body"], rel=1e-4)
    for record in sink.records:
        assert record.get("update_ratio/gate") == 0.0  # stays zero: no update, no NaN
        assert all(math.isfinite(v) for k, v in record.signals.items() if k.startswith("update_ratio/"))
    for record, ratio in zip(rest, want[1:], strict=True):  # later steps: the ordinary ratio
        assert record.get("update_ratio/root") == pytest.approx(ratio["root"], rel=1e-4)


class _SkipGram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Embedding(50, 8, sparse=True)
        self.v = nn.Embedding(50, 8, sparse=True)
        self.proj = nn.Linear(8, 8)

    def forward(self, c: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid((self.proj(self.u(c)) * self.v(o)).sum(-1)).mean()


def _coalesced(p: nn.Parameter) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.coalesce().values() if p.grad.is_sparse else p.grad


def test_sparse_embedding_gradients_are_measured_over_their_coalesced_values():
    """``nn.Embedding(sparse=True)`` + ``SparseAdam`` (word2vec, recommendation models): the foreach kernels refuse
    sparse tensors, so every gradient hook failed until the capture turned itself off after 20 errors. Sparse
    gradients are normed over their coalesced values (repeated indices summed, as SparseAdam does); the dense
    layer's Adam co-steps; a NaN in a sparse gradient is counted."""
    torch.manual_seed(0)
    model = _SkipGram()
    sparse_opt = torch.optim.SparseAdam([model.u.weight, model.v.weight], lr=1e-2)
    dense_opt = torch.optim.Adam(model.proj.parameters(), lr=1e-3)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="sparse", stats_every=1), sink).attach()
    want = []
    try:
        for step in range(4):
            c = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(step))  # repeats: uncoalesced
            loss = model(c, (c + 1) % 50)
            loss.backward()
            if step == 3:
                model.u.weight.grad = model.u.weight.grad.coalesce()
                model.u.weight.grad.values()[0, 0] = float("nan")
            grads = {n: float(_coalesced(p).double().norm()) for n, p in model.named_parameters()}
            want.append((loss.item(), math.sqrt(sum(g * g for g in grads.values())), grads))
            sparse_opt.step()
            dense_opt.step()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    assert [r.step for r in sink.records] == list(range(4))
    for record, (loss, total, grads) in zip(sink.records[:3], want[:3], strict=True):
        assert record.get("loss") == pytest.approx(loss, rel=1e-6)
        assert record.get("grad_norm/u") == pytest.approx(grads["u.weight"], rel=1e-5)
        assert record.get("grad_norm/v") == pytest.approx(grads["v.weight"], rel=1e-5)
        if record.step == 0:  # the co-stepping dense Adam is known from step 1 (as in the test above)
            continue
        assert record.get("grad_norm") == pytest.approx(total, rel=1e-5)
        assert record.get("nonfinite_grads") == 0
        assert {"update_ratio/u", "update_ratio/proj", "param_norm/v"} <= set(record.signals)
    last = sink.records[3]
    assert math.isnan(last.get("grad_norm")) and last.get("nonfinite_grads") == 1


def test_a_weight_flipped_in_memory_is_diagnosed_as_a_hardware_fault():
    """Real training, then the worker's diagnosis of its records: at step 70 one weight of an MLP layer becomes 1e4
    (a flipped exponent bit), between two optimizer steps. The layer's gradient explodes at once and its sampled
    weight norm is ~100x up at step 70's sample, with the LR on its schedule: ``hardware_fault`` first."""
    from stability.detectors import RunDiagnoser

    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="flip", stats_every=10), sink).attach(model, opt)
    try:
        for step in range(120):
            if step == 70:
                with torch.no_grad():
                    model.h[1].mlp[0].weight[3, 5] = 1e4
            lm_loss(model, tokens(step % 8, rows=8)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    assert capture.errors == 0
    diag = RunDiagnoser()
    for record in sink.records:
        diag.update(record)
    diag.finish()
    serious = [i for i in diag.incidents if i.headline.severity.rank >= 1]
    assert serious and all(i.onset >= 70 for i in serious), [(i.onset, i.kinds) for i in serious]
    first = serious[0]
    assert "param_jump" in first.kinds and first.headline.causes[0].cause == "hardware_fault", first.headline
