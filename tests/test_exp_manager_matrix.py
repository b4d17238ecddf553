"""NeMo exp_manager across its configuration space, every case next to its upstream twin in the same job.

Real launchers (a two-agent ``torchrun --nnodes 2``, ``srun -N2``), real NeMo and
Lightning, one launch per launcher running every case of
``exp_manager_worker.CASES`` first as upstream NeMo and then with nemo_safe.
What must hold with nemo_safe ("never worse than upstream", issue 9):

* every rank completes where upstream completes, and fails with NeMo's own
  error where upstream fails;
* every rank returns the same ``log_dir`` (upstream gives rank 0 a versioned
  one and the others none);
* no rank waits longer than upstream did or than rank 0's own work (start
  skew included), plus a poll interval; the tables are printed (``-s``);
* with rank 0 entering 6 s late on old files, nobody sees old files or
  entries vanish, the old files are moved exactly once and nothing of the
  current run is archived, while the upstream twin shows the race.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_safe_tools import demo

import exp_manager_worker as worker
from procs import clean_env

WORKER = str(Path(__file__).resolve().parent / "exp_manager_worker.py")
HANG_GUARD = 900  # 8 NeMo imports on 2 cores take ~60 s and every upstream run sleeps 5 s; this is a hang
SLACK = 1.0  # a poll interval and process noise on a 2-core machine: generous on purpose
ALL_CASES = tuple(worker.CASES)
RACE_CASES = tuple(c for c, spec in worker.CASES.items() if spec.rank0_late)

Results = dict[tuple[str, str, str, int], dict[str, Any]]  # (round, case, variant, rank) -> result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(base: Path, cases: tuple[str, ...]) -> None:
    for case in cases:
        if worker.CASES[case].old_run:
            for variant in ("upstream", "nemo_safe"):
                demo.make_old_log_dir(worker.old_files_dir(base, case, variant), worker.OLD_FILES)


def parse(side: Path) -> Results:
    results: Results = {}
    for path in sorted(side.glob("results.*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            results[(r["round"], r["case"], r["variant"], r["rank"])] = r
    return results


def run_torchrun(tmp: Path, cases: tuple[str, ...], *extra: str, max_restarts: int = 0, **env: str) -> Results:
    """``torchrun --nnodes 2 --nproc-per-node 2``: two agents on this machine, c10d rendezvous."""
    base, side = tmp / "base", tmp / "side"
    base.mkdir(exist_ok=True)
    side.mkdir(exist_ok=True)
    port, torchrun = free_port(), str(Path(sys.executable).with_name("torchrun"))
    cmd = [
        torchrun,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"matrix{port}",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        WORKER,
        *("--base", str(base), "--side", str(side), "--cases", ",".join(cases)),
        *("--devices", "2", "--nodes", "2", *extra),
    ]
    run_env = clean_env(NEMO_TESTING="1", **env)
    agents = [
        subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    for agent in agents:
        _finish(agent, HANG_GUARD)
    return parse(side)


def run_srun(tmp: Path, cases: tuple[str, ...], node_local: bool = False, **env: str) -> tuple[Results, str]:
    """``srun -N2 --ntasks-per-node=4``; with ``node_local`` every task gets a private mount namespace
    in which ``base`` is a different directory per node (the same path on a different disk)."""
    base, side = tmp / "base", tmp / "side"
    base.mkdir(exist_ok=True)
    side.mkdir(exist_ok=True)
    args = [WORKER, "--base", str(base), "--side", str(side), "--cases", ",".join(cases), "--devices", "4"]
    args += ["--nodes", "2"]
    cmd = ["srun", "-N2", "--ntasks-per-node=4", "-J", "exp-matrix", "--kill-on-bad-exit=0"]
    if node_local:
        for node in (0, 1):
            (tmp / f"disk{node}").mkdir(exist_ok=True)
        script = f'mount --bind "{tmp}/disk$SLURM_NODEID" "{base}" && exec "$0" "$@"'
        cmd += ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, *args]
    else:
        cmd += [sys.executable, *args]
    proc = subprocess.Popen(
        cmd,
        env=clean_env(NEMO_TESTING="1", MASTER_ADDR="127.0.0.1", **env),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = _finish(proc, HANG_GUARD)
    return parse(side), err


def _finish(proc: subprocess.Popen[str], guard: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=guard)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"hang: still running {guard:.0f} s after start\n{out[-3000:]}\n{err[-3000:]}") from None


def ranks_of(results: Results, rnd: str, case: str, variant: str) -> dict[int, dict[str, Any]]:
    return {k[3]: v for k, v in results.items() if k[:3] == (rnd, case, variant)}


def timing_table(results: Results, rnd: str, cases: tuple[str, ...], world: int) -> str:
    rows = ["| case | upstream: rank 0 / others (s) | nemo_safe: rank 0 / others (s) | log_dirs upstream / nemo_safe |"]
    rows.append("|---|---|---|---|")
    for case in cases:
        cells = []
        dirs = []
        for variant in ("upstream", "nemo_safe"):
            r = ranks_of(results, rnd, case, variant)
            others = [r[k]["seconds"] for k in range(1, world) if k in r]
            cells.append(f"{r[0]['seconds']:.2f} / {min(others):.2f}-{max(others):.2f}" if 0 in r and others else "?")
            dirs.append(str(len({x.get("log_dir") for x in r.values()})))
        rows.append(f"| {case} | {cells[0]} | {cells[1]} | {' / '.join(dirs)} |")
    return "\n".join(rows)


# -- what must hold, per case -------------------------------------------------------------


def check_case(results: Results, base: Path, rnd: str, case: str, world: int, shared: bool = True) -> None:
    up, ours = ranks_of(results, rnd, case, "upstream"), ranks_of(results, rnd, case, "nemo_safe")
    assert sorted(up) == sorted(ours) == list(range(world)), f"{case}: ranks missing: {sorted(up)} / {sorted(ours)}"
    up_failed = {r: x.get("error_type") for r, x in up.items() if x["status"] != "ok"}
    ours_failed = {r: x.get("error_type") for r, x in ours.items() if x["status"] != "ok"}
    if not up_failed:
        assert not ours_failed, f"{case}: upstream completes but with nemo_safe ranks fail: {ours}"
    else:
        # Where upstream fails, every rank fails with the same error upstream raises (NeMo's own type).
        assert ours_failed == up_failed, f"{case}: upstream fails with {up_failed}, nemo_safe with {ours_failed}"
        return
    if shared:
        dirs = {x["log_dir"] for x in ours.values()}
        assert len(dirs) == 1, f"{case}: with nemo_safe every rank must get rank 0's log_dir, got {dirs}"
        rank0_dir = Path(ours[0]["log_dir"]).relative_to(worker.case_dir(base, case, "nemo_safe"))
        up_rank0_dir = Path(up[0]["log_dir"]).relative_to(worker.case_dir(base, case, "upstream"))
        assert rank0_dir.parts[:-1] == up_rank0_dir.parts[:-1], f"{case}: rank 0's log_dir has another shape"
    late = worker.RANK0_LATE if worker.CASES[case].rank0_late else 0.0
    bound0 = late + ours[0]["seconds"]
    for r in range(1, world):
        bound = max(up[r]["seconds"], bound0) + SLACK
        assert ours[r]["seconds"] <= bound, (
            f"{case}: rank {r} spent {ours[r]['seconds']:.2f} s in exp_manager with nemo_safe; upstream took "
            f"{up[r]['seconds']:.2f} s and rank 0 was done {bound0:.2f} s after the start"
        )


def check_race(results: Results, base: Path, rnd: str, case: str, world: int) -> None:
    up, ours = ranks_of(results, rnd, case, "upstream"), ranks_of(results, rnd, case, "nemo_safe")
    for r in range(1, world):
        assert ours[r]["old_seen"] == 0, f"{case}: rank {r} saw old files after exp_manager returned"
        assert ours[r]["vanished"] == 0, f"{case}: rank {r} saw entries vanish under it"
    archive = worker.old_files_dir(base, case, "nemo_safe")
    old = demo.old_file_contents(worker.OLD_FILES)
    moved = sorted(p.name for p in (archive / "run_0").iterdir())
    assert moved == sorted(old), "run_0 must hold exactly the old files"
    for name, data in old.items():
        assert (archive / "run_0" / name).read_bytes() == data, f"{case}: {name} not moved whole"
    assert not (archive / "run_1").exists(), "old files must be moved exactly once"
    logs = {p.name for p in archive.glob("nemo_log_globalrank-*")}
    assert len(logs) == world, f"{case}: every rank keeps a log file of its own in log_dir, got {sorted(logs)}"
    # The upstream twin: rank 0 enters after upstream's 5 s sleep, so every other rank returned before the move.
    saw_old = [r for r in range(1, world) if up[r]["old_seen"]]
    assert saw_old == list(range(1, world)), f"{case}: upstream must show the race, old files seen by {saw_old}"
    up_archive = worker.old_files_dir(base, case, "upstream")
    archived_current = [p.name for p in (up_archive / "run_0").iterdir() if not p.name.startswith("old_")]
    assert archived_current, f"{case}: upstream archives files of the current run into run_0"


# -- torchrun: two agents, c10d ---------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Results, Path]]:
    tmp = tmp_path_factory.mktemp("torchrun_matrix")
    prepare(tmp / "base", ALL_CASES)
    started = time.monotonic()
    results = run_torchrun(tmp, ALL_CASES)
    print(
        f"\ntorchrun --nnodes 2 --nproc-per-node 2, {len(ALL_CASES)} cases x 2 variants: "
        f"{time.monotonic() - started:.0f} s\n{timing_table(results, 'r1', ALL_CASES, 4)}"
    )
    yield results, tmp / "base"


@pytest.mark.parametrize("case", ALL_CASES)
def test_torchrun_two_nodes(torchrun_matrix: tuple[Results, Path], case: str) -> None:
    results, base = torchrun_matrix
    check_case(results, base, "r1", case, 4)
    if case in RACE_CASES:
        check_race(results, base, "r1", case, 4)
    # The agent's store is where torchrun ranks meet: nothing of nemo_safe on disk.
    assert not list(worker.case_dir(base, case, "nemo_safe").rglob(".nemo_safe")), "no files under torchrun"


def test_torchrun_restart_with_differing_restart_counts(tmp_path: Path) -> None:
    """A real restart: rank 3 (second agent) fails once after exp_manager. Its agent counts the failure,
    the first agent restarts on the membership change without counting it, so the second round's ranks
    disagree on TORCHELASTIC_RESTART_COUNT; the first round's outcome is still in the agent's store. The
    second round (rank 0 late on the first round's files) must be ordered like any other."""
    case = "resume_explicit_rank0_late"
    prepare(tmp_path / "base", (case,))
    results = run_torchrun(tmp_path, (case,), "--die-once-rank", "3", max_restarts=1)
    counts = {r: ranks_of(results, "r2", case, "nemo_safe")[r]["restart_count"] for r in range(4)}
    assert counts == {0: "0", 1: "0", 2: "1", 3: "1"}, f"the agents must disagree on the restart count: {counts}"
    for rnd in ("r1", "r2"):
        up, ours = ranks_of(results, rnd, case, "upstream"), ranks_of(results, rnd, case, "nemo_safe")
        assert all(x["status"] == "ok" for x in [*up.values(), *ours.values()]), (rnd, up, ours)
        assert len({x["log_dir"] for x in ours.values()}) == 1
    ours = ranks_of(results, "r2", case, "nemo_safe")
    up = ranks_of(results, "r2", case, "upstream")
    for r in range(1, 4):
        assert ours[r]["old_seen"] == 0 and ours[r]["vanished"] == 0, f"round 2, rank {r}: {ours[r]}"
        assert ours[r]["seconds"] >= worker.RANK0_LATE - SLACK, "round 1's outcome released a round-2 rank"
    assert [r for r in range(1, 4) if up[r]["old_seen"]] == [1, 2, 3], "upstream must show the race in round 2"
    log_dir = worker.old_files_dir(tmp_path / "base", case, "nemo_safe")
    # Round 1 moved the old files into run_0; round 2 moved the new old files and round 1's own files into
    # run_1, once, and nothing of its own run.
    assert len(list((log_dir / "run_0").iterdir())) == worker.OLD_FILES
    run_1 = sorted(p.name for p in (log_dir / "run_1").iterdir())
    assert sum(1 for n in run_1 if n.startswith("old_")) == worker.OLD_FILES
    assert "cmd-args.log" in run_1 and not (log_dir / "run_2").exists()
    assert (log_dir / "cmd-args.log").exists(), "round 2's own files stay in log_dir"


# -- srun: two nodes of four tasks ------------------------------------------------------


@pytest.fixture(scope="module")
def srun_matrix(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Results, Path]]:
    tmp = tmp_path_factory.mktemp("srun_matrix")
    prepare(tmp / "base", ALL_CASES)
    started = time.monotonic()
    results, _ = run_srun(tmp, ALL_CASES)
    print(
        f"\nsrun -N2 --ntasks-per-node=4, {len(ALL_CASES)} cases x 2 variants: "
        f"{time.monotonic() - started:.0f} s\n{timing_table(results, 'r1', ALL_CASES, 8)}"
    )
    yield results, tmp / "base"


@pytest.mark.slurm
@pytest.mark.parametrize("case", ALL_CASES)
def test_srun_two_nodes(srun_matrix: tuple[Results, Path], case: str) -> None:
    results, base = srun_matrix
    check_case(results, base, "r1", case, 8)
    if case in RACE_CASES:
        check_race(results, base, "r1", case, 8)
        # The upstream twin of each task's own log file (#8333; check_race asserts 8 names with nemo_safe): srun
        # sets no LOCAL_RANK, so upstream names the tasks of a node alike.
        up_dir = worker.old_files_dir(base, case, "upstream")
        up_logs = {p.name for d in (up_dir, up_dir / "run_0") for p in d.glob("nemo_log_globalrank-*")}
        assert len(up_logs) < 8, f"{case}: upstream must show tasks sharing a log file name, got {sorted(up_logs)}"
    if all(x["status"] == "ok" for x in ranks_of(results, "r1", case, "nemo_safe").values()):
        # Over the shared directory the barrier leaves only its empty hidden folder behind.
        leftovers = [p for d in worker.case_dir(base, case, "nemo_safe").rglob(".nemo_safe") for p in d.iterdir()]
        assert leftovers == [], f"{case}: the barrier left {leftovers}"


@pytest.mark.slurm
def test_srun_node_local_log_dir(slurm_cluster: None, tmp_path: Path) -> None:
    """The same path on a different disk per node: node 1's tasks can never meet rank 0 there. Upstream
    runs it (each node's ranks use their own folder; only rank 0's folder is moved); so must nemo_safe:
    node 1's tasks carry on as upstream within upstream's own seconds_to_sleep, with one warning, and
    rank 0's node is still ordered."""
    cases = ("defaults", "resume_explicit")
    for node in (0, 1):
        prepare(tmp_path / f"disk{node}", cases)
    results, stderr = run_srun(tmp_path, cases, node_local=True)
    print(f"\nnode-local log_dir under srun -N2\n{timing_table(results, 'r1', cases, 8)}")
    base = tmp_path / "base"
    for case in cases:
        check_case(results, base, "r1", case, 8, shared=False)
        ours = ranks_of(results, "r1", case, "nemo_safe")
        node0 = {x["log_dir"] for x in ours.values() if x["node"] == 0}
        assert len(node0) == 1, f"{case}: rank 0's node must agree on rank 0's log_dir: {node0}"
    ours = ranks_of(results, "r1", "resume_explicit", "nemo_safe")
    for r, x in ours.items():
        if x["node"] == 0 and r:
            assert x["old_seen"] == 0 and x["vanished"] == 0, f"rank {r} on rank 0's node must be ordered: {x}"
    for node in (0, 1):
        log_dir = worker.old_files_dir(tmp_path / f"disk{node}", "resume_explicit", "nemo_safe")
        moved = (log_dir / "run_0").is_dir()
        assert moved == (node == 0), f"only global rank 0's folder is moved (node {node}: run_0 {moved})"
    # The upstream PR's warning, once per exp_manager call: each of node 1's four tasks runs both cases.
    assert stderr.count("going on without it") == 4 * len(cases), "one warning per case on each of node 1's tasks"
