"""Run the functions an upstream pull request adds as the overlay's own code.

The upstream-destined functions live verbatim in their own overlay modules
(``torchvision_upstream``, ``torchvision_mnist_upstream``), which
``ci/make_patches.py`` copies into the upstream files. The overlay runs the same
code objects with globals that behave as the target module's, so the bodies stay
one source of truth: names the function's own module defines come from there,
a few helpers it calls by name are replaced by the overlay's richer versions,
and every other name is looked up in the target module at call time, where the
function finds it upstream.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any


class _TargetGlobals(dict):  # type: ignore[type-arg]
    """The source module's names, the overlay's helpers over them, then ``target``'s names at call time."""

    def __init__(self, source: ModuleType, target: ModuleType, helpers: Mapping[str, object]) -> None:
        super().__init__(vars(source))
        self.update(helpers)
        self._target = target

    def __missing__(self, name: str) -> Any:
        return vars(self._target)[name]  # KeyError: Python goes on to the builtins


def run_in(
    source: ModuleType, target: ModuleType, names: Iterable[str], helpers: Mapping[str, object]
) -> dict[str, Callable[..., Any]]:
    """``source``'s functions ``names`` as if defined in ``target``, calling ``helpers`` and one another by name."""
    namespace = _TargetGlobals(source, target, helpers)
    out = {}
    for name in names:
        f = getattr(source, name)
        g = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        out[name] = functools.update_wrapper(g, f)
    # They call one another as they would in ``target``: each other's copies, unless a helper replaces one.
    namespace.update({name: g for name, g in out.items() if name not in helpers})
    return out
