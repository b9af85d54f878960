"""Post-mortem of the logs people actually have (issue #11) and resumed runs (issue #14 item 2).

Sources: verbatim snippets of public issue threads and BigScience chronicles (../shared/data/real-runs, see its
README), fixtures re-created in each framework's exact line format (tests/data/logs/make_fixtures.py), and
TensorBoard / W&B files written by the real libraries (wandb offline: its server is the one part that cannot run).
"""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest

from stability.cli import main
from stability.errors import SourceError
from stability.postmortem import PostmortemResult, load_source, run
from stability.report import render_text
from stability.sources import load_log, load_system_log, sniff
from tests import wandb_files

DATA = Path(__file__).parent / "data" / "logs"
REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real-runs"
if not REAL.is_dir():
    REAL = Path("/work/shared/data/real-runs")
SNIPPETS = REAL / "snippets"
needs_real = pytest.mark.skipif(not SNIPPETS.is_dir(), reason="shared real-runs data not available")


def serious(result: PostmortemResult) -> list[dict[str, object]]:
    return [e for e in result.events if e["severity"] != "info"]


def top(event: dict[str, object]) -> str:
    causes = event["causes"]
    assert isinstance(causes, list) and causes
    return str(causes[0]["cause"])


def analyse(path: Path, tmp_path: Path, **kwargs: object) -> PostmortemResult:
    return run(path, json_out=tmp_path / "f.json", html_out=tmp_path / "r.html", **kwargs)  # type: ignore[arg-type]


# -- issue #14 item 2: a rollback must not hide the incident before it ------------------------------------------------

def _rollback_csv(path: Path, relog_offset: float = 0.0, converge: bool = False) -> Path:
    rng = random.Random(0)
    first = {s: 1.0 + 3.0 * math.exp(-s / 400) + rng.gauss(0, 0.01) for s in range(500)}
    rows = [("step", "loss", "grad_norm")]
    rows += [(str(s), "nan" if s >= 260 else f"{first[s]:.5f}", "nan" if s >= 260 else "1.0") for s in range(300)]

    def offset(s: int) -> float:
        return relog_offset * max(0.0, 1 - (s - 200) / 30) if converge else relog_offset
    rows += [(str(s), f"{first[s] * (1 + offset(s)):.5f}", "1.0") for s in range(200, 500)]
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


def test_csv_rolled_back_after_nan_keeps_the_nan_and_puts_the_resume_on_the_timeline(tmp_path: Path) -> None:
    result = analyse(_rollback_csv(tmp_path / "rollback.csv"), tmp_path)
    assert [(e["kind"], e["onset"], e["severity"]) for e in serious(result)] == [("nan", 260, "error")]
    assert result.steps == 500  # re-logged steps 200-299 counted once
    assert [(s.first_step, s.last_step, s.resumed_after, s.reason) for s in result.segments] == [
        (0, 299, None, "start"), (200, 499, 299, "step went back")]
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["segments"][1]["resumed_after"] == 299
    assert "segment 2 starts at step 200 after step 299" in render_text(result)
    page = (tmp_path / "r.html").read_text()
    assert "<h3>Segments</h3>" in page and "<td>step went back</td><td>299</td>" in page
    assert '"resumes":[{"step":200,"after":299}]' in page  # the resume marked on the charts


@pytest.mark.parametrize(("converge", "cause"), [(False, "data_pipeline"), (True, "resume_mismatch")])
def test_resume_whose_relogged_steps_are_offset(tmp_path: Path, converge: bool, cause: str) -> None:
    result = analyse(_rollback_csv(tmp_path / "offset.csv", relog_offset=0.2, converge=converge), tmp_path)
    offsets = [e for e in result.events if e["kind"] == "resume_offset"]
    assert len(offsets) == 1 and offsets[0]["onset"] == 200 and offsets[0]["severity"] == "warning"
    assert top(offsets[0]) == cause
    assert ("converged back" if converge else "+20%") in str(offsets[0]["message"])


def test_broken_from_the_first_step_with_versions_known_suggests_a_software_regression(tmp_path: Path) -> None:
    """DeepSpeed#5347 / #5242 and LlamaFactory#5627: grad norm NaN and loss 0 from the start on a new version."""
    path = tmp_path / "hf_ds.log"
    path.write_text("[2024-04-02 10:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: "
                    "version=0.14.0, git-hash=unknown, git-branch=unknown\n***** Running training *****\n"
                    + "".join(f"{{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 4.549912997495027e-06, 'epoch': "
                              f"{i / 100:.2f}}}\n" for i in range(1, 30)))
    result = analyse(path, tmp_path)
    causes = {c["cause"]: c for c in serious(result)[0]["causes"]}
    assert serious(result)[0]["onset"] == 1 and "software_regression" in causes
    assert "non-finite on 29 of 29 lines" in causes["software_regression"]["evidence"]


# -- Megatron-LM ----------------------------------------------------------------------------------------------------

def test_megatron_log_restart_from_checkpoint_is_a_new_segment_with_the_nan_before_it(tmp_path: Path) -> None:
    path = DATA / "megatron_resume.log"
    assert sniff(path) == "text"
    log = load_source(path)
    assert log.format.startswith("megatron")
    assert log.context["tensor_model_parallel_size"] == "2" and log.context["lr_decay_style"] == "cosine"
    assert [(s.first_step, s.last_step, s.reason) for s in log.segments] == [(10, 300, "start"),
                                                                              (210, 500, "start-up banner")]
    first = log.records[0].signals
    assert first["loss_scale"] == 65536.0 and first["skipped"] == 0.0 and first["loss_steps"] == 10.0
    assert [e.value for e in log.events if e.kind == "checkpoint_load"][-1] == 200.0
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["onset"], top(e)) for e in serious(result)] == [("nan", 260, "numerical_nan")]
    assert result.steps == 50  # 10..500 every 10, 210-300 logged twice


def test_megatron_version_change_at_restart_is_a_software_regression(tmp_path: Path) -> None:
    lines = (DATA / "megatron_resume.log").read_text().splitlines()
    banner = [i for i, line in enumerate(lines) if line.startswith("using world size")][1]
    text = [*lines[:banner], "DeepSpeed info: version=0.12.4, git-hash=unknown, git-branch=unknown", *lines[banner:]]
    text.insert(0, "DeepSpeed info: version=0.12.3, git-hash=unknown, git-branch=unknown")
    restart = [i for i, line in enumerate(text) if "iteration      220/" in line][-1]  # the re-logged 220
    text[restart] = text[restart].replace("grad norm: ", "grad norm: nan | x: ").replace(
        "lm loss: ", "lm loss: nan | y: ")
    path = tmp_path / "regression.log"
    path.write_text("\n".join(text) + "\n")
    result = analyse(path, tmp_path)
    after = [e for e in serious(result) if e["onset"] == 220]
    assert after and top(after[0]) == "software_regression"
    assert "deepspeed: 0.12.3 -> 0.12.4" in after[0]["causes"][0]["evidence"]
    # the NaN before the restart (no version change before it) keeps its numerical cause
    assert [top(e) for e in serious(result) if e["onset"] == 260] == ["numerical_nan"]


@needs_real
def test_megatron_deepspeed_grad_norm_nan_on_every_line_with_nan_counter_zero_is_nan(tmp_path: Path) -> None:
    path = SNIPPETS / "megatron_deepspeed_bigscience_issue396_gradnorm_nan.txt"
    log = load_source(path)
    assert [r.step for r in log.records] == [5426, 5427, 5428]
    assert all(math.isnan(r.signals["grad_norm"]) and r.signals["nan_iters"] == 0 for r in log.records)
    assert all("loss_scale" not in r.signals for r in log.records)  # a static 1.0 is no dynamic scaling
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["onset"], e["severity"], top(e)) for e in result.events] == [
        ("nan", 5426, "error", "numerical_nan")]


@needs_real
def test_megatron_deepspeed_lines_with_overflow_messages_rebuilt_from_the_bigscience_excerpt(tmp_path: Path) -> None:
    """tr8b-104B 17060-17068 as Megatron-DeepSpeed printed it: each OVERFLOW message before its iteration line."""
    out = []
    with (REAL / "bigscience_tr8b-104B_spike_excerpt.csv").open() as handle:
        for row in csv.DictReader(handle):
            if row["overflow_skip_msg"]:
                old, new = (v.strip() for v in row["overflow_skip_msg"].removeprefix("attempted").split("->"))
                out.append(f"[2022-01-20 10:00:00,000] [INFO] [stage_1_and_2.py:1672:step] [deepspeed] OVERFLOW! "
                           f"Rank 0 Skipping step. Attempted loss scale: {old}, reducing to {new}")
            out.append(f" iteration    {row['step']}/  115311 | consumed samples:     {row['consumed_samples']} | "
                       f"consumed tokens:  {row['consumed_tokens']} | elapsed time per iteration (ms): "
                       f"{row['iter_time_ms']} | learning rate: {row['lr']} | global batch size:  "
                       f"{row['global_batch_size']} | lm loss: {row['loss']} | loss scale: {row['loss_scale']} | "
                       f"grad norm: {row['grad_norm']} | num zeros: 0.0 | number of skipped iterations:   "
                       f"{row['skipped_iters']} | number of nan iterations:   {row['nan_iters']} |")
    path = tmp_path / "tr8b.log"
    path.write_text("\n".join(out) + "\n")
    log = load_source(path)
    assert sum(r.signals.get("skipped", 0) > 0 for r in log.records) == 6  # the counter printed 0 on every line
    result = analyse(path, tmp_path)
    spikes = [e for e in serious(result) if e["kind"] == "loss_spike"]
    assert spikes and spikes[0]["onset"] == 17062 and top(spikes[0]) == "fp16_loss_scale"


# -- DeepSpeed / HF Trainer / fairseq fp16 messages --------------------------------------------------------------

def test_routine_deepspeed_overflows_are_one_info_finding(tmp_path: Path) -> None:
    result = analyse(DATA / "deepspeed_routine_fp16.log", tmp_path)
    assert not serious(result)
    assert [(e["kind"], e["severity"], top(e)) for e in result.events] == [("fp16_overflows", "info",
                                                                            "fp16_loss_scale")]
    log = load_source(DATA / "deepspeed_routine_fp16.log")
    assert log.context["deepspeed"] == "0.14.0"
    assert {r.step: r.signals.get("skipped") for r in log.records}[40] == 1.0  # step=40, skipped=1
    assert "loss" in log.records[0].signals  # the user's "step N loss X" print


@needs_real
@pytest.mark.parametrize(("name", "onset"), [
    ("chinese_llama_alpaca_issue534_ds_lossscale_to_minimum.txt", 379),  # HF + DeepSpeed: 64 -> 2, log ends
    ("fairseq_issue512_lossscale_cascade_crash.txt", 10198),  # 0.5 -> 0.000122 in 12 overflows, traceback
    ("fairseq_issue515_lossscale_collapse_in_warmup.txt", 190),  # 0.0625 -> 0.004 during warm-up
    ("fairseq_issue1895_gnorm_blowup_min_loss_scale.txt", 700),  # overflows at 0.0005, minimum reached
])
def test_loss_scale_falling_to_its_minimum_is_an_error(tmp_path: Path, name: str, onset: int) -> None:
    result = analyse(SNIPPETS / name, tmp_path)
    errors = [e for e in result.events if e["severity"] == "error"]
    assert [(e["kind"], e["onset"], top(e)) for e in errors][:1] == [("loss_scale_collapse", onset,
                                                                      "fp16_loss_scale")]


def test_megatron_line_variants_several_losses_and_placeholders(tmp_path: Path) -> None:
    path = tmp_path / "variants.log"
    path.write_text(
        " iteration      100/  250000 | consumed samples:        12800 | elapsed time per iteration (ms): 4247.9 | "
        "learning rate: 2.999E-04 | global batch size:   128 | lm loss: 2.100000E+00 | mtp_1 loss: 2.300000E+00 | "
        "load_balancing_loss: 1.000000E+00 | loss scale: 1.0 | grad norm: 0.000 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |\n"
        " iteration      101/  250000 | lm loss: 2.090000E+00 | loss scale: 1.0 | grad norm: 0.000 |\n"
        "[2024-02-01 09:00:00,000] [INFO] [stage_1_and_2.py:1672:step] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
        "Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1\n")
    log = load_source(path)
    assert log.records[0].signals["mtp_1_loss"] == 2.3 and log.records[0].signals["load_balancing_loss"] == 1.0
    assert log.records[0].signals["loss"] == 2.1 and log.records[1].signals["loss"] == 2.09
    assert not {"loss_scale", "grad_norm"} & set(log.records[0].signals)  # bf16's 1.0, a norm not computed
    assert [(e.kind, e.value) for e in log.events] == [("overflow", 65536.0)]


def test_megatron_skipped_iterations_that_do_not_stop_are_an_error(tmp_path: Path) -> None:
    lines = []
    for it in range(1, 121):
        skipped, scale = (1, 4096.0) if it > 100 else (0, 4096.0)  # a static scale: every step overflows
        lines.append(f" iteration {it:>8d}/  1000 | learning rate: 3.000000E-04 | global batch size:   128 | lm loss: "
                     f"{3.0 - it * 0.001:.6E} | loss scale: {scale:.1f} | grad norm: 1.000 | number of skipped "
                     f"iterations: {skipped:>3d} | number of nan iterations:   0 |")
    path = tmp_path / "skips.log"
    path.write_text("\n".join(lines) + "\n")
    errors = [e for e in analyse(path, tmp_path).events if e["severity"] == "error"]
    assert [(e["kind"], e["onset"], top(e)) for e in errors] == [("loss_scale_collapse", 101, "fp16_loss_scale")]
    assert "20 logged steps (101-120)" in str(errors[0]["message"])


@pytest.mark.parametrize("tee", [False, True])
def test_an_overflow_printed_by_every_rank_counts_once(tmp_path: Path, tee: bool) -> None:
    """DeepSpeed's ``OVERFLOW! Rank r`` from all 8 ranks, plain or under torchrun --tee's ``[default r]:`` prefixes."""
    def prefix(rank: int) -> str:
        return f"[default{rank}]:" if tee else ""

    lines = []
    for step in range(1, 41):
        if step % 10 == 5:
            lines += [f"{prefix(r)}[2024-02-01 09:00:{step:02d},000] [INFO] [loss_scaler.py:183:update_scale] "
                      f"[deepspeed] OVERFLOW! Rank {r} Skipping step. Attempted loss scale: 65536, reducing to 32768"
                      for r in range(8)]
        lines.append(f"{prefix(0)}[Rank 0] step={step}, skipped={(step + 5) // 10}, lr=[0.0001], mom=[(0.9, 0.999)]")
    path = tmp_path / "ranks.log"
    path.write_text("\n".join(lines) + "\n")
    log = load_source(path)
    assert [(e.kind, e.step, e.count) for e in log.events] == [("overflow", s, 1) for s in (4, 14, 24, 34)]
    assert [e["severity"] for e in analyse(path, tmp_path).events] == ["info"]


def test_deepspeed_minimum_scale_message_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "ds.log"
    path.write_text(
        " 10%|█         | 9/90 [00:10<01:30, 1.1s/it][2023-06-07 22:16:00,018] [INFO] [loss_scaler.py:181:"
        "update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1\n"
        "{'loss': 2.0491, 'learning_rate': 0.0001961913563176343, 'epoch': 0.28}\n"
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\n")
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["severity"], top(e)) for e in result.events] == [("loss_scale_collapse", "error",
                                                                            "fp16_loss_scale")]
    assert "minimum" in str(result.events[0]["message"])


@needs_real
def test_hf_trainer_prints_with_nan_grad_norm(tmp_path: Path) -> None:
    path = SNIPPETS / "llamafactory_issue5627_gradnorm_nan_then_loss0.txt"
    log = load_source(path)
    assert [r.signals["loss"] for r in log.records] == [1.4596, 0.0, 0.0, 0.0]
    assert any("ordinals" in n for n in log.notes)
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["onset"], top(e)) for e in serious(result)] == [("nan", 1, "numerical_nan")]


def test_trainer_state_json_and_json_lines(tmp_path: Path) -> None:
    history = [{"epoch": 0.01 * s, "grad_norm": 1.2, "learning_rate": 5e-5, "loss": 2.5 - 0.001 * s, "step": s}
               for s in range(10, 410, 10)]
    history[25]["grad_norm"] = "NaN"  # HF writes float('nan') as NaN
    history.append({"epoch": 4.0, "eval_loss": 2.1, "step": 400})
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 400, "log_history": history,
                                                             "logging_steps": 10}).replace('"NaN"', "NaN"))
    assert sniff(tmp_path) == "hf-trainer-state"
    result = analyse(tmp_path / "trainer_state.json", tmp_path)
    assert [(e["kind"], e["onset"]) for e in serious(result)] == [("nan", 260)]
    out_dir = tmp_path / "out"  # an HF output_dir: the latest checkpoint's state holds the whole history
    for n in (200, 400):
        (out_dir / f"checkpoint-{n}").mkdir(parents=True)
        (out_dir / f"checkpoint-{n}" / "trainer_state.json").write_text(
            (tmp_path / "trainer_state.json").read_text() if n == 400 else '{"log_history": []}')
    records = load_source(out_dir).records
    assert len(records) == 40 and records[-1].signals["val_loss"] == 2.1  # the eval row merged into step 400
    lines = tmp_path / "metrics.jsonl"
    lines.write_text("".join(json.dumps({"iteration": s, "train/loss": 3.0, "lr": 1e-3}) + "\n" for s in range(50))
                     + json.dumps({"iteration": 10, "train/loss": 3.0}) + "\n")
    log = load_log(lines)
    assert log.format == "jsonl" and log.records[0].signals == {"loss": 3.0, "lr": 1e-3}
    assert [(s.first_step, s.last_step) for s in log.segments] == [(0, 49), (10, 10)]


def test_fairseq_train_inner_lines(tmp_path: Path) -> None:
    path = tmp_path / "fairseq.log"
    lines = []
    for i in range(1, 60):
        gnorm = "inf" if i == 30 else "1.036"
        lines.append(f"2020-03-23 11:{i // 60:02d}:{i % 60:02d} | INFO | train_inner | epoch 001:    {i * 10} / 356 "
                     f"loss={9.4 - i * 0.01:.3f}, nll_loss=8.44, ppl=347.28, wps=30690.8, ups=0.07, wpb=427295, "
                     f"bsz=14390.4, num_updates={i * 10}, lr=0.000175, gnorm={gnorm}, loss_scale=8, "
                     f"train_wall=1281, wall=9877\n")
    path.write_text("".join(lines))
    log = load_source(path)
    assert log.format == "fairseq" and log.records[0].step == 10 and log.records[0].signals["loss_scale"] == 8.0
    assert log.records[0].signals["grad_norm"] == 1.036
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["onset"]) for e in serious(result)] == [("nan", 300)]


# -- TensorBoard and W&B ------------------------------------------------------------------------------------------

def test_tensorboard_directory_with_a_restart(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "tb"
    first = SummaryWriter(str(logdir), filename_suffix=".a")
    for step in range(0, 150):
        first.add_scalar("train/loss", math.nan if step >= 120 else 3.0 - 0.001 * step, step)
        first.add_scalar("train/grad_norm", 1.0, step)
    first.close()
    second = SummaryWriter(str(logdir), filename_suffix=".b")
    for step in range(100, 200):
        second.add_scalar("train/loss", 3.0 - 0.001 * step, step)
    second.close()
    assert sniff(logdir) == "tensorboard"
    log = load_source(logdir)
    assert [(s.first_step, s.last_step) for s in log.segments] == [(0, 149), (100, 199)]
    assert set(log.records[0].signals) == {"loss", "grad_norm"}
    result = analyse(logdir, tmp_path)
    assert [(e["kind"], e["onset"]) for e in serious(result)] == [("nan", 120)]


def test_wandb_offline_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real wandb offline run (no server: the one part that cannot run here)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wb = wandb.init(project="p", dir=str(tmp_path), settings=wandb.Settings(silent=True))
    for step in range(80):
        wb.log({"train/loss": math.inf if step == 50 else 2.0, "grad_norm": 0.5}, step=step)
    wb.finish()
    run_file = wandb_files.finished_run_file(tmp_path / "wandb", timeout=60.0)  # finish() may return before the flush
    assert sniff(tmp_path / "wandb") == "wandb-offline"
    runs = [run_file.parent]
    log = load_source(runs[0])
    assert [r.step for r in log.records] == list(range(80)) and log.records[0].signals["loss"] == 2.0
    result = analyse(runs[0], tmp_path)
    assert [(e["kind"], e["onset"]) for e in serious(result)] == [("nan", 50)]


# -- system logs -----------------------------------------------------------------------------------------------------

def test_kernel_log_and_nccl_watchdog_give_hang_and_hardware_findings(tmp_path: Path) -> None:
    events = load_system_log(DATA / "node07_kern.log", year=2024)
    assert [(e.kind, e.value, e.host) for e in events] == [("xid", 79.0, "node07"), ("hung_task", 120.0, "node07")]
    result = analyse(DATA / "hang_train.log", tmp_path, system_logs=[DATA / "node07_kern.log"])
    found = {e["kind"]: e for e in serious(result)}
    assert set(found) == {"hardware_error", "hang"}
    assert found["hardware_error"]["onset"] == 100  # the Xid's date, between iterations 100 and 101
    assert top(found["hardware_error"]) == "hardware_fault" and found["hardware_error"]["host"] == "node07"
    assert found["hang"]["rank"] == 3 and found["hang"]["onset"] == 120
    assert {c["cause"] for c in found["hang"]["causes"]} >= {"hang", "hardware_fault"}
    kinds = [e["kind"] for e in json.loads((tmp_path / "f.json").read_text())["log_events"]]
    assert kinds == ["nccl_timeout", "xid", "hung_task"]
    page = (tmp_path / "r.html").read_text()
    assert "<h3>Log events</h3>" in page and "GPU has fallen off the bus" in page


def test_a_rank_whose_log_stops_while_the_others_go_on_is_a_hang(tmp_path: Path) -> None:
    path = tmp_path / "ranks.csv"
    rows = ["step,rank,loss"] + [f"{s},{r},{3.0 - s * 0.001:.4f}" for s in range(0, 300, 10) for r in range(4)
                                 if not (r == 2 and s > 150)]
    path.write_text("\n".join(rows) + "\n")
    hangs = [e for e in analyse(path, tmp_path, loss_averaged=False).events if e["kind"] == "hang"]
    assert [(e["rank"], e["onset"], e["severity"], top(e)) for e in hangs] == [(2, 150, "warning", "hang")]
    assert "while other ranks logged up to step 290" in str(hangs[0]["message"])


def test_oom_kill_is_infrastructure(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text("".join(f"iter {i}: loss {3.0 - 0.001 * i:.4f}, time 100.00ms\n" for i in range(200))
                    + "[12345.678] Out of memory: Killed process 4242 (python) total-vm:1234kB\n")
    result = analyse(path, tmp_path)
    assert [(e["kind"], e["onset"], top(e)) for e in serious(result)] == [("infrastructure_error", 199,
                                                                           "infrastructure")]


# -- errors and CLI --------------------------------------------------------------------------------------------------

@needs_real
def test_unknown_format_gets_one_line_naming_the_expected_formats(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as info:
        load_source(SNIPPETS / "chgnet_issue81_loss_spike_running_avg.txt")
    message = str(info.value)
    assert "\n" not in message and "format not recognised" in message and "Megatron-LM" in message
    odd = tmp_path / "odd"
    odd.mkdir()
    with pytest.raises(SourceError, match=r"not a run directory.*expected"):
        load_source(odd)


def test_cli_postmortem_of_a_log_with_a_system_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["postmortem", str(DATA / "hang_train.log"), "--system-log", str(DATA / "node07_kern.log"),
                 "-o", str(tmp_path), "--fail-on", "error"])
    out = capsys.readouterr().out
    assert code == 1 and "hang" in out and "hardware_fault" in out
    assert (tmp_path / "hang_train.findings.json").exists() and (tmp_path / "hang_train.report.html").exists()


def test_progress_bar_only_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stability.postmortem import analyze

    quiet = analyse(DATA / "megatron_resume.log", tmp_path)
    assert capsys.readouterr().err == ""  # not a TTY: nothing on stderr
    log = load_source(DATA / "megatron_resume.log")
    forced = analyze(log.records, "r", segments=log.segments, events=log.events, progress=True)
    assert forced.events == quiet.events  # the bar changes nothing but stderr


# -- nvidia-smi -q dumps (--system-log) -------------------------------------------------------------------------------

V100_NVSMI = """
==============NVSMI LOG==============

Timestamp                                 : Mon May 13 11:00:50 2024
Driver Version                            : 470.182.03
CUDA Version                              : 11.4

Attached GPUs                             : 1
GPU 00000000:3B:00.0
    Product Name                          : Tesla V100-SXM2-32GB
    Minor Number                          : 5
    Clocks Throttle Reasons
        Idle                              : Not Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Not Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Not Active
        Sync Boost                        : Not Active
        SW Thermal Slowdown               : Active
        Display Clock Setting             : Not Active
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 4
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : N/A
                Total                     : 4
            Double Bit
                Device Memory             : {dbe}
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : 0
                Total                     : {dbe}
        Aggregate
            Single Bit
                Total                     : 9
            Double Bit
                Total                     : 3
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 3
        Pending Page Blacklist            : {pending}
"""


def test_nvidia_smi_dump_events(tmp_path: Path) -> None:
    events = load_system_log(DATA / "node07_nvsmi.txt")
    assert [(e.kind, e.value) for e in events] == [("ecc", 2.0), ("ecc", 2.0), ("gpu_throttle", 2.0)]
    assert all("GPU 1 (00000000:0B:00.0)" in e.message for e in events)  # GPU 0: lifetime counts, power cap only
    assert "row remapping pending" in events[1].message and "HW Thermal Slowdown" in events[2].message
    old = tmp_path / "v100.txt"
    old.write_text(V100_NVSMI.format(dbe=1, pending="Yes"))
    assert [(e.kind, e.value) for e in load_system_log(old)] == [("ecc", 1.0), ("ecc", 3.0), ("gpu_throttle", 1.0)]
    old.write_text(V100_NVSMI.format(dbe=0, pending="No"))
    assert [e.kind for e in load_system_log(old)] == ["gpu_throttle"]


def test_nvidia_smi_dump_feeds_hardware_fault(tmp_path: Path) -> None:
    result = analyse(DATA / "hang_train.log", tmp_path, system_logs=[DATA / "node07_nvsmi.txt"])
    found = {e["kind"]: e for e in serious(result)}
    hardware = found["hardware_error"]
    assert hardware["severity"] == "error" and top(hardware) == "hardware_fault"
    assert hardware["onset"] == 90  # dumped at 11:01:30, when iteration 90 was logged
    assert "volatile uncorrectable ECC" in hardware["message"]
    old = tmp_path / "v100.txt"
    old.write_text(V100_NVSMI.format(dbe=0, pending="No"))
    result = analyse(DATA / "hang_train.log", tmp_path, system_logs=[old])
    throttled = next(e for e in result.events if e["kind"] == "hardware_error")
    assert throttled["severity"] == "warning" and "SW Thermal Slowdown" in throttled["message"]
