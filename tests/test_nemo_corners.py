"""Issue 21's corners with the real NeMo ``exp_manager``, each next to its upstream twin (NEMO_SAFE_DISABLE=1).

Two or three srun-style tasks (launcher variables, no slurmd needed): one NeMo process per task and attempt, so
each case costs four NeMo imports (7-10 s each). The barrier-level versions are in test_barrier_corners.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_filesystem_faults import faultfs  # noqa: F401  (the FUSE fixture)

from nemo_safe.patches.nemo_resume_upstream import _RESUME_ORDER_SILENCE as VOUCHED_WAIT
from nemo_safe_tools.demo import make_old_log_dir

from procs import clean_env, slurm_env

WORKER = str(Path(__file__).resolve().parent / "nemo_corner_worker.py")
HANG_GUARD = 300
#: Low enough that the bug (waiting to the timeout) fails the test quickly, high enough for NeMo imports.
TIMEOUT = "60"
SLEEP = 5.0  # exp_manager's seconds_to_sleep, upstream's fixed wait and nemo_safe's grace


def _start_tasks(variant: str, job: str, command, world: int = 2, **more: str) -> dict[int, subprocess.Popen]:
    """``world`` tasks of one step, each running ``command(rank)`` (a shell line). ``more``: more environment
    variables."""
    procs = {}
    for rank in range(world):
        extra = {"NEMO_SAFE_BARRIER_TIMEOUT": TIMEOUT, **more}
        extra.update({"NEMO_SAFE_DISABLE": "1"} if variant != "nemo_safe" else {})
        # One task on each node, as Lightning's SLURM environment checks them.
        nodes = {"SLURM_NODEID": str(rank), "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
                 "SLURM_NODELIST": f"node[1-{world}]"}  # fmt: skip
        env = clean_env(**{**slurm_env(rank, world, job), **nodes}, **extra)
        procs[rank] = subprocess.Popen(["bash", "-c", command(rank)], env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    return procs


def _tasks(variant: str, job: str, command, logs: Path, world: int = 2, **more: str) -> dict[int, list[dict]]:
    """:func:`_start_tasks`, then their JSON lines by rank (their stderr, nemo_safe's barrier log at debug level
    included, in ``logs/rank<r>.err``)."""
    procs = _start_tasks(variant, job, command, world, **more)
    results = {}
    for rank, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=HANG_GUARD)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                other.kill()
            raise
        (logs / f"rank{rank}.err").write_text(err)
        results[rank] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert results[rank], err[-3000:]
    return results


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_two_ranks_with_different_exp_dirs(tmp_path: Path, variant: str) -> None:
    """Rank 1's exp_dir is another folder (a node-local disk at the same path, or another working
    directory): upstream returns after its 5 s sleep; so must rank 1 with nemo_safe (its grace), not at
    the barrier timeout."""
    run = f"{sys.executable} {WORKER} --exp-dir {tmp_path / 'a'} --exp-dir-odd {tmp_path / 'b'}"
    results = _tasks(variant, f"21{len(variant)}1", lambda rank: run, tmp_path)
    r0, r1 = results[0][-1], results[1][-1]
    print(f"{variant}: exp_manager seconds rank 0 {r0['seconds']:.2f}, rank 1 {r1['seconds']:.2f}")
    assert r0["status"] == "ok" and r1["status"] == "ok", results
    assert r0["patched"] == r1["patched"] == (variant == "nemo_safe")
    assert r1["seconds"] < SLEEP + 10, f"rank 1 must return within the grace + 10 s, took {r1['seconds']:.1f}"
    assert r1["log_dir"].startswith(str(tmp_path / "b")), r1
    # Visible on rank 1, whose NeMo logger prints nothing (no NEMO_TESTING): nemo_safe's logger says it too.
    said = "going on without it" in (tmp_path / "rank1.err").read_text()
    assert said == (variant == "nemo_safe"), (tmp_path / "rank1.err").read_text()[-2000:]


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_a_waiting_rank_says_so_where_no_logging_is_configured(tmp_path: Path, variant: str) -> None:
    """Issue 24: rank 0 enters exp_manager 3 s late; the script configures no logging and NEMO_TESTING is unset, so
    NeMo prints nothing on rank 1. Rank 1 must say in NeMo's format that it waits for rank 0, where and why, and
    when it is released. Upstream's rank 1 sleeps 5 s in silence (nemo_safe's did too, before)."""
    run = f"{sys.executable} {WORKER} --exp-dir {tmp_path / 'exp'} --no-logging-config"
    results = _tasks(variant, f"24{len(variant)}1", lambda rank: run + (" --delay 3" if rank == 0 else ""), tmp_path)
    assert all(results[r][-1]["status"] == "ok" for r in results), results
    err = (tmp_path / "rank1.err").read_text()
    said = [line for line in err.splitlines() if line.startswith("[NeMo ") and "global rank 0" in line]
    if variant == "upstream":
        assert not said, err[-2000:]
        return
    where = str(tmp_path / "exp" / "exp")  # exp_dir / name
    assert len(said) == 2, err[-2000:]
    assert said[0].startswith("[NeMo I ") and f"Rank 1 waits for global rank 0 to check {where} for resuming" in said[0]
    assert said[1].startswith("[NeMo I ") and f"Rank 1: global rank 0 checked {where} (" in said[1]
    assert "[nemo_safe " not in err, err[-2000:]  # no line twice, in another voice


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_rank_zero_alone_in_another_exp_dir(tmp_path: Path, variant: str) -> None:
    """Three ranks: rank 0's exp_dir is another folder (another working directory), ranks 1 and 2 share theirs,
    so each sees the other there and takes rank 0 for late. Upstream returns after its 5 s sleep; with
    nemo_safe (the series' code) ranks 1 and 2 wait VOUCHED_WAIT s more for rank 0, then carry on as upstream
    (before 2026-12-05 they waited until the barrier timeout and failed: exp_manager raised BarrierTimeout)."""
    (tmp_path / "gate").mkdir()  # the three start exp_manager together: ranks 1 and 2 see each other at the grace
    run = (
        f"{sys.executable} {WORKER} --nodes 3 --exp-dir {tmp_path / 'shared'} --exp-dir-zero {tmp_path / 'zero'} "
        f"--gate {tmp_path / 'gate'}"
    )
    # A barrier timeout beyond the vouched wait: ending at it would be the old bug.
    results = _tasks(
        variant, f"22{len(variant)}3", lambda rank: run, tmp_path, world=3, NEMO_SAFE_BARRIER_TIMEOUT="600"
    )
    print(f"{variant}: exp_manager seconds " + ", ".join(f"rank {r} {results[r][-1]['seconds']:.1f}" for r in results))
    assert all(results[r][-1]["status"] == "ok" for r in results), results
    for rank in (1, 2):
        seconds = results[rank][-1]["seconds"]
        bound = SLEEP + (VOUCHED_WAIT if variant == "nemo_safe" else 0) + 15  # a hang guard, not a measurement
        assert seconds < bound, f"rank {rank} took {seconds:.1f} s, bound {bound:.0f} s"
        assert results[rank][-1]["log_dir"].startswith(str(tmp_path / "shared")), results[rank]
        vouched = seconds >= SLEEP + VOUCHED_WAIT  # ranks 1 and 2 saw each other: rank 0 was taken for late
        assert vouched == (variant == "nemo_safe"), f"rank {rank} must have waited for rank 0 as a late one"


@pytest.mark.fuse
@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_rank_zero_killed_by_sigterm_while_it_moves(faultfs, tmp_path: Path, variant: str) -> None:  # noqa: F811
    """Rank 0 gets SIGTERM (scancel, preemption) while it moves the earlier run's 300 files into run_0 (a FUSE
    mount whose renames take 0.2 s: a slow metadata server). It dies of the signal as upstream's does; with
    nemo_safe its state says so first, and rank 1 raises rank 0's error within seconds, from any host, instead of
    waiting out the silence limit. Upstream, rank 1 returned after its fixed sleep, as if rank 0 were fine."""
    exp_dir = faultfs("--rename-delay", "0.2")
    make_old_log_dir(exp_dir / "log", 300)
    (tmp_path / "gate").mkdir()
    run = (
        f"{sys.executable} {WORKER} --exp-dir {exp_dir} --explicit-log-dir --resume lenient "
        f"--gate {tmp_path / 'gate'}"
    )
    procs = _start_tasks(variant, f"23{len(variant)}1", lambda rank: run)
    archive = exp_dir / "log" / "run_0"
    deadline = time.monotonic() + HANG_GUARD
    while not (archive.is_dir() and len(os.listdir(archive)) >= 3):
        assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 never started moving"
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = procs[1].communicate(timeout=HANG_GUARD)
    rank1_ended = time.monotonic() - sent
    procs[0].communicate(timeout=HANG_GUARD)
    assert procs[0].returncode == -signal.SIGTERM, "rank 0 dies of the signal, as upstream's does"
    (result,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"{variant}: rank 1 {result['status']} {rank1_ended:.1f} s after the signal")
    if variant == "nemo_safe":
        assert result["status"] == "error" and result["error_type"] == "RuntimeError", (result, err[-3000:])
        assert "SIGTERM" in result["error"] and "global rank 0" in result["error"], result
        assert rank1_ended < 15, f"rank 1 took {rank1_ended:.1f} s to notice (a hang guard, not a measurement)"
    else:
        assert result["status"] == "ok", (result, err[-3000:])
    assert len(os.listdir(archive)) < 300, "rank 0 was killed in the middle of its move"


@pytest.mark.fuse
@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_rank_zero_hidden_by_a_cached_lookup(faultfs, cached_view, tmp_path: Path, variant: str) -> None:  # noqa: F811
    """Rank 1 reads the shared folder through a client that caches lookups for 3 s and a lookup that found nothing
    for 8 s (bindfs); rank 0 enters 4 s late, within the fixed sleep, and its renames take 0.02 s (faultfs), so its
    move of 300 files runs from 4 s to 10 s. Rank 1's first look for rank 0's state found nothing and its client
    keeps saying so until 8 s: at the grace (5 s) rank 1 must find the state listed and wait for rank 0, then see
    none of the earlier run's files. Upstream, rank 1 returned after its 5 s sleep in the middle of the move (it
    saw old files), as did nemo_safe before it counted a listed state as rank 0's presence."""
    shared = faultfs("--rename-delay", "0.02")
    view = cached_view(shared, "negative_timeout=8,entry_timeout=3,attr_timeout=3")
    make_old_log_dir(shared / "log", 300)
    (tmp_path / "gate").mkdir()
    run = (
        f"{sys.executable} {WORKER} --exp-dir {shared} --exp-dir-odd {view} --explicit-log-dir --resume lenient "
        f"--gate {tmp_path / 'gate'}"
    )
    results = _tasks(variant, f"23{len(variant)}2", lambda rank: run + (" --delay 4" if rank == 0 else ""), tmp_path)
    r0, r1 = results[0][-1], results[1][-1]
    print(f"{variant}: rank 1 {r1['seconds']:.1f} s in exp_manager, saw {r1.get('old_seen')} old files")
    assert r0["status"] == "ok" and r1["status"] == "ok", results
    assert len(os.listdir(shared / "log" / "run_0")) >= 300, "rank 0 moved the earlier run's files"
    if variant == "nemo_safe":
        assert r1["old_seen"] == 0, f"rank 1 went on while rank 0 moved: {r1}"
        assert "going on without it" not in (tmp_path / "rank1.err").read_text(), "rank 1 must not give up on rank 0"
    else:
        assert r1["old_seen"] > 0, f"upstream's rank 1 must return in the middle of rank 0's move: {r1}"


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream"])
def test_retry_inside_one_step(tmp_path: Path, variant: str) -> None:
    """Each task runs train.py with a strict resume (no checkpoint: it fails) and retries at once with a
    lenient one, as a new process (`python train.py || python train.py --lenient`). Upstream both ranks
    complete the retry; with nemo_safe too: the retry is a new attempt, not a second rank 0, and attempt
    1's failure in the records fails nobody."""
    run = f"{sys.executable} {WORKER} --exp-dir {tmp_path} --explicit-log-dir"
    started = time.monotonic()
    results = _tasks(
        variant, f"21{len(variant)}2", lambda rank: f"{run} --resume strict || {run} --resume lenient", tmp_path
    )
    print(variant, {r: [f"{run['status']} {run['seconds']:.2f} s" for run in runs] for r, runs in results.items()})
    for rank in (0, 1):
        first, retry = results[rank]
        assert first["status"] == "error" and first["error_type"] == "NotFoundError", first
        assert retry["status"] == "ok", (rank, retry, results)
        assert retry["seconds"] < SLEEP + 10, (rank, retry)
    assert time.monotonic() - started < HANG_GUARD


@pytest.mark.parametrize("variant", ["nemo_safe", "upstream", "series"])
def test_retry_a_shell_runs_in_its_own_process(tmp_path: Path, variant: str) -> None:
    """As above, with `python train.py; python train.py --lenient`: bash runs the last command in its own
    process, which started before the first attempt, and rank 0's retry comes 15 s after rank 1's. Rank 1's
    retry must not take attempt 1's outcome (rank 0's failure) as this attempt's. ``series``: NeMo with
    patches/nemo applied and no nemo_safe, whose ordering took it (and raised rank 0's old error) before its
    start counted from the exec."""
    env = {}
    if variant == "series":
        from test_upstream_fixed import _fixed_release

        env["PYTHONPATH"] = str(_fixed_release("nemo", "nemo", tmp_path / "fixed"))
    run = f"{sys.executable} {WORKER} --exp-dir {tmp_path} --explicit-log-dir"

    def command(rank: int) -> str:
        return f"{run} --resume strict; {run} --resume lenient --delay {15 if rank == 0 else 0}"

    results = _tasks(variant, f"21{len(variant)}3", command, tmp_path, **env)
    print(variant, {r: [f"{run['status']} {run['seconds']:.2f} s" for run in runs] for r, runs in results.items()})
    for rank in (0, 1):
        first, retry = results[rank]
        assert first["patched"] == (variant == "nemo_safe"), first
        assert retry["pid"] == first["ppid"], "the shell did not run the retry in its own process"
        assert (first["status"], first["error_type"]) == ("error", "NotFoundError"), first  # NeMo's own, every rank
        assert retry["status"] == "ok", (rank, retry, results)
        assert retry["seconds"] < SLEEP + 10, (rank, retry)
