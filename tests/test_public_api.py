"""The public surface: every name in ``nemo_safe.__all__`` resolves and is described in docs/api.md, every name
docs/api.md describes is exported, every nemo_safe error class is exported, and ``dir(nemo_safe)`` shows the public
names only."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import nemo_safe
from nemo_safe import errors

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _documented() -> set[str]:
    """Names under a ``### `name(...)` `` heading or in the first column of the errors table."""
    text = API_PAGE.read_text()
    headings = re.findall(r"^### `([A-Za-z_]+)", text, flags=re.M)
    table = re.findall(r"^\| `([A-Za-z]+)` \|", text, flags=re.M)
    return set(headings) | set(table)


def test_every_exported_name_resolves_and_is_documented() -> None:
    for name in nemo_safe.__all__:
        value = getattr(nemo_safe, name)
        assert value is not None and (name == "__version__" or callable(value)), name
    assert set(nemo_safe.__all__) == _documented(), "docs/api.md and nemo_safe.__all__ must list the same names"


def test_every_error_class_is_exported() -> None:
    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.NemoSafeError)}
    assert classes <= set(nemo_safe.__all__), sorted(classes - set(nemo_safe.__all__))


def test_dir_shows_the_public_names_and_submodules_only() -> None:
    shown = set(dir(nemo_safe))
    assert set(nemo_safe.__all__) <= shown and {"__file__", "errors"} <= shown
    others = {n for n in shown - set(nemo_safe.__all__) if not n.startswith("__")}
    assert all(getattr(nemo_safe, n).__name__ == f"nemo_safe.{n}" for n in others), sorted(others)
