"""The barrier's corners (issue 21): two ranks are a world, a retry is a new attempt, ranks meet only
where they can tell they do, and nothing of a dead process keeps a live one waiting or exiting.

Real processes with launcher variables (tests/barrier_worker.py), a real TCPStore where the store is
the subject. Each case has a twin showing what the fix changes; the NeMo-level twins (upstream NeMo,
NEMO_SAFE_DISABLE=1) are in tests/test_nemo_corners.py.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from procs import WORKER, clean_env, slurm_env, start_ranks, torchrun_env

HANG_GUARD = 120
GRACE = 1.5


def _torchrun(world: int, run_id: str):
    return lambda rank: torchrun_env(rank, world, run_id)


def _slurm(world: int, job: str):
    return lambda rank: slurm_env(rank, world, job)


def _label(env: dict[str, str], name: str = "test") -> str:
    code = "from nemo_safe import cluster_identity as c; print(c.sanitize_component(c.detect().attempt_key))"
    key = subprocess.run([sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    return f"{name}.{key}.0"


def _store_server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


# -- 1. two ranks are a world: rank 1 never counts itself as evidence -------------------------------


def test_two_ranks_rank1_alone_in_another_directory_falls_back_after_the_grace(tmp_path: Path) -> None:
    """Rank 1's directory is not rank 0's (node-local disk): it alone is present there, which says nothing
    about rank 0, so it gives up after the grace (RankZeroAbsent: the caller carries on as upstream)."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    args = ["--dir", str(shared), "--dir-for-odd-ranks", str(elsewhere), "--open", "--timeout", "60"]
    ranks = start_ranks(2, _slurm(2, "2101"), [*args, "--grace", str(GRACE)]).finish(HANG_GUARD)
    res = ranks.results[1]
    assert res["status"] == "absent" and "with two ranks" in res["error"], res
    assert res["seconds"] < GRACE + 10, "rank 1 must give up after the grace, not at the 60 s timeout"
    assert ranks.results[0]["status"] == "ok", ranks.results[0]


def test_two_ranks_sharing_the_directory_stay_ordered_with_the_grace(tmp_path: Path) -> None:
    """The twin: the same two ranks sharing the directory, rank 0 on time: rank 1 waits for its work."""
    args = ["--dir", str(tmp_path), "--open", "--timeout", "60", "--grace", str(GRACE), "--work-seconds", "3"]
    ranks = start_ranks(2, _slurm(2, "2102"), args).finish(HANG_GUARD)
    assert ranks.results[1]["status"] == "ok" and ranks.results[1]["saw_marker"], ranks.results[1]


# -- 2. a retry is a new attempt ------------------------------------------------------------------


def test_retry_at_once_inside_one_step_is_a_new_attempt(tmp_path: Path) -> None:
    """`srun bash -c 'until python train.py; do :; done'`: attempt 1's rank 0 fails, both tasks run again at
    once (well within the 5 s clock-skew margin), rank 0 2 s late. Attempt 2's rank 0 takes over the claim
    of attempt 1's exited rank 0 (same host: its pid is gone), and rank 1 takes attempt 2's outcome, not
    attempt 1's failure still in the records."""
    env = _slurm(2, "2103")
    first = start_ranks(2, env, ["--dir", str(tmp_path), "--open", "--rank0-fault", "raise", "--work-seconds", "1",
                                 "--timeout", "20"]).finish(HANG_GUARD)  # fmt: skip
    assert first.results[1]["error_type"] == "RankZeroFailed", first.results[1]
    assert list(tmp_path.glob(".nemo_safe/*/leader")), "attempt 1 must leave its claim for this to mean anything"
    args = ["--dir", str(tmp_path), "--open", "--rank0-delay", "2", "--work-seconds", "0.5", "--timeout", "60"]
    second = start_ranks(2, env, args).finish(HANG_GUARD)
    assert second.results[0]["status"] == "ok", second.results[0]
    assert second.results[1]["status"] == "ok" and second.results[1]["saw_marker"], second.results[1]
    assert second.results[1]["seconds"] < 20


def test_retry_of_rank1_while_attempt_1s_rank0_still_accepts(tmp_path: Path) -> None:
    """Attempt 1's rank 0 enters 6 s late, fails at once and stays alive accepting late ranks; its rank 1
    takes the failure (published since it started), and its retry starts at once and answers the session
    still open. Attempt 1's rank 0 must not count the retry as rank 1 (rank 1 took the outcome already),
    so the retry waits for attempt 2's rank 0 and takes its outcome, not attempt 1's failure."""
    env = _slurm(2, "2104")
    run1 = ["--dir", str(tmp_path), "--open", "--rank0-fault", "raise", "--work-seconds", "0", "--timeout", "30",
            "--rank0-delay", "6", "--rank0-linger", "8"]  # fmt: skip
    first = start_ranks(2, env, run1)
    first.procs[1].wait(timeout=HANG_GUARD)
    retry = start_ranks(2, env, ["--dir", str(tmp_path), "--open", "--timeout", "60"], ranks=[1])
    first.finish(HANG_GUARD)  # rank 0 lingers 8 s, accepting, while the retry polls
    assert first.results[1]["error_type"] == "RankZeroFailed", first.results[1]
    second = start_ranks(2, env, ["--dir", str(tmp_path), "--open", "--work-seconds", "0.5"], ranks=[0])
    second.finish(HANG_GUARD)
    retry.finish(HANG_GUARD)
    assert second.results[0]["status"] == "ok", second.results[0]
    assert retry.results[1]["status"] == "ok" and retry.results[1]["saw_marker"], retry.results[1]


def test_retry_exec_by_the_wrapper_shell_is_a_new_attempt(tmp_path: Path) -> None:
    """`bash -c 'python train.py || python train.py'` execs the retry in place of the shell: it keeps the
    shell's pid and start time, from before attempt 1. Attempt 1's rank 0 fails 6 s after the shells
    started, so by the process start its failure looks published during the retry's life; the retry of
    rank 1 must still not take it (the program's start counts), and takes attempt 2's outcome."""
    worker = f"{sys.executable} {WORKER} --dir {tmp_path} --open --timeout 60"
    lines = {
        0: f"{worker} --rank0-fault raise --work-seconds 0 --rank0-delay 6 || {worker} --rank0-delay 3",
        1: f"{worker} || {worker}",
    }
    procs = {
        rank: subprocess.Popen(
            ["bash", "-c", line],
            env=clean_env(**slurm_env(rank, 2, "2106")),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for rank, line in lines.items()
    }
    runs = {}
    for rank, proc in procs.items():
        out, err = proc.communicate(timeout=HANG_GUARD)
        runs[rank] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(runs[rank]) == 2, (rank, runs[rank], err[-2000:])
    assert runs[1][0]["error_type"] == "RankZeroFailed", runs[1][0]
    assert runs[1][1]["pid"] == procs[1].pid, "the retry must be exec'd by the shell for this test to mean anything"
    assert runs[0][1]["status"] == "ok", runs[0][1]
    assert runs[1][1]["status"] == "ok" and runs[1][1]["saw_marker"], runs[1][1]


def test_failure_to_open_is_published(tmp_path: Path) -> None:
    """Rank 0 cannot open (a claim of another host, seconds old: a second rank 0): it publishes that
    failure, so the waiting rank stops at once with the reason instead of at its 60 s timeout."""
    work = tmp_path / "work"
    env = _slurm(2, "2105")
    records = work / ".nemo_safe" / _label(env(1))
    records.mkdir(parents=True)
    claim = {"host": "another-host", "pid": 4242, "nonce": "f00d", "time": time.time()}
    (records / "leader").write_text(json.dumps(claim))
    args = ["--dir", str(work), "--open", "--timeout", "60", "--rank0-delay", "2"]
    ranks = start_ranks(2, env, args).finish(HANG_GUARD)
    assert "two processes claim rank 0" in ranks.results[0]["error"], ranks.results[0]
    res = ranks.results[1]
    assert res["error_type"] == "RankZeroFailed" and "another-host" in res["error"], (res["error"], res["seconds"])
    assert res["seconds"] < 20, res


# -- 3. ranks that disagree on the store still meet upstream's way --------------------------------


@pytest.mark.parametrize("grace", [GRACE, None], ids=["grace", "twin-no-grace"])
def test_rank1_in_the_store_rank0_in_the_directory(tmp_path: Path, grace: float | None) -> None:
    """Rank 0's store probe failed (it meets in the directory), rank 1's succeeded (it waits in the store):
    with the grace rank 1 carries on after it; without (the store waiter before this fix) it waits out its
    timeout."""
    server = _store_server()
    run_id = secrets.token_hex(4)
    # With the grace, a timeout far beyond it: "absent" (RankZeroAbsent) is then the grace's doing, never the
    # timeout's (BarrierTimeout), and the time is only a hang guard; the twin waits out a short one.
    base = ["--dir", str(tmp_path), "--open", "--timeout", "60" if grace else "8"]
    rank0 = start_ranks(2, _torchrun(2, run_id), base, ranks=[0])
    store = ["--store", f"127.0.0.1:{server.port}"] + (["--grace", str(grace)] if grace else [])
    rank1 = start_ranks(2, _torchrun(2, run_id), [*base, *store], ranks=[1]).finish(HANG_GUARD)
    rank0.finish(HANG_GUARD)
    res = rank1.results[1]
    if grace:
        assert res["status"] == "absent" and res["seconds"] < 60, res
    else:
        assert res["error_type"] == "BarrierTimeout" and res["seconds"] >= 8, res


def test_store_connect_to_a_port_that_is_no_store_is_bounded() -> None:
    """Something else listens on MASTER_PORT: the client handshake alone would wait forever (torch 2.14);
    the channel gives up after its connect timeout."""
    from nemo_safe.barrier_channels import StoreChannel
    from nemo_safe.errors import NemoSafeError

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        started = time.monotonic()
        with pytest.raises(NemoSafeError, match="did not answer as a TCPStore"):
            StoreChannel("127.0.0.1", listener.getsockname()[1], connect_timeout=1.0)
        assert time.monotonic() - started < 5


# -- 4. nothing of a dead process holds a live one -----------------------------------------------


@pytest.mark.parametrize("rank2", ["killed", "alive"])
def test_presence_of_a_killed_process_is_no_evidence(tmp_path: Path, rank2: str) -> None:
    """An earlier round's rank 2 was SIGKILLed while present: its presence record stays. Rank 1 (rank 0
    absent) must not take it for rank 2 and wait for rank 0 until its timeout; it gives up after the grace.
    The twin: rank 2 alive and present, so rank 0 is only late and rank 1 keeps waiting past the grace, here
    until its timeout (shorter than the vouched wait), and then carries on as without rank 0 (it failed with
    BarrierTimeout before: a job upstream completes)."""
    env = _torchrun(3, secrets.token_hex(4))
    # Killed: a timeout far beyond the grace, so that "absent" is the grace's verdict, not the timeout's.
    timeout = "60" if rank2 == "killed" else "8"
    base = ["--dir", str(tmp_path), "--open", "--timeout", timeout, "--grace", str(GRACE)]
    if rank2 == "killed":
        dead = start_ranks(3, env, [*base, "--kill-ranks", "2", "--kill-after", "1"], ranks=[2]).finish(HANG_GUARD)
        assert dead.codes[2] == -signal.SIGKILL
        assert list(tmp_path.glob(".nemo_safe/*/arrive.-.2.*")), "the killed rank must leave its presence"
        ranks = start_ranks(3, env, base, ranks=[1]).finish(HANG_GUARD)
        assert ranks.results[1]["status"] == "absent" and ranks.results[1]["seconds"] < 60, ranks.results
    else:
        ranks = start_ranks(3, env, base, ranks=[1, 2]).finish(HANG_GUARD)
        for r in (1, 2):
            res = ranks.results[r]
            assert res["status"] == "absent" and "every other rank was here" in res["error"], res
            assert res["seconds"] >= 8, f"rank {r} must wait past the grace for a late rank 0: {res}"


@pytest.mark.parametrize("rank1", ["stopped", "running"])
def test_exiting_rank0_is_not_held_by_a_rank_that_stopped(tmp_path: Path, rank1: str) -> None:
    """Rank 0 releases and exits while rank 1 (accepted) is SIGSTOPped: the clean-up waits for ranks that
    still take the outcome, not for a stopped one, so rank 0's exit is not held (it was 10 s). The twin:
    rank 1 running takes the outcome and rank 0's exit removes the records."""
    args = ["--dir", str(tmp_path), "--open", "--timeout", "60", "--work-seconds", "3"]
    ranks = start_ranks(2, _torchrun(2, secrets.token_hex(4)), args)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".nemo_safe/*/arrive.*.1.*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank1 == "stopped":
        time.sleep(0.3)
        ranks.procs[1].send_signal(signal.SIGSTOP)
    proc = ranks.procs[0]
    line = proc.stdout.readline()
    printed = time.monotonic()
    proc.wait(timeout=HANG_GUARD)
    held = time.monotonic() - printed
    assert json.loads(line)["status"] == "ok"
    if rank1 == "stopped":
        ranks.procs[1].send_signal(signal.SIGCONT)
        ranks.kill(1)
        assert held < 3.5, f"rank 0's exit was held {held:.1f} s by a stopped rank"
    else:
        ranks.procs[1].wait(timeout=HANG_GUARD)
        assert held < 5, held
        assert not list(tmp_path.glob(".nemo_safe/*/*")), "the records must be removed once every rank took them"
    ranks.finish(HANG_GUARD)


# -- 5. liveness is progress: a rank 0 stuck in a call that does not return holds no one with a stall limit ----

STUCK_SECONDS = 40.0


def test_rank0_stuck_in_a_call_releases_waiters_with_a_stall_limit(tmp_path: Path) -> None:
    """Rank 0 opens, then blocks in a recv nobody answers (a hung NFS move in check_resume): its heartbeat
    thread beats on, so only its work's progress tells. exp_manager's waiters (stall limit 10 s, as NeMo's
    patch passes) carry on as upstream after about 10 s, not at the 60 s timeout; rank 0's own beat counts
    the idle time, so the bound holds from rank 1's start."""
    from nemo_safe.thread_progress import PROGRESS_LIMIT

    args = ["--dir", str(tmp_path), "--open", "--timeout", "60", "--work-seconds", str(STUCK_SECONDS),
            "--rank0-work", "stuck", "--stall-limit", str(PROGRESS_LIMIT)]  # fmt: skip
    ranks = start_ranks(3, _slurm(3, "2501"), args)
    try:
        for rank in (1, 2):
            out, err = ranks.procs[rank].communicate(timeout=HANG_GUARD)
            res = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
            assert res["status"] == "absent" and res["error_type"] == "RankZeroStalled", (res, err[-2000:])
            assert "has not advanced" in res["error"], res
            assert res["seconds"] < PROGRESS_LIMIT + 8, res  # 2 s beats + polls; the timeout was 60 s
    finally:
        for proc in ranks.procs.values():
            proc.kill()
            proc.wait()


def test_rank0_working_slowly_is_waited_for_with_a_stall_limit(tmp_path: Path) -> None:
    """The twin: rank 0 works as long (small reads every 0.2 s for 14 s, past the 10 s limit) but advances:
    the waiters wait for it and see its work done."""
    from nemo_safe.thread_progress import PROGRESS_LIMIT

    args = ["--dir", str(tmp_path), "--open", "--timeout", "60", "--work-seconds", str(PROGRESS_LIMIT + 4),
            "--rank0-work", "trickle", "--stall-limit", str(PROGRESS_LIMIT)]  # fmt: skip
    ranks = start_ranks(3, _slurm(3, "2502"), args).finish(HANG_GUARD)
    for rank in (1, 2):
        res = ranks.results[rank]
        assert res["status"] == "ok" and res["saw_marker"], res
        assert res["seconds"] >= PROGRESS_LIMIT + 3, res
