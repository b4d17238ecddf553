"""A release that carries nemo_safe's upstream fix is recognised as such, and nemo_safe stays out of it.

``patches/`` is applied (``git apply``, as ``git am`` would) to copies of the installed torchvision
and NeMo, the releases it is generated against; a process with that copy first on ``sys.path``
plays the future release. There nemo_safe must neither warn that the race remains (it does not)
nor put its own lock or ordering on top of the release's: ``nemo-safe doctor`` says "carries the
upstream fix", the library's functions stay the release's own, and NeMo keeps only the local-rank
export the fix does not cover. The same checks on the installed (unfixed) releases are the twins:
there every patch is active.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_torchvision_downloads import SKEW, _assert_all_loaded, _assert_one_fetch_each, mnist, reference, throttled

from nemo_safe.patches import nemo_exp_manager, torchvision_downloads, torchvision_mnist
from nemo_safe_tools import download_race
from nemo_safe_tools.download_race import read_results

from procs import clean_env

__all__ = ["mnist", "reference"]  # fixtures shared with the torchvision tests

REPO = Path(__file__).resolve().parents[1]
NEMO_SAFE = str(Path(sys.executable).with_name("nemo-safe"))
HANG_GUARD = 600
FIXED = "carries the upstream fix"
#: Patch name -> the series that fixes what it patches, and the name the gate looks for.
RECOGNISED = {
    "nemo-exp-manager-resume": ("nemo", nemo_exp_manager.UPSTREAM_ORDERING),
    "torchvision-atomic-downloads": ("torchvision", torchvision_downloads.UPSTREAM_ATOMIC),
    "torchvision-mnist-single-flight": ("torchvision", torchvision_mnist.UPSTREAM_ONCE),
}


def _series(project: str) -> list[Path]:
    return sorted((REPO / "patches" / project).glob("*.patch"))


def test_the_series_defines_what_the_gates_look_for() -> None:
    """The names the gates take as "the release has the fix" are the ones the series adds (no drift)."""
    for patch, (project, name) in RECOGNISED.items():
        added = "".join(p.read_text() for p in _series(project))
        assert re.search(rf"^\+def {name}\(", added, re.M), (patch, name)


def _fixed_release(package: str, project: str, dest: Path) -> Path:
    """A folder to put first on PYTHONPATH: the installed ``package`` with ``patches/<project>`` applied.
    Files the series does not touch are symlinks to the installed ones (NeMo is large)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed")
    installed = Path(spec.origin).parent
    site = dest / "site"
    shutil.copytree(installed, site / package, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__"))
    patches = _series(project)
    touched = {m for p in patches for m in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)}
    for relative in touched:
        if relative.startswith(package + "/") and (site / relative).is_symlink():
            (site / relative).unlink()
            shutil.copyfile(installed.parent / relative, site / relative)
    for patch in patches:
        subprocess.run(["git", "apply", "--include", f"{package}/*", str(patch)], cwd=site, check=True)
    return site


def _doctor(pythonpath: Path | None) -> tuple[dict[str, str], str]:
    """``nemo-safe doctor``'s patch lines (name -> "ACTIVE: ..." / "inactive: ...") and its stderr."""
    env = clean_env(**({"PYTHONPATH": str(pythonpath)} if pythonpath else {}))
    out = subprocess.run([NEMO_SAFE, "doctor"], env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {}
    for line in out.stdout.splitlines():
        name, _, rest = line.strip().partition(" ")
        if name in RECOGNISED or name == "torchvision-datasets-single-flight":
            lines[name] = rest.strip()
    return lines, out.stderr


@pytest.fixture(scope="module")
def fixed_torchvision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fixed_release("torchvision", "torchvision", tmp_path_factory.mktemp("torchvision-fixed"))


@pytest.fixture(scope="module")
def fixed_nemo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fixed_release("nemo", "nemo", tmp_path_factory.mktemp("nemo-fixed"))


@pytest.mark.parametrize("release", ["installed", "fixed"])
def test_doctor_says_which_release_carries_the_fix(release: str, fixed_torchvision: Path, fixed_nemo: Path) -> None:
    paths = f"{fixed_torchvision}{os.pathsep}{fixed_nemo}" if release == "fixed" else None
    lines, stderr = _doctor(Path(paths) if paths else None)
    assert set(lines) == {*RECOGNISED, "torchvision-datasets-single-flight"}, lines
    assert lines["torchvision-datasets-single-flight"].startswith("ACTIVE"), lines  # no upstream fix for these
    if release == "installed":
        for name in RECOGNISED:
            assert lines[name].startswith("ACTIVE") and FIXED not in lines[name], (name, lines[name])
        return
    assert "left untouched" not in stderr, stderr  # no warning that the race remains: it does not
    for name in ("torchvision-atomic-downloads", "torchvision-mnist-single-flight"):
        assert lines[name].startswith(f"inactive: {FIXED}") and "stays out" in lines[name], (name, lines[name])
    # NeMo: the ordering is the release's; only the srun/mpirun local rank is still exported.
    exp_manager = lines["nemo-exp-manager-resume"]
    assert exp_manager.startswith(f"ACTIVE: {FIXED}") and "local rank" in exp_manager, exp_manager


WHAT_IS_WRAPPED = """
import json, nemo_safe, nemo.utils.exp_manager as m, torchvision.datasets.mnist as mnist
import torchvision.datasets.utils as utils
def ours(f):  # code that lives in the nemo_safe package (a wrapper, or the overlay's copy of a function)
    return "/nemo_safe/" in getattr(getattr(f, "__code__", None), "co_filename", "")
print(json.dumps({
    "exp_manager": ours(m.exp_manager), "get_log_dir": ours(m.get_log_dir), "check_resume": ours(m.check_resume),
    "time": type(m.time).__module__.startswith("nemo_safe"), "_urlretrieve": ours(utils._urlretrieve),
    "MNIST.download": ours(mnist.MNIST.__dict__["download"]),
}))
"""


@pytest.mark.parametrize("release", ["installed", "fixed"])
def test_the_fixed_release_runs_its_own_code(release: str, fixed_torchvision: Path, fixed_nemo: Path) -> None:
    """What doctor says, read off the modules: which functions are nemo_safe's after ``import nemo_safe``."""
    env = clean_env()
    if release == "fixed":
        env["PYTHONPATH"] = f"{fixed_torchvision}{os.pathsep}{fixed_nemo}"
    out = subprocess.run(
        [sys.executable, "-c", WHAT_IS_WRAPPED], env=env, capture_output=True, text=True, timeout=HANG_GUARD
    )
    assert out.returncode == 0, out.stderr[-3000:]
    wrapped = json.loads(out.stdout.strip().splitlines()[-1])
    if release == "installed":
        assert all(wrapped.values()), wrapped
    else:
        assert wrapped == {
            "exp_manager": True,  # the local-rank export
            "get_log_dir": False,
            "check_resume": False,
            "time": False,
            "_urlretrieve": False,
            "MNIST.download": False,
        }, wrapped


def test_mnist_race_on_the_fixed_release_with_nemo_safe(
    tmp_path: Path, fixed_torchvision: Path, mnist, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release's own lock orders the download with nemo_safe imported: every rank loads, one fetch per
    file, nemo_safe's lock folder never made and no warning of nemo_safe's."""
    monkeypatch.setenv("PYTHONPATH", str(fixed_torchvision))
    with throttled(mnist) as mirror:
        out = download_race.run_spawn(
            4, tmp_path / "root", tmp_path / "res", mirror.url, disable=False, skew=SKEW, timeout=HANG_GUARD
        )
        assert out.returncode == 0, out.stderr[-3000:]
        _assert_all_loaded(read_results(tmp_path / "res"), range(4), reference)
        _assert_one_fetch_each(mirror)
    assert "nemo_safe" not in out.stderr, out.stderr[-3000:]
    assert not list((tmp_path / "root").rglob(".nemo_safe*")), list((tmp_path / "root").rglob("*"))


ONE_DEVICE_TASK = """
import json, os, sys
from pathlib import Path
if os.environ.get("NEMO_SAFE_DISABLE") != "1":
    import nemo_safe  # noqa: F401
from nemo.utils.exp_manager import exp_manager
from nemo_safe_tools.demo import nemo_lightning
pl = nemo_lightning()
trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
log_dir = Path(sys.argv[1])
exp_manager(trainer, {"explicit_log_dir": str(log_dir), "create_tensorboard_logger": False,
                      "create_checkpoint_callback": False, "seconds_to_sleep": 0})
print(json.dumps(sorted(p.name for p in log_dir.glob("nemo_log_*.txt"))))
"""


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_fixed_nemo_keeps_the_srun_local_rank_of_one_device_tasks(
    variant: str, fixed_nemo: Path, tmp_path: Path
) -> None:
    """Task 1 of a 2-task srun step on one node, one device each (Lightning's single-device strategy says local
    rank 0 in every task): on the fixed NeMo, nemo_safe still names the per-rank log after the task's
    SLURM_LOCALID; the fixed release alone (twin) names both tasks' logs ``globalrank-0_localrank-0`` (#8333).
    ``NEMO_TESTING`` makes NeMo 3.0 write a log file on every rank, as NeMo 2.x always does."""
    slurm = {
        "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "77", "SLURM_NODELIST": "node1", "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1",
    }  # fmt: skip
    disable = "1" if variant == "upstream" else "0"
    env = clean_env(PYTHONPATH=str(fixed_nemo), NEMO_SAFE_DISABLE=disable, NEMO_TESTING="1", **slurm)
    out = subprocess.run(
        [sys.executable, "-c", ONE_DEVICE_TASK, str(tmp_path / "log")],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rank = "1" if variant == "nemo_safe" else "0"  # NeMo: node_rank * devices + LOCAL_RANK
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [f"nemo_log_globalrank-{rank}_localrank-{rank}.txt"]
