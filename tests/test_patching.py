"""Lazy patching: real modules, real imports in fresh interpreters, every import order."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from procs import clean_env

PROGRAM = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    order = sys.argv[2]
    if order == "target-first":
        import pkg.target
    import nemo_safe
    from nemo_safe import patching

    def apply(mod):
        changes = patching.Replacements("greets patched")
        changes.set(mod, "greet", lambda: "patched")
        return changes

    patching.register(patching.Patch("pkg.target", "greet", apply))
    import pkg.target
    print(pkg.target.greet())
    nemo_safe.patch()                      # twice: a no-op
    print(pkg.target.greet(), len(patching.active()))
    nemo_safe.unpatch()
    print(pkg.target.greet(), len(patching.active()))
    nemo_safe.unpatch()                    # twice: still fine
    nemo_safe.patch()
    print(pkg.target.greet())
""")


@pytest.fixture()
def target(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "target.py").write_text("def greet():\n    return 'upstream'\n")
    return tmp_path


def _run(target: Path, order: str, **env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(target), order],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.split("\n")[:-1]


@pytest.mark.parametrize("order", ["nemo-safe-first", "target-first"])
def test_patch_applies_whatever_the_import_order_and_unpatch_restores(target: Path, order: str) -> None:
    assert _run(target, order) == ["patched", "patched 1", "upstream 0", "patched"]


def test_disable_env_turns_everything_off(target: Path) -> None:
    assert _run(target, "nemo-safe-first", NEMO_SAFE_DISABLE="1") == [
        "upstream",
        "upstream 0",
        "upstream 0",
        "upstream",
    ]


RELOAD_PROGRAM = textwrap.dedent("""
    import importlib, importlib.machinery, sys
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "target-first":
        import pkg.target
    import nemo_safe
    from nemo_safe import patching

    originals = []

    def apply(mod):
        originals.append(mod.greet)
        changes = patching.Replacements("greets patched")
        changes.set(mod, "greet", lambda: "patched")
        return changes

    def show(*extra):
        print(t.greet(), patching.active(), *extra, flush=True)

    patching.register(patching.Patch("pkg.target", "greet", apply))
    import pkg.target as t
    importlib.reload(t)                    # through nemo_safe's finder: applied again
    show(len(originals))
    importlib.machinery.SourceFileLoader("pkg.target", t.__file__).exec_module(t)  # not through it
    show()
    nemo_safe.patch()                      # applies it again
    show(len(originals))
    del sys.modules["pkg.target"]          # a new module object
    import pkg.target as t
    show(len(originals))
    nemo_safe.unpatch()
    show(t.greet is originals[-1])
""")


@pytest.mark.parametrize("order", ["nemo-safe-first", "target-first"])
def test_reload_applies_again_and_active_reports_only_what_is_in_place(target: Path, order: str) -> None:
    """A reload (also of a module imported before nemo_safe) re-applies the patch; a re-execution that
    bypasses the finder is not reported as applied; unpatch restores the function the module has now."""
    out = subprocess.run(
        [sys.executable, "-c", RELOAD_PROGRAM, str(target), order],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.splitlines() == [
        "patched ['greet'] 2",
        "upstream []",
        "patched ['greet'] 3",
        "patched ['greet'] 4",
        "upstream [] True",
    ], out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]


REPLACEMENTS_PROGRAM = textwrap.dedent("""
    from types import SimpleNamespace
    from nemo_safe.patching import Replacements

    ns = SimpleNamespace(a=1, b=2, table={"k": "v"})
    holder = SimpleNamespace(ns=ns)
    changes = Replacements("what they do")
    changes.expect(holder, "ns")
    changes.set(ns, "a", 10)
    changes.set_item(ns.table, "k", "V")
    changes.set(ns, "b", 20)
    print(changes.intact(), changes.description)
    ns.b = 3                               # someone else's value since
    print(changes.intact())
    changes.undo()                         # restores a and k, leaves b alone
    print(ns.a, ns.b, ns.table, changes.intact())
    again = Replacements()
    again.expect(holder, "ns")
    again.set(ns, "a", 5)
    holder.ns = SimpleNamespace(a=1)       # the container itself replaced (a reload's new class)
    print(again.intact())
""")


def test_replacements_know_whether_they_are_in_place() -> None:
    out = subprocess.run(
        [sys.executable, "-c", REPLACEMENTS_PROGRAM],
        env=clean_env(NEMO_SAFE_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.splitlines() == ["True what they do", "False", "1 3 {'k': 'v'} False", "False"], out.stderr


def test_import_is_cheap() -> None:
    """No patched library, no heavy standard-library module and no patch module is imported by
    ``import nemo_safe``; a patch module is imported with its library. ``-S``: site (and an editable
    install's finder) would import some of these itself; nemo_safe comes from this checkout."""
    code = textwrap.dedent("""
        import sys
        before = set(sys.modules)
        import nemo_safe
        def new(prefixes):
            return sorted(m for m in set(sys.modules) - before if m.split(".")[0] in prefixes or m in prefixes)
        print(new({"torch", "lightning", "nemo", "torchvision", "pytorch_lightning"}))
        print(new({"http", "email", "inspect", "urllib.request", "socket", "json", "dataclasses", "importlib.abc"}))
        print(sorted(m for m in sys.modules if m.startswith("nemo_safe.patches.")))
        sys.path.extend(sys.argv[1:])
        import torch.hub
        print(sorted(m for m in sys.modules if m.startswith("nemo_safe.patches.")), nemo_safe.active())
    """)
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run(
        [sys.executable, "-S", "-c", code, *site_packages],
        env=clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.splitlines() == [
        "[]",
        "[]",
        "[]",
        "['nemo_safe.patches.torch_hub'] ['torch-hub-single-flight']",
    ], out.stdout + out.stderr[-2000:]


def test_library_never_imports_the_tooling() -> None:
    """The library is the ground floor: no module of ``nemo_safe`` names ``nemo_safe_tools`` (the command,
    the demo's races, the loopback mirror), not even in an ``importlib`` string, so that the tooling stays
    out of every training process. The one exception is ``__main__.py``, run only by ``python -m nemo_safe``
    (issue 24), which is the command; the import check is test_import_is_cheap's."""
    package = Path(__file__).resolve().parents[1] / "nemo_safe"
    found = [
        f"{path.relative_to(package.parent)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "nemo_safe_tools" in line and path != package / "__main__.py"
    ]
    assert not found, found
    assert "from nemo_safe_tools.cli import main" in (package / "__main__.py").read_text()


def test_broken_patch_never_breaks_the_import(target: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import nemo_safe
        from nemo_safe import patching
        def apply(mod):
            raise RuntimeError("boom")
        broken = patching.Patch("pkg.target", "broken", apply)
        patching.register(broken)
        import pkg.target
        print(pkg.target.greet(), patching.active(), patching.status(broken))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "upstream [] (False, 'applying it failed (RuntimeError: boom)')"
    assert "could not be applied" in out.stderr
