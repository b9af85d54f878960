"""TEST-ONLY: run megatron-core (CUDA-bound) on a CPU-only torch. Never imported by the product.

megatron-core 0.16 asks for CUDA in a few places (buffers created on ``torch.cuda.current_device()``,
``tensor.cuda()``, RNG trackers, ``torch.cuda.FloatTensor`` checks in the optimizer). :func:`cpu_shim` maps all of
them to the CPU for the duration of a ``with`` block:

* a :class:`~torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` / ``"cuda:N"`` / integer device arguments;
* ``Tensor.cuda()`` returns the tensor itself and ``Tensor.type()`` answers ``torch.cuda.*`` names for CPU tensors;
* ``torch.cuda.current_device/synchronize/get_rng_state/set_rng_state/manual_seed/is_available/device_count``
  have CPU stand-ins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _cpu_device(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
}


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Run megatron-core on the CPU inside the block; everything is restored on exit."""
    original_type = torch.Tensor.type

    def fake_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw:
            return _TYPE_NAMES.get(self.dtype, original_type(self))
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kw)

    def fake_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    fake_cuda_rng = torch.Generator()  # the "CUDA" RNG: its own state, so megatron's RNG forks stay consistent
    stand_ins: dict[str, Any] = {
        "current_device": lambda: 0,
        "synchronize": lambda *a, **k: None,
        "get_rng_state": lambda *a, **k: fake_cuda_rng.get_state(),
        "set_rng_state": lambda state, *a, **k: fake_cuda_rng.set_state(state),
        "manual_seed": lambda seed: fake_cuda_rng.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: fake_cuda_rng.manual_seed(int(seed)),
        "is_available": lambda: True,
        "device_count": lambda: 1,
    }
    saved_cuda = {name: getattr(torch.cuda, name) for name in stand_ins}
    saved_random = {name: getattr(torch.cuda.random, name) for name in ("get_rng_state", "set_rng_state")}
    saved_tensor = {"type": torch.Tensor.type, "cuda": torch.Tensor.cuda}
    try:
        for name, fn in stand_ins.items():
            setattr(torch.cuda, name, fn)
        for name in saved_random:
            setattr(torch.cuda.random, name, stand_ins[name])
        torch.Tensor.type = fake_type  # type: ignore[method-assign,assignment]
        torch.Tensor.cuda = fake_cuda  # type: ignore[method-assign,assignment]
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved_cuda.items():
            setattr(torch.cuda, name, fn)
        for name, fn in saved_random.items():
            setattr(torch.cuda.random, name, fn)
        torch.Tensor.type = saved_tensor["type"]  # type: ignore[method-assign]
        torch.Tensor.cuda = saved_tensor["cuda"]  # type: ignore[method-assign]
