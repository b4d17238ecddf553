"""The filesystem barrier at scale: metadata operations per poll measured with strace, a model for 256-4,096 ranks.

Measured (one run, the sizes this machine can run): N real processes meet in
one ``nemo_safe.Barrier`` over files (rank 0 ``gather()``s, works ``--work``
seconds, ``release()``s; the others ``wait()``), once under ``strace -f -e
trace=%file,getdents64`` per process (the calls between two marker stats:
what the barrier itself does) and ``--rounds`` times without strace
(latencies). Rank 0's listing of N arrival names is measured at the full
sizes (N files in one folder). The flat barrier is set against the library's
node copies (``nemo_safe/node_copy.py``: one reader per node polls the shared
folder, the node's other ranks a copy in /dev/shm), with torchrun's variables
placing the ranks on nodes of 8. Then the model (see ``model_row``) is computed
for 256, 1,024 and 4,096 ranks, flat and with node copies, and set against the
measurement.

Run: .venv/bin/python benchmarks/barrier_scale.py [--sizes 2 8 16 32] [--rounds 3] [--work 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nemo_safe.barrier import CALLS_PER_POLL, RANK0_POLL_SPEEDUP
from nemo_safe.waiting import POLL_MAX_FLOOR, POLL_MIN, poll_cap

HERE = Path(__file__).resolve()
MARK = "/nonexistent-nemo-safe-scale"
#: The budgets of the issue: metadata operations per second on the shared server, release latency.
OPS_BUDGET, RELEASE_BUDGET = 2000.0, 2.0
#: Backoff: delay_k = POLL_MIN * FACTOR**k * U(0.75, 1), capped (nemo_safe/waiting.py Backoff).
FACTOR, JITTER_MEAN = 1.6, 0.875
RANKS_PER_NODE = 8
MODEL_SIZES = (256, 1024, 4096)
#: Calls on a file name that reach the metadata server; fstat of an open descriptor does not.
METADATA = {"openat", "open", "newfstatat", "stat", "lstat", "statx", "rename", "renameat", "renameat2"}
METADATA |= {"unlink", "unlinkat", "mkdir", "mkdirat", "rmdir", "getdents64", "access", "faccessat2"}


def cap_rule(pollers: int) -> float:
    """The library's poll cap for this many ranks polling the shared folder (nemo_safe/barrier.py)."""
    return poll_cap(pollers, CALLS_PER_POLL)


def mark(name: str) -> None:
    try:
        os.stat(f"{MARK}/{name}")
    except OSError:
        pass


# -- one rank ---------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    from nemo_safe.barrier import Barrier
    from nemo_safe.barrier_channels import FileChannel

    events: dict[str, Any] = {"polls": 0}
    read, arrive = FileChannel.read_state, FileChannel.arrive

    def read_state(self: FileChannel) -> Any:
        events["polls"] += 1
        return read(self)

    def arrival(self: FileChannel, *a: Any, **k: Any) -> None:
        arrive(self, *a, **k)
        events["arrived"] = time.time()

    FileChannel.read_state = read_state  # type: ignore[method-assign]
    FileChannel.arrive = arrival  # type: ignore[method-assign]
    side = Path(args.side)
    kwargs: dict[str, Any] = {"rank": args.rank, "attempt_key": args.key, "timeout": 120}
    if args.poll_max:
        kwargs["poll_max"] = args.poll_max
    top = Barrier(args.dir, args.world, "scale", **kwargs)  # node copies where the environment asks for them
    # Gate: every rank enters at one instant (latest arrival + 0.3 s), outside the marked window.
    (side / f".ready.{args.rank}").write_text(repr(time.time()))
    os.replace(side / f".ready.{args.rank}", side / f"ready.{args.rank}")
    gate = time.monotonic() + 120
    while len(found := list(side.glob("ready.*"))) < args.world:
        if time.monotonic() > gate:
            raise SystemExit("barrier_scale: not every rank reached the gate")
        time.sleep(0.005)
    start = max(float(p.read_text()) for p in found) + 0.3
    time.sleep(max(0.0, start - time.time()))
    mark("START")
    events["entered"] = time.time()
    if args.rank == 0:
        top.gather()
        events["gathered"] = time.time()
        time.sleep(args.work)
        events["released"] = time.time()
        top.release()
        mark("RELEASED")
        records = os.path.join(args.dir, ".nemo_safe")
        deadline = time.monotonic() + 30
        while os.path.exists(records + "/./") and time.monotonic() < deadline:  # clean-up done
            time.sleep(0.005)
        events["cleaned"] = time.time()
    else:
        top.wait()
        events["seen"] = time.time()
        events["role"] = getattr(top.channel, "role", "flat")
    mark("END")
    (side / f"result.{args.rank}.json").write_text(json.dumps(events))
    return 0


# -- launching and counting ---------------------------------------------------------------------------


def placed_on_nodes(rank: int, world: int, group: int, key: str) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on nodes of ``group`` ranks, node copies on (the benchmark
    places the ranks as torchrun would; nemo_safe reads only these variables)."""
    node, local = divmod(rank, group)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
        "LOCAL_WORLD_SIZE": str(group), "GROUP_WORLD_SIZE": str(-(-world // group)), "TORCHELASTIC_RUN_ID": key,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "NEMO_SAFE_NODE_COPY": "1",
    }  # fmt: skip


def run_barrier(world: int, work: float, traced: bool, poll_max: float | None = None, group: int = 0) -> dict[str, Any]:
    """One barrier of ``world`` processes; ``group`` > 0: with node copies, on nodes of ``group`` ranks."""
    with tempfile.TemporaryDirectory(prefix="nemo_safe_scale_") as tmp:
        d, side, traces = Path(tmp, "d"), Path(tmp, "side"), Path(tmp, "traces")
        for p in (d, side, traces):
            p.mkdir()
        key = f"scale-{random.getrandbits(32):x}"
        procs = []
        for rank in range(world):
            cmd = [sys.executable, str(HERE), "--worker", "--rank", str(rank), "--world", str(world)]
            cmd += ["--dir", str(d), "--side", str(side), "--key", key, "--work", str(work)]
            if poll_max:
                cmd += ["--poll-max", str(poll_max)]
            if traced:
                out = str(traces / f"t.{rank}")
                cmd = ["strace", "-f", "-qq", "-e", "trace=%file,getdents64", "-o", out, *cmd]
            env = {**os.environ, **(placed_on_nodes(rank, world, group, key) if group else {})}
            if not group:
                env["NEMO_SAFE_NODE_COPY"] = "0"
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        failed = [p for p in procs if p.poll() != 0]
        if failed:
            for p in procs:
                p.kill()
            raise SystemExit(f"barrier_scale: {len(failed)} ranks of N={world} failed")
        results = {r: json.loads((side / f"result.{r}.json").read_text()) for r in range(world)}
        counts = {r: count_calls(traces / f"t.{r}", str(d)) for r in range(world)} if traced else {}
    return {"results": results, "counts": counts}


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_DONE = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")
_AT_CALLS = {"openat", "newfstatat", "unlinkat", "mkdirat", "renameat", "renameat2", "statx", "faccessat2"}


def count_calls(trace: Path, barrier_dir: str) -> dict[str, Counter[str]]:
    """Calls between the START and END markers, by phase (before / after RELEASED) and kind; the
    ``shared`` counter has those whose path (resolved through the descriptors the trace opened) is
    under ``barrier_dir``, the shared folder (the rest are the node copies in /dev/shm)."""
    phases: dict[str, Counter[str]] = {"wait": Counter(), "after": Counter(), "shared": Counter()}
    phase = None
    fds: dict[str, str] = {}
    pending: dict[str, str] = {}
    for raw in trace.read_text().splitlines():
        m = _LINE.match(raw)
        if not m:
            continue
        pid, text = m.groups()
        if text.endswith("<unfinished ...>"):
            pending[pid] = text[: -len("<unfinished ...>")]
            continue
        if text.startswith("<... "):
            head = pending.pop(pid, None)
            if head is None or "resumed>" not in text:
                continue
            text = head + text.split("resumed>", 1)[1]
        if f"{MARK}/START" in text:
            phase = "wait"
            continue
        if f"{MARK}/RELEASED" in text:
            phase = "after"
            continue
        if f"{MARK}/END" in text:
            break
        done = _DONE.match(text)
        if phase is None or not done:
            continue
        call, rest, ret = done.groups()
        quoted = re.search(r'"([^"]*)"', rest)
        name = quoted.group(1) if quoted else ""
        first = rest.split(",", 1)[0]
        if call in _AT_CALLS and first != "AT_FDCWD" and not name.startswith("/"):
            base = fds.get(first, "?")
            path = f"{base}/{name}" if name else base
        elif call == "getdents64":
            path = fds.get(first, "?")
        else:
            path = name
        if call == "openat" and int(ret) >= 0:
            fds[ret] = path
        if path.startswith(f"{barrier_dir}/.nemo_safe/./"):
            continue  # the benchmark's own wait for the clean-up
        kind = call
        if call == "newfstatat" and rest.split(",")[1].strip() == '""':
            kind = "fstat (open fd)"
        elif call == "openat" and "O_DIRECTORY" in rest:
            kind = "openat dir"
        elif call == "openat" and "O_CREAT" in rest:
            kind = "openat create"
        elif call == "openat":
            kind = "openat file"
        phases[phase][kind] += 1
        if path.startswith(barrier_dir + "/") or path == barrier_dir:
            phases["shared"][kind] += 1
    return phases


def server_ops(c: Counter[str]) -> int:
    return sum(n for kind, n in c.items() if kind.split()[0] in METADATA and kind != "fstat (open fd)")


def measure_listing(sizes: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Rank 0's scan at full size: N arrival files in one folder, listed and parsed as the channel does."""
    from nemo_safe.barrier_channels import FileChannel

    out = {}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="nemo_safe_scale_list_") as tmp:
            ch = FileChannel(tmp)
            ch.bind("x")
            os.makedirs(ch.path)
            session = "0123456789abcdef"
            for r in range(1, n):
                open(os.path.join(ch.path, f"arrive.{session}.{r}.{n}.{os.urandom(8).hex()}"), "w").close()
            times = []
            for _ in range(7):
                t = time.perf_counter()
                ch.arrivals(session)
                times.append(time.perf_counter() - t)
            trace = Path(tmp, "trace")
            code = f"import os; os.listdir({ch.path!r})"
            cmd = ["strace", "-qq", "-e", "trace=openat,getdents64", "-o", str(trace), sys.executable, "-S", "-c", code]
            subprocess.run(cmd, check=True)
            lines = trace.read_text().splitlines()
            first = next(i for i, line in enumerate(lines) if ch.path in line and line.startswith("openat("))
            calls = sum(1 for line in lines[first:] if line.startswith("getdents64("))
            out[n] = {"ms": 1000 * statistics.median(times), "getdents64": float(calls)}
    return out


# -- the model ---------------------------------------------------------------------------------------


def schedule(cap: float, work: float, rng: random.Random) -> tuple[float, float]:
    """One poller from t = 0 (its first poll): (polls until the first poll at or after ``work``, that
    poll's delay after ``work``). The backoff of nemo_safe/waiting.py: POLL_MIN, x1.6, jitter U(0.75, 1),
    cap. Once at the cap with time to spare, the rest is the steady state: polls at 1/(0.875 cap), and
    the residual of a renewal process (interval length-biased on [0.75, 1] cap, uniform within it)."""
    t, nxt, polls = 0.0, POLL_MIN, 1.0
    while t < work:
        if nxt >= cap and work - t > 2 * cap:
            polls += (work - t) / (JITTER_MEAN * cap)
            length = cap * (0.5625 + 0.4375 * rng.random()) ** 0.5
            return polls, length * rng.random()
        t += nxt * rng.uniform(0.75, 1.0)
        nxt = min(cap, nxt * FACTOR)
        polls += 1
    return polls, t - work


def release_spread(pollers: int, cap: float, work: float, trials: int = 40) -> float:
    """Median over trials of the worst poller's delay after ``work`` (when rank 0 publishes)."""
    rng = random.Random(1)
    return statistics.median(max(schedule(cap, work, rng)[1] for _ in range(pollers)) for _ in range(trials))


def polls_per_waiter(cap: float, work: float, trials: int = 200) -> float:
    rng = random.Random(2)
    return statistics.mean(schedule(cap, work, rng)[0] for _ in range(trials))


def model_row(n: int, cap: float, pollers: int, per_poll: float, list_ms: float, work: float) -> dict[str, float]:
    """ops/s = pollers x per_poll / (0.875 x cap) in the steady state (rank 0's listings and the
    one-off records come on top); release = the worst poller's residual (simulated backoff) + one scan
    (rank 0 scans before publishing after open()); arrival = that + rank 0's cap/5 + one scan."""
    ops = pollers * per_poll / (JITTER_MEAN * cap)
    rank0_cap = max(POLL_MIN, cap / RANK0_POLL_SPEEDUP)
    spread = release_spread(pollers, cap, work)
    release = spread + list_ms / 1000
    arrival = spread + rank0_cap + list_ms / 1000
    return {"N": n, "cap": cap, "pollers": pollers, "ops": ops, "release": release, "arrival": arrival}


# -- main --------------------------------------------------------------------------------------------


def fs_type(path: str) -> str:
    """The filesystem type of the longest mount point above ``path`` (/proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (path + "/").startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=float, default=1.0, help="seconds rank 0 works inside the barrier")
    p.add_argument("--long-work", type=float, default=4.0, help="work for the emulated large caps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--dir", "--side", "--key"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--poll-max", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if not shutil.which("strace"):
        raise SystemExit("barrier_scale: needs strace (apt-get install strace)")
    loads = [load()]
    where = tempfile.gettempdir()
    print(f"host: {os.cpu_count()} cores; folders in {where} ({fs_type(where)}); work {args.work} s")
    print()
    # 1. per-poll operations (strace) and latencies (no strace), at the runnable sizes.
    measured: dict[int, dict[str, float]] = {}
    kinds: Counter[str] = Counter()
    rank0_kinds: dict[int, Counter[str]] = {}
    per_poll_all: list[float] = []
    for n in args.sizes:
        traced = run_barrier(n, args.work, traced=True)
        loads.append(load())
        res, counts = traced["results"], traced["counts"]
        wait_ops, polls, one_off = [], [], []
        for r in range(1, n):
            c = counts[r]["wait"]
            kinds.update(c)
            polls.append(res[r]["polls"])
            poll_ops = c["openat dir"] + c["openat file"]
            wait_ops.append(server_ops(c))
            one_off.append(server_ops(c) - poll_ops)
            per_poll_all.append(poll_ops / max(1, res[r]["polls"]))
        rank0_kinds[n] = counts[0]["wait"] + counts[0]["after"]
        lat: dict[str, list[float]] = {"release": [], "arrival": [], "polls": []}
        for _ in range(args.rounds):
            res = run_barrier(n, args.work, traced=False)["results"]
            loads.append(load())
            if n > 1:
                lat["release"].append(max(res[r]["seen"] for r in range(1, n)) - res[0]["released"])
                lat["arrival"].append(res[0]["gathered"] - max(res[r]["arrived"] for r in range(1, n)))
                lat["polls"].extend(res[r]["polls"] for r in range(1, n))
        waiting = args.work + statistics.median(lat["release"])
        measured[n] = {
            "polls": statistics.median(polls),
            "ops": statistics.median(wait_ops),
            "one_off": statistics.median(one_off),
            "per_poll": statistics.median(per_poll_all[-(n - 1) :]),
            "rank0_ops": float(server_ops(rank0_kinds[n])),
            "ops_s": (n - 1) * statistics.median(wait_ops) / waiting,
            "release": statistics.median(lat["release"]),
            "arrival": statistics.median(lat["arrival"]),
        }
    per_poll = statistics.median(per_poll_all)
    print("Measured: filesystem calls of the barrier (strace, between markers), one traced round per N")
    print()
    print(
        "| N | cap s | polls/waiting rank | metadata ops/waiting rank | of which one-off (arrive, withdraw, taken) "
        "| ops/poll | rank 0 ops (gather, release, clean-up) | ops/s all waiters | release ms (median) "
        "| arrival seen by rank 0 ms (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, m in measured.items():
        print(
            f"| {n} | {cap_rule(n - 1):.3f} | {m['polls']:.0f} | {m['ops']:.0f} | {m['one_off']:.0f} "
            f"| {m['per_poll']:.2f} "
            f"| {m['rank0_ops']:.0f} | {m['ops_s']:.0f} | {1000 * m['release']:.1f} | {1000 * m['arrival']:.1f} |"
        )
    print()
    print("Waiting ranks' calls by kind (all sizes): " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    last = max(rank0_kinds)
    print(f"Rank 0's calls by kind (N={last}): " + ", ".join(f"{k} {v}" for k, v in sorted(rank0_kinds[last].items())))
    print()
    # 2. the large caps, emulated on 8 ranks: per-waiter poll rate and release residual at the cap of N.
    print(f"Large-N caps on 8 ranks (poll_max set to cap(N)), work {args.long_work} s, {args.rounds} rounds")
    print()
    print("| cap of N | cap s | polls/s per waiter: measured | model | release ms: measured | model |")
    print("|---|---|---|---|---|---|")
    for n in MODEL_SIZES:
        cap = cap_rule(n - 1)
        rates, rel = [], []
        for _ in range(args.rounds):
            res = run_barrier(8, args.long_work, traced=False, poll_max=cap)["results"]
            loads.append(load())
            rel.append(max(res[r]["seen"] for r in range(1, 8)) - res[0]["released"])
            rates.extend(res[r]["polls"] / (res[r]["seen"] - res[r]["entered"]) for r in range(1, 8))
        model_rate = polls_per_waiter(cap, args.long_work) / args.long_work  # the ramp included
        measured_rel, model_rel = 1000 * statistics.median(rel), 1000 * release_spread(7, cap, args.long_work)
        print(
            f"| {n} | {cap:.3f} | {statistics.median(rates):.2f} | {model_rate:.2f} "
            f"(steady {1 / (JITTER_MEAN * cap):.2f}) | {measured_rel:.0f} | {model_rel:.0f} |"
        )
    print()
    # 3. rank 0's listing at full size.
    listing = measure_listing(MODEL_SIZES)
    loads.append(load())
    print("Rank 0's scan of N arrivals (FileChannel.arrivals, local disk; median of 7)")
    print()
    print("| N | ms | getdents64 calls |")
    print("|---|---|---|")
    for n, v in listing.items():
        print(f"| {n} | {v['ms']:.2f} | {v['getdents64']:.0f} |")
    print()
    # 4. node copies against the flat barrier, at the largest runnable size.
    big = max(args.sizes)
    group = min(RANKS_PER_NODE, big)
    print(f"Flat vs node copies (nemo_safe/node_copy.py), N={big}, nodes of {group} placed by torchrun's variables")
    print()
    print(
        "| design | shared-folder pollers | metadata ops on the shared folder (all ranks) | of which polls "
        "| shared ops/s | release ms (median) | arrival seen by rank 0 ms (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for design, g in (("flat", 0), ("node copies", group)):
        counts = run_barrier(big, args.work, traced=True, group=g)["counts"]
        loads.append(load())
        shared = Counter()
        for r in range(big):
            shared.update(counts[r]["shared"])
        rel, arr = [], []
        for _ in range(args.rounds):
            res = run_barrier(big, args.work, traced=False, group=g)["results"]
            loads.append(load())
            rel.append(max(res[r]["seen"] for r in range(1, big)) - res[0]["released"])
            arr.append(res[0]["gathered"] - max(res[r]["arrived"] for r in range(1, big)))
        window = args.work + statistics.median(rel)
        pollers = big - 1 if not g else -(-big // g)  # one reader per node (local rank 1 on node 0)
        total = server_ops(shared)
        print(
            f"| {design} | {pollers} | {total} | {shared['openat dir'] + shared['openat file']} "
            f"| {total / window:.0f} | {1000 * statistics.median(rel):.1f} | {1000 * statistics.median(arr):.1f} |"
        )
    print()
    # 5. the model against the measurement, then at scale.
    print(
        f"Model: ops/s = (N-1) x {per_poll:.2f} ops/poll / (0.875 x cap) "
        "(+ 7 one-off ops per waiter, N unlinks by rank 0); "
        "release = worst residual poll of the pollers (simulated backoff) + rank 0's scan; "
        "arrival = that + cap/5 + scan"
    )
    print()
    print("| N | polls/waiter: measured | model | ops/s all waiters: measured | model | release ms: measured | model |")
    print("|---|---|---|---|---|---|---|")
    for n, m in measured.items():
        window = args.work + m["release"]
        polls = polls_per_waiter(cap_rule(n - 1), window)
        ops_s = (n - 1) * (polls * per_poll + m["one_off"]) / window
        row = model_row(n, cap_rule(n - 1), n - 1, per_poll, 0.0, args.work)
        print(
            f"| {n} | {m['polls']:.0f} | {polls:.1f} | {m['ops_s']:.0f} | {ops_s:.0f} | {1000 * m['release']:.1f} "
            f"| {1000 * row['release']:.1f} |"
        )
    print()
    print(f"At scale ({RANKS_PER_NODE} ranks per node; waits long enough to reach the cap, 10 s):")
    print()
    one_off = statistics.median(m["one_off"] for m in measured.values())
    print(
        "| N | design | cap rule | cap s | shared-folder pollers | metadata ops/s (polls) "
        "| one-off calls per barrier (arrive, withdraw, taken) | release s | arrival s | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in MODEL_SIZES:
        nodes = n // RANKS_PER_NODE
        lst = listing[n]["ms"]
        designs = [
            ("flat", "poll_cap(N-1 pollers)", cap_rule(n - 1), n - 1, lst),
            ("node copies", "poll_cap(nodes pollers)", cap_rule(nodes), nodes, lst),
        ]
        for design, rule, cap, pollers, list_ms in designs:
            row = model_row(n, cap, pollers, per_poll, list_ms, 10.0)
            if design == "node copies":  # + the node-local hop: a 50 ms-capped poll of the copy
                row["release"] += POLL_MAX_FLOOR
                row["arrival"] += POLL_MAX_FLOOR
            ops_ok = row["ops"] <= OPS_BUDGET * 1.001
            release_ok = row["release"] <= RELEASE_BUDGET
            verdict = ", ".join(
                [
                    f"ops/s {'within' if ops_ok else 'over'} {OPS_BUDGET:,.0f}",
                    f"release {'within' if release_ok else 'over'} {RELEASE_BUDGET:.0f} s",
                ]
            )
            print(
                f"| {n:,} | {design} | {rule} | {cap:.3f} | {pollers:,} | {row['ops']:,.0f} | {(n - 1) * one_off:,.0f} "
                f"| {row['release']:.2f} "
                f"| {row['arrival']:.2f} | {verdict} |"
            )
    print()
    print(f"load averages (1/5/15 min) before and after each launch: {'; '.join(loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
