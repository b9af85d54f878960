"""On-device statistics for the capture hooks: a few fused ops, no host-device synchronisation.

Every function here returns device tensors and never reads a value on the host (no ``.item()``, no ``float()``,
no ``if tensor``), so the hooks can call them on the training thread of a CUDA job without stalling it.

Counting non-finite gradient elements (``nonfinite_grads``) takes no extra pass on a normal step: a tensor's L2
norm is NaN/Inf iff the tensor holds a NaN/Inf element, so the global norm the capture computes anyway (from the
per-tensor norms of one fused ``torch._foreach_norm``) says *whether* any element is non-finite. Only when it says
so is the count made (:func:`nonfinite_count`, one fused extra pass; the count is 0 exactly otherwise).
Deciding needs the flag on the host: on the CPU the values are already there (reading them waits for nothing), so
the count runs only on flagged steps (:func:`host_reads_free`). On an accelerator reading it would be a
host-device sync, so there the count runs on every step (a memory-bound pass, small next to a step on a GPU).

:func:`nonfinite_count` multiplies by zero with ``torch._foreach_*`` (``g * 0`` is 0 for finite elements and NaN
for NaN/Inf) and takes the L0 "norm" (number of non-zero elements, NaN counts as non-zero) of the product, in
chunks of at most :data:`COUNT_CHUNK_ELEMENTS` elements so the temporary memory is bounded. Measured on the CPU
(torch 2.13, 1 thread, the 53 gradient tensors / 3.7M elements of the 4-layer d=256 model of
``bench/bench_overhead.py``, whose step takes ~280 ms): ``_foreach_norm`` 0.37 ms; this count 2.8-2.9 ms (~1 % of
the step: most of the capture's per-step cost before the count became conditional); a per-tensor
``(~isfinite(g)).sum()`` loop 6.9 ms; ``isnan(g).sum()`` alone 2.8 ms and it misses Inf.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "COUNT_CHUNK_ELEMENTS",
    "ActStat",
    "activation_stats",
    "activation_summary",
    "adam_lag",
    "first_float_tensor",
    "host_reads_free",
    "is_sharded",
    "local_shards",
    "logit_z",
    "logits_of",
    "nonfinite_count",
    "nonfinite_given_norm",
    "segment_sum",
    "tensor_norms",
    "tensor_sums",
    "to_device",
]

COUNT_CHUNK_ELEMENTS = 1 << 26
"""At most this many gradient elements are multiplied at once by :func:`nonfinite_count` (bounded temp memory)."""
_FLOAT32_EXACT = 1 << 24
"""Counts up to this are exact in float32; chunks with a larger tensor count in float64 (30% slower on the CPU)."""


CPU_READS_FREE = True
"""Whether :func:`host_reads_free` says yes for the CPU (the tests' host-read trap turns it off to run the
accelerator code paths on the CPU)."""


def host_reads_free(device: torch.device) -> bool:
    """True when reading a value of a tensor on ``device`` on the host waits for nothing (the CPU)."""
    return device.type == "cpu" and CPU_READS_FREE


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """``torch._foreach_norm(tensors, ord, dtype=dtype)``, also for tensors wider than ``dtype`` (a float64 model
    under a float32 result: torch refuses the narrowing, so those are normed in their own dtype and cast) and for
    sparse tensors (the gradients of ``nn.Embedding(sparse=True)``: normed over their coalesced values, as
    ``SparseAdam`` coalesces them too; the foreach kernels refuse sparse tensors)."""
    odd = [i for i, t in enumerate(tensors) if t.dtype.itemsize > dtype.itemsize or t.is_sparse]
    if not odd:
        return list(torch._foreach_norm(tensors, ord, dtype=dtype))  # type: ignore[misc,arg-type]
    tensors = [_strided(t) for t in tensors]
    wide = [i for i in odd if tensors[i].dtype.itemsize > dtype.itemsize]
    narrow = [i for i, t in enumerate(tensors) if t.dtype.itemsize <= dtype.itemsize]
    norms: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    if wide:
        for i, n in zip(wide, torch._foreach_norm([tensors[i] for i in wide], ord), strict=True):  # type: ignore[misc]
            norms[i] = n.to(dtype)
    if narrow:
        values = torch._foreach_norm([tensors[i] for i in narrow], ord, dtype=dtype)  # type: ignore[misc,arg-type]
        for i, n in zip(narrow, values, strict=True):
            norms[i] = n
    return norms


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's coalesced values (same norms, same non-finite elements), else the tensor itself."""
    return t.coalesce().values() if t.is_sparse else t


def tensor_norms(tensors: Sequence[torch.Tensor | None], out: torch.device, ord: float = 2.0) -> torch.Tensor:
    """Per-tensor norms as one float32 vector on ``out``; a missing tensor (None) gets 0.

    Args:
        tensors: the tensors (for example gradients, some of which may be None).
        out: device of the result.
        ord: the norm order (2: L2; 1: sum of absolute values).

    Returns:
        A float32 vector of ``len(tensors)`` norms.
    """
    if tensors and all(t is not None and t.device == out for t in tensors):  # the usual case: one fused pass
        return torch.stack(foreach_norm(tensors, ord, torch.float32))  # type: ignore[arg-type]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            by_device.setdefault(t.device, []).append(i)
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for device, idx in by_device.items():
        values = foreach_norm([tensors[i] for i in idx], ord, torch.float32)  # type: ignore[misc]
        for i, v in zip(idx, values, strict=True):
            norms[i] = v if device == out else v.to(out, non_blocking=True)
    if not norms:
        return torch.zeros(0, dtype=torch.float32, device=out)
    zero = torch.zeros((), dtype=torch.float32, device=out)
    return torch.stack([zero if n is None else n for n in norms])


def tensor_sums(tensors: Sequence[torch.Tensor | None], out: torch.device) -> torch.Tensor:
    """Per-tensor sums as one float32 vector on ``out`` (0 for None): the L1 norms of non-negative tensors (Adam's
    ``exp_avg_sq``) without the ``|x|`` that ``_foreach_norm(ord=1)`` computes (measured 2-5x slower on the CPU)."""
    zero = torch.zeros((), dtype=torch.float32, device=out)
    sums = [zero if t is None else t.sum(dtype=torch.float32).to(out, non_blocking=True) for t in tensors]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float32, device=out)


def nonfinite_count(tensors: Sequence[torch.Tensor | None], out: torch.device) -> torch.Tensor:
    """Number of NaN/Inf elements over all ``tensors`` as a 0-d int64 tensor on ``out`` (no sync).

    See the module docstring for why every tensor is counted and what it costs.
    """
    total = torch.zeros((), dtype=torch.int64, device=out)
    chunk: list[torch.Tensor] = []
    size = 0
    present = [t for t in tensors if t is not None]
    for i, t in enumerate(present):
        chunk.append(t)
        size += t.numel()
        if size >= COUNT_CHUNK_ELEMENTS or i == len(present) - 1:
            total = total + _count_chunk(chunk, out)
            chunk, size = [], 0
    return total


def nonfinite_given_norm(tensors: Sequence[torch.Tensor | None], total_norm: torch.Tensor,
                         out: torch.device) -> torch.Tensor:
    """``nonfinite_grads`` as a 1-element int64 tensor on ``out``, given the L2 norm over all ``tensors``.

    Where host reads are free (the CPU) and the norm is finite, every element is finite: 0, with no pass over the
    tensors. Otherwise the elements are counted (:func:`nonfinite_count`). Exact either way.
    """
    if host_reads_free(total_norm.device) and bool(torch.isfinite(total_norm)):
        return torch.zeros(1, dtype=torch.int64, device=out)
    return nonfinite_count(tensors, out).reshape(1)


def _count_chunk(chunk: list[torch.Tensor], out: torch.device) -> torch.Tensor:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in chunk:
        by_device.setdefault(t.device, []).append(_strided(t))
    parts = []
    for device, tensors in by_device.items():
        zeros = torch._foreach_mul(tensors, 0.0)  # 0 where finite, NaN where NaN/Inf
        big = device.type != "mps" and any(t.numel() > _FLOAT32_EXACT for t in tensors)
        counts = foreach_norm(zeros, 0, torch.float64 if big else torch.float32)
        parts.append(torch.stack(counts).sum().to(out, dtype=torch.int64, non_blocking=True))
    return torch.stack(parts).sum()


def adam_lag(grads: Sequence[torch.Tensor | None] | None, exp_avg_sqs: Sequence[torch.Tensor | None],
             beta2: Sequence[float], steps: Sequence[torch.Tensor | float | None], index: torch.Tensor,
             segments: int, out: torch.device, *, grad_norms: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment (module): ``sum(g^2)`` and ``sum(v_hat_prev)``, Adam's bias-corrected second moment *before*
    this step, from the state after it (``v_t = beta2 * v_prev + (1 - beta2) * g^2``, so
    ``v_prev = (v_t - (1 - beta2) * g^2) / beta2``, divided by ``1 - beta2 ** (t - 1)``).

    Their ratio is how many times the squared gradient exceeds what Adam expected (about 1 when steady, large when
    ``v`` lags a gradient that grew: the update is then ``~ g / sqrt(v)``, too big). Unlike ``g^2 / v_t``, which
    is at most ``1 / (1 - beta2)``, it does not saturate. Parameters without a state, or at their first step, add
    nothing. ``steps`` may be device tensors (capturable / fused Adam): they are used on the device, not read.
    ``grad_norms``: the per-tensor L2 norms of the gradients, when already known (``grads`` is then not read).
    """
    if grad_norms is None:
        assert grads is not None
        grad_norms = tensor_norms(grads, out)
    g2 = grad_norms.square()
    v1 = tensor_sums(exp_avg_sqs, out)
    b2 = _constant(tuple(beta2), out)
    t = _step_counts(steps, out)
    prev = (v1 - (1.0 - b2) * g2).clamp_min(0.0) / b2 / (1.0 - b2.pow(t - 1.0)).clamp_min(1e-12)
    used = (t > 1.0) & (v1 > 0)
    zero = torch.zeros_like(g2)
    return (segment_sum(torch.where(used, g2, zero), index, segments),
            segment_sum(torch.where(used, prev, zero), index, segments))


def _step_counts(steps: Sequence[torch.Tensor | float | None], out: torch.device) -> torch.Tensor:
    """Adam's per-parameter step counts as one float32 vector on ``out``, never read on the host."""
    if steps and all(isinstance(s, torch.Tensor) for s in steps):
        # the usual case: one stack (Adam(W) keeps 0-d step tensors, on the CPU unless capturable / fused); torch
        # checks the devices and shapes (a mix raises, or stacks into more than one value per parameter)
        try:
            stacked = torch.stack(steps).to(torch.float32)  # type: ignore[arg-type]
        except RuntimeError:
            stacked = None
        if stacked is not None and stacked.dim() == 1:
            return to_device(stacked, out) if stacked.device.type == "cpu" else stacked.to(out, non_blocking=True)
    counts = [s.detach().reshape(()).to(torch.float32) if isinstance(s, torch.Tensor)
              else torch.tensor(0.0 if s is None else float(s)) for s in steps]
    if all(c.device.type == "cpu" for c in counts):  # CPU step tensors or numbers, stacked, never read
        return to_device(torch.stack(counts), out)
    return torch.stack([c.to(out, non_blocking=True) for c in counts])  # device step counts stay there


def _dtensor_type() -> type | None:
    """torch's ``DTensor`` class when its module is loaded (no DTensor can exist before), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor`` (FSDP2's ``fully_shard``, tensor parallelism) or an FSDP1 flat
    parameter (this rank's shard of several parameters)."""
    dtensor = _dtensor_type()
    return any(getattr(t, "_is_flat_param", False) for t in tensors) or (
        dtensor is not None and any(isinstance(t, dtensor) for t in tensors))


def local_shards(tensors: Sequence[Any]) -> list[Any]:
    """``tensors`` with every ``DTensor`` replaced by this rank's local shard (a plain tensor sharing its storage).

    Statistics of sharded parameters, gradients and optimizer states are then those of this rank's shard, and no
    collective runs in a hook (a ``DTensor`` reduction would all-reduce across ranks). ``_local_tensor`` is read
    directly: ``to_local()`` goes through an autograd function, ~10 us a tensor on every step."""
    dtensor = _dtensor_type()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return list(tensors)
    return [_local(t) if isinstance(t, dtensor) else t for t in tensors]


def _local(t: Any) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def to_device(host: torch.Tensor, out: torch.device) -> torch.Tensor:
    """A CPU tensor on ``out`` without a blocking copy (pinned + non-blocking on CUDA; PyTorch's caching host
    allocator keeps the pinned block until the copy has run)."""
    if out.type == "cuda":
        host = host.pin_memory()
    return host.to(out, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A float32 vector of ``values`` on ``device``, made once (Adam's betas, the element counts of a model's
    activations: the same every sampled step; only read, never written)."""
    return to_device(torch.tensor(values, dtype=torch.float32), device)


def segment_sum(values: torch.Tensor, index: torch.Tensor, segments: int) -> torch.Tensor:
    """Sum ``values[i]`` into ``result[index[i]]`` for ``segments`` segments (one fused ``index_add``)."""
    return torch.zeros(segments, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def first_float_tensor(output: object) -> torch.Tensor | None:
    """The module output's tensor to take activation statistics of, or None.

    A floating-point tensor is taken as is; for a tuple/list the first floating-point tensor element, for a
    mapping (or an object with a ``logits`` attribute, such as a HF ``ModelOutput``) the first floating-point tensor
    value. Integer and boolean tensors (masks, indices) and other types are skipped.
    """
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() and output.numel() > 0 else None
    items: Sequence[object]
    if isinstance(output, (tuple, list)):
        items = output
    elif isinstance(output, Mapping):
        items = list(output.values())
    else:
        return None
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel() > 0:
            return item
    return None


class ActStat(NamedTuple):
    """One forward call's activation statistics, still on the device (see :func:`activation_stats`)."""

    low: torch.Tensor
    """``min(x)``, 0-d, in ``x``'s dtype (NaN if ``x`` holds a NaN)."""
    high: torch.Tensor
    """``max(x)``, 0-d, in ``x``'s dtype (NaN if ``x`` holds a NaN)."""
    sum_sq: torch.Tensor
    """``sum(x**2)``, 0-d float32 (NaN/Inf if ``x`` holds one)."""
    numel: int


def activation_stats(x: torch.Tensor) -> ActStat:
    """``min``, ``max`` and ``sum(x**2)`` of an activation: exactly two kernels over ``x``, no temporary of its size
    and no arithmetic on the small results (that is batched for all modules by :func:`activation_summary`).

    ``aminmax`` is ~3x faster than ``x.abs().amax()`` on the CPU and propagates NaN; the sum of squares of a
    contiguous float32 tensor is one BLAS ``dot`` (measured ~1.4x faster than ``vector_norm`` on the CPU, and more
    accurate: BLAS accumulates in blocks); other dtypes and layouts use ``vector_norm`` accumulating in float32.
    Both passes read every element, so a NaN or Inf anywhere shows in ``act_absmax`` and ``act_rms`` exactly.
    """
    x = x.detach()
    low, high = torch.aminmax(x)
    numel = x.numel()
    if x.dtype is torch.float32 and not x.is_mps and numel < 1 << 31 and x.is_contiguous():
        flat = x.view(-1)
        sum_sq = torch.dot(flat, flat)
    else:
        wide = x.dtype.itemsize > 4  # float64: torch refuses a narrowing dtype
        sum_sq = torch.linalg.vector_norm(x, 2, dtype=None if wide else torch.float32).square().to(torch.float32)
    return ActStat(low, high, sum_sq, numel)


def activation_summary(calls: Sequence[Sequence[ActStat]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per module, from the :func:`activation_stats` of its forward calls this step: ``max |x|`` over the calls
    and the root of the mean of their ``mean(x**2)`` (two float32 vectors, one value per module; a handful of ops
    for all modules together)."""
    flat = [c for per_module in calls for c in per_module]
    if not flat:
        empty = torch.zeros(0, dtype=torch.float32)
        return empty, empty
    device = flat[0].sum_sq.device
    low = torch.stack([c.low.to(device=device, dtype=torch.float32) for c in flat])
    high = torch.stack([c.high.to(device=device, dtype=torch.float32) for c in flat])
    sum_sq = torch.stack([c.sum_sq.to(device) for c in flat])
    absmax = torch.maximum(high, low.neg())  # NaN propagates
    mean_sq = sum_sq / _constant(tuple(float(c.numel) for c in flat), device)
    if len(flat) == len(calls):  # one forward pass per step (the usual case)
        return absmax, mean_sq.sqrt()
    out_abs, out_sq, at = [], [], 0
    for per_module in calls:  # several forward calls of a module: max of the maxima, mean of the mean squares
        n = len(per_module)
        out_abs.append(absmax[at : at + n].amax())
        out_sq.append(mean_sq[at : at + n].mean())
        at += n
    return torch.stack(out_abs), torch.stack(out_sq).sqrt()


def logits_of(output: object) -> torch.Tensor | None:
    """The logits a model output exposes cleanly (a ``.logits`` tensor attribute or a ``"logits"`` key), else None.

    Nothing is guessed: a bare tensor output is not assumed to be logits.
    """
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.numel() > 0:
        return logits
    return None


def logit_z(logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``logsumexp`` over the last (vocabulary) dimension, float32, 0-d."""
    return torch.logsumexp(logits.detach().to(torch.float32), dim=-1).mean()
