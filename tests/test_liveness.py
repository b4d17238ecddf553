"""Liveness is progress: a download leader that is alive but stuck holds nobody, one killed by SIGTERM
is noticed at the next poll from any host, one stopped whole is taken over at the stale limit. All real.

Real processes, real torch.hub / torchvision downloads from real HTTP servers on 127.0.0.1, another
host name by ``unshare -u``; each download case has its upstream twin (``NEMO_SAFE_DISABLE=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_torch_hub import _mirror, _name, weights
from test_torchvision_downloads import (
    _assert_all_loaded,
    _assert_clean_root,
    _assert_raw_equals_original,
    _member_cmd,
    mnist,
    reference,
    throttled,
)

from nemo_safe.single_flight import DEFAULT_STALE_AFTER, PROGRESS_LIMIT
from nemo_safe.thread_progress import ThreadProgress
from nemo_safe_tools.download_race import read_results
from nemo_safe_tools.loopback_mirror import LoopbackMirror

from procs import clean_env, finish_flights, start_flights, torchrun_env, wait_until

__all__ = ["mnist", "reference", "weights"]  # fixtures shared with the torchvision and torch.hub tests

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "liveness_worker.py")
HANG_GUARD = 120
STUCK_WARNING = "is alive but its work made no progress"


def _wait_for(predicate, what: str, timeout: float = 120):
    return wait_until(predicate, what, timeout)


def _other_host(name: str, cmd: list[str]) -> list[str]:
    """``cmd`` run under another host name (a UTS namespace of its own): no pid of it can be judged here."""
    return ["unshare", "-u", "sh", "-c", f'hostname {name} && exec "$0" "$@"', *cmd]


# -- the sampler ---------------------------------------------------------------------------------------------


def test_progress_sampler_tells_a_blocked_recv_from_work() -> None:
    """A thread blocked in ``recv`` on a silent connection never advances; one reading a file in a loop,
    or sleeping in a loop between steps, advances between any two looks a second apart."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            with open(__file__, "rb") as fh:
                fh.read()

    def sleep_loop() -> None:
        while not stop.is_set():
            time.sleep(0.1)

    threads = [threading.Thread(target=t, daemon=True) for t in (lambda: client.recv(1), read_loop, sleep_loop)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)  # the receiver is in recv now
        samplers = [ThreadProgress(t) for t in threads]
        assert samplers[0].sources, "Linux: /proc/self/task/<tid>/* are read"
        looks = []
        for _ in range(3):
            time.sleep(1.0)
            looks.append([s.advanced() for s in samplers])
        assert looks == [[False, True, True]] * 3, looks
        peer.sendall(b"x")  # the receiver returns and ends: that is a step
        threads[0].join(5)
        assert samplers[0].advanced()
    finally:
        stop.set()
        for sock in (client, peer, server):
            sock.close()


# -- a leader stuck in a half-open download --------------------------------------------------------------------


class HalfOpenMirror(LoopbackMirror):
    """Sends the headers and a third of the body, then nothing, with the connection kept open (a server
    or proxy gone silent; ``urlopen`` has no timeout): the client blocks in ``recv`` until the mirror closes."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(files)
        self.silent = threading.Event()
        self._close = threading.Event()

    def _response(self, name: str, scheme: str) -> tuple[bytes, int]:
        body = self.files[name]
        return body, len(body) // 3

    def _after_body(self, handler: Any, name: str, scheme: str) -> bool:
        self.silent.set()
        self._close.wait(HANG_GUARD * 5)
        return True

    def __exit__(self, *exc: Any) -> None:
        self._close.set()
        super().__exit__(*exc)


def _start_hub(url: str, dst: Path, prefix: str, home: Path, disable: bool) -> subprocess.Popen:
    # The timeout: a waiter that took beats for work waited past it (the beats extended it).
    env = clean_env(TORCH_HOME=str(home), NEMO_SAFE_DISABLE="1" if disable else "0", NEMO_SAFE_BARRIER_TIMEOUT="20")
    cmd = [sys.executable, WORKER, "--url", url, "--dst", str(dst), "--hash-prefix", prefix]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_leader_stuck_in_a_half_open_download_holds_nobody(tmp_path: Path, weights, disable: bool) -> None:
    """A leads the download of a checkpoint from a server that went silent mid-body (A blocks in ``recv``
    for good, its heartbeat goes on); B asks for the same file from a healthy server 3 s into A's stall.
    B must finish within its own download time + the progress limit + 10 s, with the right file and one
    warning naming A (before: B waited as long as A beat, for ever). Upstream: B downloads on its own."""
    data, _ = weights
    prefix = hashlib.sha256(data).hexdigest()[:8]
    name = _name(data)
    dst = tmp_path / "out" / name
    dst.parent.mkdir()
    with HalfOpenMirror({name: data}) as stuck, _mirror({name: data}) as healthy:
        a = _start_hub(stuck.url + name, dst, prefix, tmp_path / "home", disable)
        try:
            _wait_for(stuck.silent.is_set, "A's download never started")
            time.sleep(3.0)
            b = _start_hub(healthy.url + name, dst, prefix, tmp_path / "home", disable)
            try:
                out, err = b.communicate(timeout=HANG_GUARD)
            except subprocess.TimeoutExpired:
                b.kill()
                pytest.fail(f"B waited {HANG_GUARD} s for the stuck download: {b.communicate()[1][-2000:]}")
            assert a.poll() is None, "A is still stuck (it is killed below)"
        finally:
            a.kill()
            a.communicate()
        b_stats = healthy.stats()[name]
    assert b.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["status"] == "ok", res
    assert dst.read_bytes() == data
    assert (b_stats.requests, b_stats.complete) == (1, 1), b_stats
    own_download = 2.0  # test_torch_hub's throttled mirror: the file takes 2 s
    print(f"\nhalf-open B ({'upstream' if disable else 'nemo_safe'}): {res['seconds']:.1f} s")
    assert res["seconds"] < own_download + PROGRESS_LIMIT + 10, res
    assert err.count(STUCK_WARNING) == (0 if disable else 1), err[-3000:]
    if not disable:
        assert f"pid {a.pid})" in err and "made no progress for" in err, err[-3000:]


# -- a leader killed by SIGTERM -------------------------------------------------------------------------------


def _members_on_two_hosts(root: Path, results: Path, mirror: str, disable: bool) -> dict[int, subprocess.Popen]:
    """Two torchrun-style members of one job, each under a host name of its own."""
    run_id = f"liveness-{os.getpid()}-{time.monotonic_ns()}"
    cmd = [sys.executable, *_member_cmd(root, results, results.with_name("gate"), mirror)]
    procs = {}
    for rank in range(2):
        env = clean_env(**torchrun_env(rank, 2, run_id), NEMO_SAFE_DISABLE="1" if disable else "0")
        procs[rank] = subprocess.Popen(_other_host(f"liveness-host{rank}", cmd), env=env, text=True,
                                       stderr=subprocess.PIPE)  # fmt: skip
    return procs


@pytest.mark.parametrize("disable", [False, True], ids=["nemo_safe", "upstream"])
def test_leader_killed_by_sigterm_is_taken_over_at_once_from_another_host(
    tmp_path: Path, mnist, reference, disable: bool
) -> None:
    """Two ranks on two host names load MNIST (a 4 s download); the one downloading gets SIGTERM (scancel,
    preemption) 1.5 s in. It dies of the signal as upstream's does (-SIGTERM), its lock says abandoned and
    its temporaries are gone (another host could only judge them by a day's age), so the other rank
    downloads at once: done within its own download time + 6 s of the signal (before: the stale limit
    first). Upstream: each rank downloads anyway."""
    name = "train-images-idx3-ubyte.gz"
    root, raw = tmp_path / "root", tmp_path / "root" / "MNIST" / "raw"
    own_download = 5.0  # the four files through the throttle (the largest alone 4 s)

    def downloader() -> int | None:
        if disable:  # upstream writes the final name directly; both ranks download: take rank 0
            return procs[0].pid if (raw / name).is_file() and (raw / name).stat().st_size > 0 else None
        temps = [t for t in raw.glob(f".tmp.{name}~*") if t.stat().st_size > 0] if raw.is_dir() else []
        return int(temps[0].name.split("~")[-2]) if temps else None

    with throttled(mnist, seconds=4.0) as mirror:
        procs = _members_on_two_hosts(root, tmp_path / "res", mirror.url, disable)
        try:
            victim = _wait_for(downloader, "no download in progress was seen")
            time.sleep(1.5)
            os.kill(victim, signal.SIGTERM)
            sent = time.time()
            logs = {rank: p.communicate(timeout=HANG_GUARD)[1] for rank, p in procs.items()}
        finally:
            for p in procs.values():
                p.kill()
    (killed,) = [rank for rank, p in procs.items() if p.pid == victim]
    (other,) = {0, 1} - {killed}
    assert procs[killed].returncode == -signal.SIGTERM, logs[killed][-2000:]
    assert procs[other].returncode == 0, logs[other][-3000:]
    results = read_results(tmp_path / "res")
    _assert_all_loaded(results, range(other, other + 1), reference)
    _assert_raw_equals_original(root, mnist)
    finished = results[other]["started"] + results[other]["seconds"]
    print(f"\nSIGTERM ({'upstream' if disable else 'nemo_safe'}): the other rank done {finished - sent:.1f} s after it")
    assert finished - sent < own_download + 6, f"the other rank finished {finished - sent:.1f} s after the signal"
    if not disable:
        _assert_clean_root(root)  # the killed rank's temporary too: on another host nobody could judge it
        assert "stopped answering" not in logs[other], logs[other][-2000:]


# -- a leader stopped whole (SIGSTOP) ---------------------------------------------------------------------------


def test_stopped_leader_is_taken_over_at_the_default_stale_limit(tmp_path: Path) -> None:
    """A leader stopped whole (SIGSTOP: beat and job frozen together) is no stuck job: its waiters do not run
    the job beside it at the progress limit, one of them takes the lock over at the default stale limit;
    continued, the old leader finds itself deposed and publishes nothing (generic single flight, no torch)."""
    leader = start_flights(1, tmp_path, "--work", "60", "--fence")[0]
    lock = tmp_path / ".nemo_safe" / "job.0"
    try:
        _wait_for(lambda: lock.exists() and b'"beat": 0' not in lock.read_bytes(), "the leader never beat")
        time.sleep(1.0)
        os.kill(leader.pid, signal.SIGSTOP)
        waiters = start_flights(2, tmp_path, "--work", "0.5")
        try:
            results, logs = finish_flights(waiters, HANG_GUARD)
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        old, old_log = finish_flights([leader], HANG_GUARD)
    finally:
        leader.kill()
    assert all(r["status"] == "ok" for r in results + old), (results, old)
    assert sum(r["led"] for r in results) == 1, results
    assert STUCK_WARNING not in logs, logs[-2000:]
    assert "stopped answering" in logs, logs[-2000:]
    took = max(r["seconds"] for r in results)
    assert DEFAULT_STALE_AFTER - 1 < took < DEFAULT_STALE_AFTER + 10, results
    assert [p.name for p in tmp_path.glob("made-by.*")] != [f"made-by.{leader.pid}"], "the deposed leader published"
    assert len(list(tmp_path.glob("made-by.*"))) == 1
    assert "taken over while stalled" in old_log, old_log[-2000:]
