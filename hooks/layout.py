"""Which parameters the capture measures and which module each belongs to.

Per-module signals are named ``<quantity>/<module path>``, the module path being the name ``named_modules()``
gives the module that *directly* owns the parameters (``transformer.h.0.attn.c_attn``). Parameters owned by the
root module itself are grouped under ``root``. With several root modules (two models trained by one optimizer)
paths are prefixed ``root0.``, ``root1.``, ...; parameters the optimizer holds that are in no root go to
``_other``. A parameter shared by two modules (tied embeddings) belongs to the first one in module order.
Wrappers' attributes (``torch.compile``'s ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``,
``_checkpoint_wrapped_module``) are dropped from the paths unless two modules would then share one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from stability.hooks.stats import is_sharded, local_shards, to_device

__all__ = ["OTHER", "ROOT", "ParamLayout", "build_layout", "optimizer_params"]

ROOT = "root"
"""Module path used for parameters owned directly by the (single) root module."""
OTHER = "_other"
"""Module path used for parameters the optimizer holds that belong to no known module."""


@dataclass(eq=False)
class ParamLayout:
    """The measured parameters in a fixed order, grouped into modules."""

    params: list[torch.Tensor]
    owners: list[int]
    """Index into :attr:`modules` of each parameter."""
    modules: list[str]
    """Module paths, one per group."""
    module_objects: list[torch.nn.Module | None]
    """The module of each group (None for ``_other``)."""
    sharded: bool = False
    """Some parameters are ``DTensor`` shards (FSDP2, tensor parallelism) or FSDP1 holds the model: their statistics
    are this rank's shard's (:func:`~stability.hooks.stats.local_shards`)."""
    _index: dict[tuple[torch.device, int], torch.Tensor] = field(default_factory=dict)
    _names: dict[str, list[str]] = field(default_factory=dict)
    _bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of all measured parameters (what a snapshot for update ratios costs), summed once: asked on every
        sampled step, and the parameters of a layout keep their sizes (a snapshot buffer of another shape is
        remade anyway)."""
        if self._bytes is None:
            self._bytes = sum(p.numel() * p.element_size() for p in self.params)
        return self._bytes

    def local_params(self) -> list[torch.Tensor]:
        """:attr:`params`, each ``DTensor`` as this rank's local shard (read each time: FSDP may re-create it)."""
        return self.params if not self.sharded else local_shards(self.params)

    def index(self, device: torch.device, *, repeat: int = 1) -> torch.Tensor:
        """The owner index as an int64 tensor on ``device``, made once (pinned + non-blocking copy on CUDA).

        ``repeat=k``: the index of ``k`` concatenated per-parameter vectors into ``k`` concatenated module vectors
        (copy ``j`` of parameter ``i`` goes to ``j * len(modules) + owners[i]``), for one segment sum over several
        per-parameter statistics."""
        cached = self._index.get((device, repeat))
        if cached is None:
            owners = [j * len(self.modules) + o for j in range(repeat) for o in self.owners]
            cached = self._index[(device, repeat)] = to_device(torch.tensor(owners, dtype=torch.int64), device)
        return cached

    def names(self, quantity: str) -> list[str]:
        """``["<quantity>/<module path>", ...]`` in module order (cached)."""
        names = self._names.get(quantity)
        if names is None:
            names = [f"{quantity}/{m}" for m in self.modules]
            self._names[quantity] = names
        return names

    def activation_modules(self, limit: int) -> list[tuple[str, torch.nn.Module]]:
        """Up to ``limit`` parameter-owning modules, evenly spread over the module order (first and last kept)."""
        found = [(n, m) for n, m in zip(self.modules, self.module_objects, strict=True) if m is not None]
        if limit <= 0 or not found:
            return []
        if len(found) <= limit:
            return found
        if limit == 1:
            return [found[-1]]
        picks = sorted({round(i * (len(found) - 1) / (limit - 1)) for i in range(limit)})
        return [found[i] for i in picks]


def optimizer_params(*optimizers: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizers hold, in optimizer and param-group order, without duplicates."""
    seen: set[int] = set()
    params = []
    for group in (g for optimizer in optimizers for g in optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def build_layout(roots: Sequence[torch.nn.Module], params: Iterable[torch.Tensor] | None) -> ParamLayout:
    """Group ``params`` (default: all parameters of ``roots``) by the module of ``roots`` that owns them.

    Args:
        roots: the model(s); may be empty (then everything is ``_other``).
        params: the parameters to measure, usually the optimizer's; None measures every parameter of ``roots``.

    Returns:
        The layout.
    """
    wanted = None if params is None else list(params)
    wanted_ids = None if wanted is None else {id(p) for p in wanted}
    layout = ParamLayout(params=[], owners=[], modules=[], module_objects=[])
    placed: set[int] = set()
    for r, root in enumerate(roots):
        prefix = f"root{r}" if len(roots) > 1 else ""
        for name, module in root.named_modules():
            short = _without_wrappers(name)
            if short != name and (".".join(x for x in (prefix, short) if x) or ROOT) not in layout.modules:
                name = short
            own = [
                p
                for p in module.parameters(recurse=False)
                if id(p) not in placed and (wanted_ids is None or id(p) in wanted_ids)
            ]
            if not own:
                continue
            path = ".".join(x for x in (prefix, name) if x) or ROOT
            _add_group(layout, path, module, own, placed)
    rest = [p for p in (wanted or []) if id(p) not in placed]
    if rest:
        _add_group(layout, OTHER, None, rest, placed)
    layout.sharded = _fsdp1(roots) or is_sharded(layout.params)
    return layout


WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""Attributes under which wrappers hold the module they wrap (``torch.compile``, FSDP1's ``FullyShardedDataParallel``,
activation checkpointing's ``CheckpointWrapper``): module paths drop them, so a wrapped model keeps the names the user
knows (``_fsdp_wrapped_module.h.0._fsdp_wrapped_module.attn`` -> ``h.0.attn``)."""


def _without_wrappers(name: str) -> str:
    """``name`` without the :data:`WRAPPERS` components (``""`` for the wrapped root itself)."""
    if not any(w in name for w in WRAPPERS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _fsdp1(roots: Sequence[torch.nn.Module]) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) wraps part of ``roots``: each rank then holds a shard of every
    flat parameter (the original parameters are views of it, empty where another rank holds them)."""
    return any(type(m).__name__ == "FullyShardedDataParallel" for root in roots for m in root.modules())


def _add_group(
    layout: ParamLayout, path: str, module: torch.nn.Module | None, params: list[torch.Tensor], placed: set[int]
) -> None:
    group = len(layout.modules)
    layout.modules.append(path)
    layout.module_objects.append(module)
    for p in params:
        placed.add(id(p))
        layout.params.append(p)
        layout.owners.append(group)
