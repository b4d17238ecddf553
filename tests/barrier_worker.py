"""One rank of a barrier test: run as a real process by the tests (locally, under srun, on FUSE).

Rank 0 optionally sleeps, then works inside the barrier (sleeps ``--work-seconds``
and writes a marker file); every other rank records whether it saw the marker
when released. Prints one JSON line and exits 0 (ok), 3 (nemo_safe error) or 4.
Fault switches let the tests make rank 0 raise or hang, and ``--no-barrier``
runs the same scenario without the barrier (the twin that must fail).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from nemo_safe import Barrier, NemoSafeError, RankZeroAbsent, detect_identity, rank_zero_first
from nemo_safe.atomic_files import publish, read_if_exists
from nemo_safe.barrier_channels import StoreChannel

MARKER_TEXT = b"rank 0 finished its work\n"


def main() -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--dir-for-odd-ranks", help="another view (mount) of --dir for odd ranks")
    p.add_argument("--name", default="test")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--world", type=int)
    p.add_argument("--work-seconds", type=float, default=1.0)
    p.add_argument("--rank0-delay", type=float, default=0.0, help="start skew: rank 0 enters late")
    p.add_argument("--rank0-fault", choices=["none", "raise", "hang"], default="none")
    p.add_argument("--rank0-work", choices=["sleep", "stuck", "trickle"], default="sleep",
                   help="--open: rank 0's work: a sleep, a recv on a socket nobody writes to (a call that does not "
                   "return, as a hung NFS call), or small reads every 0.2 s (slow, advancing work)")  # fmt: skip
    p.add_argument("--stall-limit", type=float, help="waiters stop waiting for a rank 0 idle this long")
    p.add_argument("--ready-dir", help="each rank touches ready.<rank> here before entering")
    p.add_argument("--hold-rank", type=int, help="this rank sleeps forever before entering")
    p.add_argument("--no-barrier", action="store_true")
    p.add_argument("--open", action="store_true", help="rank 0 opens the barrier without waiting for anyone")
    p.add_argument("--grace", type=float, help="waiters give up on an absent rank 0 after this (RankZeroAbsent)")
    p.add_argument("--store", help="HOST:PORT of a TCPStore to meet in instead of --dir")
    p.add_argument("--rank0-linger", type=float, default=0.0, help="rank 0 stays this long after releasing")
    p.add_argument("--sigusr1-handler", action="store_true", help="install a handler like Lightning's requeue one")
    p.add_argument("--kill-ranks", type=lambda v: {int(r) for r in v.split(",")}, default=set(),
                   help="these ranks SIGKILL themselves --kill-after seconds after entering")  # fmt: skip
    p.add_argument("--kill-after", type=float, default=0.5)
    args = p.parse_args()

    ident = detect_identity()
    rank = ident.rank
    world = args.world or ident.world_size
    directory = args.dir_for_odd_ranks if (args.dir_for_odd_ranks and rank % 2) else args.dir
    marker = os.path.join(directory, "marker")
    result = {
        "rank": rank,
        "world": world,
        "launcher": ident.launcher,
        "key": ident.attempt_key,
        "pid": os.getpid(),
        "saw_marker": None,
        "status": "ok",
    }
    if args.sigusr1_handler:
        import signal

        result["sigusr1"] = 0

        def on_usr1(signum, frame):
            result["sigusr1"] += 1

        signal.signal(signal.SIGUSR1, on_usr1)
    if args.ready_dir:
        publish(args.ready_dir, f"ready.{rank}", str(os.getpid()).encode())
    if args.hold_rank == rank:
        time.sleep(3600)
    if rank == 0:
        time.sleep(args.rank0_delay)
    code = 0
    started = time.monotonic()
    if rank in args.kill_ranks:
        import signal
        import threading

        threading.Timer(args.kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        if args.open or args.grace is not None or args.store:
            return _open_barrier(args, ident, directory, world, marker, result, started)
        ctx = rank_zero_first(directory, world, args.name, timeout=args.timeout)
        if args.no_barrier:
            from contextlib import nullcontext

            ctx = nullcontext()
        with ctx as barrier:
            if barrier is not None and rank != 0:
                result["reads"] = _reads(barrier)
            if rank == 0:
                if args.rank0_fault == "hang":
                    time.sleep(3600)
                time.sleep(args.work_seconds)
                if args.rank0_fault == "raise":
                    raise PermissionError(13, "Permission denied", marker)
                publish(directory, "marker", MARKER_TEXT)
            else:
                result["saw_marker"] = read_if_exists(marker) == MARKER_TEXT
    except NemoSafeError as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc))
        code = 3
    except Exception as exc:  # rank 0's own exception
        result.update(status="error", error_type=type(exc).__name__, error=str(exc))
        code = 4
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    return code


def _rank0_work(kind: str, seconds: float) -> None:
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "stuck":
        import socket

        here, _there = socket.socketpair()
        here.settimeout(seconds)
        try:
            here.recv(1)  # nobody writes: blocked for ``seconds``, as a half-open connection or a hung NFS call
        except TimeoutError:
            pass
    else:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with open(__file__, "rb") as fh:
                fh.read()
            time.sleep(0.2)


def _reads(barrier: Barrier) -> dict:
    """How this rank read rank 0's state: its role and the reads of the shared state and of a node copy."""
    ch = barrier.channel
    return {"role": getattr(ch, "role", "flat"), "shared": getattr(ch, "shared_reads", barrier.polls),
            "copy": getattr(ch, "copy_reads", 0)}  # fmt: skip


def _open_barrier(args, ident, directory: str, world: int, marker: str, result: dict, started: float) -> int:
    """Rank 0 opens the barrier (no waiting), works, releases; the others wait with an optional grace."""
    where = directory
    if args.store:
        host, port = args.store.rsplit(":", 1)
        where = StoreChannel(host, int(port))
    barrier = Barrier(where, world, args.name, timeout=args.timeout, attempt_unique=ident.attempt_unique)
    code = 0
    try:
        if ident.rank == 0:
            barrier.open()
            _rank0_work(args.rank0_work, args.work_seconds)
            if args.rank0_fault == "raise":
                error = PermissionError(13, "Permission denied", marker)
                barrier.release(error)
                result.update(status="error", error_type=type(error).__name__, error=str(error))
                code = 4
            else:
                publish(directory, "marker", MARKER_TEXT)
                barrier.release()
            print(json.dumps({**result, "seconds": time.monotonic() - started}), flush=True)
            time.sleep(args.rank0_linger)
            return code
        else:
            try:
                barrier.wait(grace=args.grace, stall_limit=args.stall_limit)
            finally:
                result["reads"] = _reads(barrier)
            result["saw_marker"] = read_if_exists(marker) == MARKER_TEXT
    except RankZeroAbsent as exc:  # RankZeroStalled too
        result.update(status="absent", error_type=type(exc).__name__, error=str(exc))
    except NemoSafeError as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc))
        code = 3
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
