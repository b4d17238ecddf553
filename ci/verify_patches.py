"""Verify patches/ on the pristine releases, with nemo_safe NOT imported.

    python ci/verify_patches.py                   # every project and release
    python ci/verify_patches.py --only nemo       # one project

For each release the series names in ``ci/upstream/series.py``: unpack the release's
wheel into a temporary git repository, ``git am`` the series (exact context: no fuzz,
no three-way merge), put the patched tree first on ``PYTHONPATH`` (torchvision: a copy
of the installed package, for its compiled parts, with the tree's Python files laid
over it), and run the series' tests there: all must pass. Then the race tests alone
on the unpatched release: each must fail (an assertion, not an error). A stand-in
``nemo_safe`` package that raises on import is first on ``PYTHONPATH`` throughout, so
no process of the run can pick up the overlay.
"""

from __future__ import annotations

import argparse
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
from series import Series, all_series

REPO = Path(__file__).resolve().parents[1]

#: The environment each release is tested in (its dependencies at the right versions).
VENVS = {("nemo", "3.0.0"): ".venv", ("nemo", "2.7.3"): ".venv-nemo273", ("torchvision", "0.29.1"): ".venv"}
#: Per project: the race tests that must fail on the unpatched release.
RACE_TESTS = {
    "nemo": {
        "tests/core/test_exp_manager_resume_race.py": ["test_check_resume_moves_old_files_before_other_ranks_continue"],
        "tests/core/test_exp_manager_srun_log_names.py": ["test_every_srun_task_gets_its_own_log_file"],
    },
    "torchvision": {
        "test/test_datasets_utils_atomic.py": [
            "test_download_url_broken_off_leaves_no_file",
            "test_download_url_wrong_md5_leaves_no_file",
        ],
        "test/test_datasets_download_race.py": ["test_mnist_download_from_concurrent_processes"],
    },
}
HANG_GUARD = 1200
GUARD = 'raise ImportError("nemo_safe must not be imported while the upstream patches are verified")\n'


class VerifyError(RuntimeError):
    pass


@dataclass
class Outcome:
    passed: list[str]
    failed: list[str]
    errors: list[str]
    skipped: list[str]
    seconds: float
    log: str = ""
    #: test name -> the first line of its failure message
    reasons: dict[str, str] = field(default_factory=dict)


def _python(project: str, version: str) -> str:
    venv = VENVS[(project, version)]
    python = REPO / venv / "bin" / "python"
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


def _run_tests(project: str, python: str, path_entry: Path, tree: Path, tests: list[str], work: Path) -> Outcome:
    guard = work / "guard"
    (guard / "nemo_safe").mkdir(parents=True, exist_ok=True)
    (guard / "nemo_safe" / "__init__.py").write_text(GUARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_SAFE_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([str(guard), str(path_entry)])
    # --noconftest below: the 2.7.3 wheel ships NeMo's tests/conftest.py, which first downloads NeMo's test data
    # archive from GitHub (no internet here); the series' tests need none of its fixtures.
    # An empty working directory: `python -m` puts it first on sys.path, and the tree itself must not be there
    # (torchvision's tree lacks the compiled parts the copy on PYTHONPATH has).
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)
    origin = subprocess.run(
        [python, "-c", f"import {project}; print({project}.__file__)"], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    if not origin.stdout.strip().startswith(str(path_entry)):
        raise VerifyError(f"{project} came from {origin.stdout.strip()!r}, not {path_entry}: {origin.stderr[-2000:]}")
    report = work / f"junit-{time.monotonic_ns()}.xml"
    started = time.monotonic()
    out = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q", "-rfE", f"--rootdir={tree}",
         f"--junitxml={report}",
         *(str(tree / t) for t in tests)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    seconds = time.monotonic() - started
    if not report.exists():
        raise VerifyError(
            f"pytest wrote no report (exit {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
        )
    outcome = Outcome([], [], [], [], seconds, out.stdout[-6000:])
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name", "")
        kinds = {child.tag for child in case}
        bucket = (
            outcome.errors if "error" in kinds else outcome.failed if "failure" in kinds
            else outcome.skipped if "skipped" in kinds else outcome.passed
        )  # fmt: skip
        bucket.append(name)
        for child in case:
            if child.tag == "failure":
                message = child.get("message") or ""
                outcome.reasons[name] = message.splitlines()[0][:160] if message else ""
    return outcome


def verify(series: Series, version: str, work: Path) -> list[str]:
    project = series.project
    python = _python(project, version)
    lines = []
    repo = pristine_repo(series.distribution, version, work / f"{project}-{version}")
    base = git(repo, "rev-parse", "HEAD").stdout.strip()
    patches = sorted((REPO / "patches" / project).glob("*.patch"))
    if not patches:
        raise VerifyError(f"no patches in patches/{project}")
    applied = git(repo, "am", "--quiet", *map(str, patches), check=False)
    if applied.returncode != 0:
        raise VerifyError(f"git am of patches/{project} failed on {series.distribution} {version}:\n{applied.stderr}")
    added_tests = git(
        repo, "diff", "--name-only", "--diff-filter=A", base, "HEAD", "--", "test", "tests"
    ).stdout.split()
    tests = sorted(t for t in added_tests if Path(t).name.startswith("test_"))
    lines.append(f"{project} {version}: git am of {len(patches)} patches: clean; tests {', '.join(tests)}")

    patched = _run_tests(project, python, _importable(project, repo, python, work), repo, tests, work)
    if patched.failed or patched.errors or patched.skipped or not patched.passed:
        raise VerifyError(f"{project} {version} patched: tests did not all pass: {patched}\n{patched.log}")
    lines.append(f"  patched:   {len(patched.passed)} passed in {patched.seconds:.0f} s")

    pristine = work / f"{project}-{version}-pristine"
    git(repo, "worktree", "add", "-q", "--detach", str(pristine), base)
    race = RACE_TESTS[project]
    for test in race:
        (pristine / test).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / test, pristine / test)
    upstream = _run_tests(project, python, _importable(project, pristine, python, work), pristine, list(race), work)
    must_fail = {name for names in race.values() for name in names}
    if upstream.errors or not must_fail <= set(upstream.failed):
        raise VerifyError(
            f"{project} {version} unpatched: expected {sorted(must_fail)} to fail, got {upstream}\n{upstream.log}"
        )
    lines.append(
        f"  unpatched: {len(upstream.failed)} race tests failed as expected "
        f"({', '.join(sorted(upstream.failed))}), {len(upstream.passed)} passed, in {upstream.seconds:.0f} s"
    )
    lines += [f"    {name}: {reason}" for name, reason in sorted(upstream.reasons.items())]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=[s.project for s in all_series()])
    parser.add_argument("--release", help="only this release of the project(s)")
    args = parser.parse_args(argv)
    summary: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="nemo_safe-verify-") as tmp:
        for series in all_series():
            if args.only and series.project != args.only:
                continue
            for version in series.verified:
                if args.release and version != args.release:
                    continue
                try:
                    lines = verify(series, version, Path(tmp))
                except VerifyError as exc:
                    print(f"verify_patches: FAILED: {exc}", flush=True)
                    return 1
                summary[f"{series.project} {version}"] = lines
                print("\n".join(f"verify_patches: {line}" for line in lines), flush=True)
    print(f"verify_patches: ok ({json.dumps(sorted(summary))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
