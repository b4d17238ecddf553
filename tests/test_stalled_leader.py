"""A download leader that is alive but stalled (SIGSTOP: swapped out, an NFS failover) past the
stale limit is taken over; when it continues it must notice before it publishes anything, and wait
for the new leader instead of running as a second one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_torchvision_downloads import (
    _assert_all_loaded,
    _assert_clean_root,
    _assert_raw_equals_original,
    _local_members,
    mnist,
    reference,
    throttled,
)

from nemo_safe_tools.download_race import read_results

from procs import finish_flights, start_flights, wait_until

__all__ = ["mnist", "reference"]  # fixtures shared with the torchvision tests

HANG_GUARD = 300


def _wait_for(predicate, what: str, timeout: float = 60):
    return wait_until(predicate, what, timeout)


@pytest.mark.parametrize("resume", ["while the new leader works", "after the new leader finished"])
def test_stopped_leader_is_deposed_and_publishes_nothing(tmp_path: Path, resume: str) -> None:
    """Generic single flight: one product, written by the new leader, not two; the stopped leader
    notices whether the new one is still at work (a newer lock) or already done (its lock is gone)."""
    procs = start_flights(3, tmp_path, "--work", "6", "--fence", NEMO_SAFE_STALE_AFTER="2")
    lock = tmp_path / ".nemo_safe" / "job.0"
    _wait_for(lambda: lock.exists() and lock.read_bytes().startswith(b"{"), "no leader appeared")
    leader = json.loads(lock.read_bytes())["pid"]
    time.sleep(1.0)
    os.kill(leader, signal.SIGSTOP)
    try:
        _wait_for(lambda: (tmp_path / ".nemo_safe" / "job.1").exists(), "nobody took over the stopped leader")
        if resume == "after the new leader finished":
            _wait_for(lambda: (tmp_path / "product").exists(), "the new leader did not finish", timeout=120)
        else:
            time.sleep(1.0)  # the new leader is at work when the old one continues
    finally:
        os.kill(leader, signal.SIGCONT)
    results = finish_flights(procs, HANG_GUARD)[0]
    assert all(r["status"] == "ok" for r in results), results
    made = sorted(p.name for p in tmp_path.glob("made-by.*"))
    assert len(made) == 1, f"two leaders published: {made}"
    assert made != [f"made-by.{leader}"], "the deposed leader published"


def test_stopped_mnist_downloader_is_deposed_and_waits(tmp_path: Path, mnist, reference) -> None:
    """MNIST: the downloader is stopped 4 s into its first file (a 20 s download) under a 2 s stale
    limit. Another rank takes over; the stopped one, continued, publishes nothing (its download is
    dropped at the latest before publishing) and loads what the new leader published."""
    name = "train-images-idx3-ubyte.gz"
    raw = tmp_path / "root" / "MNIST" / "raw"

    def downloaders() -> set[int]:
        temps = raw.glob(f".tmp.{name}~*") if raw.is_dir() else []
        return {int(t.name.split("~")[-2]) for t in temps}

    with throttled(mnist, seconds=20.0) as mirror:
        procs = _local_members(3, tmp_path / "root", tmp_path / "res", mirror.url, NEMO_SAFE_STALE_AFTER="2")
        (stalled,) = _wait_for(downloaders, "no download in progress was seen")
        time.sleep(0.5)
        os.kill(stalled, signal.SIGSTOP)
        try:
            _wait_for(lambda: downloaders() - {stalled}, "nobody took over the stopped downloader")
            time.sleep(1.0)
        finally:
            os.kill(stalled, signal.SIGCONT)
        logs = {}
        for rank, p in procs.items():
            try:
                logs[rank] = p.communicate(timeout=HANG_GUARD)[1]
            except subprocess.TimeoutExpired:
                for q in procs.values():
                    q.kill()
                raise AssertionError(f"rank {rank} hung") from None
        stats = mirror.stats()
    assert {p.returncode for p in procs.values()} == {0}, logs
    _assert_all_loaded(read_results(tmp_path / "res"), range(3), reference)
    _assert_raw_equals_original(tmp_path / "root", mnist)
    _assert_clean_root(tmp_path / "root")
    (rank,) = [r for r, p in procs.items() if p.pid == stalled]
    assert "taken over while stalled" in logs[rank], logs[rank][-2000:]
    assert stats[name].requests == 2 and stats[name].complete >= 1, stats[name]
