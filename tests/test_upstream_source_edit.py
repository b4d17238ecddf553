"""The text surgery behind patches/ (ci/upstream/source_edit.py) fails loudly instead of guessing.

The series themselves are regenerated and verified on the pristine releases by
ci/make_patches.py --check and ci/verify_patches.py (run by ci/run_tests.sh); these
tests pin the failure modes a new upstream release would hit.
"""

from __future__ import annotations

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
