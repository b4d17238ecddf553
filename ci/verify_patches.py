"""Verify patches/ on the pristine releases, with nemo_safe NOT imported.

    python ci/verify_patches.py                   # every project and release
    python ci/verify_patches.py --only nemo       # one project
    python ci/verify_patches.py --which newest    # each series on its newest release (CI; --which older: the sweep)

For each release the series names in ``ci/upstream/series*.py``, from the release's
wheel unpacked into a temporary git repository (plus the upstream test files the series
declares; see ``releases.pristine_repo``):

1. **Each pull request alone**: ``git am`` it (with only the patches it ``requires``) on
   the pristine tree (exact context: no fuzz, no three-way merge) and run the tests it
   adds: all must pass.
2. **The series in order**: ``git am`` every patch, run every test file the series touches
   *whole* (the upstream tests already in them included), then the same files on the
   unpatched release. Patched, every test passes that passed unpatched, and every test
   the series added passes; unpatched, every declared race test fails with an assertion.
   On a release outside the series' ``whole_files_on`` (NeMo 2.7.3, whose test file is the
   same as 3.0.0's) only the added tests run patched and the race tests unpatched.
3. **Windows**: every module the series changes imports with ``os.O_NOFOLLOW`` and
   ``os.link`` removed (they do not exist there).

Patched trees are put first on ``PYTHONPATH`` (torchvision: a copy of the installed
package, for its compiled parts, with the tree's Python files laid over it). A stand-in
``nemo_safe`` package that raises on import is first on ``PYTHONPATH`` throughout, so no
process of the run can pick up the overlay.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream"))

from releases import git, pristine_repo
from series import Series, UpstreamPatch, all_series

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "ci" / "upstream"

#: The environment each release is tested in (its dependencies at the right versions).
VENVS = {("nemo", "3.0.0"): ".venv", ("nemo", "2.7.3"): ".venv-nemo273", ("torchvision", "0.29.1"): ".venv"}
HANG_GUARD = 1800
GUARD = 'raise ImportError("nemo_safe must not be imported while the upstream patches are verified")\n'
#: What Windows lacks that POSIX code tends to reach for at import time.
WINDOWS_STAND_IN = "import os\nfor name in ('O_NOFOLLOW', 'link'):\n    delattr(os, name)\n"


class VerifyError(RuntimeError):
    pass


@dataclass
class Outcome:
    #: test id (``path::Class::name``) -> "passed" | "failed" | "error" | "skipped"
    results: dict[str, str]
    seconds: float
    log: str = ""
    #: test id -> the first line of its failure message
    reasons: dict[str, str] = field(default_factory=dict)

    def having(self, result: str) -> list[str]:
        return sorted(t for t, r in self.results.items() if r == result)

    def summary(self) -> str:
        counts = {r: len(self.having(r)) for r in ("passed", "failed", "error", "skipped")}
        return ", ".join(f"{n} {r}" for r, n in counts.items() if n) + f" in {self.seconds:.0f} s"


def _python(project: str, version: str) -> str:
    python = REPO / VENVS[(project, version)] / "bin" / "python"
    if not python.exists():
        raise VerifyError(f"{python} is missing: run `bash ci/setup_env.sh` (and `bash ci/setup_env.sh nemo273`)")
    return str(python)


def _importable(project: str, tree: Path, python: str, work: Path) -> Path:
    """The directory to put first on PYTHONPATH so that ``project`` is imported from ``tree``."""
    if project == "nemo":
        return tree  # pure Python: the tree itself
    installed = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True, cwd=work,
    ).stdout.strip()  # fmt: skip
    site = work / f"site-{tree.name}"
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(installed, site / "torchvision", ignore=shutil.ignore_patterns("__pycache__"))
    for source in (tree / "torchvision").rglob("*.py"):
        target = site / source.relative_to(tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return site


def _plugins(project: str) -> list[Path]:
    """pytest plugins the project's test runs load (``ci/upstream/<project>/plugins/``)."""
    return sorted((HERE / project / "plugins").glob("*.py"))


def _env(project: str, path_entry: Path, work: Path) -> dict[str, str]:
    guard = work / "guard"
    (guard / "nemo_safe").mkdir(parents=True, exist_ok=True)
    (guard / "nemo_safe" / "__init__.py").write_text(GUARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_SAFE_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([str(guard), str(path_entry), *{str(p.parent) for p in _plugins(project)}])
    return env


def _cwd(work: Path) -> Path:
    """A new empty working directory for each run: `python -m` puts it first on sys.path, and the tree itself
    must not be there (torchvision's tree lacks the compiled parts the copy on PYTHONPATH has); NeMo's tests write
    into it (./nemo_experiments, ./lightning_logs) and count what they find there."""
    cwd = work / f"cwd-{time.monotonic_ns()}"
    cwd.mkdir()
    return cwd


def _test_id(case: ET.Element) -> str:
    """``tests.core.test_x.TestX`` + ``test_y`` -> ``tests/core/test_x.py::TestX::test_y``."""
    parts = case.get("classname", "").split(".")
    for cut in range(len(parts), 0, -1):  # the module is the longest prefix that names a test_*.py
        if parts[cut - 1].startswith("test_"):
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])
    return "::".join([*parts, case.get("name", "")])


def _run_tests(project: str, python: str, path_entry: Path, tree: Path, tests: list[str], work: Path) -> Outcome:
    env, cwd = _env(project, path_entry, work), _cwd(work)
    origin = subprocess.run(
        [python, "-c", f"import {project}; print({project}.__file__)"], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    if not origin.stdout.strip().startswith(str(path_entry)):
        raise VerifyError(f"{project} came from {origin.stdout.strip()!r}, not {path_entry}: {origin.stderr[-2000:]}")
    report = work / f"junit-{time.monotonic_ns()}.xml"
    started = time.monotonic()
    # --noconftest: the 2.7.3 wheel ships NeMo's tests/conftest.py, which first downloads NeMo's test data archive
    # from GitHub (no internet here); the series' tests need none of its fixtures.
    out = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q", "-rfE", f"--rootdir={tree}",
         f"--junitxml={report}", *(f"-p{p.stem}" for p in _plugins(project)), *(str(tree / t) for t in tests)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    seconds = time.monotonic() - started
    if not report.exists():
        raise VerifyError(
            f"pytest wrote no report (exit {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
        )
    outcome = Outcome({}, seconds, out.stdout[-6000:])
    for case in ET.parse(report).iter("testcase"):
        test = _test_id(case)
        kinds = {child.tag for child in case}
        outcome.results[test] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
        outcome.results[test] = outcome.results[test].replace("failure", "failed")
        for child in case:
            if child.tag in ("failure", "error"):
                message = child.get("message") or ""
                outcome.reasons[test] = message.splitlines()[0][:160] if message else ""
    return outcome


def _test_names(path: Path, relative: str) -> set[str]:
    """The test ids a test file defines (``file::name``, ``file::Class::name``), read from its source."""
    if not path.exists():
        return set()
    ids = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            ids.add(f"{relative}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids |= {
                f"{relative}::{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test")
            }
    return ids


def _base_id(test: str) -> str:
    return test.split("[", 1)[0]  # parametrized cases count as their function


def _tree_with(repo: Path, base: str, name: str, patches: list[Path], work: Path) -> Path:
    """A fresh worktree of the pristine release with ``patches`` applied by ``git am``."""
    tree = work / name
    git(repo, "worktree", "add", "-q", "--detach", str(tree), base)
    if patches:
        applied = git(tree, "am", "--quiet", *map(str, patches), check=False)
        if applied.returncode != 0:
            raise VerifyError(f"git am of {[p.name for p in patches]} failed in {tree}:\n{applied.stderr}")
    return tree


def _patch_files(series: Series) -> dict[str, Path]:
    files = sorted((REPO / "patches" / series.project).glob("*.patch"))
    if len(files) != len(series.patches):
        raise VerifyError(f"patches/{series.project} holds {len(files)} patches, the series {len(series.patches)}")
    return {patch.slug: path for patch, path in zip(series.patches, files, strict=True)}


def _patches_for(series: Series, version: str) -> list[UpstreamPatch]:
    """The series' patches written for ``version`` (a patch may name the releases whose code it fits)."""
    return [p for p in series.patches if p.applies_to(version)]


def _added_tests(series: Series, patch: UpstreamPatch, before: Path, after: Path) -> set[str]:
    return {t for rel in patch.tests for t in _test_names(after / rel, rel) - _test_names(before / rel, rel)}


def _verify_alone(series: Series, version: str, patch: UpstreamPatch, repo: Path, base: str, work: Path) -> str:
    files = _patch_files(series)
    needed = [files[slug] for slug in (*patch.requires, patch.slug)]
    python = _python(series.project, version)
    tree = _tree_with(repo, base, f"{series.project}-{version}-{patch.slug}", needed, work)
    before = tree if not patch.requires else _tree_with(
        repo, base, f"{series.project}-{version}-{patch.slug}-before", needed[:-1], work
    )  # fmt: skip
    added = sorted(_added_tests(series, patch, before if patch.requires else repo, tree))
    if not added:
        raise VerifyError(f"{patch.slug} adds no test")
    outcome = _run_tests(series.project, python, _importable(series.project, tree, python, work), tree, added, work)
    bad = {t: r for t, r in outcome.results.items() if r != "passed"}
    if bad or not outcome.results:
        raise VerifyError(f"{patch.slug} alone on {version}: {bad or 'nothing ran'}\n{outcome.log}")
    alone = "alone" if not patch.requires else f"with {', '.join(patch.requires)}"
    return f"  {patch.slug} ({alone}): git am clean; its {len(added)} new tests: {outcome.summary()}"


def _verify_series(series: Series, version: str, repo: Path, base: str, work: Path) -> list[str]:
    project, python = series.project, _python(series.project, version)
    patches = _patches_for(series, version)
    files = [_patch_files(series)[p.slug] for p in patches]
    tree = _tree_with(repo, base, f"{project}-{version}-series", files, work)
    test_files = sorted({t for p in patches for t in p.tests})
    added = {t for p in patches for t in _added_tests(series, p, repo, tree)}
    races = {t for p in patches for t in p.race_tests}
    whole = series.runs_whole_files(version)
    patched_tests, unpatched_tests = (test_files, test_files) if whole else (sorted(added), sorted(races))
    patched = _run_tests(project, python, _importable(project, tree, python, work), tree, patched_tests, work)

    pristine = _tree_with(repo, base, f"{project}-{version}-pristine", [], work)
    for rel in test_files:  # the series' versions of the test files, on the unpatched release
        (pristine / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, pristine / rel)
    unpatched = _run_tests(
        project, python, _importable(project, pristine, python, work), pristine, unpatched_tests, work
    )

    regressed = [t for t in unpatched.having("passed") if patched.results.get(t) != "passed"]
    new_not_passing = [t for t, r in patched.results.items() if _base_id(t) in added and r != "passed"]
    missing_new = added - {_base_id(t) for t in patched.results}
    if regressed or new_not_passing or missing_new:
        raise VerifyError(
            f"{project} {version} series: passing unpatched but not patched: {regressed}; new tests not passing: "
            f"{new_not_passing}; new tests that did not run: {sorted(missing_new)}\n{patched.log}"
        )
    not_failing = [
        t for t in races if not any(_base_id(r) == t and unpatched.results[r] == "failed" for r in unpatched.results)
    ]
    if not_failing:
        raise VerifyError(f"{project} {version} unpatched: race tests did not fail: {not_failing}\n{unpatched.log}")
    ran = (
        (f"{', '.join(test_files)} patched" if whole else f"the {len(added)} tests the series adds patched")
        + f": {patched.summary()}; "
        + ("unpatched" if whole else "its race tests unpatched")
    )
    lines = [
        f"  series of {len(files)}: git am clean; {ran}: {unpatched.summary()}",
        f"  race tests failing unpatched, passing patched: {', '.join(sorted(races))}",
    ]
    lines += [f"    unpatched {t}: {r}" for t, r in sorted(unpatched.reasons.items()) if _base_id(t) in races]
    if whole:
        lines += _new_tests_unpatched(series, version, added, races, unpatched)
    known = sorted(t for t, r in patched.results.items() if r != "passed")
    if known:
        lines.append(f"  failing or skipped patched and unpatched alike (the release's own, here): {known}")
    lines.append(_windows_imports(series, version, repo, base, tree, work))
    return lines


def _new_tests_unpatched(
    series: Series, version: str, added: set[str], races: set[str], unpatched: Outcome
) -> list[str]:
    """Each test the series adds, run on the unpatched release: it fails there (it can fail), or it is declared
    behaviour-keeping (``keeps_behaviour``) and passes. A new test that passes unpatched undeclared, or a declared
    one that fails, is an error: the first could be a test that cannot fail."""
    keeping = {t for p in _patches_for(series, version) for t in p.keeps_behaviour}
    lines, wrong = [f"  each new test on the unpatched release ({len(added)}):"], []
    for test in sorted(added):
        results = {r for t, r in unpatched.results.items() if _base_id(t) == test}
        reasons = sorted({unpatched.reasons.get(t, "") for t in unpatched.results if _base_id(t) == test} - {""})
        if test in keeping:
            kept = results == {"passed"}
            verdict = "passes: declared behaviour-keeping" if kept else f"declared keeping but {sorted(results)}"
            wrong += [] if kept else [test]
        elif results and "passed" not in results:
            kind = "race test, " if test in races else ""
            verdict = f"fails ({kind}{reasons[0][:100] if reasons else ', '.join(sorted(results))})"
        else:
            verdict = f"NOT failing unpatched ({', '.join(sorted(results)) or 'did not run'}) and not declared keeping"
            wrong.append(test)
        lines.append(f"    {test}: {verdict}")
    if wrong:
        raise VerifyError(f"{series.project}: new tests that neither fail unpatched nor are declared keeping: {wrong}\n"
                          + "\n".join(lines))  # fmt: skip
    return lines


def _windows_imports(series: Series, version: str, repo: Path, base: str, tree: Path, work: Path) -> str:
    changed = git(tree, "diff", "--name-only", "--diff-filter=AM", base, "HEAD", "--", f"{series.project}/*.py")
    modules = sorted(p[: -len(".py")].replace("/", ".").removesuffix(".__init__") for p in changed.stdout.split())
    python = _python(series.project, version)
    env = _env(series.project, _importable(series.project, tree, python, work), work)
    code = WINDOWS_STAND_IN + "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    out = subprocess.run(
        [python, "-c", code], env=env, cwd=_cwd(work), capture_output=True, text=True, timeout=HANG_GUARD
    )
    if out.returncode != 0:
        raise VerifyError(
            f"{series.project} {version}: without os.O_NOFOLLOW and os.link, importing {modules} fails:\n"
            + out.stderr[-3000:]
        )
    return f"  without os.O_NOFOLLOW and os.link (Windows): {', '.join(modules)} import"


def verify(series: Series, version: str, work: Path) -> list[str]:
    repo = pristine_repo(series.distribution, version, work / f"{series.project}-{version}", series.upstream_files)
    base = git(repo, "rev-parse", "HEAD").stdout.strip()
    lines = [f"{series.project} {version}:"]
    print(f"verify_patches: {lines[0]}", flush=True)
    for patch in series.patches:
        if patch.applies_to(version):
            lines.append(_verify_alone(series, version, patch, repo, base, work))
        else:
            lines.append(f"  {patch.slug}: not for {version} (written for {', '.join(patch.releases)})")
        print(f"verify_patches: {lines[-1]}", flush=True)
    for line in _verify_series(series, version, repo, base, work):
        lines.append(line)
        print(f"verify_patches: {line}", flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=[s.project for s in all_series()])
    parser.add_argument("--release", help="only this release of the project(s)")
    parser.add_argument(
        "--which", choices=("all", "newest", "older"), default="all",
        help="newest: each series on its newest verified release (CI); older: the others (the release sweep)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    summary: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="nemo_safe-verify-") as tmp:
        for series in all_series():
            if args.only and series.project != args.only:
                continue
            releases = {"all": series.verified, "newest": series.verified[:1], "older": series.verified[1:]}
            for version in releases[args.which]:
                if args.release and version != args.release:
                    continue
                try:
                    lines = verify(series, version, Path(tmp))
                except VerifyError as exc:
                    print(f"verify_patches: FAILED: {exc}", flush=True)
                    return 1
                summary[f"{series.project} {version}"] = lines
    print(f"verify_patches: ok ({json.dumps(sorted(summary))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
