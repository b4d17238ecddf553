"""The text surgery behind patches/ (ci/upstream/source_edit.py) fails loudly instead of guessing.

The series themselves are regenerated and verified on the pristine releases by
ci/make_patches.py --check and ci/verify_patches.py (run by ci/run_tests.sh); these
tests pin the failure modes a new upstream release would hit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci" / "upstream"))

from source_edit import (
    EditError,
    module_source,
    rename,
    replace_function,
    replace_once,
    tidy_new_module,
)

UPSTREAM = textwrap.dedent('''\
    import os


    def _decompress(from_path: str, to_path: str) -> str:
        """Upstream's docstring.

        Args:
            from_path (str): kept.
        """
        return to_path


    def other():
        return 1
''')


def test_replace_once_needs_exactly_one_match(tmp_path: Path) -> None:
    path = tmp_path / "utils.py"
    path.write_text(UPSTREAM)
    with pytest.raises(EditError, match="found 0"):
        replace_once(path, "import shutil\n", "import shutil\nimport x\n")
    path.write_text(UPSTREAM + "\nimport os\n")
    with pytest.raises(EditError, match="found 2"):
        replace_once(path, "import os\n", "import os\nimport shutil\n")


def test_replace_function_keeps_upstream_head(tmp_path: Path) -> None:
    path = tmp_path / "utils.py"
    path.write_text(UPSTREAM)
    new = '''\
        def _decompress(from_path: str | os.PathLike[str], to_path=None) -> str:
            """Overlay docstring."""
            tmp = to_path + ".tmp"
            return tmp
        '''
    replace_function(path, "_decompress", new, keep_head=True)
    text = path.read_text()
    assert "def _decompress(from_path: str, to_path: str) -> str:" in text
    assert "Upstream's docstring." in text and "Overlay docstring." not in text
    assert 'tmp = to_path + ".tmp"' in text and "def other():" in text
    with pytest.raises(EditError, match="no top-level def missing"):
        replace_function(path, "missing", new)


def test_cut_module_must_stand_alone(tmp_path: Path) -> None:
    """Cutting a definition another one needs is caught by ruff's undefined-name check."""
    source = module_source("atomic_files", keep=("publish",))  # publish needs temp_name and _OPEN_NEW
    assert source.count("def ") == 1 and "from nemo_safe" not in source
    path = tmp_path / "atomic_files.py"
    path.write_text(source)
    with pytest.raises(EditError, match="does not stand alone"):
        tidy_new_module(path, 120)
    whole = tmp_path / "whole.py"
    keep = ("TMP_PREFIX", "_FLAGS", "_OPEN_NEW", "temp_name", "publish")
    whole.write_text(module_source("atomic_files", keep=keep))
    tidy_new_module(whole, 120)


def test_relative_imports_and_renames() -> None:
    source = rename(module_source("single_flight"), {"NemoSafeError": "DownloadError", "nemo_safe: ": ""})
    assert "from .waiting import" in source and "from .errors import" in source
    assert "nemo_safe.waiting" not in source


def _make_patches(tmp_path: Path, *args: str, author: str | None = None) -> subprocess.CompletedProcess[str]:
    """ci/make_patches.py run as someone whose git knows no identity (empty global and system config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "NEMO_SAFE_PATCH_AUTHOR"))}
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", HOME=str(tmp_path))
    if author is not None:
        env["NEMO_SAFE_PATCH_AUTHOR"] = author
    script = Path(__file__).resolve().parents[1] / "ci" / "make_patches.py"
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)


def test_submitted_series_carry_the_submitters_identity_or_none(tmp_path: Path) -> None:
    """The committed series carry an obvious placeholder; --submit refuses without the submitter's own
    identity (NeMo's DCO, torchvision's CLA) and writes every commit as them when given one."""
    refused = _make_patches(tmp_path, "--submit", str(tmp_path / "none"))
    assert refused.returncode == 2, refused
    assert "NEMO_SAFE_PATCH_AUTHOR" in refused.stderr and not (tmp_path / "none").exists()

    made = _make_patches(tmp_path, "--submit", str(tmp_path / "out"), author="Ada Lovelace <ada@example.com>")
    assert made.returncode == 0, made.stdout + made.stderr
    patches = sorted((tmp_path / "out").rglob("*.patch"))
    committed = sorted((Path(__file__).resolve().parents[1] / "patches").rglob("*.patch"))
    assert [p.name for p in patches] == [p.name for p in committed]
    for patch, placeholder in zip(patches, committed, strict=True):
        text = patch.read_text()
        assert (
            "From: Ada Lovelace <ada@example.com>" in text and "Signed-off-by: Ada Lovelace <ada@example.com>" in text
        )
        assert "REPLACE WITH YOUR NAME" not in text
        assert "From: REPLACE WITH YOUR NAME" in placeholder.read_text()
