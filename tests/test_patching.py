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
        original = mod.greet
        mod.greet = lambda: "patched"
        def undo():
            mod.greet = original
        return undo

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


def test_import_is_cheap() -> None:
    code = (
        "import sys, nemo_safe; heavy = [m for m in ('torch', 'lightning', 'nemo', 'torchvision', "
        "'pytorch_lightning') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_broken_patch_never_breaks_the_import(target: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import nemo_safe
        from nemo_safe import patching
        def apply(mod):
            raise RuntimeError("boom")
        patching.register(patching.Patch("pkg.target", "broken", apply))
        import pkg.target
        print(pkg.target.greet(), patching.active())
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "upstream []"
    assert "could not be applied" in out.stderr
