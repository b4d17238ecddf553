"""Single-flight downloads on a real FUSE filesystem with the faults of cluster filesystems.

The filesystem is ``tests/faultfs.py`` (a passthrough over mfusepy) mounted by the test:
no hard links (gcsfuse, s3fs, blobfuse, FAT), ESTALE between open and read (NFSv3),
EIO for a few seconds (a failover seen by one client). Each nemo_safe case runs next to
its upstream twin on the same mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import IN_CI
from test_torchvision_downloads import _assert_all_loaded, _assert_one_fetch_each, mnist, reference, throttled

from nemo_safe_tools.download_race import read_results

from download_harness import run_spawn
from procs import HERE, finish_flights, start_flights

__all__ = ["mnist", "reference"]  # fixtures shared with the torchvision tests

pytestmark = pytest.mark.fuse
HANG_GUARD = 600


def _unmount(mountpoint: Path) -> None:
    for tool in ("fusermount3", "fusermount"):
        if shutil.which(tool):
            subprocess.run([tool, "-u", "-z", str(mountpoint)], capture_output=True, timeout=30)
            return


@pytest.fixture
def faultfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``faultfs(*options)`` mounts tests/faultfs.py over a fresh folder and returns the mount point."""
    problem = None
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        problem = f"mfusepy is not usable: {exc}"
    if not os.path.exists("/dev/fuse"):
        problem = "/dev/fuse does not exist"
    if problem:
        if IN_CI:
            pytest.fail(f"CI must run the FUSE tests: {problem}", pytrace=False)
        pytest.skip(problem)
    mounts: list[tuple[Path, subprocess.Popen]] = []

    def mount(*options: str) -> Path:
        base, mnt = tmp_path / f"base{len(mounts)}", tmp_path / f"mnt{len(mounts)}"
        base.mkdir()
        mnt.mkdir()
        proc = subprocess.Popen([sys.executable, str(HERE / "faultfs.py"), str(base), str(mnt), *options],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        mounts.append((mnt, proc))
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=5)[0] if proc.poll() is not None else "(still starting)"
                pytest.fail(f"faultfs did not mount: {out[-2000:]}")
            time.sleep(0.05)
        return mnt

    yield mount
    for mnt, proc in mounts:
        _unmount(mnt)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _spawn(world: int, root: Path, res: Path, mirror: str, disable: bool, **kw: object) -> str:
    out = run_spawn(world, root, res, mirror, disable=disable, timeout=HANG_GUARD, **kw)
    return "" if out.returncode == 0 else out.stderr[-3000:]


def test_no_hard_links_one_rank_works_like_upstream(faultfs, mnist, reference) -> None:
    """Where link(2) is refused, one process downloads exactly as upstream does (it used to crash with EPERM)."""
    mnt = faultfs("--no-link")
    for disable in (True, False):  # upstream twin first, then nemo_safe, same mount
        with throttled(mnist, seconds=0.5) as mirror:
            err = _spawn(1, mnt / f"root-{disable}", mnt / f"res-{disable}", mirror.url, disable)
            assert not err, (disable, err)
            _assert_all_loaded(read_results(mnt / f"res-{disable}"), range(1), reference)
            _assert_one_fetch_each(mirror)


def test_no_hard_links_eight_ranks_one_download(faultfs, mnist, reference) -> None:
    mnt = faultfs("--no-link")
    with throttled(mnist) as mirror:
        err = _spawn(8, mnt / "root", mnt / "res", mirror.url, disable=False, init=False, skew=0.3)
        assert not err, err
        _assert_all_loaded(read_results(mnt / "res"), range(8), reference)
        _assert_one_fetch_each(mirror)
    assert not list((mnt / "root").rglob(".nemo_safe")), "the lock folder is removed after success"


def test_stale_file_handles_are_read_again(faultfs, mnist, reference) -> None:
    """Every 3rd read of a lock file answers ESTALE: the waiters read again instead of dying."""
    mnt = faultfs("--estale-every", "3")
    with throttled(mnist) as mirror:
        err = _spawn(6, mnt / "root", mnt / "res", mirror.url, disable=False, init=False)
        assert not err, err
        _assert_all_loaded(read_results(mnt / "res"), range(6), reference)
        _assert_one_fetch_each(mirror)


def test_own_failed_reads_are_not_the_leaders_silence(faultfs, tmp_path: Path) -> None:
    """The waiters' reads of the lock fail with EIO for 4 s (a failover they see, the leader does not):
    with a 2 s stale limit they must neither crash nor take over the live leader."""
    mnt = faultfs("--eio-seconds", "4")
    procs = start_flights(3, mnt, "--work", "6", "--fence", NEMO_SAFE_STALE_AFTER="2")
    results = finish_flights(procs, HANG_GUARD)[0]
    assert all(r["status"] == "ok" for r in results), results
    assert sum(r["led"] for r in results) == 1, results
    assert len(list(mnt.glob("made-by.*"))) == 1, "the job ran once"


def test_barrier_reads_through_stale_file_handles(faultfs) -> None:
    """The rank-0-first barrier on the same ESTALE-answering mount: every rank completes in order."""
    from procs import start_ranks, torchrun_env

    mnt = faultfs("--estale-every", "3")
    run_id = f"estale-{os.getpid()}"
    ranks = start_ranks(6, lambda r: torchrun_env(r, 6, run_id), ["--dir", str(mnt), "--work-seconds", "2"]).finish(
        HANG_GUARD
    )
    assert set(ranks.codes.values()) == {0}, ranks.results
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 6)), ranks.results


def test_a_lock_being_replaced_is_never_read_as_gone(faultfs) -> None:
    """A path-based FUSE mount answers ENOENT for a file while a rename replaces it: the twin reads the
    beating lock naively and finds it missing. The leader's own ownership check (its job thread, while its
    beat thread rewrites the lock) must never conclude from that that it was taken over: it then aborted
    a healthy download (an MNIST leader's "Error downloading" reached every rank, CI of 49b3c72)."""
    import threading

    from nemo_safe.atomic_files import read_if_exists
    from nemo_safe.flight_locks import FlightLocks

    mnt = faultfs()
    locks = FlightLocks(str(mnt), "download", "test download")
    assert locks.try_lead(0)
    path = os.path.join(locks.lock_dir, locks.lock_name(0))
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(0.05):  # beats 20 times as often as a leader: many replacements to meet
            n += 1
            locks.publish(0, locks.info("running", n))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        end = time.monotonic() + 6
        naive_missing = lost = unread = checks = 0
        while time.monotonic() < end:
            naive_missing += read_if_exists(path) is None
            checks += 1
            lost += not locks.still_holds(0)
            unread += locks.read(0) is None
    finally:
        stop.set()
        beating.join()
    assert naive_missing > 0, f"the mount must show the fault ({checks} reads)"  # the twin
    assert (lost, unread) == (0, 0), f"of {checks} checks, {lost} said 'taken over', {unread} read no lock"
