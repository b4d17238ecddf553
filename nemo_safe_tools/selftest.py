"""``nemo-safe selftest``: run the barrier for real and report what was detected and how fast it was.

Under srun / torchrun / mpirun every task runs one member; otherwise the
command starts N local member processes with torchrun-style variables. Users
run it on their shared filesystem before a long job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from nemo_safe import cluster_identity
from nemo_safe.atomic_files import publish, read_if_exists, unlink_if_exists
from nemo_safe.barrier import Barrier, rank_zero_first
from nemo_safe.errors import NemoSafeError
from nemo_safe_tools import local_ranks
from nemo_safe_tools.mounts import filesystem_type

REPORT_PREFIX = "NEMO_SAFE_SELFTEST_REPORT "
#: A selftest's barrier timeout unless --timeout says otherwise: every member starts within seconds of the
#: others, so a minute is plenty and a failure shows in a minute, not after the library's 30.
DEFAULT_TIMEOUT = 60.0
#: Kernel filesystems where no file a barrier needs can be created.
NOT_FOR_FILES = ("proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs", "bpf")


def check_directory(directory: str) -> None:
    """NemoSafeError saying why, in seconds, unless a file can be created and removed in ``directory`` (before
    any member waits for a rank 0 that cannot write)."""
    kind = filesystem_type(directory)
    if kind in NOT_FOR_FILES:
        raise NemoSafeError(f"selftest: {directory} is on {kind}, a kernel filesystem; use your shared filesystem")
    try:
        fd, probe = tempfile.mkstemp(prefix=".nemo_safe_selftest_probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise NemoSafeError(f"selftest: cannot create a file in {directory} ({exc.strerror or exc}); the barrier "
                            "needs to, on every rank: use a writable directory") from None  # fmt: skip


def run_member(directory: str, timeout: float | None, work_seconds: float) -> dict[str, Any] | None:
    """One rank's part. Rank 0 returns the report; other ranks return None.

    Rank 0 sleeps ``work_seconds`` and then writes a marker file inside the
    barrier; every other rank must see that marker once released, which proves
    the barrier waited for rank 0's work.
    """
    ident = cluster_identity.detect()
    world, rank = ident.world_size, ident.rank
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    tag = f".nemo_safe_selftest.{ident.attempt_key}"
    marker = os.path.join(directory, f"{tag}.marker")
    entered = time.time()
    work_done = 0.0
    saw_marker = True
    with rank_zero_first(directory, world, "selftest", timeout=timeout):
        if rank == 0:
            time.sleep(work_seconds)
            publish(directory, os.path.basename(marker), b"rank 0 finished its work\n")
            work_done = time.time()
        else:
            saw_marker = read_if_exists(marker) == b"rank 0 finished its work\n"
    released = time.time()
    mine = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "entered": entered,
        "released": released,
        "saw_marker": saw_marker,
    }
    result_name = f"{tag}.rank{rank}.json"
    publish(directory, result_name, json.dumps(mine).encode())

    def collect() -> dict[str, Any]:
        results = []
        for r in range(world):
            raw = read_if_exists(os.path.join(directory, f"{tag}.rank{r}.json"))
            if raw is None:
                raise NemoSafeError(f"selftest: rank {r} released but left no result")
            results.append(json.loads(raw))
        return {
            "launcher": ident.launcher,
            "world_size": world,
            "attempt_key": ident.attempt_key,
            "directory": os.path.abspath(directory),
            "filesystem": filesystem_type(directory),
            "hosts": sorted({r["host"] for r in results}),
            "all_saw_rank0_work": all(r["saw_marker"] for r in results),
            # From when each waiting rank could go on (rank 0's work done, or its own late start) to its release.
            "release_latency_s": max(
                (r["released"] - max(r["entered"], work_done) for r in results if r["rank"] != 0), default=0.0
            ),
            "warnings": list(ident.warnings),
        }

    report: dict[str, Any] | None = None
    try:
        # Rank 0 reads every rank's result: it gathers them all first (Barrier.run), unlike rank_zero_first.
        report = collect() if world == 1 else Barrier(directory, world, "selftest-report", timeout=timeout).run(collect)
    finally:
        unlink_if_exists(os.path.join(directory, result_name))
        if rank == 0:
            unlink_if_exists(marker)
    return report


def format_report(report: dict[str, Any]) -> str:
    ordering = (
        "OK: every rank saw rank 0 finish first"
        if report["all_saw_rank0_work"]
        else "FAILED: a rank was released before rank 0 finished"
    )
    lines = [
        "nemo-safe selftest",
        f"  launcher          {report['launcher']}",
        f"  world size        {report['world_size']}",
        f"  hosts             {', '.join(report['hosts'])}",
        f"  attempt key       {report['attempt_key']}",
        f"  directory         {report['directory']} ({report['filesystem']})",
        f"  ordering          {ordering}",
        f"  release latency   {report['release_latency_s'] * 1000:.1f} ms (rank 0 done -> last rank released)",
    ]
    lines += [f"  warning           {w}" for w in report.get("warnings", [])]
    return "\n".join(lines)


def _outputs_stopping_at_a_failure(children: list[subprocess.Popen[str]], stopped: set[int]) -> list[tuple[str, str]]:
    """Every child's (stdout, stderr). When one fails, the others are stopped a second later instead of waiting
    out the timeout for it (rank 0's own error is then the one reported first); ``stopped`` gets their ranks."""
    outputs: dict[int, tuple[str, str]] = {}
    readers = [threading.Thread(target=lambda r=r, c=c: outputs.__setitem__(r, c.communicate()), daemon=True)
               for r, c in enumerate(children)]  # fmt: skip
    for reader in readers:
        reader.start()
    failed_at = None
    while any(reader.is_alive() for reader in readers):
        if failed_at is None and any(c.poll() not in (None, 0) for c in children):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 1.0:
            for rank, child in enumerate(children):
                if child.poll() is None:
                    stopped.add(rank)
                    child.terminate()
        time.sleep(0.05)
    return [outputs[r] for r in range(len(children))]


def _last_words(child: subprocess.Popen[str], err: str, stopped: bool) -> str:
    if stopped:  # what it printed is its waiting, not a failure
        return "stopped: another rank failed first"
    last = err.strip().splitlines()[-1] if err.strip() else "no output"
    return f"killed by signal {-child.returncode} ({last})" if child.returncode < 0 else last


def run_local(procs: int, directory: str | None, timeout: float | None, work_seconds: float) -> dict[str, Any]:
    """Start ``procs`` local members with torchrun-style variables and return rank 0's report."""
    with tempfile.TemporaryDirectory(prefix="nemo_safe_selftest_") as tmp:
        target = directory or tmp
        args = [
            sys.executable,
            "-m",
            "nemo_safe_tools.cli",
            "selftest",
            "--dir",
            target,
            "--work-seconds",
            str(work_seconds),
            "--member",
        ]
        if timeout is not None:
            args += ["--timeout", str(timeout)]
        children, stopped = local_ranks.start(args, procs), set()
        try:
            outputs = _outputs_stopping_at_a_failure(children, stopped)
        finally:
            for child in children:  # Ctrl-C, or anything else raised here: no member is left waiting
                if child.poll() is None:
                    child.kill()
                    child.wait()
        failed = [(r, c, err) for r, (c, (_, err)) in enumerate(zip(children, outputs, strict=True)) if c.returncode]
        if failed:
            detail = "\n".join(f"rank {r}: {_last_words(c, err, r in stopped)}" for r, c, err in failed)
            raise NemoSafeError(f"selftest: {len(failed)} of {procs} local ranks failed:\n{detail}")
        for line in outputs[0][0].splitlines():
            if line.startswith(REPORT_PREFIX):
                return json.loads(line[len(REPORT_PREFIX) :])
        raise NemoSafeError("selftest: rank 0 printed no report")
