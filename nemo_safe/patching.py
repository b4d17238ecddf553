"""Lazy, reversible patches of third-party modules, whatever the import order.

A :class:`Patch` names the module it changes and a function that changes it and
returns the :class:`Replacements` it made. :func:`enable` applies every
registered patch to modules already imported and installs a ``sys.meta_path``
finder that applies the rest right after their module finishes executing, so
``import nemo_safe`` never imports torch, lightning, nemo or torchvision itself.
:func:`disable` undoes everything. ``NEMO_SAFE_DISABLE=1`` keeps :func:`enable`
from doing anything.

A patch counts as applied only while its replacements are still in place in the
module object ``sys.modules`` holds: ``importlib.reload`` re-executes the module
and overwrites them. A reload goes through the finder (it looks the spec up in
``sys.meta_path``, also for a module imported before ``import nemo_safe``), which
re-applies the patch; any other re-execution is seen by :func:`active` and
repaired by :func:`enable`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from nemo_safe.wait_lines import say

if TYPE_CHECKING:  # importlib.abc costs ~15 ms (importlib.resources); the import system needs no base class
    import importlib.abc
    import importlib.machinery

log = logging.getLogger(__name__)

DISABLE_ENV = "NEMO_SAFE_DISABLE"
#: What ``NEMO_SAFE_DISABLE`` may name besides a patch: every patch of one library (its name starts so).
DISABLE_FAMILIES = ("nemo", "torchvision", "torch-hub")

#: Kept for older imports: what undoes a patch is now its :class:`Replacements`.
Undo = Callable[[], None]


class Patch(NamedTuple):
    """``apply(module)`` changes ``module`` in place and returns the :class:`Replacements` it
    made, or None when it decided not to patch (for example an unknown upstream version).
    ``describe(module)`` says, for ``nemo-safe doctor``, what the unpatched module is to the
    patch (the release it recognises, or why it declines); it is asked only while the patch
    is not in place, because what the patch does is recorded when it is applied
    (:attr:`Replacements.description`)."""

    module: str
    name: str
    apply: Callable[[ModuleType], Replacements | None]
    describe: Callable[[ModuleType], str] | None = None


def deferred(module: str, *functions: str) -> tuple[Callable[..., Any], ...]:
    """Stand-ins for ``module``'s ``functions`` that import it on their first call: registering a
    patch then costs nothing, and the patch's own imports (``urllib.request``, ``inspect``, ...)
    happen only when the library it patches is imported."""

    def stand_in(function: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), function)(*args, **kwargs)

        call.__qualname__ = call.__name__ = f"{module}.{function}"
        call.load = lambda: importlib.import_module(module)  # type: ignore[attr-defined]
        return call

    return tuple(stand_in(function) for function in functions)


def _load_deferred(module_names: set[str]) -> None:
    """Import the deferred patch modules of the patches for ``module_names`` *before* taking the
    registry lock: an import under it could wait for a thread that is importing a watched module and
    waits for the lock. A module that fails to import is reported when its patch is applied."""
    with _lock:
        loads = [getattr(p.apply, "load", None) for p in _registry if p.module in module_names]
    for load in loads:
        if load is not None:
            try:
                load()
            except Exception:  # the apply that follows fails the same way and logs it under the patch's name
                pass


_CURRENT = object()
_MISSING = object()


class _Slot(NamedTuple):
    """One attribute or mapping item a patch set (or only expects to stay the same object)."""

    read: Callable[[], object]
    write: Callable[[object], None] | None  # None: only checked, never restored
    value: object
    previous: object

    def holds_value(self) -> bool:
        return self.read() is self.value


class Replacements:
    """The attribute and mapping-item replacements one patch makes: undone in one call, and
    checked in one call (:meth:`intact`), so that nothing reports a patch a reload has undone.

    ``description`` says what they do, recorded when they are made from the unpatched module;
    ``nemo-safe doctor`` shows it while they are in place.
    """

    def __init__(self, description: str = "") -> None:
        self.description = description
        self._slots: list[_Slot] = []
        self._undone = False
        made = getattr(_making, "made", None)
        if made is not None:  # inside _apply: undone there if the patch fails halfway
            made.append(self)

    def set(self, obj: object, name: str, value: object, original: object = _CURRENT) -> None:
        """``obj.name = value``; undo restores ``original`` (default: the current value), which
        differs for a class attribute inherited or a module that already bound the patched function."""
        previous = getattr(obj, name) if original is _CURRENT else original
        setattr(obj, name, value)
        self._slots.append(
            _Slot(lambda: getattr(obj, name, _MISSING), lambda v: setattr(obj, name, v), value, previous)
        )

    def set_item(self, mapping: dict[Any, Any], key: object, value: object) -> None:
        previous = mapping[key]
        mapping[key] = value
        self._slots.append(
            _Slot(lambda: mapping.get(key, _MISSING), lambda v: mapping.__setitem__(key, v), value, previous)
        )

    def expect(self, obj: object, name: str) -> None:
        """Count ``obj.name`` staying the object it is now as part of being in place: the class or
        table the other replacements are made in, which a reload of ``obj`` replaces by a new one."""
        current = getattr(obj, name)
        self._slots.append(_Slot(lambda: getattr(obj, name, _MISSING), None, current, None))

    def intact(self) -> bool:
        """Whether every replacement is still in place (and the objects they were made in are current)."""
        return not self._undone and all(slot.holds_value() for slot in self._slots)

    def undo(self) -> None:
        """Restore the originals, newest first, wherever a replacement is still in place. A value set
        since (a reload re-executing the module, someone else's patch) is newer than the original
        and is left alone."""
        self._undone = True
        while self._slots:
            slot = self._slots.pop()
            if slot.write is not None and slot.holds_value():
                slot.write(slot.previous)


class _Applied(NamedTuple):
    """A patch applied to ``module``, the object ``sys.modules[name]`` held then."""

    name: str
    module: ModuleType
    replacements: Replacements

    def in_place(self) -> bool:
        return sys.modules.get(self.name) is self.module and self.replacements.intact()


_lock = threading.RLock()
#: ``.made``: the Replacements created by the patch being applied in this thread (see :func:`_apply`).
_making = threading.local()
_registry: list[Patch] = []
_applied: dict[str, _Applied] = {}  # patch name -> what it replaced, in which module object
_failed: dict[str, str] = {}  # patch name -> the error its apply raised
_retired: list[Replacements] = []  # replacements on objects of an earlier execution of a module (a reload)
_finder: _PostImportFinder | None = None
_off: frozenset[str] = frozenset()  # the patches NEMO_SAFE_DISABLE turned off when patching was enabled
_off_by = ""  # its value then


_DISABLE_VALUES = {"1": True, "true": True, "yes": True, "on": True, "": False, "0": False, "false": False,
                   "no": False, "off": False}  # fmt: skip
_warned_disable_value: list[str] = []


def judge_disable(raw: str) -> tuple[bool | frozenset[str], str]:
    """What the setting turns off, and what is wrong with its text ("" when nothing): True (every patch) for
    1/true/yes/on, False (none) for 0/false/no/off/empty, else the names of the patches a comma-separated list
    names, each by its name (``torch-hub-single-flight``) or a family (``nemo``, ``torchvision``, ``torch-hub``:
    every patch whose name starts so; ``_`` reads as ``-``, case does not matter). A word that names neither (a
    typo, ``1`` in a list) turns off every patch: upstream's behaviour is the safe reading of an unclear wish."""
    text = raw.strip().lower()
    value = _DISABLE_VALUES.get(text)
    if value is not None:
        return value, ""
    names = [patch.name for patch in registered()]
    words = [word.strip().replace("_", "-") for word in text.split(",") if word.strip()]

    def named(word: str) -> set[str]:
        return {n for n in names if n == word or (word in DISABLE_FAMILIES and n.startswith(word + "-"))}

    unknown = [word for word in words if not named(word)]
    if unknown or not words:
        return True, (
            f"neither 1/true/yes/on nor 0/false/no/off nor patches ({', '.join(unknown) or repr(text)}: no patch or "
            f"family of that name; families {', '.join(DISABLE_FAMILIES)}, or a name `nemo-safe doctor` lists); "
            "taking it as set: no library is patched"
        )
    return frozenset(set().union(*map(named, words))), ""


def turned_off() -> bool | frozenset[str]:
    """``NEMO_SAFE_DISABLE`` (:func:`judge_disable`), with one warning for a value it cannot use."""
    raw = os.environ.get(DISABLE_ENV, "")
    value, problem = judge_disable(raw)
    if problem and raw not in _warned_disable_value:
        _warned_disable_value.append(raw)
        log.warning("nemo_safe: %s=%r is %s", DISABLE_ENV, raw, problem)
    return value


def disabled_by_env() -> bool:
    """Whether ``NEMO_SAFE_DISABLE`` turns off every patch."""
    return turned_off() is True


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
    """Names of the patches whose replacements are in place now."""
    with _lock:
        return [name for name, applied in _applied.items() if applied.in_place()]


def is_enabled() -> bool:
    return _finder is not None


def status(patch: Patch) -> tuple[bool, str]:
    """Whether ``patch`` is in place now, and what it does or why it is not, for ``nemo-safe doctor``."""
    with _lock:
        applied = _applied.get(patch.name)
        if applied is not None and applied.in_place():
            return True, applied.replacements.description
        module = sys.modules.get(patch.module)
        if applied is not None:
            return False, (
                "no longer in place: what it replaced changed after it was applied (a re-execution of "
                f"{patch.module} or of a module it depends on, or a reassignment) without nemo_safe's import "
                "hook; nemo_safe.patch() applies it again"
            )
        if _finder is None:
            cause = f"{DISABLE_ENV} is set" if disabled_by_env() else "patching is not enabled in this process"
        elif patch.name in _off:
            cause = f"turned off by {DISABLE_ENV}={_off_by}"
        elif patch.name in _failed:
            cause = f"applying it failed ({_failed[patch.name]})"
        else:
            cause = ""
        if module is None:
            what = f"{patch.module} is not imported"
        else:
            what = patch.describe(module) if patch.describe is not None else ""
        return False, "; ".join(part for part in (cause, what) if part)


def _apply(patch: Patch, module: ModuleType) -> None:
    if patch.name in _off:
        return
    applied = _applied.get(patch.name)
    if applied is not None:
        if applied.in_place():
            return
        # The module was re-executed (a reload) or replaced since: the patch applies afresh to what it
        # now defines. The old replacements stay until disable(): objects of the old execution (a class
        # that `from torchvision.datasets import MNIST` still names) keep being patched.
        del _applied[patch.name]
        _retired.append(applied.replacements)
        log.debug("nemo_safe: %s changed since %s was applied; applying it again", patch.module, patch.name)
    previous, _making.made = getattr(_making, "made", None), []
    try:
        replacements = patch.apply(module)
        if replacements is not None and not isinstance(replacements, Replacements):
            raise TypeError(f"apply returned {type(replacements).__name__}, not Replacements or None")
    except Exception as exc:  # a broken patch must never break the user's import
        for made in reversed(_making.made):  # what it replaced before it failed: put back
            made.undo()
        _failed[patch.name] = f"{type(exc).__name__}: {exc}"
        log.exception("nemo_safe: patch %s could not be applied; leaving %s unchanged", patch.name, patch.module)
        return
    finally:
        _making.made = previous
    _failed.pop(patch.name, None)
    if replacements is not None:
        _applied[patch.name] = _Applied(patch.module, module, replacements)
        log.debug("nemo_safe: applied %s to %s", patch.name, patch.module)


def _on_import(module: ModuleType) -> None:
    if _finder is None:
        return
    _load_deferred({module.__name__})
    with _lock:
        if _finder is None:
            return
        reloaded = False
        for patch in _registry:
            if patch.module == module.__name__:
                reloaded = reloaded or patch.name in _applied
                _apply(patch, module)
        if not reloaded:
            return
        # A reload of this module can leave patches made elsewhere stale, e.g. modules that bound one of
        # its functions by name: those are applied again, now that this module is patched afresh.
        for patch in _registry:
            applied, target = _applied.get(patch.name), sys.modules.get(patch.module)
            if applied is not None and target is not None and not applied.in_place():
                _apply(patch, target)


class _PatchingLoader:
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


if "importlib.abc" in sys.modules:  # only where it is loaded anyway: isinstance checks of other tools hold
    sys.modules["importlib.abc"].Loader.register(_PatchingLoader)


class _PostImportFinder:
    """Finds watched modules through the other finders and wraps their loaders (for
    ``importlib.reload`` too: it finds the spec again through ``sys.meta_path``)."""

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
    """Apply all patches now and on future imports; re-apply those no longer in place.
    Idempotent. False when disabled by env."""
    global _finder, _off, _off_by
    off = turned_off()
    if off is True:
        say(log, "nemo_safe: %s is set; no library is patched", DISABLE_ENV)
        return False
    raw = os.environ.get(DISABLE_ENV, "")
    if off and off != _off:
        say(log, "nemo_safe: %s=%s: %s left as upstream has them", DISABLE_ENV, raw, ", ".join(sorted(off)))
    with _lock:
        _off, _off_by = off or frozenset(), raw
        for name in [name for name in reversed(list(_applied)) if name in _off]:  # turned off since it was applied
            _applied.pop(name).replacements.undo()
    _load_deferred({name for name in {p.module for p in registered()} if name in sys.modules})
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
            _applied.pop(name).replacements.undo()
        while _retired:
            _retired.pop().undo()
        _failed.clear()
