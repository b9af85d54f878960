"""The root-cause catalogue: every ``cause`` id a finding may carry, with a title and a remedy.

Sources: shared reference ``root-causes.md`` (OPT, BLOOM, GLM-130B logbooks, PaLM, Wortsman et al. 2023, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOGUE", "Cause", "remedy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    """One catalogued root cause."""

    id: str
    title: str
    remedy: str
    signals: str
    """What points to it (documentation)."""


_CAUSES = (
    Cause(
        id="lr_too_high",
        title="Learning rate too high (or not decaying fast enough)",
        remedy="Roll back to the rollback step and lower the peak LR (OPT: -10%, then 2/3); decay faster.",
        signals="update/param ratios and grad norms drift up or jump with the LR; LR recently raised.",
    ),
    Cause(
        id="warmup_too_short",
        title="Warm-up too short / end-of-warm-up fragility",
        remedy="Lengthen the LR warm-up (or re-warm after a restart or data change); roll back and resume.",
        signals="instability within ~3x the warm-up length, while the LR is still rising or just peaked.",
    ),
    Cause(
        id="bad_batch",
        title="Bad or degenerate data batch",
        remedy="Skip the listed batches (Megatron --iterations-to-skip, Lightning skip_batches.json), "
        "inspect them, filter the data; roll back ~100 steps if the model did not recover.",
        signals="a one-step loss jump with no precursor in gradients or update ratios.",
    ),
    Cause(
        id="attention_logit_growth",
        title="Attention-logit growth / attention entropy collapse",
        remedy="Add QK-LayerNorm (or softmax capping), lower the LR, keep the softmax in fp32.",
        signals="max attention logit of a layer grows steadily before the instability.",
    ),
    Cause(
        id="output_logit_divergence",
        title="Output-logit divergence (log Z drift)",
        remedy="Add z-loss (1e-4 * log^2 Z), weight decay on the output layer.",
        signals="logit_z drifts far from 0, a slow loss rise rather than a spike, late in training.",
    ),
    Cause(
        id="adam_second_moment",
        title="Adam second moment lags the gradient (g^2 >> v)",
        remedy="Lower beta2 (0.95), use update clipping (StableAdamW), lower the LR.",
        signals="adam_v_ratio of a layer jumps 1-8 steps before the loss spike.",
    ),
    Cause(
        id="fp16_loss_scale",
        title="fp16 overflow / loss-scale collapse",
        remedy="Switch to bf16, keep softmax and accumulation in fp32, set a minimum loss scale, roll back.",
        signals="loss scale falls, skipped steps, grad norm frozen, then NaN.",
    ),
    Cause(
        id="vanishing_gradients",
        title="Vanishing gradients / dead layers",
        remedy="Check the initialisation and normalisation, residual scaling, and the LR schedule.",
        signals="grad norms of one or more layers collapse towards zero.",
    ),
    Cause(
        id="hardware_fault",
        title="Hardware fault / silent data corruption",
        remedy="Recompute the step on other hardware, cordon the node of the named rank, run GPU diagnostics.",
        signals="one rank disagrees with the others; non-reproducible one-step event.",
    ),
    Cause(
        id="numerical_nan",
        title="Numerical NaN/Inf in the forward or backward pass",
        remedy="Find the first non-finite module, check for log(0), division by zero, overflow in fp16/bf16; "
        "roll back and skip the batch.",
        signals="a non-finite loss, gradient or activation.",
    ),
    Cause(
        id="data_shift",
        title="Sharp data-distribution shift",
        remedy="Ramp the new mixture in gradually and re-warm the LR.",
        signals="the loss level shifts and stays, without a gradient precursor.",
    ),
    Cause(
        id="lr_too_low",
        title="Optimisation stalled (learning rate too low or data exhausted)",
        remedy="Check the LR schedule (decayed too early?), data repetition and the loss of held-out data; "
        "raise the LR or stop the run if the plateau is expected.",
        signals="log loss has not improved over a long window outside the warm-up, with the LR above its floor.",
    ),
    Cause(
        id="software_regression",
        title="Software / version regression",
        remedy="Pin the previous framework versions (or config) and re-run from the last good checkpoint; bisect "
        "the version change (e.g. DeepSpeed 0.12.3 -> 0.12.4 broke ZeRO-2 grad norms: overlap_comm=False).",
        signals="loss 0, grad norm NaN or a frozen LR from the first step, or right after a version/config change "
        "at a restart (post-mortem of logs only).",
    ),
    Cause(
        id="resume_mismatch",
        title="Resume did not restore the training state",
        remedy="Check that the optimizer state, LR scheduler, RNG and data-loader position are saved and loaded "
        "(Megatron --no-load-optim / --no-load-rng, consumed samples); compare the re-logged steps.",
        signals="a spike or loss offset right after a resume from a checkpoint that recovers (post-mortem of logs).",
    ),
    Cause(
        id="data_pipeline",
        title="Data pipeline changed at a resume or shard boundary",
        remedy="Check the data-loader position, shard order and mixture after the resume; re-logged steps should "
        "match the first run's loss.",
        signals="the loss level shifts at a resume boundary and stays (post-mortem of logs).",
    ),
    Cause(
        id="infrastructure",
        title="Infrastructure failure (host memory, network, scheduler)",
        remedy="Check the node's memory (OOM killer), network fabric and job scheduler logs; restart from the last "
        "checkpoint, excluding the node if it repeats.",
        signals="OOM-killer or NCCL/communication errors in the system log near the event.",
    ),
    Cause(
        id="straggler",
        title="Straggler rank (one rank slower than its peers)",
        remedy="Check the named host: GPU clocks and temperature (nvidia-smi -q -d PERFORMANCE), other processes, "
        "PCIe/NVLink errors, its data-loader workers and local disk; cordon it or restart the job without it.",
        signals="one rank's data + compute time before the first collective is consistently above its peers'.",
    ),
    Cause(
        id="dataloader_stall",
        title="Data-loader stall (the loop waits for its batches)",
        remedy="Raise DataLoader num_workers / prefetch_factor, use pin_memory and persistent_workers, check the "
        "storage or network the data comes from, and the profile's data-wait share.",
        signals="data_time (optimizer step to next forward) jumps or rises and explains the step-time rise.",
    ),
    Cause(
        id="slowdown",
        title="Compute or communication slowdown",
        remedy="Capture a profile (stability profile RUN_ID --steps 5) and compare top ops with a healthy run: "
        "recompilation, thermal throttling, contention from other jobs, a slower collective, fragmentation.",
        signals="step time rose (or one step spiked) without data waiting and outside recurring checkpoint/eval steps.",
    ),
    Cause(
        id="memory_leak",
        title="Memory leak toward out-of-memory",
        remedy="Look for tensors kept across steps (losses accumulated without .item()/.detach(), growing lists, "
        "caches, autograd graphs held by logging); torch.cuda.memory_snapshot() / tracemalloc around the steps.",
        signals="host RSS or allocated device memory grows steadily step after step.",
    ),
    Cause(
        id="hang",
        title="Hang (a rank or the whole job stopped making progress)",
        remedy="Read the dumped Python stacks (hang-rank*-step*.txt in the run directory): a collective waiting "
        "for a dead or diverged rank, a deadlocked data loader, I/O. Find the rank that stopped first (the NCCL "
        "watchdog names the collective) and check its node (kernel log: hung tasks, Xid); set NCCL/gloo timeouts and "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING, restart from the last checkpoint without that node.",
        signals="a rank's records (or log) stop while others continue, no step completes within 2x the usual step "
        "time, or NCCL watchdog timeouts / 'blocked for more than 120 seconds' in the system log.",
    ),
    Cause(
        id="unknown",
        title="Unknown",
        remedy="Roll back to the rollback step; inspect per-layer signals around the onset.",
        signals="no structural rule matched.",
    ),
)

CATALOGUE: dict[str, Cause] = {c.id: c for c in _CAUSES}
"""Cause id -> :class:`Cause`."""


def remedy(cause_id: str) -> str:
    """The catalogued remedy of ``cause_id`` (the ``unknown`` remedy for an unknown id)."""
    return CATALOGUE.get(cause_id, CATALOGUE["unknown"]).remedy
