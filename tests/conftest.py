"""Shared fixtures: the real local SLURM cluster and FUSE (bindfs) mounts.

Outside CI a missing piece skips with the reason; in CI (CI=true) it fails,
because those tests must run there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"CI must run this test but {what}", pytrace=False)
    pytest.skip(f"{what} (run ci/run_tests.sh to set it up)")


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The two-node cluster started by ci/slurm_up.sh must answer."""
    if not shutil.which("srun"):
        _missing("srun is not installed")
    out = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or "node" not in out.stdout:
        _missing(f"the local SLURM cluster does not answer (sinfo: {out.stderr.strip() or out.stdout.strip()})")


#: bindfs caches like an NFS client's: a lookup, its attributes and a lookup that found nothing live 3 s.
CACHING = "negative_timeout=3,entry_timeout=3,attr_timeout=3"


@pytest.fixture()
def cached_view(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``cached_view(source, caching=CACHING)``: a new bindfs view of ``source``, unmounted when the test ends."""
    if not shutil.which("bindfs"):
        _missing("bindfs is not installed")
    if not os.path.exists("/dev/fuse"):
        _missing("/dev/fuse does not exist")
    mounted: list[Path] = []

    def mount(source: Path, caching: str = CACHING) -> Path:
        view = tmp_path / f"view{len(mounted) + 1}"
        view.mkdir()
        out = subprocess.run(["bindfs", "-o", caching, str(source), str(view)], capture_output=True, text=True,
                             timeout=30)  # fmt: skip
        if out.returncode != 0:
            _missing(f"bindfs could not mount: {out.stderr.strip()}")
        mounted.append(view)
        return view

    try:
        yield mount
    finally:
        for view in reversed(mounted):
            if subprocess.run(["umount", str(view)], check=False, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(view)], check=True, timeout=30)  # busy: detach it now


@pytest.fixture()
def bindfs_views(tmp_path: Path, cached_view: Callable[..., Path]) -> tuple[Path, Path, Path]:
    """Two bindfs views of one directory with :data:`CACHING` (an NFS-like view)."""
    base = tmp_path / "base"
    base.mkdir()
    return base, cached_view(base), cached_view(base)


@pytest.fixture()
def read_only() -> Iterator[Callable[[Path], Path]]:
    """``read_only(path)``: ``path`` (created if missing) bind-mounted read-only onto itself until the test ends."""
    mounted: list[Path] = []

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], check=True)
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=True)


def torchvision_release() -> tuple[int, int]:
    """The installed torchvision's (major, minor): the release sweep runs the same tests on several."""
    import importlib.metadata

    major, minor = importlib.metadata.version("torchvision").split("+")[0].split(".")[:2]
    return int(major), int(minor)
