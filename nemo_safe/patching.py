"""Lazy, reversible patches of third-party modules, whatever the import order.

A :class:`Patch` names the module it changes and a function that changes it and
returns an undo. :func:`enable` applies every registered patch to modules
already imported and installs a ``sys.meta_path`` finder that applies the rest
right after their module finishes executing, so ``import nemo_safe`` never
imports torch, lightning, nemo or torchvision itself. :func:`disable` undoes
everything. ``NEMO_SAFE_DISABLE=1`` keeps :func:`enable` from doing anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

DISABLE_ENV = "NEMO_SAFE_DISABLE"

Undo = Callable[[], None]


@dataclass(frozen=True)
class Patch:
    """``apply(module)`` changes ``module`` in place and returns a function undoing it,
    or None when it decided not to patch (for example an unknown upstream version).
    ``describe(module)`` says which case applies, for ``nemo-safe doctor``."""

    module: str
    name: str
    apply: Callable[[ModuleType], Undo | None]
    describe: Callable[[ModuleType], str] | None = None


_CURRENT = object()


class Replacements:
    """The attribute and mapping-item replacements one patch makes, so that its undo is one call.

    ``original`` is what undo restores when it differs from the current value (a class
    attribute inherited or a module that already bound the patched function).
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: object, name: str, value: object, original: object = _CURRENT) -> None:
        previous = getattr(obj, name) if original is _CURRENT else original
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, previous))

    def set_item(self, mapping: dict[Any, Any], key: object, value: object) -> None:
        previous = mapping[key]
        mapping[key] = value
        self._undo.append(lambda: mapping.__setitem__(key, previous))

    def undo(self) -> None:
        """Restore everything, newest first."""
        while self._undo:
            self._undo.pop()()


_lock = threading.RLock()
_registry: list[Patch] = []
_applied: dict[str, Undo] = {}  # patch name -> undo
_finder: _PostImportFinder | None = None


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def register(patch: Patch) -> None:
    """Add a patch; applied now if patching is enabled and its module is already imported."""
    with _lock:
        if any(p.name == patch.name for p in _registry):
            return
        _registry.append(patch)
        if _finder is not None and patch.module in sys.modules:
            _apply(patch, sys.modules[patch.module])


def registered() -> list[Patch]:
    with _lock:
        return list(_registry)


def active() -> list[str]:
    """Names of the patches currently applied."""
    with _lock:
        return list(_applied)


def is_enabled() -> bool:
    return _finder is not None


def _apply(patch: Patch, module: ModuleType) -> None:
    if patch.name in _applied:
        return
    try:
        undo = patch.apply(module)
    except Exception:  # a broken patch must never break the user's import
        log.exception("nemo_safe: patch %s could not be applied; leaving %s unchanged", patch.name, patch.module)
        return
    if undo is not None:
        _applied[patch.name] = undo
        log.debug("nemo_safe: applied %s to %s", patch.name, patch.module)


def _on_import(module: ModuleType) -> None:
    with _lock:
        if _finder is None:
            return
        for patch in _registry:
            if patch.module == module.__name__:
                _apply(patch, module)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then applies the patches of the module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _on_import(module)

    def __getattr__(self, name: str) -> object:  # get_source, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds watched modules through the other finders and wraps their loaders."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if getattr(self._busy, "active", False):
            return None
        with _lock:
            watched = any(p.module == fullname for p in _registry)
        if not watched:
            return None
        self._busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def enable() -> bool:
    """Apply all patches now and on future imports. Idempotent. False when disabled by env."""
    global _finder
    if disabled_by_env():
        log.info("nemo_safe: %s is set; no library is patched", DISABLE_ENV)
        return False
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
        for patch in _registry:
            module = sys.modules.get(patch.module)
            if module is not None:
                _apply(patch, module)
    return True


def disable() -> None:
    """Undo every applied patch (newest first) and stop patching future imports."""
    global _finder
    with _lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        for name in reversed(list(_applied)):
            undo = _applied.pop(name)
            undo()
