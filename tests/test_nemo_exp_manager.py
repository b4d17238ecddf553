"""NeMo exp_manager resume under a real srun -N2 --ntasks-per-node=4, with the real NeMo and Lightning.

Each race test has an upstream twin (NEMO_SAFE_DISABLE=1) that must show the race.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_safe_tools.demo import make_old_log_dir, old_file_contents, read_results

from procs import clean_env

pytestmark = pytest.mark.slurm
WORKER = str(Path(__file__).resolve().parent / "nemo_worker.py")
HANG_GUARD = 600  # 8 NeMo imports on 2 cores take ~40 s; a step still running after this is a hang
OLD_FILES = 2000


def srun(
    mode: str, tmp: Path, *args: str, nodes: int = 2, per_node: int = 4, stderr: list[str] | None = None, **env: str
) -> dict[int, dict]:
    side = tmp / f"side-{len(list(tmp.glob('side-*')))}"
    side.mkdir()
    cmd = [
        "srun",
        f"-N{nodes}",
        f"--ntasks-per-node={per_node}",
        "-J",
        f"nemo-{mode}",
        "--kill-on-bad-exit=0",
        sys.executable,
        WORKER,
        mode,
        "--log-dir",
        str(tmp / "log"),
        "--side",
        str(side),
        *args,
    ]
    run_env = clean_env(NEMO_TESTING="1", MASTER_ADDR="127.0.0.1", **env)
    out = subprocess.run(cmd, cwd=tmp, env=run_env, capture_output=True, text=True, timeout=HANG_GUARD)
    if stderr is not None:
        stderr.append(out.stderr)
    return read_results(side)


def _old_log_dir(tmp: Path) -> dict[str, str]:
    """The earlier run's log_dir (``demo.make_old_log_dir``): name -> sha256 of each old file."""
    make_old_log_dir(tmp / "log", OLD_FILES)
    return {name: hashlib.sha256(data).hexdigest() for name, data in old_file_contents(OLD_FILES).items()}


def test_resume_race_is_gone_through_the_series_code(slurm_cluster, tmp_path: Path) -> None:
    """The resume race (8 ranks, rank 0 6 s late on 2,000 old files) ordered by the code of NeMo pull request 2
    (nemo_safe/patches/nemo_resume_core.py): the ranks meet where the series meets them, in
    log_dir/.exp_manager/<run>/, whose "state" says done, and nothing of nemo_safe's own barrier is on disk.
    The upstream twin and the defaults are cases of the srun matrix (test_exp_manager_matrix.py)."""
    digests = _old_log_dir(tmp_path)
    results = srun("race", tmp_path, "--rank0-delay", "6")
    assert sorted(results) == list(range(8)), results
    assert all(r["status"] == "ok" for r in results.values()), results
    for rank in range(1, 8):
        assert results[rank]["old_seen"] == 0, f"rank {rank} saw old files after exp_manager returned"
        assert results[rank]["vanished"] == 0, f"rank {rank} saw entries vanish"
    last = str(tmp_path / "log" / "checkpoints" / "model--step=2-last.ckpt")
    assert {r["ckpt_path"] for r in results.values()} == {last}
    run0 = tmp_path / "log" / "run_0"
    assert sorted(p.name for p in run0.iterdir()) == sorted(digests), "run_0 must hold exactly the old files"
    assert all(hashlib.sha256((run0 / n).read_bytes()).hexdigest() == d for n, d in digests.items())
    logs = sorted(p.name for p in (tmp_path / "log").glob("nemo_log_globalrank-*"))
    assert len(logs) == 8, f"eight tasks must write eight distinct log files, got {logs}"
    (meeting,) = (tmp_path / "log" / ".exp_manager").iterdir()
    state = json.loads((meeting / "state").read_text())
    assert state["phase"] == "done" and state["error"] is None, state
    records = [p.name for p in meeting.iterdir() if p.name.startswith("rank")]
    assert records == [], f"every waiting rank removes its arrival record: {records}"
    assert not (tmp_path / "log" / ".nemo_safe").exists(), "exp_manager no longer uses nemo_safe's own barrier"


def test_train_then_resume_twice(slurm_cluster, tmp_path: Path) -> None:
    # 2 nodes x 2 tasks: the ordering is per rank and across nodes; 8 NeMo imports per step add only time.
    def train(steps: int) -> dict[int, dict]:
        return srun("train", tmp_path, "--max-steps", str(steps), "--devices", "2", per_node=2)

    first = train(2)
    assert sorted(first) == list(range(4)) and {r["global_step"] for r in first.values()} == {2}, first
    for steps, run_dir in ((4, "run_0"), (6, "run_1")):
        again = train(steps)
        assert sorted(again) == list(range(4)), again
        assert {r["global_step"] for r in again.values()} == {steps}, again
        ckpts = {r["ckpt_path"] for r in again.values()}
        assert len(ckpts) == 1 and ckpts.pop().endswith("-last.ckpt")
        assert (tmp_path / "log" / run_dir / "cmd-args.log").exists()
        assert max(r["exp_manager_seconds"] for r in again.values()) < 60
    assert not (tmp_path / "log" / "run_2").exists()


def test_task_killed_before_exp_manager(slurm_cluster, tmp_path: Path) -> None:
    """Rank 3 (of 2 nodes x 2 tasks) dies before exp_manager. Upstream, every other rank completes exp_manager;
    so must they with nemo_safe (rank 0 never waits for anyone, the others only for rank 0), with the old files
    moved once."""
    outcomes = {}
    for variant, env in (("upstream", {"NEMO_SAFE_DISABLE": "1"}), ("nemo_safe", {})):
        case = tmp_path / variant
        case.mkdir()
        _old_log_dir(case)
        stderr: list[str] = []
        outcomes[variant] = srun("race", case, "--die-rank", "3", "--devices", "2", per_node=2, stderr=stderr, **env)
        assert "task 3: Exited with exit code 17" in stderr[0], stderr[0][-2000:]
        assert sorted(outcomes[variant]) == [0, 1, 2], outcomes[variant]
        assert all(outcomes[variant][r]["status"] == "ok" for r in (0, 1, 2)), outcomes[variant]
        moved = [p.name for p in (case / "log" / "run_0").iterdir()]
        assert sum(1 for n in moved if n.startswith("old_")) == OLD_FILES and not (case / "log" / "run_1").exists()
        if variant == "nemo_safe":
            assert len(moved) == OLD_FILES, "nothing of the current run may be archived"
    for r in (1, 2):
        ours, up = outcomes["nemo_safe"][r]["exp_manager_seconds"], outcomes["upstream"][r]["exp_manager_seconds"]
        assert ours <= up + 1.0, f"rank {r}: {ours:.2f} s with nemo_safe, {up:.2f} s upstream"


def test_read_only_log_dir(slurm_cluster, tmp_path: Path) -> None:
    """A read-only log_dir holding an earlier run's files: the ranks cannot meet there (the series warns and runs
    check_resume() unordered), so each rank ends exactly as upstream's does: rank 0 with NeMo's own OSError
    from its move, within the step's hang guard."""
    outcomes = {}
    for variant, env in (("upstream", {"NEMO_SAFE_DISABLE": "1"}), ("nemo_safe", {})):
        case = tmp_path / variant
        case.mkdir()
        _old_log_dir(case)
        log = case / "log"
        subprocess.run(["mount", "--bind", "-o", "ro", str(log), str(log)], check=True)
        try:
            # One task per node (a trainer of 2 nodes x 1 device): 2 NeMo imports per step.
            stderr: list[str] = []
            results = srun("race", case, "--devices", "1", per_node=1, stderr=stderr, **env)
        finally:
            subprocess.run(["umount", str(log)], check=True)
        assert sorted(results) == [0, 1], (variant, results)
        outcomes[variant] = {rank: (res["status"], res.get("error_type")) for rank, res in results.items()}
        if variant == "nemo_safe":
            assert "Ranks cannot meet in" in stderr[0], stderr[0][-3000:]
    assert outcomes["upstream"][0] == ("error", "OSError"), outcomes
    assert outcomes["nemo_safe"] == outcomes["upstream"], outcomes


@pytest.mark.parametrize(
    "devices,warned",
    [(4, True), (1, False)],
    ids=["trainer expects 4, srun started 2", "independent one-device tasks (a sweep)"],
)
def test_trainer_and_launcher_disagree(slurm_cluster, tmp_path: Path, devices: int, warned: bool) -> None:
    """srun -n2 but the trainer says devices x nodes = 4 (or 1: each task trains alone). Upstream's
    exp_manager completes on both tasks; so must nemo_safe's, unordered, with one warning where the numbers
    disagree (Lightning reports the mismatch itself when fit() starts)."""
    for variant, env in (("upstream", {"NEMO_SAFE_DISABLE": "1"}), ("nemo_safe", {})):
        case = tmp_path / variant
        case.mkdir()
        _old_log_dir(case)
        stderr: list[str] = []
        args = ("--devices", str(devices), "--nodes", "1")
        results = srun("race", case, *args, nodes=1, per_node=2, stderr=stderr, **env)
        assert sorted(results) == [0, 1], (variant, results, stderr[0][-3000:])
        assert all(r["status"] == "ok" for r in results.values()), (variant, results)
        assert not (case / "log" / ".nemo_safe").exists(), "nothing to order: no barrier"
        if variant == "nemo_safe":
            assert (stderr[0].count("nemo_safe cannot tell which ranks to wait for") == 2) == warned, stderr[0][-3000:]
            if warned:
                assert "num_nodes=1 x devices=4 = 4 processes but slurm started 2" in stderr[0]


def test_single_process_is_unchanged(tmp_path: Path) -> None:
    """No launcher: upstream behaviour, no barrier files."""
    _old_log_dir(tmp_path)
    side = tmp_path / "side"
    side.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            WORKER,
            "race",
            "--log-dir",
            str(tmp_path / "log"),
            "--side",
            str(side),
            "--devices",
            "1",
            "--nodes",
            "1",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    res = read_results(side)[0]
    assert res["status"] == "ok", out.stderr[-2000:]
    assert len(list((tmp_path / "log" / "run_0").iterdir())) == OLD_FILES
    assert not (tmp_path / "log" / ".nemo_safe").exists()


GUARD_PROGRAM = """
import importlib.util, logging, sys
logging.basicConfig()
spec = importlib.util.spec_from_file_location("nemo.utils.exp_manager", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["nemo.utils.exp_manager"] = module
spec.loader.exec_module(module)
original = module.check_resume
import nemo_safe
from nemo_safe import patching
patch = next(p for p in patching.registered() if p.name == "nemo-exp-manager-resume")
print(module.check_resume is original, [p for p in patching.active() if p.startswith("nemo-exp-manager")])
print(patching.status(patch)[1])
"""

MOVE_MARKER = "    if is_global_rank_zero():\n        # Check to see if any files exist that need to be moved\n"
#: Edits of the installed exp_manager.py: (what, replacement) pairs, and whether the patch must still apply.
GUARD_EDITS = {
    # Formatting, comments, annotations and a change the patch does not rely on: recognised by structure.
    "harmless": (
        [
            ("            new_run_dir.mkdir()\n", "            new_run_dir.mkdir(exist_ok=True)  # edited\n"),
            ("def check_resume(\n", "def check_resume(  # edited\n"),
        ],
        True,
    ),
    # The move no longer rank 0's only: every rank would archive rank 0's new files after it.
    "move on every rank": ([(MOVE_MARKER, MOVE_MARKER.replace("is_global_rank_zero()", "True"))], False),
    # No fixed sleep after check_resume: a release that orders start-up some other way (1.20.0 had none).
    "no fixed sleep": ([("time.sleep(cfg.seconds_to_sleep)", "time.sleep(0)")], False),
}


@pytest.mark.parametrize("case", list(GUARD_EDITS))
def test_version_guard_by_structure(tmp_path: Path, case: str) -> None:
    """The real exp_manager.py, edited: a harmless edit is patched (by structure, said at INFO); an edit of
    a fact the patch relies on leaves upstream's code in place, with one warning naming the fact."""
    import importlib.util

    real = Path(importlib.util.find_spec("nemo").submodule_search_locations[0]) / "utils" / "exp_manager.py"
    text = real.read_text()
    edits, patched = GUARD_EDITS[case]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    changed = tmp_path / "exp_manager.py"
    changed.write_text(text)
    out = subprocess.run(
        [sys.executable, "-c", GUARD_PROGRAM, str(changed)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    same, status = out.stdout.strip().splitlines()[-2:]
    if patched:
        assert same == "False ['nemo-exp-manager-resume']", out.stderr[-2000:]
        assert status.startswith("recognised by structure"), status
        assert "left untouched" not in out.stderr
    else:
        assert same == "True []", out.stderr[-2000:]
        assert status.startswith("declined: "), status
        assert out.stderr.count("nemo.utils.exp_manager is left untouched, declined: ") == 1, out.stderr[-2000:]
        fact = {"move on every rank": "check_resume moves old files only under", "no fixed sleep": "then time.sleep("}
        assert fact[case] in status and fact[case] in out.stderr, status


def test_doctor_shows_the_nemo_case() -> None:
    nemo_safe_cli = str(Path(sys.executable).with_name("nemo-safe"))
    out = subprocess.run([nemo_safe_cli, "doctor"], env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    shown = re.search(r"^  nemo-exp-manager-resume +ACTIVE: verified on nemo_toolkit", out.stdout, flags=re.M)
    assert shown, out.stdout


IMPORT_ORDER_PROGRAM = """
import sys
order = sys.argv[1]
if order == "nemo-first":
    import nemo.utils.exp_manager as em
import nemo_safe
import nemo.utils.exp_manager as em
print(em.check_resume.__name__, hasattr(em.check_resume, "__wrapped__"), type(em.time).__name__)
nemo_safe.unpatch()
print(hasattr(em.check_resume, "__wrapped__"), type(em.time).__name__)
"""


@pytest.mark.parametrize("order", ["nemo-safe-first", "nemo-first"])
def test_patch_whatever_the_import_order(order: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDER_PROGRAM, order],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    lines = out.stdout.strip().splitlines()[-2:]
    assert lines == ["check_resume True _SleepGate", "False module"], out.stderr[-2000:]


def test_demo_command_local() -> None:
    """The README's main job, on local processes: the upstream row shows the race, ours does not. Three
    ranks: with two, rank 1 cannot tell rank 0 entering 6 s late from a rank 0 that does not share the
    directory, and carries on as upstream after the 5 s sleep (test_nemo_corners.py)."""
    nemo_safe_cli = str(Path(sys.executable).with_name("nemo-safe"))
    cmd = [nemo_safe_cli, "demo", "--only", "exp_manager", "--local", "--tasks-per-node", "3", "--old-files", "200"]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.stdout.splitlines()
        if line.startswith("| upstream") or line.startswith("| with")
    }
    assert rows["upstream NeMo"][1] == "2 of 2", out.stdout  # returned while the old files were still there
    assert int(rows["upstream NeMo"][2]) > 0, out.stdout  # current-run files archived
    assert rows["with nemo_safe"][:3] == ["0 of 2", "0 of 2", "0"], out.stdout


@pytest.mark.parametrize("how", ["plain process", "interactive SLURM shell (job named bash)"])
def test_lightning_local_launcher_never_deadlocks(how: str, tmp_path: Path, request) -> None:
    """One process with devices=2: Lightning starts rank 1 only in fit(), which runs exp_manager again.
    Neither process is under a multi-process launcher, so there is no barrier to wait on."""
    side = tmp_path / "side"
    side.mkdir()
    cmd = [
        sys.executable,
        WORKER,
        "train",
        "--log-dir",
        str(tmp_path / "log"),
        "--side",
        str(side),
        "--devices",
        "2",
        "--nodes",
        "1",
        "--max-steps",
        "2",
    ]
    if how.startswith("interactive"):
        request.getfixturevalue("slurm_cluster")
        cmd = ["srun", "-N1", "-n1", "-J", "bash", *cmd]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    # Two processes (Lightning's child inherits stdout) print a result each; parse every object found.
    decoder, results, at = json.JSONDecoder(), [], out.stdout.find('{"rank"')
    while at != -1:
        obj, end = decoder.raw_decode(out.stdout, at)
        results.append(obj)
        at = out.stdout.find('{"rank"', end)
    assert out.returncode == 0 and len(results) == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert {r["global_step"] for r in results} == {2}, results
    assert not (tmp_path / "log" / ".nemo_safe").exists()
