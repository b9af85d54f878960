"""Auto-attach registry: run a framework adapter when its framework is imported (or at once if it already is).

Auto mode (``import stability.auto``) calls :func:`install` with its capture. For every framework in
:data:`ADAPTERS` (module name -> ``"<adapter module>:<function>"``) the adapter function
``auto_attach(module, capture) -> undo`` runs right after that module is first imported, or immediately when it is
already in ``sys.modules``; it patches the framework's entry point (``deepspeed.initialize``,
``transformers.Trainer.__init__``, ...) and returns a callable that removes the patch. :func:`uninstall` runs every
undo and removes the import hook. Adapter modules are imported only when their framework is, so
``import stability.auto`` stays light; an adapter module that does not exist (yet) is skipped with a debug log.

The post-import hook is one ``sys.meta_path`` finder placed first: for a watched module name it asks the other
finders for the spec and wraps the loader's ``exec_module`` so the hooks run after the module's code. It never
changes what is imported, and it is removed by :func:`uninstall`. Lower-level: :func:`when_imported`.

Nothing here may break the training script: hook and adapter failures are logged and swallowed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["ADAPTERS", "install", "installed", "uninstall", "when_imported"]

logger = logging.getLogger(__name__)

Hook = Callable[[ModuleType], None]
Undo = Callable[[], None]

ADAPTERS: dict[str, str] = {
    "deepspeed": "stability.hooks.deepspeed:auto_attach",
    "transformers.trainer": "stability.hooks.hf:auto_attach",
    "lightning.pytorch": "stability.hooks.lightning:auto_attach",
    "pytorch_lightning": "stability.hooks.lightning:auto_attach",
    "megatron.core": "stability.hooks.megatron:auto_attach",
}
"""Framework module -> adapter ``auto_attach(module, capture) -> undo``; adapters are free to add entries."""

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}
_undo: list[Undo] = []
_finder: _PostImportFinder | None = None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so registered hooks run right after the module executes."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        spec = None
        try:  # the spec the rest of the import system would find, in its order
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.name = None
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(loader, fullname)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module sees its real loader (pkgutil, importlib.resources)
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_hooks(self._name, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run_hooks(name: str, module: ModuleType) -> None:
    with _lock:
        hooks = list(_hooks.get(name, ()))
    for hook in hooks:
        try:
            hook(module)
        except Exception:
            logger.exception("stability: post-import hook for %s failed (ignored)", name)


def when_imported(name: str, hook: Hook) -> Undo:
    """Call ``hook(module)`` once module ``name`` is imported (now, if it already is).

    Returns:
        A callable that unregisters the hook (a hook that already ran is not undone).
    """
    global _finder
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None:
        _run_hooks_once(name, module, hook)

    def unregister() -> None:
        with _lock:
            hooks = _hooks.get(name, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                _hooks.pop(name, None)
            _drop_finder_if_idle()

    return unregister


def _run_hooks_once(name: str, module: ModuleType, hook: Hook) -> None:
    try:
        hook(module)
    except Exception:
        logger.exception("stability: post-import hook for %s failed (ignored)", name)


def _drop_finder_if_idle() -> None:
    global _finder
    if not _hooks and _finder is not None:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


def _adapter(target: str) -> Callable[[ModuleType, Any], Undo | None] | None:
    module_name, _, function = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            logger.debug("stability: adapter %s not available", module_name)
            return None
        raise
    found: Callable[[ModuleType, Any], Undo | None] = getattr(module, function)
    return found


def install(capture: Any, adapters: dict[str, str] | None = None) -> None:
    """Auto-attach ``capture`` to every framework of ``adapters`` (default :data:`ADAPTERS`) when it is imported.

    Called by auto mode. Idempotent per process: a second call first uninstalls the first one.
    """
    uninstall()
    for name, target in (ADAPTERS if adapters is None else adapters).items():

        def hook(module: ModuleType, target: str = target) -> None:
            attach = _adapter(target)
            if attach is None:
                return
            undo = attach(module, capture)
            if undo is not None:
                with _lock:
                    _undo.append(undo)

        unregister = when_imported(name, hook)
        with _lock:
            _undo.append(unregister)


def uninstall() -> None:
    """Undo :func:`install`: remove the post-import hooks and every adapter patch (newest first)."""
    with _lock:
        undo, _undo[:] = list(_undo), []
    for fn in reversed(undo):
        try:
            fn()
        except Exception:
            logger.exception("stability: undoing an auto-attach patch failed (ignored)")


def installed() -> list[str]:
    """Module names with a pending post-import hook (for tests and diagnostics)."""
    with _lock:
        return sorted(_hooks)
