"""Barrier release latency: nemo_safe's filesystem barrier vs the same protocol over
torch.distributed.TCPStore and FileStore (what a user could pick before
init_process_group), side by side in one run.

Latency of one round = last rank released - last rank entered. Every medium
runs the same protocol (rank 0 opens a session, waiters answer it, rank 0
publishes the outcome; waiters poll one key with the same jittered backoff and
cap); TCPStore is also shown with its blocking ``wait`` (push, no polling) as
the best a pre-init barrier can do.

Run: .venv/bin/python benchmarks/barrier_latency.py [--sizes 8 64 256] [--rounds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

from nemo_safe.barrier import CALLS_PER_POLL, RANK0_POLL_SPEEDUP, Barrier
from nemo_safe.waiting import POLL_MIN, Backoff, poll_cap

FS_CALLS = ("open", "scandir", "listdir", "replace", "unlink", "lstat", "stat", "mkdir", "rmdir")


def _poll_cap(world: int) -> float:
    """The barrier's cap for ``world`` ranks (the same for the store protocols, to compare like with like)."""
    return poll_cap(world - 1, CALLS_PER_POLL)


class _Counter:
    """Counts filesystem calls made through ``os`` (to report metadata load per poll)."""

    def __init__(self) -> None:
        self.count = 0
        for name in FS_CALLS:
            original = getattr(os, name)

            def wrapped(*a, _original=original, **k):
                self.count += 1
                return _original(*a, **k)

            setattr(os, name, wrapped)


def _store_protocol(store, rank: int, world: int, tag: str, blocking: bool) -> None:
    """The nemo_safe protocol over a torch Store: state key, per-rank arrival keys, outcome."""
    state = f"{tag}/state"
    timeout = timedelta(seconds=120)
    if rank == 0:
        store.set(state, "collect")
        keys = [f"{tag}/arrive/{r}" for r in range(1, world)]
        if blocking:
            store.wait(keys, timeout)
        else:
            backoff = Backoff(max(POLL_MIN, _poll_cap(world) / RANK0_POLL_SPEEDUP))
            while not store.check(keys):
                backoff.sleep(time.monotonic() + 1)
        store.set(f"{tag}/done" if blocking else state, "done")
        return
    if blocking:
        store.wait([state], timeout)
        store.set(f"{tag}/arrive/{rank}", secrets.token_hex(8))
        store.wait([f"{tag}/done"], timeout)
        return
    backoff = Backoff(_poll_cap(world))
    arrived = False
    while True:
        value = store.get(state) if store.check([state]) else b""
        if value == b"collect" and not arrived:
            store.set(f"{tag}/arrive/{rank}", secrets.token_hex(8))
            arrived = True
            backoff.reset()
        elif value == b"done" and arrived:
            return
        backoff.sleep(time.monotonic() + 1)


def _child(
    rank: int, world: int, medium: str, rounds: int, fs_dir: str, port: int, filestore: str, align, results
) -> None:
    counter = _Counter() if medium == "nemo_safe (files)" else None
    store = None
    if medium.startswith("TCPStore"):
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    elif medium.startswith("FileStore"):
        store = dist.FileStore(filestore, world)
    for rnd in range(rounds):
        align.wait()
        entered = time.time()
        polls = ops = 0
        if store is None:
            barrier = Barrier(fs_dir, world, "bench", rank=rank, attempt_key=f"bench-{rnd}", timeout=120)
            if rank == 0:
                barrier.run(lambda: None)
            else:
                before = counter.count
                barrier.wait()
                ops, polls = counter.count - before, barrier.polls
        else:
            _store_protocol(store, rank, world, f"r{rnd}", medium.endswith("blocking wait"))
        results.put((rnd, rank, entered, time.time(), polls, ops))
    align.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(medium: str, world: int, rounds: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    align = ctx.Barrier(world)
    results = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp:
        children = [
            ctx.Process(
                target=_child,
                args=(r, world, medium, rounds, tmp, port, os.path.join(tmp, "filestore"), align, results),
            )
            for r in range(world)
        ]
        for c in children:
            c.start()
        server = None
        if medium.startswith("TCPStore"):
            server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
        rows = [results.get(timeout=600) for _ in range(world * rounds)]
        for c in children:
            c.join(120)
        del server
    latencies = []
    for rnd in range(rounds):
        mine = [r for r in rows if r[0] == rnd]
        latencies.append(max(r[3] for r in mine) - max(r[2] for r in mine))
    waiting = [r for r in rows if r[1] != 0]
    polls = sum(r[4] for r in waiting)
    return {
        "median_ms": statistics.median(latencies) * 1000,
        "p90_ms": sorted(latencies)[int(0.9 * (len(latencies) - 1))] * 1000,
        "polls_per_rank": polls / len(waiting),
        "ops_per_poll": (sum(r[5] for r in waiting) / polls) if polls else float("nan"),
    }


MEDIA: tuple[str, ...] = (
    "nemo_safe (files)",
    "TCPStore, same protocol",
    "FileStore, same protocol",
    "TCPStore, blocking wait",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--media", nargs="+", default=list(MEDIA), choices=MEDIA)
    args = p.parse_args(argv)
    print(f"host: {os.cpu_count()} cores; rounds per cell: {args.rounds}; latency = last released - last entered")
    print(
        "| N | medium | median ms | p90 ms | vs TCPStore same protocol | polls/waiting rank "
        "| fs calls/poll (incl. arrival) |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in args.sizes:
        cells = {m: run(m, world, args.rounds) for m in args.media}
        ref = cells.get("TCPStore, same protocol", {}).get("median_ms")
        for medium, c in cells.items():
            ratio = f"{c['median_ms'] / ref:.2f}x" if ref else "-"
            files = medium.startswith("nemo_safe")
            polls = f"{c['polls_per_rank']:.1f}" if files else "-"
            ops = f"{c['ops_per_poll']:.2f}" if files else "-"
            print(
                f"| {world} | {medium} | {c['median_ms']:.1f} | {c['p90_ms']:.1f} | {ratio} | {polls} | {ops} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
