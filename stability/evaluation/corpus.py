"""Corpus (a): small models trained on the CPU with injected faults, captured through the real hooks, labelled.

Each :class:`RunSpec` describes one training run (model, schedule, seed, fault). :func:`generate_run` trains it
with a :class:`~stability.hooks.capture.Capture` attached (records go to a :class:`~stability.testing.ListSink`)
and derives the labels (:class:`Event`: kind, true cause, onset, end, precursor start, faulty rank) from the
injection and the *defining signal* of the event (loss, loss scale, non-finite loss), never from a detector.
Runs are cached on disk as msgpack (records via :func:`stability.records.encode`), keyed by a hash of the spec.

Faults (``RunSpec.fault``):

==================  ============================================================================  =================
fault               injection                                                                     event / cause
==================  ============================================================================  =================
``clean``           none (seeds, schedules, fp16 emulation, several DP ranks vary)                —
``bad_batch``       ``duration`` batches of uniformly random tokens at ``fault_step``            loss_spike (or
                                                                                                  bad_batch when
                                                                                                  it reverts at
                                                                                                  once) /
                                                                                                  bad_batch
``lr_spike``        LR x ``magnitude`` for ``duration`` steps                                     loss_spike /
                                                                                                  lr_too_high
``lr_ramp``         LR x ``magnitude ** (t - fault_step)`` from ``fault_step``                    divergence /
                                                                                                  lr_too_high
``short_warmup``    a warm-up of ``duration`` steps (0 or 1: none) to a peak LR of ``magnitude``  loss_spike or
                                                                                                  divergence /
                                                                                                  warmup_too_short
``attn_growth``     no QK-norm; from ``fault_step`` the LR of the attention input projections        divergence /
                    (a second param group, so the logged ``lr`` is unchanged) grows by           attention_logit_
                    ``magnitude`` per step (at most 1000x): the attention logits grow            growth
``fp16_overflow``   GradScaler with fp16-emulated gradients; the embedding gradient grows by      loss_scale_
                    ``magnitude`` per step for ``duration`` steps, so steps overflow and are      collapse /
                    skipped and the scale backs off                                              fp16_loss_scale
``nan_data``        a NaN in one sample's input embeddings at ``fault_step``; ``duration`` > 0:   nan /
                    the loop skips non-finite steps (one-step event), else the weights go NaN     numerical_nan
                    and the job stops ``5`` steps later
``vanishing``       deep tanh MLP without residuals, weights initialised with std ``magnitude``   grad_vanishing /
                                                                                                  vanishing_
                                                                                                  gradients
``dp_rank``         ``ranks`` data-parallel replicas (gloo DDP processes, or simulated in one     cross_rank /
                    process); after the all-reduce, rank ``faulty_rank``'s gradients are         hardware_fault
                    multiplied by ``magnitude`` for ``duration`` steps
==================  ============================================================================  =================

Data-parallel runs come two ways. ``ddp=True``: real ``torch.distributed`` gloo processes with
``DistributedDataParallel`` and one auto-attached capture per process (:mod:`stability.evaluation.ddp`; about
15 s for 4 ranks x 200 steps). ``ddp=False``: replicas simulated in one process, gradients averaged by hand (the
post-reduce gradients are identical to DDP's, measured); their losses are passed to :meth:`Capture.observe`
because ``backward()`` of one replica would be reported to the captures of all replicas in the process, and they
are not clipped with the patched ``clip_grad_norm_`` for the same reason. Every other run uses the plain capture
path (patched ``backward``, ``clip_grad_norm_``, GradScaler).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from stability.config import WatchConfig
from stability.evaluation.model import DeepMLP, MarkovData, TinyGPT, next_token_loss
from stability.hooks.capture import Capture
from stability.records import StepRecord, decode, encode
from stability.testing import ListSink

if TYPE_CHECKING:
    from stability.evaluation.families import FamilySpec

__all__ = [
    "FAULTS",
    "GENERATOR_VERSION",
    "Event",
    "GeneratedRun",
    "RunSpec",
    "ci_specs",
    "default_cache_dir",
    "full_specs",
    "generate",
    "generate_run",
]

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 4
"""Bump when the generator changes what a spec produces (invalidates the cache)."""

FAULTS = ("clean", "bad_batch", "lr_spike", "lr_ramp", "short_warmup", "attn_growth", "fp16_overflow",
          "nan_data", "vanishing", "dp_rank")

SPIKE_FACTOR = 1.5
"""Labelling rule: a loss at least this many times the pre-fault median is part of the event."""
RECOVERED_FACTOR = 1.2
"""Labelling rule: the event ends when the loss is back under this many times the pre-fault median."""
MAX_RECOVERY = 60
"""Labelled events last at most this many steps after the injection ends (unless they diverge)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """One generated run."""

    name: str
    fault: str = "clean"
    seed: int = 0
    steps: int = 260
    fault_step: int = 180
    duration: int = 1
    magnitude: float = 0.0
    lr: float = 3e-3
    warmup: int = 30
    schedule: str = "cosine"
    """``cosine`` (to 10%), ``constant``, ``linear`` (to 10%) or ``step`` (x0.3 at 60% of the steps)."""
    fp16: bool = False
    """GradScaler with fp16-emulated gradients (healthy back-offs happen in clean runs too)."""
    ranks: int = 1
    faulty_rank: int = 0
    stats_every: int = 10
    ddp: bool = False
    """With ``ranks > 1``: real gloo ``DistributedDataParallel`` processes (:mod:`stability.evaluation.ddp`)
    instead of replicas simulated in one process."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; choose one of {', '.join(FAULTS)}")

    def key(self) -> str:
        """Cache key: a hash of the spec and the generator version (``ddp`` only when set, so adding the field
        kept the keys of existing specs)."""
        fields = asdict(self)
        if not self.ddp:
            del fields["ddp"]
        blob = json.dumps({"v": GENERATOR_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A labelled event: ``[precursor_start, onset, end]`` in steps, its kind, true cause and faulty rank."""

    kind: str
    cause: str | None
    onset: int
    end: int
    precursor_start: int
    rank: int | None = None
    """The faulty rank of a cross-rank event (None: not rank-specific)."""
    rise: int | None = None
    """Slow divergences (families corpus): the step the loss first rose sustainedly (``onset`` is when it reached
    1.5x); the divergence target is measured from here."""
    info_ok: bool = False
    """An INFO finding detects it: a one-step batch outlier that reverts must not be alerted as an instability of
    the run (issue #4), but should be reported as ``bad_batch`` info."""
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratedRun:
    """The records of one run (all ranks) and its labels; ``clean`` runs have no events."""

    name: str
    records: list[StepRecord]
    events: list[Event] = field(default_factory=list)
    clean: bool = False
    source: str = "synthetic"
    seconds: float = 0.0
    """Generation time (0 when read from the cache)."""
    spec: RunSpec | FamilySpec | None = None

    @property
    def steps(self) -> int:
        """Number of records over all ranks."""
        return len(self.records)


# ------------------------------------------------------------------------------------------------ corpora
def ci_specs() -> list[RunSpec]:
    """The reduced corpus (CI regression test, 18 runs): one or two runs per fault plus varied clean runs.

    """
    return [
        RunSpec(name="clean-cosine-s0", seed=0),
        RunSpec(name="clean-constant-s1", seed=1, schedule="constant", lr=2e-3),
        RunSpec(name="clean-step-s2", seed=2, schedule="step"),
        RunSpec(name="clean-fp16-s3", seed=3, fp16=True),
        RunSpec(name="clean-dp4-s4", seed=4, ranks=4, steps=200),
        RunSpec(name="bad-batch-s0", fault="bad_batch", seed=0),
        RunSpec(name="bad-batch-s5", fault="bad_batch", seed=5, fault_step=150, schedule="linear"),
        RunSpec(name="lr-spike-s0", fault="lr_spike", seed=0, magnitude=150.0, duration=3),
        RunSpec(name="lr-spike-s6", fault="lr_spike", seed=6, magnitude=300.0, duration=2, fault_step=140),
        RunSpec(name="lr-ramp-s0", fault="lr_ramp", seed=0, magnitude=1.1, fault_step=150),
        RunSpec(name="attn-growth-s0", fault="attn_growth", seed=0, magnitude=1.15, fault_step=150, steps=230),
        RunSpec(name="fp16-overflow-s0", fault="fp16_overflow", seed=0, fp16=True, magnitude=4.0, duration=12),
        RunSpec(name="nan-crash-s0", fault="nan_data", seed=0, duration=0),
        RunSpec(name="nan-skip-s7", fault="nan_data", seed=7, duration=1, fault_step=120),
        RunSpec(name="vanishing-s0", fault="vanishing", seed=0, magnitude=0.02, lr=0.1, steps=150),
        RunSpec(name="short-warmup-s0", fault="short_warmup", seed=0, magnitude=0.2, duration=0, steps=120),
        RunSpec(name="dp-rank-s0", fault="dp_rank", seed=0, ranks=4, faulty_rank=2, magnitude=1000.0,
                duration=2, steps=200, fault_step=140),
        RunSpec(name="dp-rank-ddp-s1", fault="dp_rank", seed=1, ranks=4, faulty_rank=3, magnitude=300.0,
                duration=2, steps=200, fault_step=150, ddp=True),
    ]


def full_specs(seeds: Sequence[int] = (0, 1, 2, 3, 4)) -> list[RunSpec]:
    """The benchmark corpus: every fault with several seeds and variants, and more clean runs."""
    schedules = ("cosine", "constant", "linear", "step")
    out: list[RunSpec] = []
    for s in seeds:
        sched = schedules[s % len(schedules)]
        step = 150 + 20 * (s % 4)
        out += [
            RunSpec(name=f"clean-{sched}-s{s}", seed=s, schedule=sched, steps=400, lr=(3e-3, 2e-3)[s % 2]),
            RunSpec(name=f"clean-fp16-s{s}", seed=s, fp16=True, schedule=sched, steps=300),
            RunSpec(name=f"clean-dp4-s{s}", seed=s, ranks=4, steps=200, schedule=sched),
            RunSpec(name=f"bad-batch-s{s}", fault="bad_batch", seed=s, fault_step=step, schedule=sched),
            RunSpec(name=f"bad-batch2-s{s}", fault="bad_batch", seed=s, fault_step=step + 40, duration=2),
            RunSpec(name=f"lr-spike-s{s}", fault="lr_spike", seed=s, fault_step=step, schedule=sched,
                    magnitude=(150.0, 300.0, 1000.0)[s % 3], duration=(3, 2, 1)[s % 3]),
            RunSpec(name=f"lr-ramp-s{s}", fault="lr_ramp", seed=s, fault_step=step, magnitude=(1.1, 1.08)[s % 2],
                    steps=step + 110),
            RunSpec(name=f"attn-growth-s{s}", fault="attn_growth", seed=s, fault_step=step,
                    magnitude=(1.15, 1.2)[s % 2], steps=step + 80),
            RunSpec(name=f"fp16-overflow-s{s}", fault="fp16_overflow", seed=s, fp16=True, fault_step=step,
                    magnitude=(4.0, 2.0)[s % 2], duration=12),
            RunSpec(name=f"nan-crash-s{s}", fault="nan_data", seed=s, fault_step=step, duration=0),
            RunSpec(name=f"nan-skip-s{s}", fault="nan_data", seed=s, fault_step=step, duration=1),
            RunSpec(name=f"short-warmup-s{s}", fault="short_warmup", seed=s, schedule=sched, steps=150,
                    magnitude=(0.2, 0.4, 0.3)[s % 3], duration=(0, 2)[s % 2]),
            RunSpec(name=f"vanishing-s{s}", fault="vanishing", seed=s, steps=150, lr=0.1,
                    magnitude=(0.02, 0.01)[s % 2]),
            RunSpec(name=f"dp-rank-s{s}", fault="dp_rank", seed=s, ranks=4, faulty_rank=(s % 3) + 1, steps=200,
                    fault_step=120 + 10 * (s % 5), magnitude=(1000.0, 100.0)[s % 2], duration=2),
            RunSpec(name=f"dp-rank-ddp-s{s}", fault="dp_rank", seed=s, ranks=4, faulty_rank=s % 4, steps=200,
                    fault_step=130 + 10 * (s % 5), magnitude=(300.0, 30.0)[s % 2], duration=(2, 1)[s % 2], ddp=True),
        ]
    return out


def default_cache_dir() -> Path:
    """``$STABILITY_EVAL_CACHE`` or ``~/.cache/stability/eval``."""
    env = os.environ.get("STABILITY_EVAL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "stability" / "eval"


def generate(specs: Iterable[RunSpec], cache_dir: Path | None = None,
             progress: Callable[[str], None] | None = None) -> list[GeneratedRun]:
    """Generate (or read from the cache) every spec, in order."""
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    runs = []
    for spec in specs:
        run = _load_cached(cache, spec)
        if run is None:
            run = generate_run(spec)
            _store(cache, run)
        if progress is not None:
            progress(f"{spec.name}: {run.steps} records, {len(run.events)} events"
                     + (f", generated in {run.seconds:.1f} s" if run.seconds else " (cached)"))
        runs.append(run)
    return runs


# ------------------------------------------------------------------------------------------------ cache
def _load_cached(cache: Path, spec: RunSpec) -> GeneratedRun | None:
    path = cache / f"{spec.name}-{spec.key()}.msgpack"
    if not path.exists():
        return None
    try:
        obj = msgpack.unpackb(path.read_bytes(), raw=False)
        events = [Event(**e) for e in obj["events"]]
        records = [decode(b) for b in obj["records"]]
    except Exception as exc:  # a truncated or stale file is regenerated
        logger.warning("evaluation cache %s unreadable (%s); regenerating", path, exc)
        return None
    return GeneratedRun(name=spec.name, records=records, events=events, clean=obj["clean"], spec=spec)


def _store(cache: Path, run: GeneratedRun) -> None:
    assert run.spec is not None
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{run.name}-{run.spec.key()}.msgpack"
    blob = msgpack.packb({"spec": asdict(run.spec), "clean": run.clean, "events": [asdict(e) for e in run.events],
                          "records": [encode(r) for r in run.records]}, use_bin_type=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ training
def _lr_at(spec: RunSpec, step: int) -> float:
    warmup = spec.duration if spec.fault == "short_warmup" else spec.warmup
    warm = 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)
    peak = spec.magnitude if spec.fault == "short_warmup" else spec.lr
    frac = step / max(1, spec.steps - 1)
    decay = {"cosine": 0.1 + 0.45 * (1 + math.cos(math.pi * frac)), "constant": 1.0, "linear": 1.0 - 0.9 * frac,
             "step": 1.0 if frac < 0.6 else 0.3}[spec.schedule]
    lr = peak * warm * decay
    if spec.fault == "lr_spike" and spec.fault_step <= step < spec.fault_step + spec.duration:
        lr *= spec.magnitude
    if spec.fault == "lr_ramp" and step >= spec.fault_step:
        lr *= spec.magnitude ** (step - spec.fault_step)
    return lr


def _emulate_fp16(params: Iterable[torch.Tensor]) -> None:
    """Round the (scaled) gradients through fp16, so values over 65504 overflow to inf as on a GPU."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.copy_(p.grad.to(torch.float16).to(torch.float32))


def generate_run(spec: RunSpec) -> GeneratedRun:
    """Train ``spec`` with the real capture attached and label it."""
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    if spec.ranks > 1 and spec.ddp:
        from stability.evaluation.ddp import train_ddp

        records = train_ddp(spec, _lr_at)
    else:
        records = _train_dp(spec) if spec.ranks > 1 else _train_single(spec)
    events = label(spec, records)
    return GeneratedRun(name=spec.name, records=records, events=events, clean=spec.fault == "clean", spec=spec,
                        seconds=time.perf_counter() - start)


def _config(spec: RunSpec) -> WatchConfig:
    return WatchConfig(run_id=f"eval-{spec.name}", stats_every=spec.stats_every, layer_every=1, max_act_modules=8,
                       timing=False)


def _train_single(spec: RunSpec) -> list[StepRecord]:
    data = MarkovData(seed=spec.seed)
    model: TinyGPT | DeepMLP
    opt: torch.optim.Optimizer
    if spec.fault == "vanishing":  # SGD: Adam would rescale the vanishing gradients away
        model = DeepMLP(init_std=spec.magnitude, layers=12)
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    else:
        model = TinyGPT()
        opt = _adamw(model, spec)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=40) if spec.fp16 else None
    sink = ListSink()
    capture = Capture(_config(spec), sink, rank=0).attach(model, opt)
    try:
        for step in range(spec.steps):
            if spec.fault == "nan_data" and spec.duration == 0 and step >= spec.fault_step + 5:
                break  # the job died after the NaN
            _train_step(spec, step, model, opt, scaler, data, capture)
    finally:
        capture.close()
    if capture.errors:
        logger.warning("run %s: %d capture errors", spec.name, capture.errors)
    return sorted(sink.records, key=lambda r: r.step)


def _adamw(model: TinyGPT, spec: RunSpec) -> torch.optim.Optimizer:
    """AdamW; for ``attn_growth`` the attention input projections are a second group (its LR is raised later)."""
    betas = (0.9, 0.999) if spec.fault == "short_warmup" else (0.9, 0.95)
    qkv = [p for name, p in model.named_parameters() if ".qkv." in name] if spec.fault == "attn_growth" else []
    ids = {id(p) for p in qkv}
    groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if id(p) not in ids]}]
    if qkv:
        groups.append({"params": qkv})
    return torch.optim.AdamW(groups, lr=spec.lr, weight_decay=0.01, betas=betas)


def _train_step(spec: RunSpec, step: int, model: TinyGPT | DeepMLP, opt: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler | None, data: MarkovData, capture: Capture) -> None:
    fault, in_fault = spec.fault, spec.fault_step <= step < spec.fault_step + max(1, spec.duration)
    for i, group in enumerate(opt.param_groups):  # group 1 (attn_growth): attention projections at a high LR
        boost = min(1000.0, spec.magnitude ** (step - spec.fault_step + 1)) if i == 1 and step >= spec.fault_step else 1
        group["lr"] = _lr_at(spec, step) * boost
    batch = data.bad_batch() if fault == "bad_batch" and in_fault else data.sample()
    capture.set_batch(f"{spec.name}:{step}")
    x = model.embed(batch[:, :-1])
    if fault == "nan_data" and step == spec.fault_step:
        x = x.clone()
        x[0, 3] = float("nan")
    if fault == "fp16_overflow" and in_fault:
        growth = spec.magnitude ** (step - spec.fault_step + 1) * 1e3
        x.register_hook(lambda g, growth=growth: g * growth)  # type: ignore[no-untyped-call]
    loss = next_token_loss(model(x), batch, capture.observe)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        _emulate_fp16(model.parameters())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return
    loss.backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if fault == "nan_data" and spec.duration > 0 and not bool(torch.isfinite(norm)):
        opt.zero_grad(set_to_none=True)  # the loop's own guard: skip the update of a non-finite step
    opt.step()


def _train_dp(spec: RunSpec) -> list[StepRecord]:
    replicas = []
    for r in range(spec.ranks):
        torch.manual_seed(spec.seed)  # identical initial weights on every rank, as DDP broadcasts them
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
        data = MarkovData(seed=spec.seed, stream=r)
        replicas.append((model, opt, data))
    sink = ListSink()
    captures = [Capture(_config(spec), sink, rank=r, coords={"dp": r, "world_size": spec.ranks}).attach(m, o)
                for r, (m, o, _) in enumerate(replicas)]
    try:
        for step in range(spec.steps):
            _dp_step(spec, step, replicas, captures)
    finally:
        for capture in captures:
            capture.close()
    return sorted(sink.records, key=lambda r: (r.step, r.rank))


def _dp_step(spec: RunSpec, step: int, replicas: Sequence[tuple[TinyGPT, torch.optim.Optimizer, MarkovData]],
             captures: list[Capture]) -> None:
    grads: list[list[torch.Tensor]] = []
    for (model, opt, data), capture in zip(replicas, captures, strict=True):
        for group in opt.param_groups:
            group["lr"] = _lr_at(spec, step)
        batch = data.sample()
        capture.set_batch(f"{spec.name}:{step}:r{len(grads)}")
        loss = next_token_loss(model(model.embed(batch[:, :-1])), batch, capture.observe)
        capture.observe("loss", loss.detach())
        grads.append(list(torch.autograd.grad(loss, list(model.parameters()))))
    mean = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]  # the all-reduce
    for r, (model, opt, _) in enumerate(replicas):
        faulty = (spec.fault == "dp_rank" and r == spec.faulty_rank
                  and spec.fault_step <= step < spec.fault_step + spec.duration)
        for i, (p, g) in enumerate(zip(model.parameters(), mean, strict=True)):
            p.grad = g.clone() * (spec.magnitude if faulty and i % 3 == 0 else 1.0)  # corrupted after the reduce
        opt.step()
        opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------ labels
def _loss_by_step(records: Sequence[StepRecord], rank: int = 0) -> dict[int, float]:
    return {r.step: r.get("loss") for r in records if r.rank == rank}


def _baseline(loss: dict[int, float], before: int, width: int = 20) -> float:
    vals = sorted(v for s, v in loss.items() if before - width <= s < before and math.isfinite(v))
    return vals[len(vals) // 2] if vals else math.nan


def _recovery(loss: dict[int, float], after: int, level: float, last: int) -> int:
    """Last step of the event: the step before the loss is back under ``level`` (at most MAX_RECOVERY steps)."""
    for s in range(after, min(last, after + MAX_RECOVERY) + 1):
        v = loss.get(s, math.nan)
        if math.isfinite(v) and v <= level:
            return max(after - 1, s - 1)
    return min(last, after + MAX_RECOVERY)


def label(spec: RunSpec, records: Sequence[StepRecord]) -> list[Event]:
    """Events of a run from its injection and defining signal; an injection without effect gives no event."""
    if spec.fault == "clean" or not records:
        return []
    last = max(r.step for r in records)
    if spec.fault == "vanishing":
        return [Event(kind="grad_vanishing", cause="vanishing_gradients", onset=0, end=last, precursor_start=0)]
    loss = _loss_by_step(records, spec.faulty_rank if spec.fault == "dp_rank" else 0)
    if spec.fault == "short_warmup":
        return _label_warmup(loss, last)
    if spec.fault_step > last:
        return []  # the run ended before the injection
    f0, f1 = spec.fault_step, spec.fault_step + max(1, spec.duration) - 1
    if spec.fault in ("bad_batch", "lr_spike"):
        return _label_spike(spec, loss, _baseline(loss, f0), last)
    if spec.fault in ("lr_ramp", "attn_growth"):
        cause = "lr_too_high" if spec.fault == "lr_ramp" else "attention_logit_growth"
        base = _baseline(loss, f0)
        onset = _first(loss, f0, last, lambda v: not math.isfinite(v) or v >= SPIKE_FACTOR * base)
        return [] if onset is None else [Event(kind="divergence", cause=cause, onset=onset, end=last,
                                               precursor_start=f0)]
    return label_tail("fp16" if spec.fault == "fp16_overflow" else spec.fault, records, loss, f0, f1, last,
                      one_step=bool(spec.duration), faulty_rank=spec.faulty_rank)


def label_tail(fault: str, records: Sequence[StepRecord], loss: dict[int, float], f0: int, f1: int, last: int, *,
               one_step: bool, faulty_rank: int, note: str = "") -> list[Event]:
    """Events of the faults both corpora label the same way: ``fp16`` (first skipped step in the injection),
    ``nan_data`` (first non-finite loss; ``one_step``: the loop skipped it) and ``dp_rank`` (the injection + 30)."""
    if fault == "fp16":
        onset = _first({r.step: r.get("skipped", 0.0) for r in records}, f0, f1, lambda v: v > 0)
        return [] if onset is None else [Event(kind="loss_scale_collapse", cause="fp16_loss_scale", onset=onset,
                                               end=f1, precursor_start=f0)]
    if fault == "nan_data":
        onset = _first(loss, f0, last, lambda v: not math.isfinite(v))
        return [] if onset is None else [Event(kind="nan", cause="numerical_nan", onset=onset,
                                               end=onset if one_step else last, precursor_start=onset)]
    assert fault == "dp_rank", fault
    return [Event(kind="cross_rank", cause="hardware_fault", onset=f0, end=min(last, f1 + 30), precursor_start=f0,
                  rank=faulty_rank, note=note)]


def _label_spike(spec: RunSpec, loss: dict[int, float], base: float, last: int) -> list[Event]:
    f0, f1 = spec.fault_step, spec.fault_step + max(1, spec.duration) - 1
    cause = "bad_batch" if spec.fault == "bad_batch" else "lr_too_high"
    onset = _first(loss, f0, f1 + 5, lambda v: not math.isfinite(v) or v >= SPIKE_FACTOR * base)
    if onset is None:
        return []
    end = _recovery(loss, max(onset, f1) + 1, RECOVERED_FACTOR * base, last)
    if spec.fault == "bad_batch" and end == onset:  # reverted at once: a batch outlier, not an instability
        return [Event(kind="bad_batch", cause=cause, onset=onset, end=end, precursor_start=f0, info_ok=True)]
    return [Event(kind="loss_spike", cause=cause, onset=onset, end=end, precursor_start=f0)]


def _first(series: dict[int, float], lo: int, hi: int, pred: Callable[[float], bool]) -> int | None:
    for s in range(lo, hi + 1):
        if s in series and pred(series[s]):
            return s
    return None


def _label_warmup(loss: dict[int, float], last: int) -> list[Event]:
    """Instability early in training: the first loss ``SPIKE_FACTOR`` x above its best so far (or non-finite);
    it ends when the loss is back under ``RECOVERED_FACTOR`` x that best, a divergence when that takes longer
    than ``MAX_RECOVERY`` steps. (With the same peak LR, a 40-step warm-up gives no such event: the counterfactual
    that makes the cause the warm-up.)"""
    best = math.inf
    for s in sorted(loss):  # steps without a loss record are unknown, not non-finite
        v = loss[s]
        if not math.isfinite(v) or v >= SPIKE_FACTOR * best:
            end = _recovery(loss, s + 1, RECOVERED_FACTOR * best, last)
            kind = "divergence" if end >= min(last, s + MAX_RECOVERY) else "loss_spike"
            return [Event(kind=kind, cause="warmup_too_short", onset=s, end=end, precursor_start=0)]
        best = min(best, v)
    return []


def replace_spec(spec: RunSpec, **changes: Any) -> RunSpec:
    """``dataclasses.replace`` for specs (used by benchmarks that sweep a parameter)."""
    return replace(spec, **changes)
