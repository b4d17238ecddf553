"""Attributes of a package imported on first use, so that ``import nemo_safe`` stays cheap in every
process of a job (most of which never use the barrier API or look at a patch module)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def module_getattr(
    package: str, namespace: dict[str, Any], on_first_use: dict[str, tuple[str, str]] | None = None
) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``package``: a name of ``on_first_use`` (name -> (module,
    attribute)) or a submodule (``nemo_safe.barrier``, as before imports became lazy), imported when first
    asked for and then kept in ``namespace``; anything else is an ``AttributeError``."""
    first_use = on_first_use or {}

    def __getattr__(name: str) -> object:
        if name in first_use:
            module, attribute = first_use[name]
            value = getattr(importlib.import_module(module), attribute)
        elif name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    return __getattr__
