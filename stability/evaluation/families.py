"""The families corpus: labelled runs of *other* model families, split into a calibration and a frozen test split.

The legacy corpus (:mod:`stability.evaluation.corpus`: one 2-layer GPT, AdamW, LR ramps of x1.08-1.1 per step,
4-replica faults, faults on multiples of ``stats_every``) served both to calibrate the detectors and to score
them (issue #8). This corpus is independent of it: seven model families (:mod:`~stability.evaluation.family_models`),
AdamW / SGD with momentum / Adafactor / NAdam, seven LR schedules, fp32 / bf16 autocast / fp16 with a GradScaler,
1-8 replicas, fault magnitudes drawn log-uniformly over two orders of magnitude and fault steps drawn among primes
(never a multiple of ``stats_every``).

Split: :data:`TEMPLATES` is a fixed list; :func:`spec_for` turns a template and a seed into a :class:`FamilySpec`
(the seed decides the family among the template's options, the fault step, the magnitude ...).
**Calibration** = seeds :data:`CALIB_SEEDS`, **test** = seeds :data:`TEST_SEEDS`; the test split's spec keys are
frozen in ``docs/test-corpus-manifest.json`` (:func:`manifest`). Records come from the real capture
(``Capture(WatchConfig(...), ListSink(), rank=r).attach(model, opt)``), labels from the injection and the
event's defining signal (:mod:`stability.evaluation.family_labels`), never from a detector.

Clean runs carry the traps of issue #8: planned LR drops, warm restarts (the LR jumps back up), warm-up-stable-
decay and step schedules, healthy fp16 back-offs (one skipped step, the scale halved, every ~100-150 steps),
Zipf-distributed tokens (rare embedding rows), learned position embeddings, runs of 5-6k steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from stability.config import WatchConfig
from stability.evaluation.corpus import GeneratedRun, _emulate_fp16, default_cache_dir
from stability.evaluation.family_labels import label_family
from stability.evaluation.family_models import ATTENTION_FAMILIES, FAMILIES, Task
from stability.hooks.capture import Capture
from stability.records import StepRecord, decode, encode
from stability.testing import ListSink

__all__ = [
    "CALIB_SEEDS",
    "FAMILIES_VERSION",
    "FAULTS",
    "TEMPLATES",
    "TEST_SEEDS",
    "holdout_specs",
    "FamilySpec",
    "Template",
    "calib_specs",
    "ci_specs",
    "generate_families",
    "manifest",
    "spec_for",
    "test_specs",
]

logger = logging.getLogger(__name__)

FAMILIES_VERSION = 1
"""Bump when the generator changes what a spec produces (invalidates the cache and the test manifest)."""
CALIB_SEEDS = (100, 101, 102, 200, 201, 202, 203, 204)
"""Seeds 200-204 were the first test split (scored once on 2026-12-03, its misses read): they joined calibration."""
TEST_SEEDS = (300, 301, 302, 303, 304)
"""The second test split, drawn before any detector change that used the first one's misses."""
TEST_BACKEND = "gloo"
"""Replicas of the test split are real gloo ``DistributedDataParallel`` processes; calibration simulates them in one
process (the same arithmetic), so the test also exercises the capture of a real DDP job."""
CI_SEED = 7

FAULTS = ("clean", "bad_batch", "lr_spike", "lr_drift", "attn_growth", "fp16_collapse", "nan_data", "vanishing",
          "dp_rank", "short_warmup")
OPTIMIZERS = ("adamw", "sgd", "adafactor", "nadam")
SCHEDULES = ("constant", "cosine", "linear", "wsd", "step", "restarts", "drop")
PRECISIONS = ("fp32", "bf16", "fp16")

_PEAK_LR = {"adamw": 3e-3, "nadam": 2e-3, "adafactor": 1e-2, "sgd": 0.05}


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilySpec:
    """One generated run of the families corpus."""

    name: str
    family: str
    fault: str = "clean"
    seed: int = 0
    steps: int = 400
    optimizer: str = "adamw"
    schedule: str = "cosine"
    precision: str = "fp32"
    ranks: int = 1
    faulty_rank: int = 0
    fault_step: int = 0
    duration: int = 1
    magnitude: float = 0.0
    """Fault size: LR factor (spike), per-step LR growth (drift, attention), gradient factor (DP, fp16 start),
    corrupted fraction / scale (bad batch), peak LR (short warm-up), init std (vanishing)."""
    growth: float = 0.0
    """fp16 collapse: per-step growth of the gradient injection."""
    lr: float = 3e-3
    warmup: int = 30
    depth: int = 12
    stats_every: int = 10
    growth_interval: int = 100
    """GradScaler growth interval (fp16): a healthy back-off about every this many steps."""
    backend: str = ""
    """Replicated runs: ``gloo`` = real DDP processes (:mod:`~stability.evaluation.family_ddp`); empty = simulated in
    one process (per-replica gradients averaged by hand)."""
    variant: str = ""
    """``bad_batch``: ``constant`` = every row one token (padding-like: the gradient spikes much harder than the
    loss); empty = random-token rows / shuffled labels / noisy targets."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; choose one of {', '.join(FAULTS)}")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}")
        if self.optimizer not in OPTIMIZERS or self.schedule not in SCHEDULES or self.precision not in PRECISIONS:
            raise ValueError(f"bad optimizer/schedule/precision in {self.name}")
        if self.backend not in ("", "gloo"):
            raise ValueError(f"unknown backend {self.backend!r} in {self.name}; choose '' (simulated) or 'gloo'")

    def key(self) -> str:
        """Cache key: a hash of every field and :data:`FAMILIES_VERSION`."""
        fields = asdict(self)
        for late in ("variant", "backend"):  # added after the first runs were cached: absent from their keys
            if not fields[late]:
                del fields[late]
        blob = json.dumps({"families_v": FAMILIES_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]


# ------------------------------------------------------------------------------------------------ templates
@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    """A row of the fixed spec list: the seed picks ``families[seed % n]`` and draws the fault's numbers."""

    name: str
    fault: str
    families: tuple[str, ...]
    optimizers: tuple[str, ...] = ("adamw",)
    schedules: tuple[str, ...] = ("cosine",)
    precisions: tuple[str, ...] = ("fp32",)
    ranks: int = 1
    steps: int = 500


TEMPLATES: tuple[Template, ...] = (
    # clean runs: schedule, precision and embedding traps
    Template(name="clean-gpt", fault="clean", families=("gpt_s", "gpt_m"), schedules=("wsd", "restarts", "drop"),
             steps=600),
    Template(name="clean-gpt-bf16", fault="clean", families=("gpt_s",), precisions=("bf16",),
             schedules=("cosine", "step"), steps=400),
    Template(name="clean-lstm", fault="clean", families=("lstm",), schedules=("restarts", "linear", "wsd"),
             steps=700),
    Template(name="clean-moe-fp16", fault="clean", families=("moe",), optimizers=("adafactor", "adamw"),
             schedules=("linear", "drop"), precisions=("fp16",), steps=400),
    Template(name="clean-cnn-fp16", fault="clean", families=("cnn",), optimizers=("sgd", "nadam"),
             schedules=("step", "restarts"), precisions=("fp16",), steps=800),
    Template(name="clean-mlp-long", fault="clean", families=("mlp",), optimizers=("adamw", "sgd", "nadam"),
             schedules=("drop", "restarts", "cosine"), steps=5000),
    Template(name="clean-dp2", fault="clean", families=("gpt_s",), schedules=("cosine", "wsd"), ranks=2, steps=400),
    Template(name="clean-dp8", fault="clean", families=("mlp",), optimizers=("nadam", "sgd"),
             schedules=("wsd", "step"), ranks=8, steps=500),
    # faults
    Template(name="bad-batch", fault="bad_batch", families=("gpt_m", "lstm", "cnn", "mlp", "moe"),
             optimizers=("adamw", "sgd", "adafactor"), schedules=("cosine", "wsd", "linear"), steps=500),
    Template(name="bad-batch-late", fault="bad_batch", families=("gpt_s", "moe"),
             schedules=("wsd", "cosine"), precisions=("bf16", "fp32"), steps=500),
    Template(name="lr-spike", fault="lr_spike", families=("mlp", "cnn", "gpt_s", "lstm"),
             optimizers=("adamw", "sgd", "adafactor", "nadam"), schedules=("cosine", "restarts", "step", "wsd"),
             steps=500),
    Template(name="lr-drift", fault="lr_drift", families=("gpt_s", "lstm", "mlp", "cnn"),
             optimizers=("adamw", "sgd", "nadam"), schedules=("cosine", "wsd", "constant"), steps=600),
    Template(name="attn-growth", fault="attn_growth", families=("gpt_s", "moe", "gpt_m"),
             schedules=("cosine", "wsd"), steps=400),
    Template(name="fp16-collapse", fault="fp16_collapse", families=("cnn", "mlp", "gpt_s", "moe"),
             optimizers=("adamw", "sgd"), precisions=("fp16",), steps=500),
    Template(name="nan-data", fault="nan_data", families=("lstm", "mlp", "cnn", "gpt_m"),
             optimizers=("adamw", "nadam"), schedules=("linear", "cosine"), steps=400),
    Template(name="vanishing", fault="vanishing", families=("deep_tanh",), optimizers=("sgd",),
             schedules=("constant", "cosine"), steps=300),
    Template(name="dp2-rank", fault="dp_rank", families=("gpt_s",), ranks=2, steps=300),
    Template(name="dp4-rank", fault="dp_rank", families=("cnn",), optimizers=("sgd", "adamw"), ranks=4, steps=300),
    Template(name="dp8-rank", fault="dp_rank", families=("mlp",), optimizers=("adamw", "nadam"), ranks=8,
             steps=300),
    Template(name="short-warmup", fault="short_warmup", families=("gpt_s", "moe"), schedules=("cosine", "linear"),
             steps=200),
)


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _prime_in(rng: random.Random, lo: int, hi: int) -> int:
    primes = [n for n in range(max(lo, 11), hi + 1) if all(n % d for d in range(2, int(n ** 0.5) + 1))]
    return rng.choice(primes)


def spec_for(t: Template, seed: int, *, steps: int | None = None, backend: str = "") -> FamilySpec:
    """The spec of template ``t`` for ``seed`` (every draw comes from ``Random(f"{t.name}:{seed}")``); ``backend``
    applies to replicated templates only."""
    rng = random.Random(f"{t.name}:{seed}")
    fam = t.families[seed % len(t.families)]
    opt = t.optimizers[seed % len(t.optimizers)]
    sched = t.schedules[seed % len(t.schedules)]
    prec = t.precisions[seed % len(t.precisions)]
    n = steps if steps is not None else t.steps
    if fam in ("mlp", "cnn") and opt in ("adamw", "nadam"):
        lr = _PEAK_LR[opt] * 0.5
    else:
        lr = _PEAK_LR[opt] * (1.0 if fam != "lstm" or opt == "sgd" else 1.5)
    lr *= _loguniform(rng, 0.7, 1.4)
    kw: dict[str, Any] = {"name": f"{t.name}-{fam}-s{seed}", "family": fam, "fault": t.fault, "seed": seed,
                          "steps": n, "optimizer": opt, "schedule": sched, "precision": prec, "ranks": t.ranks,
                          "lr": lr, "warmup": rng.choice((20, 30, 50)), "stats_every": rng.choice((10, 10, 16, 25)),
                          "growth_interval": rng.choice((100, 120, 150)),
                          "backend": backend if t.ranks > 1 else ""}
    f = t.fault
    if f == "bad_batch":
        late = t.name.endswith("late")
        kw["fault_step"] = _prime_in(rng, int(n * (0.7 if late else 0.35)), int(n * (0.85 if late else 0.7)))
        kw["duration"] = 1
        kw["magnitude"] = rng.uniform(0.3, 1.0) if fam in ("gpt_s", "gpt_m", "moe", "lstm") else _loguniform(
            rng, 0.03, 3.0)
        if late:  # a padding-like batch: one token everywhere (frequent: loss ~1.1x; rare: ~3x; grad ~20x)
            kw["variant"], kw["magnitude"] = "constant", rng.uniform(0.0, 1.0)
    elif f == "lr_spike":
        kw["fault_step"] = _prime_in(rng, int(n * 0.35), int(n * 0.75))
        kw["duration"] = rng.choice((1, 2, 3))
        kw["magnitude"] = _loguniform(rng, 10.0, 1000.0)
    elif f in ("lr_drift", "attn_growth"):
        kw["fault_step"] = _prime_in(rng, int(n * 0.25), int(n * 0.45))
        kw["magnitude"] = m = rng.uniform(1.015, 1.02) if f == "lr_drift" else _loguniform(rng, 1.02, 1.06)
        if f == "attn_growth":  # long enough for the attention LR to reach its 1000x cap, plus 150 steps
            kw["schedule"] = "constant" if seed % 3 == 2 else sched
            kw["steps"] = max(n, kw["fault_step"] + math.ceil(math.log(1000) / math.log(m)) + 150)
        else:  # the LR doubles every 35-47 steps: x100-x400 after 300
            kw["steps"] = max(n, kw["fault_step"] + 420)
    elif f == "fp16_collapse":
        kw["fault_step"] = _prime_in(rng, int(n * 0.35), int(n * 0.7))
        kw["duration"] = rng.randint(8, 14)
        kw["magnitude"] = _loguniform(rng, 30.0, 3000.0)
        kw["growth"] = rng.uniform(2.5, 5.0)
    elif f == "nan_data":
        kw["fault_step"] = _prime_in(rng, int(n * 0.3), int(n * 0.8))
        kw["duration"] = seed % 2  # 0: the job dies 5 steps later; 1: the loop skips the non-finite step
    elif f == "vanishing":
        kw["magnitude"] = _loguniform(rng, 0.005, 0.04)
        kw["depth"] = rng.randint(10, 16)
        kw["lr"] = rng.uniform(0.05, 0.1)
    elif f == "dp_rank":
        kw["fault_step"] = _prime_in(rng, int(n * 0.4), int(n * 0.75))
        kw["duration"] = rng.choice((1, 2))
        kw["magnitude"] = _loguniform(rng, 3.0, 1000.0)
        kw["faulty_rank"] = rng.randrange(t.ranks)
    elif f == "short_warmup":
        kw["magnitude"] = _loguniform(rng, 0.15, 0.5)
        kw["duration"] = rng.choice((0, 2))
    return FamilySpec(**kw)


def calib_specs() -> list[FamilySpec]:
    """The calibration split: every template with :data:`CALIB_SEEDS`."""
    return [spec_for(t, s) for s in CALIB_SEEDS for t in TEMPLATES]


def test_specs() -> list[FamilySpec]:
    """The test split (frozen: ``docs/test-corpus-manifest.json``): every template with :data:`TEST_SEEDS`."""
    return [spec_for(t, s, backend=TEST_BACKEND) for s in TEST_SEEDS for t in TEMPLATES]


def holdout_specs(seeds: tuple[int, ...]) -> list[FamilySpec]:
    """A held-out split: every template with ``seeds`` (none of :data:`CALIB_SEEDS` / :data:`TEST_SEEDS`), built as
    the test split is (real gloo replicas): runs nobody has looked at, to check that published figures hold."""
    used = set(CALIB_SEEDS) | set(TEST_SEEDS)
    if not seeds or used & set(seeds):
        raise ValueError(f"held-out seeds must be new, got {sorted(seeds)} (calibration {CALIB_SEEDS}, test "
                         f"{TEST_SEEDS})")
    return [spec_for(t, s, backend=TEST_BACKEND) for s in seeds for t in TEMPLATES]


_CI = {"clean-moe-fp16": 240, "clean-lstm": 200, "bad-batch-late": 200, "lr-spike": 160, "lr-drift": 360,
       "attn-growth": 300, "fp16-collapse": 200, "nan-data": 150, "vanishing": 100, "dp2-rank": 140,
       "dp8-rank": 140, "short-warmup": 100}


def ci_specs() -> list[FamilySpec]:
    """A small subset (seed :data:`CI_SEED`, shorter runs): one run of each new fault class, two clean traps."""
    by_name = {t.name: t for t in TEMPLATES}
    out = []
    for name, steps in _CI.items():
        t = by_name[name]
        if name in ("lr-spike", "fp16-collapse", "nan-data", "lr-drift"):
            t = Template(name=t.name, fault=t.fault, families=("mlp",), optimizers=t.optimizers,
                         schedules=t.schedules, precisions=t.precisions, ranks=t.ranks, steps=t.steps)
        elif name in ("attn-growth", "short-warmup", "bad-batch-late"):
            t = Template(name=t.name, fault=t.fault, families=("gpt_s",), optimizers=t.optimizers,
                         schedules=t.schedules, precisions=t.precisions, ranks=t.ranks, steps=t.steps)
        out.append(spec_for(t, CI_SEED, steps=steps))
    return out


def manifest(specs: Sequence[FamilySpec] | None = None) -> dict[str, Any]:
    """The frozen description of the test split: generator version, seeds, each spec's key, and one digest."""
    chosen = list(specs) if specs is not None else test_specs()
    runs = {s.name: s.key() for s in chosen}
    digest = hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()
    return {"families_version": FAMILIES_VERSION, "seeds": list(TEST_SEEDS), "templates": [t.name for t in TEMPLATES],
            "runs": runs, "digest": digest}


# ------------------------------------------------------------------------------------------------ schedule
def schedule_lr(spec: FamilySpec, step: int) -> float:
    """The planned LR of ``spec`` at ``step`` (warm-up, then the schedule), before any fault."""
    warmup = spec.duration if spec.fault == "short_warmup" else spec.warmup
    peak = spec.magnitude if spec.fault == "short_warmup" else spec.lr
    warm = 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)
    n = max(1, spec.steps - 1)
    frac = step / n
    s = spec.schedule
    if s == "constant":
        decay = 1.0
    elif s == "cosine":
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * frac))
    elif s == "linear":
        decay = 1.0 - 0.9 * frac
    elif s == "wsd":  # warm-up, stable, then a linear decay to 2% over the last 20%
        decay = 1.0 if frac < 0.8 else 1.0 - 0.98 * (frac - 0.8) / 0.2
    elif s == "step":
        decay = 1.0 if frac < 0.5 else 0.3 if frac < 0.75 else 0.09
    elif s == "restarts":  # cosine with warm restarts (SGDR): 3 cycles, each back to the peak with no warm-up
        cycle = n / 3
        decay = 0.05 + 0.475 * (1 + math.cos(math.pi * ((step % cycle) / cycle)))
    else:  # "drop": a planned LR drop x0.1 at 60%
        decay = 1.0 if frac < 0.6 else 0.1
    return peak * warm * decay


def lr_at(spec: FamilySpec, step: int) -> float:
    """The LR the loop sets: the schedule, times the injected LR fault."""
    lr = schedule_lr(spec, step)
    if spec.fault == "lr_spike" and spec.fault_step <= step < spec.fault_step + spec.duration:
        lr *= spec.magnitude
    if spec.fault == "lr_drift" and step >= spec.fault_step:
        lr *= spec.magnitude ** (step - spec.fault_step + 1)
    return lr


# ------------------------------------------------------------------------------------------------ training
def _optimizer(spec: FamilySpec, task: Task) -> torch.optim.Optimizer:
    model = task.model
    qkv = ([p for name, p in model.named_parameters() if ".qkv." in name]
           if spec.fault == "attn_growth" and spec.family in ATTENTION_FAMILIES else [])
    ids = {id(p) for p in qkv}
    groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if id(p) not in ids]}]
    if qkv:
        groups.append({"params": qkv})
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=0.9)
    if spec.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=spec.lr)
    if spec.optimizer == "nadam":
        return torch.optim.NAdam(groups, lr=spec.lr, weight_decay=0.01)
    betas = (0.9, 0.999) if spec.fault == "short_warmup" else (0.9, 0.95)
    return torch.optim.AdamW(groups, lr=spec.lr, weight_decay=0.01, betas=betas)


def _set_lr(spec: FamilySpec, step: int, opt: torch.optim.Optimizer) -> None:
    lr = lr_at(spec, step)
    for i, group in enumerate(opt.param_groups):  # group 1 (attn_growth): the attention input projections
        boost = 1.0
        if i == 1 and step >= spec.fault_step:
            boost = min(1000.0, spec.magnitude ** (step - spec.fault_step + 1))
        group["lr"] = lr * boost


def _in_fault(spec: FamilySpec, step: int) -> bool:
    return spec.fault_step <= step < spec.fault_step + max(1, spec.duration)


def _task(spec: FamilySpec, stream: int = 0) -> Task:
    return Task(spec.family, seed=spec.seed, stream=stream, depth=spec.depth,
                init_std=spec.magnitude if spec.fault == "vanishing" else 0.02)


def _config(spec: FamilySpec) -> WatchConfig:
    return WatchConfig(run_id=f"fam-{spec.name}", stats_every=spec.stats_every, layer_every=1, max_act_modules=8,
                       timing=False)


def _ceiling_scale(task: Task) -> float:
    """The largest power-of-two loss scale whose fp16 gradients of one probe batch do not overflow (a GradScaler
    that has settled; a fresh one starting at 2^16 would back off several steps in a row first)."""
    loss = task.loss(task.sample(), None)
    grads = torch.autograd.grad(loss, [p for p in task.model.parameters() if p.requires_grad], allow_unused=True)
    peak = max(float(g.abs().max()) for g in grads if g is not None)
    return 2.0 ** math.floor(math.log2(65504.0 / max(peak, 1e-30)))


def _train_single(spec: FamilySpec) -> list[StepRecord]:
    task = _task(spec)
    opt = _optimizer(spec, task)
    scaler = None
    if spec.precision == "fp16":  # start just under the overflow ceiling: healthy back-offs every ~G steps
        scaler = torch.amp.GradScaler("cpu", init_scale=_ceiling_scale(task), growth_interval=spec.growth_interval)
    sink = ListSink()
    capture = Capture(_config(spec), sink, rank=0).attach(task.model, opt)
    params = list(task.model.parameters())
    try:
        for step in range(spec.steps):
            if spec.fault == "nan_data" and spec.duration == 0 and step >= spec.fault_step + 5:
                break  # the job died after the NaN
            _set_lr(spec, step, opt)
            in_fault = _in_fault(spec, step)
            bad = spec.fault == "bad_batch" and in_fault
            batch = task.bad(spec.magnitude, constant=spec.variant == "constant") if bad else task.sample()
            hook: Callable[[torch.Tensor], torch.Tensor] | None = None
            if spec.fault == "fp16_collapse" and in_fault:
                factor = spec.magnitude * spec.growth ** (step - spec.fault_step)
                hook = lambda g, factor=factor: g * factor  # noqa: E731
            capture.set_batch(f"{spec.name}:{step}")
            loss = task.loss(batch, capture.observe, nan=spec.fault == "nan_data" and step == spec.fault_step,
                             bf16=spec.precision == "bf16", grad_hook=hook)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
                _emulate_fp16(params)
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if spec.fault == "nan_data" and spec.duration > 0 and not bool(torch.isfinite(norm)):
                opt.zero_grad(set_to_none=True)  # the loop's own guard: skip the update of a non-finite step
            opt.step()
    finally:
        capture.close()
    if capture.errors:
        logger.warning("run %s: %d capture errors", spec.name, capture.errors)
    return sorted(sink.records, key=lambda r: r.step)


def _train_dp(spec: FamilySpec) -> list[StepRecord]:
    """Replicas simulated in one process: per-replica data, gradients averaged by hand (the all-reduce), the
    faulty replica's gradients corrupted after it; losses go through ``observe`` (see corpus.py)."""
    replicas = []
    for r in range(spec.ranks):
        task = _task(spec, stream=r)
        replicas.append((task, _optimizer(spec, task)))
    sink = ListSink()
    captures = [Capture(_config(spec), sink, rank=r, coords={"dp": r, "world_size": spec.ranks}).attach(t.model, o)
                for r, (t, o) in enumerate(replicas)]
    try:
        for step in range(spec.steps):
            grads: list[list[torch.Tensor]] = []
            for r, ((task, opt), capture) in enumerate(zip(replicas, captures, strict=True)):
                _set_lr(spec, step, opt)
                capture.set_batch(f"{spec.name}:{step}:r{r}")
                loss = task.loss(task.sample(), capture.observe, bf16=spec.precision == "bf16")
                capture.observe("loss", loss.detach())
                grads.append(list(torch.autograd.grad(loss, list(task.model.parameters()))))
            mean = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
            for r, (task, opt) in enumerate(replicas):
                faulty = spec.fault == "dp_rank" and r == spec.faulty_rank and _in_fault(spec, step)
                for i, (p, g) in enumerate(zip(task.model.parameters(), mean, strict=True)):
                    p.grad = g.clone() * (spec.magnitude if faulty and i % 3 == 0 else 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        for capture in captures:
            capture.close()
    return sorted(sink.records, key=lambda r: (r.step, r.rank))


def generate_family_run(spec: FamilySpec) -> GeneratedRun:
    """Train ``spec`` with the real capture attached and label it."""
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    if spec.ranks > 1 and spec.backend == "gloo":
        from stability.evaluation.family_ddp import train_gloo

        records = train_gloo(spec)
    else:
        records = _train_dp(spec) if spec.ranks > 1 else _train_single(spec)
    events = label_family(spec, records)
    return GeneratedRun(name=spec.name, records=records, events=events, clean=spec.fault == "clean", spec=spec,
                        source="synthetic", seconds=time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ cache
def _path(cache: Path, spec: FamilySpec) -> Path:
    return cache / "families" / f"{spec.name}-{spec.key()}.msgpack"


def load_cached(cache: Path, spec: FamilySpec) -> GeneratedRun | None:
    """A cached run, or None (absent or unreadable); the labels are derived again from the records (cheap), so a
    labelling fix needs no retraining."""
    path = _path(cache, spec)
    if not path.exists():
        return None
    try:
        obj = msgpack.unpackb(path.read_bytes(), raw=False)
        records = [decode(b) for b in obj["records"]]
    except Exception as exc:  # a truncated or stale file is regenerated
        logger.warning("families cache %s unreadable (%s); regenerating", path, exc)
        return None
    return GeneratedRun(name=spec.name, records=records, events=label_family(spec, records), clean=obj["clean"],
                        spec=spec, source="synthetic")


def store(cache: Path, run: GeneratedRun, spec: FamilySpec) -> Path:
    """Write ``run`` (spec, labels, encoded records) atomically; returns the path."""
    path = _path(cache, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = msgpack.packb({"spec": asdict(spec), "clean": run.clean, "events": [asdict(e) for e in run.events],
                          "records": [encode(r) for r in run.records]}, use_bin_type=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)
    return path


def generate_families(specs: Iterable[FamilySpec], cache_dir: Path | None = None,
                      progress: Callable[[str], None] | None = None) -> list[GeneratedRun]:
    """Generate (or read from the cache) every spec, in order."""
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    runs = []
    for spec in specs:
        run = load_cached(cache, spec)
        if run is None:
            run = generate_family_run(spec)
            store(cache, run, spec)
        if progress is not None:
            progress(f"{spec.name}: {run.steps} records, {len(run.events)} events"
                     + (f", generated in {run.seconds:.1f} s" if run.seconds else " (cached)"))
        runs.append(run)
    return runs
