"""SingleFlight with real processes on a real directory (no torch): one leader, errors, stale leaders."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_safe import atomic_files
from nemo_safe.cluster_identity import without_launchers
from nemo_safe.single_flight import LOCK_DIRNAME, SingleFlight

from procs import FLIGHT_WORKER, finish_flights, start_flights

WORKER = FLIGHT_WORKER
HANG_GUARD = 120


def _run(n: int, directory: Path, *args: str, **env: str) -> list[dict]:
    return finish_flights(start_flights(n, directory, *args, **env), HANG_GUARD)[0]


def test_one_leader_and_nothing_left(tmp_path: Path) -> None:
    results = _run(6, tmp_path, "--work", "1.0")
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1, results
    assert len(list(tmp_path.glob("made-by.*"))) == 1, "the job ran once"
    assert not (tmp_path / LOCK_DIRNAME).exists()


def test_leader_error_reaches_every_waiter(tmp_path: Path) -> None:
    results = _run(4, tmp_path, "--work", "2.0", "--fail")
    leader = [r for r in results if r["led"]]
    assert len(leader) == 1 and leader[0]["error_type"] == "OSError", results
    waiters = [r for r in results if not r["led"]]
    for r in waiters:
        assert r["error_type"] == "LeaderFailed" and "No space left on device" in r["error"], r
        assert f"pid {leader[0]['pid']}" in r["error"], r


def test_an_old_failure_does_not_fail_a_new_attempt(tmp_path: Path) -> None:
    (first,) = _run(1, tmp_path, "--work", "0.1", "--fail")
    assert first["status"] == "error"
    assert list((tmp_path / LOCK_DIRNAME).iterdir()), "the failure is kept for processes that waited on it"
    results = _run(3, tmp_path, "--work", "0.5")
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1
    assert not (tmp_path / LOCK_DIRNAME).exists(), "the next success removes the old failure too"


def test_stale_leader_on_another_host_is_replaced_after_its_heartbeat_stops(tmp_path: Path) -> None:
    """A leader on another host that died (no pid check possible): taken over once its beat is frozen."""
    lock_dir = tmp_path / LOCK_DIRNAME
    lock_dir.mkdir()
    info = {"state": "running", "beat": 7, "host": "elsewhere", "pid": 1, "nonce": "x"}
    (lock_dir / "job.0").write_text(json.dumps(info))
    results = _run(2, tmp_path, "--work", "0.2", NEMO_SAFE_STALE_AFTER="3")
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1
    assert min(r["seconds"] for r in results) >= 3, "not before the heartbeat was frozen for 3 s"
    assert not lock_dir.exists()


def test_dead_leader_on_this_host_is_replaced_quickly(tmp_path: Path) -> None:
    lock_dir = tmp_path / LOCK_DIRNAME
    lock_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    info = {"state": "running", "beat": 3, "host": socket.gethostname(), "pid": dead.pid, "nonce": "x",
            "pidns": atomic_files.pid_namespace()}  # fmt: skip
    (lock_dir / "job.0").write_text(json.dumps(info))
    results = _run(2, tmp_path, "--work", "0.2")  # default stale_after is 30 s: the pid check must do it
    assert all(r["status"] == "ok" for r in results), results
    assert max(r["seconds"] for r in results) < 30, results


def test_hold_runs_the_block_in_the_leader_and_records_its_failure(tmp_path: Path) -> None:
    """SingleFlight.hold, the context-manager form the MNIST overlay uses as upstream's ``_download_lock``:
    nothing to wait for when done() holds; the leader runs the block and cleans up, or records its error."""
    made = tmp_path / "made"
    with SingleFlight(tmp_path, "job").hold(made.exists) as leading:
        assert leading and (tmp_path / LOCK_DIRNAME / "job.0").exists()
        made.write_text("x")
    assert not (tmp_path / LOCK_DIRNAME).exists()
    with SingleFlight(tmp_path, "job").hold(made.exists) as leading:
        assert not leading, "done() holds: nothing to lead"
    made.unlink()
    with pytest.raises(OSError, match="disk full"), SingleFlight(tmp_path, "job").hold(made.exists):
        raise OSError("disk full")
    lock = json.loads((tmp_path / LOCK_DIRNAME / "job.0").read_text())
    assert (lock["state"], lock["error"]) == ("failed", "disk full")


@pytest.mark.parametrize(
    "foreign",
    [b"[]", b'{"state": "running", "beat": "7", "host": [], "pid": "1", "nonce": 5}', b"garbage", b"null", None],
    ids=["list", "wrong-types", "text", "null", "directory"],
)
def test_foreign_lock_file_is_ignored(tmp_path: Path, foreign: bytes | None) -> None:
    """Shared folders are writable by others: a lock nemo_safe cannot have written is no leader.
    It is ignored with a warning naming it (never an AttributeError), without waiting for a stale limit."""
    lock_dir = tmp_path / LOCK_DIRNAME
    lock_dir.mkdir()
    if foreign is None:
        (lock_dir / "job.0").mkdir()
    else:
        (lock_dir / "job.0").write_bytes(foreign)
    results, logs = finish_flights(start_flights(3, tmp_path, "--work", "0.3"), HANG_GUARD)
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1, results
    assert max(r["seconds"] for r in results) < 20, "a foreign file is not a leader to wait 30 s for"
    assert f"{lock_dir / 'job.0'} is not a lock nemo_safe wrote" in logs


def test_leader_working_longer_than_the_timeout_is_waited_for(tmp_path: Path) -> None:
    """The job takes 8 s under a 3 s timeout: the leader beats while it works, so the waiters'
    timeout (which counts silence) never fires; a dead leader is still replaced (tests above)."""
    results = _run(3, tmp_path, "--work", "8", NEMO_SAFE_BARRIER_TIMEOUT="3")
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1, results


def test_a_flight_held_again_by_its_leader_runs_inside_it(tmp_path: Path) -> None:
    """A patch applied over its own wrapper (a repair after a user wrapped one method) nests the same flight
    in one thread: the inner hold must run as part of the outer one, not wait for itself until its timeout."""
    ran: list[str] = []
    done = lambda: len(ran) == 2  # noqa: E731

    def outer() -> None:
        ran.append("outer")
        SingleFlight(tmp_path, "x", timeout=5).run(lambda: ran.append("inner"), done)

    flight = threading.Thread(target=SingleFlight(tmp_path, "x", timeout=5).run, args=(outer, done), daemon=True)
    flight.start()
    flight.join(60)  # hang guard: without the fix the inner hold waits for its own, live, leader
    assert not flight.is_alive(), "the inner hold waited for the outer one"
    assert ran == ["outer", "inner"]
    assert not (tmp_path / LOCK_DIRNAME).exists(), "nothing left behind"


def _without_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as one no launcher started (the test runner may run under one), no poll cap set."""
    kept = without_launchers(os.environ)
    for name in [n for n in os.environ if n not in kept or n == "NEMO_SAFE_POLL_MAX"]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0.25),  # no launcher (mp.spawn, Lightning's own launcher): any number of processes may wait
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, 0.05),  # a small job: the barrier's floor
        ({"RANK": "3", "WORLD_SIZE": "300", "LOCAL_RANK": "3"}, 0.5143),  # 300 x 3 calls / (0.875 x cap) = 2,000/s
        ({"RANK": "3", "WORLD_SIZE": "4096", "LOCAL_RANK": "3"}, 1.0),  # capped
        ({"NEMO_SAFE_POLL_MAX": "0.2"}, 0.2),
    ],
)
def test_waiters_poll_as_often_as_the_job_size_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: float
) -> None:
    """Download waiters poll with the barrier's cap for the launcher's world size (3 metadata calls a poll):
    50 ms in small jobs (they learn of the leader's success within that), slower where thousands of ranks
    poll one folder, 0.25 s where no launcher says how many processes there are."""
    _without_launchers(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert SingleFlight(tmp_path, "job").poll_max == pytest.approx(expected, abs=1e-4)


def test_waiters_of_a_spawned_job_poll_as_a_small_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mp.spawn`` + ``init_process_group`` (PyTorch's FSDP tutorial) sets no launcher variables, but the
    default process group knows the job's size: its waiters poll as the launcher's would (here 50 ms, not
    the 0.25 s of a job of unknown size)."""
    import torch.distributed as dist

    _without_launchers(monkeypatch)
    assert SingleFlight(tmp_path, "job").poll_max == pytest.approx(0.25)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert SingleFlight(tmp_path, "job").poll_max == pytest.approx(0.05)
    finally:
        dist.destroy_process_group()


def test_a_beating_leader_stuck_in_recv_is_taken_over_not_timed_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader (here a thread of this process) whose job blocks in ``recv`` on a silent connection beats
    on without progress. A waiter whose timeout (2 s) is shorter than the progress limit does not raise
    WaitTimeout at it: it takes over (the next generation) and runs the job, with one warning naming the
    leader; the stuck leader, released later, is deposed and publishes nothing."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    made = tmp_path / "made"
    leading = threading.Event()

    def stuck_job() -> None:
        leading.set()
        client.recv(1)  # nothing ever comes until the test sends it

    leader = threading.Thread(target=SingleFlight(tmp_path, "job").run, args=(stuck_job, made.exists), daemon=True)
    waiter = SingleFlight(tmp_path, "job", timeout=2)
    seen: dict[str, object] = {}

    def wait() -> None:
        started = time.monotonic()
        with waiter.hold(made.exists) as runs_here:
            seen.update(runs_here=runs_here, locks=sorted(p.name for p in (tmp_path / LOCK_DIRNAME).iterdir()))
            seen["stuck"] = json.loads((tmp_path / LOCK_DIRNAME / "job.0").read_text())
            made.write_text("x")
        seen["took"] = time.monotonic() - started

    leader.start()
    try:
        assert leading.wait(30)
        with caplog.at_level(logging.WARNING, logger="nemo_safe"):
            waiting = threading.Thread(target=wait, daemon=True)
            waiting.start()
            waiting.join(30)  # hang guard: a waiter that trusts beats waits as long as the leader is stuck
            assert not waiting.is_alive(), "the waiter is still waiting for the stuck leader"
        assert seen["runs_here"] and waiter.led and seen["locks"] == ["job.0", "job.1"], seen
        assert 2 <= seen["took"] < 2 + 5, seen
        warnings = [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]
        assert len(warnings) == 1 and f"pid {os.getpid()})" in warnings[0], warnings
        assert seen["stuck"]["state"] == "running" and seen["stuck"]["idle"] >= 1, seen
    finally:
        peer.sendall(b"x")  # the stuck job returns; the leader finds done() and cleans up
        leader.join(30)
        for sock in (client, peer, server):
            sock.close()
    assert not leader.is_alive()


def test_sigterm_handler_is_installed_only_over_the_default_and_only_while_leading(tmp_path: Path) -> None:
    """A lead in the main thread handles SIGTERM where the handler was the default and restores it after;
    a Python handler (Lightning's, the user's) or SIG_IGN is left alone."""
    seen = []
    for previous in (signal.SIG_DFL, signal.SIG_IGN, lambda signum, frame: None):
        old = signal.signal(signal.SIGTERM, previous)
        try:
            with SingleFlight(tmp_path, "job").hold(lambda: False) as leading:
                assert leading
                seen.append(signal.getsignal(signal.SIGTERM) is previous)
            assert signal.getsignal(signal.SIGTERM) is previous
        finally:
            signal.signal(signal.SIGTERM, old)
    assert seen == [False, True, True]


def test_a_forked_child_killed_by_sigterm_leaves_its_parents_lead_alone(tmp_path: Path) -> None:
    """A leader forks (a DataLoader worker, ``Process.terminate()`` later): the child inherits the SIGTERM
    handler and its table of leads, but its death must not mark the parent's lock abandoned (the waiters
    would download a second time while the parent goes on) nor remove the parent's temporaries."""
    with SingleFlight(tmp_path, "job").hold(lambda: False) as leading:
        assert leading
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: say it runs (a signal during fork's own set-up is lost), wait to be terminated
            os.write(ready_w, b"r")
            time.sleep(60)
            os._exit(0)
        assert os.read(ready_r, 1) == b"r"
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        lock = json.loads((tmp_path / LOCK_DIRNAME / "job.0").read_text())
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status  # died of it, as upstream
    assert lock["state"] == "running" and lock["pid"] == os.getpid(), lock
