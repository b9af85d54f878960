"""Re-create the log fixtures of tests/test_sources_logs.py (run once; the outputs are committed).

Each file copies the line format of its framework verbatim (Megatron-LM ``training.py`` ``training_log``,
DeepSpeed ``loss_scaler.py`` / ``engine.py`` ``log_dist``, kernel ``NVRM: Xid`` / ``hung_task`` messages, the
PyTorch NCCL watchdog); the numbers are a deterministic, seeded curve. ``python tests/data/logs/make_fixtures.py``
"""

from __future__ import annotations

import math
import random
from pathlib import Path

HERE = Path(__file__).parent

ARGS = """------------------------ arguments ------------------------
  bf16 ............................................ False
  clip_grad ....................................... 1.0
  data_parallel_size .............................. 2
  fp16 ............................................ True
  global_batch_size ............................... 128
  hysteresis ...................................... 2
  initial_loss_scale .............................. 4294967296
  load ............................................ /ckpt/gpt-345m
  log_interval .................................... 10
  loss_scale_window ............................... 1000
  lr .............................................. 0.0003
  lr_decay_style .................................. cosine
  lr_warmup_iters ................................. 50
  micro_batch_size ................................ 4
  min_loss_scale .................................. 1.0
  pipeline_model_parallel_size .................... 2
  seed ............................................ 1234
  tensor_model_parallel_size ...................... 2
  train_iters ..................................... 500
  world_size ...................................... 8
-------------------- end of arguments ---------------------"""


def _line(it: int, loss: float, grad: str, scale: float, lr: float, skipped: int = 0, nans: int = 0) -> str:
    stamp = f"[2024-05-13 10:{it // 60 % 60:02d}:{it % 60:02d}]"
    return (f" {stamp} iteration {it:>8d}/     500 | consumed samples: {it * 128:>12d} | elapsed time per iteration "
            f"(ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 142.1 | learning rate: {lr:.6E} | global batch size: "
            f"  128 | lm loss: {loss:.6E} | loss scale: {scale:.1f} | grad norm: {grad} | num zeros: 0.0 | number of "
            f"skipped iterations: {skipped:>3d} | number of nan iterations: {nans:>3d} |")


def _loss(it: int, rng: random.Random) -> float:
    return 2.0 + 8.0 * math.exp(-it / 80.0) + rng.gauss(0.0, 0.02)


def megatron_resume() -> str:
    """Megatron-LM, log interval 10: NaN from iteration 260, killed at 300, restarted from the checkpoint at 200."""
    rng = random.Random(1)
    out = ["using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 2, "
           "pipeline-model-parallel size: 2", ARGS, " loading checkpoint from /ckpt/gpt-345m at iteration 0"]
    saved = {}
    for it in range(10, 310, 10):
        loss = _loss(it, rng)
        saved[it] = loss
        if it >= 260:
            out.append(_line(it, math.nan, "nan", 65536.0, 3e-4, 0, 10).replace("lm loss: NAN", "lm loss: nan"))
        else:
            out.append(_line(it, loss, f"{1.0 + rng.gauss(0, 0.05):.3f}", 65536.0, 3e-4))
        if it % 100 == 0:
            out.append(f"  successfully saved checkpoint from iteration {it:>7d} to /ckpt/gpt-345m")
    out += ["using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 2, "
            "pipeline-model-parallel size: 2", ARGS,
            " loading checkpoint from /ckpt/gpt-345m at iteration 200",
            "  successfully loaded checkpoint from /ckpt/gpt-345m [ t 0/2, p 0/2 ] at iteration 200"]
    for it in range(210, 510, 10):
        loss = saved.get(it) if it < 260 else _loss(it, rng)
        out.append(_line(it, loss if loss is not None else _loss(it, rng), f"{1.0 + rng.gauss(0, 0.05):.3f}",
                         65536.0, 3e-4))
    return "\n".join(out) + "\n"


def deepspeed_routine_fp16() -> str:
    """DeepSpeed fp16 (loss_scale_window 100 here): an overflow every ~100 steps halves the scale, the scaler
    re-probes (doubles) after each clean window: healthy, routine dynamic loss scaling."""
    rng = random.Random(2)
    out = ["[2024-02-01 09:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.14.0, "
           "git-hash=unknown, git-branch=unknown"]
    scale, skipped = 65536.0, 0
    for step in range(1, 601):
        if step % 100 == 37:
            out.append(f"[2024-02-01 09:{step // 60 % 60:02d}:{step % 60:02d},000] [INFO] [loss_scaler.py:183:"
                       f"update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {scale:g}, "
                       f"reducing to {scale / 2:g}")
            scale /= 2
            skipped += 1
        elif step % 100 == 0:
            scale *= 2
        if step % 10 == 0:
            out.append(f"[2024-02-01 09:{step // 60 % 60:02d}:{step % 60:02d},000] [INFO] [logging.py:96:log_dist] "
                       f"[Rank 0] step={step}, skipped={skipped}, lr=[0.0001], mom=[(0.9, 0.999)]")
            out.append(f"step {step} loss {_loss(step, rng):.4f}")
    return "\n".join(out) + "\n"


def hang_training() -> str:
    """A Megatron-DeepSpeed run whose log stops; the NCCL watchdog of rank 3 times out 10 minutes later."""
    rng = random.Random(3)
    out = []
    for it in range(1, 121):
        out.append(_line(it, _loss(it, rng), f"{1.0 + rng.gauss(0, 0.05):.3f}", 65536.0, 3e-4)
                   .replace("[2024-05-13 10:", "[2024-05-13 11:"))
    out.append("[rank3]:[E513 11:12:00.123456 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation "
               "timeout: WorkNCCL(SeqNum=48213, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
               "600034 milliseconds before timing out.")
    return "\n".join(out) + "\n"


DMESG = (  # a journalctl -k excerpt of the node the hung rank ran on
    "May 13 11:01:40 node07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=28911, name=python, GPU has fallen off the "
    "bus.\n"
    """May 13 11:01:40 node07 kernel: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.
May 13 11:05:02 node07 kernel: INFO: task python:28911 blocked for more than 120 seconds.
May 13 11:05:02 node07 kernel:       Tainted: P           OE     5.15.0-91-generic #101-Ubuntu
May 13 11:05:02 node07 kernel: "echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.
""")


def main() -> None:
    (HERE / "megatron_resume.log").write_text(megatron_resume())
    (HERE / "deepspeed_routine_fp16.log").write_text(deepspeed_routine_fp16())
    (HERE / "hang_train.log").write_text(hang_training())
    (HERE / "node07_kern.log").write_text(DMESG)


if __name__ == "__main__":
    main()
