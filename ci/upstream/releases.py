"""Pristine upstream releases as git repositories: the base the patch series is made against
and verified on.

The sources come from the release wheels on the package index (what users run), cached
by file name; a wheel holds the package tree at the same paths as the upstream repository
(``nemo/...``, ``torchvision/...``), so a series made here applies to a checkout too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("NEMO_SAFE_CACHE", Path.home() / ".cache" / "nemo_safe")) / "wheels"

#: The committed series carry this obviously-placeholder author and sign-off and a fixed date, so that
#: regenerating them gives the same bytes; a submitter replaces it with their own (``make_patches.py --submit``).
PLACEHOLDER = "REPLACE WITH YOUR NAME <replace-with-your-email@example.invalid>"
DATE = "2026-11-30T12:00:00+00:00"


def split_identity(identity: str) -> tuple[str, str]:
    """``"Name <email>"`` -> ``("Name", "email")``."""
    name, _, rest = identity.partition("<")
    return name.strip(), rest.rstrip(">").strip()


def git_env(identity: str = PLACEHOLDER, date: str | None = DATE) -> dict[str, str]:
    """Git run with ``identity`` as author and committer, none of the caller's configuration, and
    ``date`` (None: now)."""
    name, email = split_identity(identity)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
    )
    if date is not None:
        env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    return env


def git(
    repo: Path, *args: str, check: bool = True, identity: str = PLACEHOLDER, date: str | None = DATE
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["git", *args], cwd=repo, env=git_env(identity, date), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo} failed:\n{out.stdout}\n{out.stderr}")
    return out


def fetch_wheel(distribution: str, version: str) -> Path:
    """The release wheel from the package index (``pip download``), cached."""
    CACHE.mkdir(parents=True, exist_ok=True)
    prefix = f"{distribution.replace('-', '_')}-{version}-"
    cached = sorted(CACHE.glob(prefix + "*.whl"))
    if cached:
        return cached[0]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(CACHE),
         f"{distribution}=={version}"],
        check=True,
    )  # fmt: skip
    cached = sorted(CACHE.glob(prefix + "*.whl"))
    if not cached:
        raise RuntimeError(f"pip download {distribution}=={version} gave no wheel in {CACHE}")
    return cached[0]


def pristine_repo(
    distribution: str, version: str, dest: Path, upstream_files: tuple[tuple[str, str, str], ...] = ()
) -> Path:
    """A git repository at ``dest`` whose one commit is the release's sources, plus the upstream
    test files the release wheel lacks (``(path, distribution, version)``: taken from that wheel)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with zipfile.ZipFile(fetch_wheel(distribution, version)) as wheel:
        members = [m for m in wheel.namelist() if ".dist-info/" not in m and not m.endswith("/")]
        wheel.extractall(dest, members)
    for path, source, source_version in upstream_files:
        with zipfile.ZipFile(fetch_wheel(source, source_version)) as wheel:
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(path))
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"{distribution} {version} as released")
    return dest
