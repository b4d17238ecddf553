"""The barrier across real local processes with launcher variables set, including faults."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import clean_env, slurm_env, start_ranks, torchrun_env, wait_for_files

HANG_GUARD = 120  # generous: a rank still running after this is a hang


def _torchrun(world: int, run_id: str | None = None):
    run_id = run_id or secrets.token_hex(4)
    return lambda rank: torchrun_env(rank, world, run_id)


def test_sixteen_ranks_released_only_after_rank0_work(tmp_path: Path) -> None:
    ranks = start_ranks(16, _torchrun(16), ["--dir", str(tmp_path), "--work-seconds", "1.5"]).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.stderr
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 16)), ranks.results
    assert sorted(os.listdir(tmp_path)) == ["marker"], "a successful barrier must leave nothing behind"


def test_same_scenario_without_barrier_shows_the_race(tmp_path: Path) -> None:
    """The twin of the test above: without the barrier, ranks run ahead of rank 0's work."""
    ranks = start_ranks(16, _torchrun(16), ["--dir", str(tmp_path), "--work-seconds", "1.5", "--no-barrier"]).finish(
        HANG_GUARD
    )
    missed = [r for r in range(1, 16) if not ranks.results[r]["saw_marker"]]
    assert missed, "without the barrier some rank must miss rank 0's marker"


def test_rank0_late_by_six_seconds(tmp_path: Path) -> None:
    ranks = start_ranks(
        8, _torchrun(8), ["--dir", str(tmp_path), "--rank0-delay", "6", "--work-seconds", "0.2"]
    ).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.stderr
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 8))


def test_waiter_killed_before_arriving(tmp_path: Path) -> None:
    """kill -9 of rank 3 before it arrives: rank 0 does its work at once (it never waits before its block),
    the ranks present are released, and rank 0 ends at its timeout naming rank 3 instead of leaving it waiting."""
    ready = tmp_path / "ready"
    ready.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    ranks = start_ranks(
        6, _torchrun(6), ["--dir", str(work), "--timeout", "8", "--hold-rank", "3", "--ready-dir", str(ready)]
    )
    wait_for_files(ready, ["ready.3"], 60)
    ranks.kill(3)
    ranks.finish(HANG_GUARD)
    assert ranks.codes[3] == -9
    r0 = ranks.results[0]
    assert r0["error_type"] == "BarrierTimeout" and "ranks 3 never arrived" in r0["error"], r0
    assert "5 of 6 did" in r0["error"] and "rank 0 finished its block" in r0["error"], r0
    for r in (1, 2, 4, 5):
        assert ranks.results[r]["status"] == "ok" and ranks.results[r]["saw_marker"], ranks.results[r]
    assert (work / "marker").exists(), "rank 0 works without waiting for the missing rank"


def test_rank0_raising_reaches_every_rank(tmp_path: Path) -> None:
    ranks = start_ranks(
        6, _torchrun(6), ["--dir", str(tmp_path), "--rank0-fault", "raise", "--work-seconds", "0.3"]
    ).finish(HANG_GUARD)
    assert ranks.results[0]["error_type"] == "PermissionError"
    for r in range(1, 6):
        res = ranks.results[r]
        assert res["error_type"] == "RankZeroFailed", res
        assert "PermissionError" in res["error"] and "Permission denied" in res["error"], res


def test_rank0_killed_mid_work(tmp_path: Path) -> None:
    """Rank 0 dies inside the barrier: the others fail at their timeout saying so."""
    ranks = start_ranks(5, _torchrun(5), ["--dir", str(tmp_path), "--rank0-fault", "hang", "--timeout", "6"])
    deadline = time.monotonic() + 60
    state_dirs: list[Path] = []
    while time.monotonic() < deadline and not state_dirs:
        state_dirs = list((tmp_path / ".nemo_safe").glob("*/arrive.*"))
        time.sleep(0.05)
    time.sleep(0.5)  # let all four waiters arrive; rank 0 is now in its (hanging) work
    ranks.kill(0)
    ranks.finish(HANG_GUARD)
    for r in range(1, 5):
        res = ranks.results[r]
        assert res["error_type"] == "BarrierTimeout", res
        assert "never finished" in res["error"], res
        assert res["seconds"] < 30, "must end at its own 6 s timeout"


def test_stale_directory_same_key_never_releases_early(tmp_path: Path) -> None:
    """Attempt 1 fails (leaving a failure outcome); attempt 2 with the same key and rank 0
    6 s late must not release anyone on attempt 1's files, and completes correctly."""
    run_id = "static-none"
    first = start_ranks(
        4, _torchrun(4, run_id), ["--dir", str(tmp_path), "--rank0-fault", "raise", "--work-seconds", "0"]
    ).finish(HANG_GUARD)
    assert first.results[1]["error_type"] == "RankZeroFailed"
    leftovers = list((tmp_path / ".nemo_safe").glob("*/state"))
    assert leftovers, "attempt 1 should leave its failure state for this test to be meaningful"
    second = start_ranks(
        4, _torchrun(4, run_id), ["--dir", str(tmp_path), "--rank0-delay", "6", "--work-seconds", "0.5"]
    ).finish(HANG_GUARD)
    assert set(second.codes.values()) == {0}, second.results
    assert all(second.results[r]["saw_marker"] for r in range(1, 4))
    assert {r["key"] for r in first.results.values()} == {r["key"] for r in second.results.values()}


def test_stale_collect_state_from_killed_rank0(tmp_path: Path) -> None:
    """Attempt 1's rank 0 is killed mid-work; attempt 2 with the same key completes."""
    run_id = "static-none"
    first = start_ranks(4, _torchrun(4, run_id), ["--dir", str(tmp_path), "--rank0-fault", "hang", "--timeout", "4"])
    time.sleep(3)
    first.kill(0)
    first.finish(HANG_GUARD)
    assert list((tmp_path / ".nemo_safe").glob("*/state"))
    second = start_ranks(
        4, _torchrun(4, run_id), ["--dir", str(tmp_path), "--rank0-delay", "2", "--work-seconds", "0.5"]
    ).finish(HANG_GUARD)
    assert set(second.codes.values()) == {0}, second.results
    assert all(second.results[r]["saw_marker"] for r in range(1, 4))


def test_requeued_attempt_uses_a_new_key(tmp_path: Path) -> None:
    """SLURM requeue: same job id, SLURM_RESTART_COUNT 0 -> 1. Attempt 0 died; attempt 1 completes."""

    def env(restart: int):
        return lambda rank: slurm_env(rank, 4, "4242", restart)

    first = start_ranks(4, env(0), ["--dir", str(tmp_path), "--rank0-fault", "hang", "--timeout", "4"])
    time.sleep(3)
    first.kill(0)
    first.finish(HANG_GUARD)
    second = start_ranks(4, env(1), ["--dir", str(tmp_path), "--work-seconds", "0.5"]).finish(HANG_GUARD)
    assert set(second.codes.values()) == {0}, second.results
    assert all(second.results[r]["saw_marker"] for r in range(1, 4))
    assert first.results[1]["key"] != second.results[1]["key"]
    assert second.results[0]["launcher"] == "slurm"


def test_symlink_planted_at_barrier_path(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".nemo_safe").symlink_to(victim)
    ranks = start_ranks(4, _torchrun(4), ["--dir", str(work), "--timeout", "30"]).finish(HANG_GUARD)
    for r in range(4):
        assert ranks.results[r]["error_type"] == "UnsafeBarrierPath", ranks.results[r]
        assert ranks.results[r]["seconds"] < 10, "must refuse at once, not at the timeout"
    assert list(victim.iterdir()) == [], "nothing may be written through the planted symlink"


def test_world_size_mismatch_is_named(tmp_path: Path) -> None:
    bad = start_ranks(
        3,
        lambda r: torchrun_env(r, 3, "mismatch2"),
        ["--dir", str(tmp_path), "--timeout", "20", "--world", "3"],
        ranks=[0],
    )
    odd = start_ranks(
        3,
        lambda r: torchrun_env(r, 3, "mismatch2"),
        ["--dir", str(tmp_path), "--timeout", "20", "--world", "2"],
        ranks=[1],
    )
    bad.finish(HANG_GUARD)
    odd.finish(HANG_GUARD)
    assert "world size 2 but rank 0 uses 3" in bad.results[0]["error"], bad.results
    assert odd.results[1]["error_type"] == "ConfigurationError", odd.results
    assert "rank 0 rejected this rank 1" in odd.results[1]["error"] and "world size" in odd.results[1]["error"]
    assert bad.results[0]["seconds"] < 15, "rank 0 names the mismatch at once, not at its 20 s timeout"


def test_waiting_ranks_stay_interruptible_by_signals(tmp_path: Path) -> None:
    """While ranks wait for a late rank 0: SIGUSR1 (Lightning's requeue handler) runs and the
    rank keeps waiting (then is released); SIGTERM ends a rank at once (so rank 0 later names it as missing)."""
    ready = tmp_path / "ready"
    ready.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    args = ["--dir", str(work), "--rank0-delay", "4", "--sigusr1-handler", "--ready-dir", str(ready)]
    ranks = start_ranks(4, _torchrun(4), [*args, "--timeout", "6"])
    wait_for_files(ready, ["ready.1", "ready.2"], 60)
    time.sleep(1)  # ranks 1 and 2 are polling now; rank 0 is still 3 s away
    ranks.procs[1].send_signal(signal.SIGUSR1)
    ranks.procs[2].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    ranks.procs[2].wait(timeout=30)
    assert time.monotonic() - sent < 5, "SIGTERM must end a waiting rank promptly"
    ranks.finish(HANG_GUARD)
    assert ranks.codes[2] == -signal.SIGTERM
    assert ranks.results[1]["sigusr1"] == 1, ranks.results[1]
    assert "ranks 2 never arrived" in ranks.results[0]["error"], ranks.results[0]
    assert ranks.results[1]["status"] == "ok" and ranks.results[1]["saw_marker"], ranks.results[1]


def test_open_barrier_rank0_never_waits_for_a_missing_rank(tmp_path: Path) -> None:
    """Barrier.open(): rank 0 works at once although rank 3 never arrives; the others get its outcome.
    (rank_zero_first's rank 0 also works at once, then stays until its timeout to name the missing rank:
    test_waiter_killed_before_arriving.)"""
    ready = tmp_path / "ready"
    ready.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    args = ["--dir", str(work), "--open", "--timeout", "60", "--hold-rank", "3", "--ready-dir", str(ready)]
    ranks = start_ranks(5, _torchrun(5), args)
    for r in (0, 1, 2, 4):
        ranks.procs[r].wait(timeout=HANG_GUARD)
    ranks.kill(3)
    ranks.finish(HANG_GUARD)
    assert ranks.results[0]["status"] == "ok" and ranks.results[0]["seconds"] < 20, ranks.results[0]
    assert all(ranks.results[r]["saw_marker"] for r in (1, 2, 4)), ranks.results


def test_grace_gives_up_on_a_directory_rank0_does_not_share(tmp_path: Path) -> None:
    """Odd ranks look in another directory (a node-local disk): with a grace they stop waiting after it
    (RankZeroAbsent) instead of at the timeout, while the even ranks are ordered; without a grace (the
    twin) they wait until the timeout."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    common = ["--dir", str(shared), "--dir-for-odd-ranks", str(elsewhere), "--open"]
    # A timeout far beyond the grace: "absent" (RankZeroAbsent) is the grace's verdict, never the timeout's.
    with_grace = start_ranks(4, _torchrun(4), [*common, "--timeout", "60", "--grace", "1.5"]).finish(HANG_GUARD)
    for r in (1, 3):
        res = with_grace.results[r]
        assert res["status"] == "absent" and "not shared" in res["error"], res
        assert res["seconds"] < 60, "must give up after the grace, not at the 60 s timeout"
    assert with_grace.results[2]["saw_marker"], with_grace.results[2]
    twin = start_ranks(4, _torchrun(4), [*common, "--timeout", "8"]).finish(HANG_GUARD)
    for r in (1, 3):
        assert twin.results[r]["error_type"] == "BarrierTimeout", twin.results[r]


def test_grace_keeps_waiting_for_a_late_rank0_when_every_other_rank_is_here(tmp_path: Path) -> None:
    """Rank 0 enters 4 s late, the grace is 1 s: every other rank is present, so rank 0 is only late."""
    args = ["--dir", str(tmp_path), "--open", "--grace", "1", "--rank0-delay", "4", "--work-seconds", "0.5"]
    ranks = start_ranks(6, _torchrun(6), args).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.results
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 6)), ranks.results


def test_store_channel_orders_ranks_and_ignores_an_earlier_attempt(tmp_path: Path) -> None:
    """Over a real TCPStore (as torchrun's agent serves it), with the same key twice: the second
    attempt's ranks are not released by the first attempt's outcome while rank 0 is 4 s late."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = f"127.0.0.1:{server.port}"
    first = start_ranks(4, _torchrun(4, "same"), ["--dir", str(tmp_path), "--store", store]).finish(HANG_GUARD)
    assert all(first.results[r]["saw_marker"] for r in range(1, 4)), first.results
    (tmp_path / "marker").unlink()
    args = ["--dir", str(tmp_path), "--store", store, "--rank0-delay", "4", "--work-seconds", "0.5"]
    second = start_ranks(4, _torchrun(4, "same"), args).finish(HANG_GUARD)
    assert set(second.codes.values()) == {0}, second.results
    assert all(second.results[r]["saw_marker"] for r in range(1, 4)), second.results
    assert not (tmp_path / ".nemo_safe").exists(), "over a store nothing is written to the directory"


def test_two_processes_claiming_rank0_are_a_named_error_never_two_works(tmp_path: Path) -> None:
    """Under SLURM the key names one attempt, so rank 0 claims its place exclusively: a second process
    with SLURM_PROCID=0 in the same step stops at once with an error naming the first, before its work."""
    work = tmp_path / "work"
    work.mkdir()
    env = lambda rank: slurm_env(rank, 3, "777")  # noqa: E731
    args = ["--dir", str(work), "--open", "--timeout", "30", "--work-seconds", "2"]
    first = start_ranks(3, env, args, ranks=[0, 1, 2])
    deadline = time.monotonic() + 60
    while not list(work.glob(".nemo_safe/*/leader")) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = start_ranks(3, env, args, ranks=[0]).finish(HANG_GUARD)
    first.finish(HANG_GUARD)
    res = second.results[0]
    assert res["error_type"] == "ConfigurationError" and "two processes claim rank 0" in res["error"], res
    assert f"pid {first.results[0]['pid']}" in res["error"], "the error must name the process that got there first"
    assert res["seconds"] < 10
    assert first.results[0]["status"] == "ok" and all(first.results[r]["saw_marker"] for r in (1, 2))


def test_rerun_inside_one_srun_step_takes_over_the_earlier_runs_records(tmp_path: Path) -> None:
    """A retry loop inside one step (`srun bash -c 'until python train.py; ...'`) gives every run the same
    SLURM key. Run 1's rank 0 fails (its failure and its leader claim stay); run 2, rank 0 3 s late, must
    neither call its rank 0 a second claimant nor release anyone on run 1's outcome."""
    work = tmp_path / "work"
    work.mkdir()
    env = lambda rank: slurm_env(rank, 3, "888")  # noqa: E731
    # Run 1's rank 0 fails and exits before the others arrive: they cannot tell its outcome from an earlier
    # attempt's, so they wait out their timeout (5 s here: their outcome is not what this test is about).
    run1 = ["--dir", str(work), "--open", "--rank0-fault", "raise", "--work-seconds", "0", "--timeout", "5"]
    first = start_ranks(3, env, run1)
    first.finish(HANG_GUARD)
    assert list(work.glob(".nemo_safe/*/leader")), "run 1 must leave its claim for this test to mean anything"
    time.sleep(6)  # run 2 starts later than the clock-skew margin after run 1 published
    args = ["--dir", str(work), "--open", "--rank0-delay", "3", "--work-seconds", "0.5", "--timeout", "60"]
    second = start_ranks(3, env, args).finish(HANG_GUARD)
    assert second.results[0]["status"] == "ok", second.results[0]
    assert all(second.results[r]["saw_marker"] for r in (1, 2)), second.results


def test_frozen_accepting_state_of_a_killed_round_releases_nobody(tmp_path: Path) -> None:
    """torchrun round 1: rank 0 opens, works and releases while rank 2 never arrives, so its acceptance
    thread is still running when SIGTERM ends it (no atexit): the store keeps 'done, accepting, rank 1 =
    <dead nonce>'. Round 2 (same key), rank 0 3 s late: its rank 1 must neither take round 1's outcome nor
    call the dead nonce a second claimant."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = ["--store", f"127.0.0.1:{server.port}", "--dir", str(tmp_path), "--timeout", "60"]
    ready = tmp_path / "ready"
    ready.mkdir()
    args = [*store, "--hold-rank", "2", "--ready-dir", str(ready), "--rank0-linger", "600"]
    first = start_ranks(3, _torchrun(3, "same"), args)
    first.procs[1].wait(timeout=HANG_GUARD)
    first.procs[0].send_signal(signal.SIGTERM)
    first.kill(2)
    first.finish(HANG_GUARD)
    (tmp_path / "marker").unlink()
    second = start_ranks(3, _torchrun(3, "same"), [*store, "--rank0-delay", "3", "--work-seconds", "0.5"])
    second.finish(HANG_GUARD)
    assert set(second.codes.values()) == {0}, second.results
    assert all(second.results[r]["saw_marker"] for r in (1, 2)), second.results


def test_rank0_working_longer_than_the_timeout_is_not_silence(tmp_path: Path) -> None:
    """Rank 0 works 9 s under a 3 s timeout: alive and working, it must not be reported dead or hung;
    the timeout counts its silence (test_rank0_killed_mid_work shows that silence still ends the wait)."""
    ranks = start_ranks(4, _torchrun(4), ["--dir", str(tmp_path), "--timeout", "3", "--work-seconds", "9"]).finish(
        HANG_GUARD
    )
    assert set(ranks.codes.values()) == {0}, ranks.results
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 4)), ranks.results


def _attempt_key(env: dict[str, str]) -> str:
    code = "from nemo_safe import cluster_identity as c; print(c.sanitize_component(c.detect().attempt_key))"
    return subprocess.run([sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


@pytest.mark.parametrize(
    "foreign",
    [b"[]", b'{"phase": "done", "session": "s", "accepted": [], "ok": true}', b'{"phase": 3}', b"\xff\xfe"],
    ids=["list", "accepted-list", "phase-int", "binary"],
)
def test_foreign_state_record_is_ignored(tmp_path: Path, foreign: bytes) -> None:
    """Shared folders are writable by others: a state record nemo_safe cannot have written is
    ignored by the waiters (never an AttributeError), and rank 0's real one then releases them."""
    run_id = secrets.token_hex(4)
    label = f"test.{_attempt_key(torchrun_env(1, 4, run_id))}.0"
    records = tmp_path / ".nemo_safe" / label
    records.mkdir(parents=True)
    (records / "state").write_bytes(foreign)
    ranks = start_ranks(
        4, _torchrun(4, run_id), ["--dir", str(tmp_path), "--rank0-delay", "3", "--work-seconds", "0.3"]
    ).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.results
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 4)), ranks.results


def test_foreign_state_record_is_named_when_rank0_never_comes(tmp_path: Path) -> None:
    run_id = secrets.token_hex(4)
    label = f"test.{_attempt_key(torchrun_env(1, 3, run_id))}.0"
    records = tmp_path / ".nemo_safe" / label
    records.mkdir(parents=True)
    (records / "state").write_bytes(b'{"phase": "done", "accepted": "all"}')
    ranks = start_ranks(3, _torchrun(3, run_id), ["--dir", str(tmp_path), "--timeout", "3"], ranks=[1, 2])
    ranks.finish(HANG_GUARD)
    for r in (1, 2):
        res = ranks.results[r]
        assert res["error_type"] == "BarrierTimeout" and "not one nemo_safe writes" in res["error"], res
        assert str(records) in res["error"], res
