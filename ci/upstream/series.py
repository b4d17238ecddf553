"""The two upstream patch series: what each patch takes from nemo_safe and where it goes.

Each patch is a commit message plus a function that edits a pristine release tree
(see ``source_edit``); ``make_patches.py`` runs them in order on the release and
turns the commits into ``git format-patch`` files. Test files come verbatim from
``ci/upstream/<project>/`` (upstream test layout); code comes from ``nemo_safe/``.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from source_edit import overlay_file, rename, tidy_new_module

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class UpstreamPatch:
    slug: str
    subject: str
    body: str
    apply: Callable[[Path], None]
    #: Test files (relative to the tree) this patch adds or extends; run patched, with every test in them.
    tests: tuple[str, ...] = ()
    #: ``file::name`` of the tests that must fail on the unpatched release (with the patched test files).
    race_tests: tuple[str, ...] = ()
    #: Slugs of earlier patches this one needs; empty: it applies and passes on the pristine release alone.
    requires: tuple[str, ...] = ()
    #: ``file::name`` of the tests this patch adds that pass on the unpatched release too, on purpose: they check
    #: that behaviour the patch must keep is kept. Every other test it adds must fail unpatched.
    keeps_behaviour: tuple[str, ...] = ()
    #: The verified releases this patch is for; empty: all of the series' (an older release's code may differ).
    releases: tuple[str, ...] = ()

    def applies_to(self, version: str) -> bool:
        return not self.releases or version in self.releases

    def message(self, signoff: str, size: str = "") -> str:
        """The commit message: subject, body, the size line ``make_patches`` measured, sign-off."""
        size = f"\n\n{size}" if size else ""
        return f"{self.subject}\n\n{self.body.strip()}{size}\n\nSigned-off-by: {signoff}\n"


@dataclass(frozen=True)
class Series:
    project: str
    distribution: str
    #: The release the series is generated against; verified against all of ``verified``.
    base_version: str
    #: Newest first: CI verifies the first, the release sweep the others (ci/verify_patches.py --which).
    verified: tuple[str, ...]
    patches: tuple[UpstreamPatch, ...]
    #: Upstream test files the release wheel lacks, added to the pristine tree as they were released:
    #: path -> (distribution, version) of a wheel that ships it (NeMo 2.7.3's wheel ships its tests/).
    upstream_files: tuple[tuple[str, str, str], ...] = ()
    #: The releases on which the series' test files are run whole (patched and unpatched); on the other
    #: verified releases only the tests the series adds run patched, and its race tests unpatched. Empty: all.
    whole_files_on: tuple[str, ...] = ()

    def runs_whole_files(self, version: str) -> bool:
        return not self.whole_files_on or version in self.whole_files_on


def _copy_tests(project: str, tree: Path, *relative: str) -> None:
    for rel in relative:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / project / rel, target)


def _overlay_imports(module: str, used_in: str, package: str, width: int) -> str:
    """The overlay module's ``from nemo_safe... import`` lines, cut to the names ``used_in``
    needs, pointing at ``package`` instead."""
    lines = []
    for node in ast.parse(overlay_file(module).read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_safe")):
            continue
        names = sorted(a.name for a in node.names if re.search(rf"\b{a.name}\b", used_in))
        if names:
            target = package + node.module[len("nemo_safe") :]
            line = f"from {target} import {', '.join(names)}\n"
            if len(line) > width + 1:  # black's wrapping
                line = f"from {target} import (\n" + "".join(f"    {n},\n" for n in names) + ")\n"
            lines.append(line)
    return "".join(sorted(lines))


def _write_package(tree: Path, package: Path, modules: dict[str, str], renames: dict[str, str], width: int) -> None:
    """Write the cut-down overlay modules (``name -> source``) as a package and tidy them."""
    (tree / package).mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        path = tree / package / f"{name}.py"
        path.write_text(rename(source, renames))
        tidy_new_module(path, width)


def all_series() -> tuple[Series, ...]:
    from series_nemo import NEMO
    from series_torchvision import TORCHVISION

    return (NEMO, TORCHVISION)
