"""Generate the upstream patch series in patches/ from nemo_safe's own code, or check them.

    python ci/make_patches.py            # (re)write patches/nemo/ and patches/torchvision/
    python ci/make_patches.py --check    # fail when the committed patches differ from the code

For each project: the pinned release's wheel is unpacked into a temporary git
repository, each patch of ``ci/upstream/series.py`` edits the tree and is committed
with a fixed author and date, and ``git format-patch`` writes the series. The same
code always gives the same bytes, so CI can diff.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream"))

from releases import AUTHOR_EMAIL, AUTHOR_NAME, git, pristine_repo
from series import Series, all_series
from source_edit import check_names_defined

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"


def generate(series: Series, work: Path, out: Path) -> list[Path]:
    """Write ``series`` as format-patch files into ``out``; returns them in order."""
    repo = pristine_repo(series.distribution, series.base_version, work / series.project, series.upstream_files)
    base = git(repo, "rev-parse", "HEAD").stdout.strip()
    for patch in series.patches:
        patch.apply(repo)
        git(repo, "add", "-A")
        changed = git(repo, "diff", "--cached", "--name-only", "--diff-filter=AM", "--", "*.py").stdout.split()
        check_names_defined(repo, changed)
        git(repo, "commit", "-q", "-m", patch.message(f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>"))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    names = git(
        repo, "format-patch", "--zero-commit", "--no-signature", "--full-index", "-o", str(out), f"{base}..HEAD"
    ).stdout.split()
    return [Path(n) for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with patches/ instead of writing it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nemo_safe-patches-") as tmp:
        work = Path(tmp)
        stale = []
        for series in all_series():
            target = PATCHES / series.project
            out = work / "out" / series.project if args.check else target
            made = generate(series, work, out)
            print(f"make_patches: {series.project} {series.base_version}: {', '.join(p.name for p in made)}")
            if not args.check:
                continue
            for name in sorted({p.name for p in out.glob("*.patch")} | {p.name for p in target.glob("*.patch")}):
                want, have = out / name, target / name
                if not have.exists() or not want.exists() or want.read_text() != have.read_text():
                    stale.append(name)
                    old = have.read_text().splitlines(keepends=True) if have.exists() else []
                    new = want.read_text().splitlines(keepends=True) if want.exists() else []
                    sys.stdout.writelines(
                        list(difflib.unified_diff(old, new, f"committed/{name}", f"code/{name}"))[:80]
                    )
        if stale:
            print(f"make_patches: patches/ is stale ({', '.join(stale)}); run `python ci/make_patches.py` and commit")
            return 1
        if args.check:
            print("make_patches: patches/ matches the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
