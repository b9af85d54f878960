"""Public training scripts, re-created small (tests/scripts/, attribution and licence in each file), run unchanged
apart from ``import stability.auto``: the embedded redis-server, a real local worker process, the Parquet archive,
then the post-mortem over the run directory. Clean runs must raise nothing; an LR x100, a NaN and a bad batch must
be found with the right kind at the step they were injected.

* ``word_lm.py`` (pytorch/examples word_language_model): no ``torch.optim`` at all, a hand-written SGD update;
  step boundaries come from the backward / clip / zero_grad rhythm.
* ``nanogpt.py`` (nanoGPT train.py): AdamW, cosine LR with warm-up, gradient accumulation 4 with ``loss / 4``;
  the recorded loss must be the true (undivided) loss.
* ``nn_tutorial.py`` (pytorch/tutorials "What is torch.nn really?"): an MLP, ``p -= p.grad * lr`` under
  ``no_grad`` then ``model.zero_grad()`` at the end of each iteration, no clipping, no optimizer.
* ``dcgan.py`` (pytorch/examples dcgan): two Adam optimizers; the discriminator steps first (tracked), the
  generator's ``errG.backward()`` runs between two discriminator steps and must not count in its loss; the losses
  of the two networks swing against each other by design. BCELoss refuses a NaN input: the NaN fault kills the
  script, which must be recorded as died at its last step with the reason.
* ``time_seq.py`` (pytorch/examples time_sequence_prediction): a float64 LSTM trained with ``LBFGS.step(closure)``,
  whose closure runs up to 20 times a step: the step's loss is the first call's, not the sum of the trial points'.
* ``reinforce.py`` (pytorch/examples reinforcement_learning): REINFORCE, one Adam step per cart-pole episode; the
  loss is a signed surrogate that swings 10x between episodes: not judged by the loss detectors once negative.
* ``regression.py`` (pytorch/examples regression): a polynomial fit on x..x^4 features with a hand-written update:
  a wild, heavy-tailed loss (0.008-2.5 between batches) and update ratios that follow the gradient.
* ``forward_forward.py`` (pytorch/examples mnist_forward_forward): one Adam per layer, layers trained one after
  the other: the second layer's optimizer becomes the tracked one (a new phase), faults in that phase are found.
* ``mnist_hogwild.py`` (pytorch/examples mnist_hogwild): the parent forks two processes that train one shared
  model (each its own SGD), then only tests it: each child is recorded as a rank of its own (``fork`` coordinate);
  with ``--start-method spawn|forkserver`` each child imports the script again and is recorded the same way.
* ``ddp_tutorial.py`` (pytorch/tutorials ddp_tutorial): ``torch.multiprocessing.spawn`` of gloo DDP ranks, which
  sets no ``LOCAL_RANK``: one process owns the run directory's Redis, worker and console; the others join it.
* ``mnist.py`` (pytorch/examples mnist): a CNN with dropout, ``Adadelta(lr=1.0)``, ``StepLR`` stepped per epoch
  (the LR drops 0.7x every 50 steps), and a training loss that reaches 1e-3-1e-2 where single batches lift it
  10x: the heavy-tailed regime a clean run must not alarm on.
* ``vae.py`` (pytorch/examples vae): ``BCE(reduction='sum') + KLD`` summed over the batch (a loss ~500x the batch
  size that halves within 200 steps), Adam 1e-3. A noise batch moves the gradient norm 124x and the loss 2.7x: the
  grad-norm explosion heads the incident and names the bad batch. ``binary_cross_entropy`` refuses a NaN: the NaN
  fault kills the script, recorded as died.
* ``amp.py`` (pytorch/tutorials Automatic Mixed Precision recipe): ``autocast("cpu", bfloat16)`` and a
  ``GradScaler``: ``scaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt); scaler.update();
  opt.zero_grad()`` last, clipped at every step: the loss and the (unclipped) gradient norm recorded unscaled; the NaN
  batch's step skipped by the scaler.
* ``gat.py`` (pytorch/examples gat): a graph attention network trained full-batch, one step per epoch, dropout 0.6
  (a loss swinging 0.77-1.13 between epochs), Adam with weight decay 5e-4, two ``no_grad`` evaluation passes under
  ``model.eval()`` after each step.
* ``siamese.py`` (pytorch/examples siamese_network): one shared tower run twice a forward (two images a pair), the
  embeddings concatenated, ``BCELoss`` on a sigmoid similarity, ``Adadelta(lr=1.0)`` and ``StepLR`` per epoch. The
  NaN fault kills the script (``BCELoss`` refuses a NaN), recorded as died. Without its batch norm the grad norm
  climbs 4x as the net leaves its plateau at chance and a one-step blip back at the previous value was "confirmed"
  against the lagging baseline (``tests/test_detectors.py``, SIAMESE_GRAD).
* ``super_resolution.py`` (pytorch/examples super_resolution): the sub-pixel CNN (``PixelShuffle``), orthogonal
  init, ``MSELoss`` on [0, 1] pixels falling to ~5e-3, ``Adam(lr=0.01)``.
* ``translation.py`` (pytorch/tutorials translation_transformer): ``nn.Transformer`` sequence-first with a float
  causal mask and key-padding masks, ``CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)``, Adam with an
  inverse-square-root warm-up through ``LambdaLR``; the NaN fault is a NaN in the float ``tgt_mask``.
* ``wgan_gp.py`` (eriklindernoren/PyTorch-GAN wgan_gp): a gradient penalty through ``autograd.grad(create_graph=True)``
  (a double backward, not a backward of its own), 5 critic steps a generator step, ``Adam(betas=(0.0, 0.9))``, a
  signed, drifting Wasserstein loss (not judged by the loss detectors once negative). The noise batch is an
  ``adam_v_lag`` WARNING named ``adam_second_moment``: a signed loss gives the lag's "loss jumped too" test no ratio.
* ``finetune.py`` (huggingface run_glue_no_trainer): embeddings and all encoder layers but the last frozen, four
  parameter groups (no weight decay on biases and norms; the head at 10x the LR), linear warm-up + decay through
  ``LambdaLR``, accumulation 2 with ``loss / 2``: only the trainable modules are measured.
* ``ppo.py`` (cleanrl ppo.py): 16 minibatch updates of clipped surrogate + value loss + entropy on each rollout,
  ``clip_grad_norm_(0.5)``, ``no_grad`` rollout forwards; ``Agent.forward`` never runs, so its two networks are two
  roots (``root0``, ``root1``). Known false alarm (strict xfail): the value loss grows with the returns of an
  improving policy and is read as a divergence.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from stability import postmortem, runstate, supervisor
from stability.detectors.steptime import PERF_KINDS
from stability.embedded import free_port
from stability.hooks.capture import HANDOVER_STEPS
from stability.records import StepRecord

SCRIPTS = Path(__file__).parent / "scripts"


@dataclass(frozen=True)
class Script:
    file: str
    steps: int

    @property
    def fault_step(self) -> int:
        return int(self.steps * 0.6)


WORD_LM = Script("word_lm.py", 300)
NANOGPT = Script("nanogpt.py", 150)
NN_TUTORIAL = Script("nn_tutorial.py", 300)
MNIST = Script("mnist.py", 200)
MNIST_ARGS = ("--batch-size", "32")
EXPECTED = {  # fault -> (kind, top cause, onset slack after the injection step)
    "lr": ("loss_spike", "lr_too_high", 3),  # the x100 LR acts through the update: the loss jumps one step later
    "nan": ("nan", "numerical_nan", 0),
    "batch": ("loss_spike", "bad_batch", 0),
}


@dataclass
class Run:
    proc: subprocess.CompletedProcess[str]
    records: list[StepRecord]
    events: list[dict]
    run_dir: Path
    log_events: tuple = ()

    def serious(self) -> list[dict]:
        return [e for e in self.events if e["severity"] in ("warning", "error")]


def _run(tmp_path: Path, script: Script, fault: str, *extra: str, dies: bool = False) -> Run:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(OMP_NUM_THREADS="1", STABILITY_RUN_DIR=str(run_dir), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script.file), "--steps", str(script.steps), "--fault", fault, *extra],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert (proc.returncode != 0) is dies, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error in hook" not in proc.stderr, proc.stderr[-3000:]
    assert supervisor.wait_stopped(run_dir, 240)  # the local worker finishes the run after the process exits
    records = postmortem.load_run_dir(run_dir)
    result = postmortem.analyze(records, records[0].run_id)
    return Run(proc, records, result.events, run_dir, result.log_events)


def _stability_warnings(stderr: str) -> list[str]:
    """What stability said besides the terminal's start and summary lines (stability.console): capture notes, alerts."""
    console = re.compile(r"^stability: run \S+ (-> .* · W&B |done · )")
    return [line for line in stderr.splitlines() if line.startswith("stability:") and not console.match(line)]


def _assert_captured(run: Run, script: Script) -> None:
    assert [r.step for r in run.records] == list(range(script.steps))
    for record in run.records:
        assert "loss" in record.signals and "grad_norm" in record.signals, record.step
        assert any(name.startswith("grad_norm/") for name in record.signals), record.step


def _assert_found(run: Run, script: Script, fault: str) -> None:
    kind, cause, slack = EXPECTED[fault]
    lo, hi = script.fault_step, script.fault_step + slack
    found = [e for e in run.events if e["kind"] == kind and lo <= e["onset"] <= hi]
    assert found, run.events
    assert found[0]["causes"][0]["cause"] == cause, found[0]
    early = [e for e in run.serious() if e["onset"] < lo]
    assert early == [], early  # nothing serious before the fault


def _run_and_find(tmp_path: Path, script: Script, fault: str) -> Run:
    """Run ``script`` with ``fault``: every step recorded, the fault found as :data:`EXPECTED` says."""
    run = _run(tmp_path, script, fault)
    assert len(run.records) == script.steps
    _assert_found(run, script, fault)
    return run


def _assert_named(run: Run, at: int, cause: str, *, kind: str | None = None, slack: int = 0) -> None:
    """A warning/error with its onset in ``[at, at + slack]`` (of ``kind``, if given) names ``cause`` first, and
    nothing serious comes before ``at``."""
    found = [e for e in run.serious() if (kind is None or e["kind"] == kind) and at <= e["onset"] <= at + slack]
    assert found and found[0]["causes"][0]["cause"] == cause, run.events
    assert [e for e in run.serious() if e["onset"] < at] == []


# ------------------------------------------------------------------------------- word_language_model (hand SGD)


def test_word_lm_clean_run_is_captured_without_an_optimizer_and_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, WORD_LM, "none")
    _assert_captured(run, WORD_LM)
    assert all(r.get("micro_batches") == 1 and "lr" not in r.signals for r in run.records)
    assert "param_norm/rnn" in run.records[50].signals and "update_ratio/rnn" in run.records[50].signals
    said = _stability_warnings(run.proc.stderr)
    assert len(said) == 1, said  # said once, at start, and nothing else
    assert "capturing model RNNModel (3 modules" in said[0] and "no optimizer seen" in said[0]
    assert "no lr (pass it with handle.observe('lr', lr))" in said[0]
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_word_lm_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, WORD_LM, fault)


# ----------------------------------------------------------------------------------- nanoGPT (accumulation 4)


def _true_losses(path: Path) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in (line.split() for line in path.read_text().splitlines())}


def test_nanogpt_clean_run_records_the_undivided_loss_and_raises_nothing(tmp_path: Path) -> None:
    log = tmp_path / "losses.txt"
    run = _run(tmp_path, NANOGPT, "none", "--loss-log", str(log))
    _assert_captured(run, NANOGPT)
    true = _true_losses(log)
    assert len(true) == NANOGPT.steps
    for record in run.records:  # loss / 4 went into backward(); the record holds the step's mean micro-batch loss
        assert record.get("loss") == pytest.approx(true[record.step], rel=1e-5), record.step
        assert record.get("micro_batches") == 4
    lrs = [r.get("lr") for r in run.records]
    assert lrs[0] < lrs[10] < lrs[20] == pytest.approx(max(lrs)) and lrs[-1] < lrs[20] / 5  # warm-up, cosine
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_nanogpt_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, NANOGPT, fault)


# --------------------------------------------------------------------- nn tutorial (hand update, zero_grad last)


def test_nn_tutorial_clean_run_is_captured_and_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, NN_TUTORIAL, "none")
    _assert_captured(run, NN_TUTORIAL)
    assert "update_ratio/hidden" in run.records[100].signals and "act_rms/out" in run.records[100].signals
    said = _stability_warnings(run.proc.stderr)
    assert len(said) == 1 and "capturing model Mnist_MLP (2 modules" in said[0], said
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))  # lr: no lr signal; named by the runaway rule (ranking._runaway)
def test_nn_tutorial_fault_is_found(tmp_path: Path, fault: str) -> None:
    run = _run(tmp_path, NN_TUTORIAL, fault)
    assert len(run.records) == NN_TUTORIAL.steps
    if fault != "batch":  # a bad batch that reverts at once is an INFO bad_batch, not an alert
        assert run.serious() and min(e["onset"] for e in run.serious()) in range(NN_TUTORIAL.fault_step,
                                                                                  NN_TUTORIAL.fault_step + 4)
    _assert_found(run, NN_TUTORIAL, fault)


# ------------------------------------------------------------------ pytorch/examples mnist (Adadelta, StepLR)


def test_mnist_clean_run_in_the_heavy_tailed_regime_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, MNIST, "none", *MNIST_ARGS)
    _assert_captured(run, MNIST)
    losses = [r.get("loss") for r in run.records[100:]]
    assert min(losses) < 0.01 and max(losses) > 5 * sorted(losses)[len(losses) // 2]  # near zero, heavy-tailed
    lrs = [r.get("lr") for r in run.records]
    assert lrs[0] == 1.0 and lrs[60] == pytest.approx(0.7) and lrs[-1] < 0.35  # StepLR once per epoch
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


# batch: a natural 16x batch one step before the bad one lifts every layer's gradient 20-120x (read as a precursor:
# lr_too_high at the alert); the 300x jump, alerted at once, reverts at the next record: re-ranked bad_batch
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_mnist_fault_is_found(tmp_path: Path, fault: str) -> None:
    run = _run(tmp_path, MNIST, fault, *MNIST_ARGS)
    assert len(run.records) == MNIST.steps
    kind, _, slack = EXPECTED[fault]
    assert [e for e in run.serious() if e["kind"] == kind and MNIST.fault_step <= e["onset"] <= MNIST.fault_step
            + slack], run.events  # the right kind at the right step, whatever the cause
    _assert_found(run, MNIST, fault)


# ------------------------------------------------ pytorch/examples mnist_hogwild (forked processes, no parent step)

HOGWILD = Script("mnist_hogwild.py", 120)
HOGWILD_RANKS = {1: 1, 2: 2}
"""Rank of each forked process's records -> its ``fork`` coordinate (the parent, rank 0, never trains); the
fault is injected in the script's process 1, the second fork: rank 2."""


def test_mnist_hogwild_processes_are_recorded_as_ranks_of_their_own_and_a_clean_run_raises_nothing(
        tmp_path: Path) -> None:
    """Before: the parent never trains and the forked children were not captured, so the run had no record at all."""
    run = _run(tmp_path, HOGWILD, "none")
    by_rank: dict[int, list[StepRecord]] = {}
    for record in run.records:
        by_rank.setdefault(record.rank, []).append(record)
    assert sorted(by_rank) == sorted(HOGWILD_RANKS), run.proc.stderr[-3000:]
    for rank, records in by_rank.items():
        assert [r.step for r in records] == list(range(HOGWILD.steps)), rank
        assert all(r.coords.get("fork") == HOGWILD_RANKS[rank] for r in records)  # kept by the archive
        assert all("loss" in r.signals and "grad_norm/fc1" in r.signals for r in records)
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()  # no rank_disagreement, straggler or hang between the processes


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_mnist_hogwild_spawned_processes_are_recorded_as_ranks_of_their_own(tmp_path: Path, method: str) -> None:
    """The same script with ``mp.set_start_method("spawn")`` (W&B's Hogwild examples) or ``"forkserver"`` (Python
    3.14's default): each child imports the script, so ``stability.auto``, again instead of inheriting the parent's
    capture. Before: every child was rank 0 of the parent's run (records rejected as duplicates, two consoles).
    Now each is the rank of its ``multiprocessing`` ordinal with the ``fork`` coordinate, as a forked child is; the
    first to claim the run directory owns its Redis and the other joins; the last to end records the run's end."""
    run = _run(tmp_path, HOGWILD, "none", "--start-method", method)
    by_rank: dict[int, list[StepRecord]] = {}
    for record in run.records:
        by_rank.setdefault(record.rank, []).append(record)
    assert sorted(by_rank) == sorted(HOGWILD_RANKS), run.proc.stderr[-3000:]
    for rank, records in by_rank.items():
        assert [r.step for r in records] == list(range(HOGWILD.steps)), rank
        assert all(r.coords.get("fork") == HOGWILD_RANKS[rank] for r in records)
    assert "rejected as duplicates" not in run.proc.stderr
    assert len(_console_starts(run)) == 1, run.proc.stderr[-3000:]
    status = json.loads((run.run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("finished", HOGWILD.steps - 1)
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


def test_mnist_hogwild_nan_in_a_spawned_process_is_found_on_its_rank(tmp_path: Path) -> None:
    run = _run(tmp_path, HOGWILD, "nan", "--start-method", "spawn")
    lo = HOGWILD.fault_step
    found = [e for e in run.serious() if e["kind"] == "nan" and e["rank"] == 2 and e["onset"] == lo]
    assert found and found[0]["causes"][0]["cause"] == "numerical_nan", run.events
    assert [e for e in run.serious() if e["rank"] == 2 and e["onset"] < lo] == []


@pytest.mark.parametrize("fault", ["nan", "batch"])
def test_mnist_hogwild_fault_in_one_process_is_found_on_its_rank(tmp_path: Path, fault: str) -> None:
    """The fault is found on the rank of the process that met it, at its step. The other process may be hit too
    (the weights are shared: a NaN or a wild update reaches it at whatever step it is at, earlier or later by its
    own count), so only the faulted rank is held to "nothing serious before the fault"."""
    run = _run(tmp_path, HOGWILD, fault)
    kind, cause, slack = EXPECTED[fault]
    lo = HOGWILD.fault_step
    found = [e for e in run.serious() if e["kind"] == kind and e["rank"] == 2 and lo <= e["onset"] <= lo + slack]
    assert found and found[0]["causes"][0]["cause"] == cause, run.events
    assert [e for e in run.serious() if e["rank"] == 2 and e["onset"] < lo] == []
    assert [e for e in run.serious() if e["kind"] in ("rank_disagreement", "straggler", "hang")] == []


# ------------------------------------- pytorch/tutorials ddp_tutorial (torch.multiprocessing.spawn, no LOCAL_RANK)

DDP_TUTORIAL = Script("ddp_tutorial.py", 80)


def _console_starts(run: Run) -> list[str]:
    return [line for line in (run.proc.stdout + run.proc.stderr).splitlines()
            if line.startswith("stability: run ") and " -> " in line]


def test_ddp_tutorial_spawned_ranks_share_one_embedded_redis_and_a_clean_run_raises_nothing(tmp_path: Path) -> None:
    """``mp.spawn`` sets no ``LOCAL_RANK``: before, both ranks read themselves as local rank 0 and each started a
    supervisor, a worker and a console on the one run directory (two start and two summary lines, the run's last
    step unknown). Now the first to claim the run directory owns them and the other joins its Redis."""
    run = _run(tmp_path, DDP_TUTORIAL, "none", "--port", str(free_port()))
    assert len(_console_starts(run)) == 1, run.proc.stderr[-3000:]
    by_rank: dict[int, list[int]] = {}
    for record in run.records:
        by_rank.setdefault(record.rank, []).append(record.step)
    assert {rank: sorted(steps) for rank, steps in by_rank.items()} == {
        0: list(range(DDP_TUTORIAL.steps)), 1: list(range(DDP_TUTORIAL.steps))}
    status = json.loads((run.run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("finished", DDP_TUTORIAL.steps - 1)
    assert _stability_warnings(run.proc.stderr) == []
    # training findings only: on a busy 2-core machine the rank that also runs the console is really slower, and
    # the straggler rule says so (every rank waits for it at the all-reduce): true, and not what this test is about
    assert [e for e in run.serious() if e["kind"] not in PERF_KINDS] == [], run.serious()


def test_ddp_tutorial_nan_on_one_spawned_rank_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, DDP_TUTORIAL, "nan", "--port", str(free_port()))
    lo = DDP_TUTORIAL.fault_step
    found = [e for e in run.serious() if e["kind"] == "nan" and e["onset"] == lo]
    assert found and found[0]["causes"][0]["cause"] == "numerical_nan", run.events
    assert [e for e in run.serious() if e["onset"] < lo and e["kind"] not in PERF_KINDS] == []  # (see above)


# ---------------------------------------------------------------------- DCGAN (two optimizers, adversarial losses)

DCGAN = Script("dcgan.py", 200)


def test_dcgan_clean_run_tracks_the_discriminator_loss_only_and_raises_nothing(tmp_path: Path) -> None:
    log = tmp_path / "losses.txt"
    run = _run(tmp_path, DCGAN, "none", "--loss-log", str(log))
    assert [r.step for r in run.records] == list(range(DCGAN.steps))
    true = _true_losses(log)  # errD = errD_real + errD_fake, as the example prints Loss_D
    for record in run.records:  # errG.backward() (for optimizerG) between two discriminator steps is left out
        assert record.get("micro_batches") == 2, record.step
        assert record.get("loss") == pytest.approx(true[record.step], rel=1e-5), record.step
        assert record.signals.get("objectives") == (2.0 if record.step else None), record.step  # G steps after D
    assert "grad_norm/main.0" in run.records[50].signals and "adam_v_ratio/main.0" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", ["lr", "batch"])  # nan: the script dies of it (next test)
def test_dcgan_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, DCGAN, fault)


def test_dcgan_killed_by_its_own_nan_is_recorded_as_died_at_its_last_step(tmp_path: Path) -> None:
    run = _run(tmp_path, DCGAN, "nan", dies=True)  # BCELoss raises on the NaN the discriminator outputs
    assert "RuntimeError: all elements of input should be between 0 and 1" in run.proc.stderr
    assert [r.step for r in run.records] == list(range(DCGAN.fault_step))
    status = runstate.read_status_file(run.run_dir)
    assert status is not None and status.status == runstate.DIED and status.step == DCGAN.fault_step - 1
    assert status.reason.startswith("RuntimeError: all elements of input")
    summary = [line for line in run.proc.stderr.splitlines() if line.startswith("stability: run ")][-1]
    assert " died (RuntimeError: all elements of input should be between 0 and 1) · " in summary, summary
    assert run.serious() == [], run.serious()


# -------------------------------------------------------- time sequence prediction (float64, LBFGS step(closure))

TIME_SEQ = Script("time_seq.py", 30)


def test_time_seq_lbfgs_records_the_loss_lbfgs_returns_and_raises_nothing(tmp_path: Path) -> None:
    log = tmp_path / "losses.txt"
    run = _run(tmp_path, TIME_SEQ, "none", "--loss-log", str(log))
    _assert_captured(run, TIME_SEQ)
    lines = (line.split() for line in log.read_text().splitlines())
    calls = {int(step): (float(loss), int(n)) for step, loss, n in lines}
    assert sum(n for _, n in calls.values()) > 3 * TIME_SEQ.steps  # LBFGS evaluated many trial points per step
    for record in run.records:  # the first closure call's loss (at the step's start), as LBFGS.step returns it
        assert record.get("micro_batches") == 1, record.step
        assert record.get("loss") == pytest.approx(calls[record.step][0], rel=1e-6), record.step
    assert "update_ratio/lstm1" in run.records[0].signals
    assert _stability_warnings(run.proc.stderr) == []  # float64: no hook error, no capture turned off
    assert run.serious() == [], run.serious()


def test_time_seq_lr_jump_that_ends_in_nan_names_the_lr(tmp_path: Path) -> None:
    run = _run(tmp_path, TIME_SEQ, "lr")
    assert len(run.records) == TIME_SEQ.steps
    _assert_named(run, TIME_SEQ.fault_step, "lr_too_high", kind="nan", slack=2)  # LBFGS's next update overflows


def test_time_seq_nan_in_the_data_is_numerical(tmp_path: Path) -> None:
    run = _run(tmp_path, TIME_SEQ, "nan")
    _assert_found(run, TIME_SEQ, "nan")


# ------------------------------------------------------------------------- REINFORCE (a signed, swinging loss)

REINFORCE = Script("reinforce.py", 150)


def test_reinforce_signed_loss_raises_nothing_and_says_why_once(tmp_path: Path) -> None:
    run = _run(tmp_path, REINFORCE, "none")
    _assert_captured(run, REINFORCE)
    losses = [r.get("loss") for r in run.records]
    assert min(losses) < -1 and max(losses) > 1  # both signs, large swings
    said = _stability_warnings(run.proc.stderr)
    assert len(said) == 1 and "the loss is negative" in said[0] and "stop judging" in said[0], said
    assert run.serious() == [], run.serious()  # the early "spike" on a 2-point baseline is kept as INFO
    early = [e for e in run.events if e["kind"] == "loss_spike"]
    assert all(e["severity"] == "info" and e["onset"] < 8 for e in early), early


def test_reinforce_lr_jump_is_named(tmp_path: Path) -> None:
    run = _run(tmp_path, REINFORCE, "lr")
    _assert_named(run, REINFORCE.fault_step, "lr_too_high")


def test_reinforce_nan_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, REINFORCE, "nan")
    _assert_found(run, REINFORCE, "nan")


# ------------------------------------------------------------- regression (hand-written SGD, a wild loss series)

REGRESSION = Script("regression.py", 600)


def test_regression_wild_loss_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, REGRESSION, "none")
    _assert_captured(run, REGRESSION)
    losses = [r.get("loss") for r in run.records[100:]]
    assert max(losses) / min(losses) > 100  # heavy-tailed batch losses
    assert run.serious() == [], run.serious()  # the update ratio sampled every 50 steps follows the gradient


def test_regression_nan_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, REGRESSION, "nan")
    _assert_found(run, REGRESSION, "nan")


@pytest.mark.xfail(strict=True, reason="known miss: targets x30 give a 1,000x+ loss, but this series' log noise "
                   "(robust sigma 1.7) puts it at z 4.4 < 6; a z-free rule for wild series was tried and dropped: "
                   "it added false alarms on the families corpus's near-zero CNN losses")
def test_regression_bad_batch_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, REGRESSION, "batch")
    _assert_found(run, REGRESSION, "batch")


def test_regression_lr_fault_is_found_at_its_step(tmp_path: Path) -> None:
    run = _run(tmp_path, REGRESSION, "lr")  # no LR logged (hand-written update): the runaway names the LR
    _assert_named(run, REGRESSION.fault_step, "lr_too_high", slack=3)


# ---------------------------------------------------- forward-forward (one optimizer per layer, trained in turn)

FORWARD_FORWARD = Script("forward_forward.py", 150)  # epochs per layer, two layers
FF_PHASE = FORWARD_FORWARD.steps  # the second layer's phase starts here (its first HANDOVER_STEPS - 1 unseen)


def test_forward_forward_second_layer_is_a_new_phase_and_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, FORWARD_FORWARD, "none")
    assert [r.step for r in run.records] == list(range(2 * FORWARD_FORWARD.steps - HANDOVER_STEPS + 1))
    assert [r.step for r in run.records if r.signals.get("phase_start")] == [FF_PHASE]
    assert [(e.kind, e.step) for e in run.log_events] == [("phase_start", FF_PHASE)]  # on the report's timeline
    assert _stability_warnings(run.proc.stderr) == []  # no hang reported while the second layer trains
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", ["lr", "nan"])
def test_forward_forward_fault_in_the_second_phase_is_found(tmp_path: Path, fault: str) -> None:
    run = _run(tmp_path, FORWARD_FORWARD, fault)
    kind, cause, slack = EXPECTED[fault]
    _assert_named(run, FF_PHASE + FORWARD_FORWARD.fault_step - (HANDOVER_STEPS - 1), cause, kind=kind, slack=slack)


# ------------------------------------------------------------- pytorch/examples vae (a loss summed over the batch)

VAE = Script("vae.py", 200)
VAE_BATCH = 128


def test_vae_clean_run_with_a_summed_loss_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, VAE, "none")
    _assert_captured(run, VAE)
    losses = [r.get("loss") for r in run.records]
    assert losses[0] > 400 * VAE_BATCH and losses[-1] < 0.6 * losses[0]  # reduction='sum': ~500 a sample, falling
    assert "adam_v_ratio/fc21" in run.records[50].signals and "update_ratio/fc4" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


def test_vae_lr_jump_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, VAE, "lr")
    _assert_found(run, VAE, "lr")


def test_vae_noise_batch_is_a_bad_batch(tmp_path: Path) -> None:
    """The noise batch lifts the gradient norm 124x and the summed loss 2.7x on the same record: the grad detector
    alerts at once (>= 50x with the loss up) and heads the incident, the loss spike (under 3x: it waits for the next
    record, which reverted) joins it. Before: the no-precursor rule spoke for a loss-spike headline only, so this
    one was ranked ``unknown``."""
    run = _run(tmp_path, VAE, "batch")
    assert len(run.records) == VAE.steps
    _assert_named(run, VAE.fault_step, "bad_batch", kind="grad_explosion")
    head = next(e for e in run.serious() if e["onset"] == VAE.fault_step)
    assert "loss_spike" in head["kinds"], head


def test_vae_killed_by_a_nan_pixel_is_recorded_as_died_at_its_last_step(tmp_path: Path) -> None:
    run = _run(tmp_path, VAE, "nan", dies=True)  # the NaN reconstruction is refused by binary_cross_entropy
    reason = "RuntimeError: all elements of input should be between 0 and 1"
    assert reason in run.proc.stderr
    assert [r.step for r in run.records] == list(range(VAE.fault_step))
    status = runstate.read_status_file(run.run_dir)
    assert status is not None and status.status == runstate.DIED and status.step == VAE.fault_step - 1
    assert status.reason.startswith(reason)
    assert run.serious() == [], run.serious()


# ------------------------------------------------ AMP recipe (bf16 autocast, GradScaler, unscale_ + clip, zero last)

AMP = Script("amp.py", 300)


def _printed(stdout: str) -> dict[int, tuple[float, float]]:
    """Step -> (loss, the norm ``clip_grad_norm_`` returned), as the script prints them every 25 steps."""
    lines = re.finditer(r"^epoch \d+ step (\d+) loss (\S+) grad norm (\S+)", stdout, re.M)
    return {int(m[1]): (float(m[2]), float(m[3])) for m in lines}


def test_amp_clean_run_records_unscaled_values_and_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, AMP, "none")
    _assert_captured(run, AMP)
    printed = _printed(run.proc.stdout)
    assert len(printed) == AMP.steps // 25
    for step, (loss, norm) in printed.items():  # scaler.scale(loss) (x65536) went into backward()
        assert run.records[step].get("loss") == pytest.approx(loss, abs=1e-5), step  # unscaled
        assert run.records[step].get("grad_norm") == pytest.approx(norm, rel=1e-4), step  # after unscale_, unclipped
        assert norm > 0.1  # the recipe's max_norm: clipped at every step
    assert all(r.get("loss_scale") == 2.0**16 and r.get("skipped") == 0 for r in run.records)
    assert run.records[-1].get("loss") < 0.7 * run.records[0].get("loss")
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_amp_fault_is_found(tmp_path: Path, fault: str) -> None:
    run = _run_and_find(tmp_path, AMP, fault)
    if fault == "nan":  # the scaler skipped the step and halved its scale; training went on
        at = run.records[AMP.fault_step]
        assert at.get("skipped") == 1 and run.records[AMP.fault_step + 1].get("loss_scale") == 2.0**15


# ------------------------------------------------------- pytorch/examples gat (full batch, one step per epoch)

GAT = Script("gat.py", 200)


def test_gat_clean_full_batch_run_with_dropout_noise_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, GAT, "none")
    _assert_captured(run, GAT)  # the two no_grad evaluation passes after each step make no record
    losses = [r.get("loss") for r in run.records[100:]]
    assert max(losses) > 1.3 * min(losses)  # dropout 0.6 on a fixed full batch: a noisy loss
    assert "grad_norm/gat1" in run.records[50].signals and "adam_v_ratio/gat2" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_gat_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, GAT, fault)


# ---------------------------------------- pytorch/examples siamese_network (two towers, BCELoss, Adadelta + StepLR)

SIAMESE = Script("siamese.py", 200)


def test_siamese_clean_two_tower_run_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, SIAMESE, "none")
    _assert_captured(run, SIAMESE)  # one forward of the model runs the shared tower twice
    losses = [r.get("loss") for r in run.records]
    assert losses[0] > 0.6 and max(losses[-50:]) < 0.2  # BCE from chance (log 2) to near zero
    lrs = [r.get("lr") for r in run.records]
    assert lrs[0] == 1.0 and lrs[60] == pytest.approx(0.7) and lrs[-1] == pytest.approx(0.343)  # StepLR per epoch
    assert "grad_norm/conv1" in run.records[50].signals and "grad_norm/fc.2" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", ["lr", "batch"])  # nan: the script dies of it (next test)
def test_siamese_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, SIAMESE, fault)


def test_siamese_killed_by_its_own_nan_is_recorded_as_died_at_its_last_step(tmp_path: Path) -> None:
    run = _run(tmp_path, SIAMESE, "nan", dies=True)  # BCELoss refuses the NaN probability
    reason = "RuntimeError: all elements of input should be between 0 and 1"
    assert reason in run.proc.stderr
    assert [r.step for r in run.records] == list(range(SIAMESE.fault_step))
    status = runstate.read_status_file(run.run_dir)
    assert status is not None and status.status == runstate.DIED and status.step == SIAMESE.fault_step - 1
    assert status.reason.startswith(reason)
    assert run.serious() == [], run.serious()


# ------------------------------------------------ pytorch/examples super_resolution (PixelShuffle, MSE, Adam 0.01)

SUPER_RES = Script("super_resolution.py", 200)


def test_super_resolution_clean_run_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, SUPER_RES, "none")
    _assert_captured(run, SUPER_RES)
    losses = [r.get("loss") for r in run.records]
    assert max(losses[-20:]) < 0.1 * losses[0]  # MSE on [0, 1] pixels, falling 10x and more
    assert "grad_norm/conv4" in run.records[50].signals and "adam_v_ratio/conv1" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_super_resolution_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, SUPER_RES, fault)


# --------------------- pytorch/tutorials translation_transformer (nn.Transformer, masks, label smoothing, warm-up)

TRANSLATION = Script("translation.py", 200)


def test_translation_clean_run_with_warmup_and_label_smoothing_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, TRANSLATION, "none")
    _assert_captured(run, TRANSLATION)
    lrs = [r.get("lr") for r in run.records]
    assert lrs[0] == pytest.approx(2.5e-5) and max(lrs) == pytest.approx(lrs[39]) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-3 * (40 / 200) ** 0.5)  # linear warm-up, then inverse square root
    losses = [r.get("loss") for r in run.records]
    assert min(losses[-20:]) > 1.0 and max(losses[-20:]) < 0.7 * losses[0]  # falling, far from zero
    assert "grad_norm/generator" in run.records[50].signals
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


# batch: random words lift the label-smoothed loss 1.5x and it is back at once: an INFO loss_spike ranked bad_batch
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_translation_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, TRANSLATION, fault)


# ------------------------- eriklindernoren/PyTorch-GAN wgan_gp (double backward, 5 critic steps a generator step)

WGAN_GP = Script("wgan_gp.py", 250)


def test_wgan_gp_clean_run_records_the_critic_loss_through_a_double_backward_and_raises_nothing(
        tmp_path: Path) -> None:
    log = tmp_path / "losses.txt"
    run = _run(tmp_path, WGAN_GP, "none", "--loss-log", str(log))
    _assert_captured(run, WGAN_GP)  # the critic's optimizer steps first: the tracked one, one record a critic step
    true = _true_losses(log)
    for record in run.records:  # autograd.grad(create_graph=True) in the penalty is no backward of its own
        assert record.get("loss") == pytest.approx(true[record.step], rel=1e-5), record.step
        assert record.get("micro_batches") == 1, record.step
    losses = [r.get("loss") for r in run.records]
    assert losses[0] > 5 and max(losses[-50:]) < -2  # penalty-dominated, then a negative, drifting W estimate
    assert "grad_norm/model.0" in run.records[50].signals and "adam_v_ratio/model.4" in run.records[50].signals
    said = _stability_warnings(run.proc.stderr)
    assert len(said) == 1 and "the loss is negative" in said[0] and "stop judging" in said[0], said
    assert run.serious() == [], run.serious()


def test_wgan_gp_lr_jump_is_a_grad_explosion_named_lr(tmp_path: Path) -> None:
    run = _run(tmp_path, WGAN_GP, "lr")  # the signed loss is not judged: the gradient norm shows it (331x)
    _assert_named(run, WGAN_GP.fault_step, "lr_too_high", kind="grad_explosion", slack=1)


def test_wgan_gp_nan_is_found(tmp_path: Path) -> None:
    run = _run(tmp_path, WGAN_GP, "nan")  # no BCELoss: the NaN runs through, the run goes on NaN
    _assert_found(run, WGAN_GP, "nan")


# batch: noise x5 as the real images moves the grad norm 6x for one step (under the 20x of a per-layer explosion)
# and Adam's second moment lags 58x: an adam_v_lag WARNING at the step, named adam_second_moment. A bad batch's lag
# is INFO when the loss jumped with it, but a signed loss (here -5.1 -> -6.5) has no ratio to judge: known gap.
def test_wgan_gp_noise_batch_is_an_adam_lag_at_its_step(tmp_path: Path) -> None:
    run = _run(tmp_path, WGAN_GP, "batch")
    assert len(run.records) == WGAN_GP.steps
    _assert_named(run, WGAN_GP.fault_step, "adam_second_moment", kind="adam_v_lag")


# ------------------- huggingface run_glue_no_trainer (frozen layers, 4 param groups, head 10x, warm-up + decay, acc 2)

FINETUNE = Script("finetune.py", 200)


def test_finetune_clean_run_with_frozen_layers_and_param_groups_raises_nothing(tmp_path: Path) -> None:
    log = tmp_path / "losses.txt"
    run = _run(tmp_path, FINETUNE, "none", "--loss-log", str(log))
    _assert_captured(run, FINETUNE)
    true = _true_losses(log)
    for record in run.records:  # loss / 2 went into backward(); the record holds the step's mean micro-batch loss
        assert record.get("loss") == pytest.approx(true[record.step], rel=1e-5), record.step
        assert record.get("micro_batches") == 2, record.step
    lrs = [r.get("lr") for r in run.records]  # the first group's (the last encoder layer's, base LR)
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-3 / 180)
    signals = run.records[50].signals  # only the trainable modules are measured
    assert "grad_norm/classifier" in signals and "grad_norm/encoder.layers.2.linear1" in signals
    assert not any(k.startswith(("grad_norm/embeddings", "grad_norm/encoder.layers.0")) for k in signals)
    assert _stability_warnings(run.proc.stderr) == []
    assert run.serious() == [], run.serious()


@pytest.mark.parametrize("fault", sorted(EXPECTED))  # batch: an INFO loss_spike ranked bad_batch (reverted at once)
def test_finetune_fault_is_found(tmp_path: Path, fault: str) -> None:
    _run_and_find(tmp_path, FINETUNE, fault)


# ----------------------------- cleanrl ppo.py (16 minibatch updates a rollout, clipped losses, clip_grad_norm_ 0.5)

PPO = Script("ppo.py", 240)


# Known false alarm: PPO's loss is dominated by the value loss, whose targets (the returns) grow as the policy
# improves (episodes get longer), so a clean run's loss rises 1.4x: read as a divergence (ERROR, warmup_too_short).
@pytest.mark.xfail(strict=True, reason="value-loss growth of an improving policy is read as a divergence")
def test_ppo_clean_run_raises_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, PPO, "none")
    _assert_captured(run, PPO)
    assert run.serious() == [], run.serious()


def test_ppo_clean_run_is_captured_with_the_agent_split_into_its_two_called_networks(tmp_path: Path) -> None:
    run = _run(tmp_path, PPO, "none")
    _assert_captured(run, PPO)  # no_grad rollout forwards between the rollouts' 16 updates make no record
    lrs = [r.get("lr") for r in run.records]
    assert lrs[0] == pytest.approx(2.5e-4) and lrs[16] == pytest.approx(2.5e-4 * 14 / 15)  # annealed a rollout
    # Agent.forward never runs (get_action_and_value calls .actor and .critic): two roots, named root0 / root1
    assert "grad_norm/root0.4" in run.records[50].signals and "grad_norm/root1.4" in run.records[50].signals
    assert [e["kind"] for e in run.serious()] == ["divergence"]  # the false alarm above, and nothing else


def test_ppo_nan_is_found_and_the_script_dies_of_it_a_step_later(tmp_path: Path) -> None:
    run = _run(tmp_path, PPO, "nan", dies=True)  # Adam wrote NaN weights: Categorical refuses the NaN logits
    assert "ValueError: Expected parameter logits" in run.proc.stderr
    assert [r.step for r in run.records] == list(range(PPO.fault_step + 1))
    found = [e for e in run.serious() if e["kind"] == "nan" and e["onset"] == PPO.fault_step]
    assert found and found[0]["causes"][0]["cause"] == "numerical_nan", run.events


# lr: the clean run's value-loss growth already has the loss rising: the LR jump's divergence is fitted to start up
# to 20 steps before the jump (onset 125 for the jump at 144), and is named lr_too_high (lr off its schedule)
def test_ppo_lr_jump_is_named(tmp_path: Path) -> None:
    run = _run(tmp_path, PPO, "lr")
    found = [e for e in run.serious() if e["kind"] == "divergence" and e["causes"][0]["cause"] == "lr_too_high"]
    assert found and PPO.fault_step - 20 <= found[0]["onset"] <= PPO.fault_step, run.events


# batch: not found, legitimately: noise observations move the clipped surrogate and the clipped value loss
# (dominated by the returns) by under 4 %, and clip_grad_norm_(0.5) clips every step (the norm even falls 15 -> 9)
def test_ppo_noise_minibatch_is_not_visible(tmp_path: Path) -> None:
    run = _run(tmp_path, PPO, "batch")
    assert len(run.records) == PPO.steps
    assert [e for e in run.events if PPO.fault_step <= e["onset"] <= PPO.fault_step + 3] == [], run.events
