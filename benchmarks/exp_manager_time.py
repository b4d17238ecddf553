"""Seconds each rank spends in NeMo's exp_manager: upstream vs nemo_safe, side by side in one run.

Two configurations (NeMo's defaults on a fresh start; a resume with 2,000 old
files in log_dir, ``--old-files``) under two launchers (a real ``torchrun
--standalone --nproc-per-node 4`` and a real ``srun -N2 --ntasks-per-node=4``;
since 2026-12-05 both meet in ``.exp_manager/`` of the shared directory, the
upstream PR's way; before, torchrun met in the elastic agent's store).
Every rank enters exp_manager at one common wall-clock instant
(see ``exp_manager_member.py``); rank 0 is not delayed (the demo and the tests
show the late-rank-0 race): this is the cost every healthy start pays.

Table 1, per case and variant: rank 0's own seconds, the non-zero ranks'
seconds (median, max), their excess over rank 0's of the same launch
(relative: rank r's seconds minus rank 0's), and how much later than rank 0
they left exp_manager (end minus rank 0's end); upstream / nemo_safe ratios.
Table 2 (nemo_safe): where the time goes, from timestamps the member takes
around the upstream PR's functions the overlay runs and at every read and
write of their state file; and the start spread of the earlier 50 ms-poll gate
against the common instant.

Run: .venv/bin/python benchmarks/exp_manager_time.py [--rounds 3] [--no-slurm] [--old-files 2000] [--per-node 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_safe.cluster_identity import without_launchers
from nemo_safe_tools import demo

MEMBER = str(Path(__file__).resolve().parent / "exp_manager_member.py")
OLD_FILES = 2000
VARIANTS = ("upstream", "nemo_safe")
#: NeMo's default seconds_to_sleep: upstream's non-zero ranks sleep this long after their own work.
UPSTREAM_SLEEP = 5.0

Record = dict[str, Any]


def clean_env() -> dict[str, str]:
    return {**without_launchers(os.environ), "PYTHONUNBUFFERED": "1"}


def launch(
    launcher: str, config: str, tmp: Path, old_files: int, per_node: int = 4, nemo_safe_first: bool = False
) -> dict[str, list[Record]]:
    """One launch: every rank's record per variant, by rank."""
    base, side = tmp / "base", tmp / "side"
    side.mkdir(parents=True)
    if config == "resume":
        for variant in VARIANTS:
            demo.make_old_log_dir(base / variant / "log", old_files)
    args = [MEMBER, "--base", str(base), "--side", str(side), "--config", config]
    args += ["--nemo-safe-first"] if nemo_safe_first else []
    env = clean_env()
    if launcher == "torchrun":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(per_node), *args, "--devices", str(per_node)]
        cmd += ["--nodes", "1"]
    else:
        cmd = ["srun", "-N2", f"--ntasks-per-node={per_node}", "-J", "bench-expm", sys.executable, *args]
        cmd += ["--devices", str(per_node)]
        cmd += ["--nodes", "2"]
        env["MASTER_ADDR"] = "127.0.0.1"
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{launcher} {config} failed:\n{out.stderr[-3000:]}")
    records: dict[str, dict[int, Record]] = {v: {} for v in VARIANTS}
    for path in side.glob("times.*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records[r["variant"]][r["rank"]] = r
    return {v: [t[r] for r in sorted(t)] for v, t in records.items()}


def slurm_answers() -> bool:
    if not shutil.which("srun"):
        return False
    out = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and bool(out.stdout.strip())


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def breakdown(ranks: list[Record]) -> dict[str, list[float]]:
    """Milliseconds of one nemo_safe launch, split at the upstream PR's functions (see the member)."""
    r0, t0 = ranks[0], ranks[0]["trace"]
    ms = 1000.0
    out: dict[str, list[float]] = {k: [] for k in PARTS}
    published = t0.get("published", [])
    checking = next((t for phase, t in published if phase == "checking"), None)
    done = next((t for phase, t in published if phase == "done"), None)
    if "_check_resume_first.start" in t0 and checking is not None and done is not None:
        out["r0: enter -> _check_resume_first()"].append((t0["_check_resume_first.start"] - r0["enter"]) * ms)
        out["r0: -> state=checking written"].append((checking - t0["_check_resume_first.start"]) * ms)
        out["r0: check_resume()'s work"].append((t0["check_resume.end"] - t0["check_resume.start"]) * ms)
        out["r0: check_resume() -> state=done written"].append((done - t0["check_resume.end"]) * ms)
        out["r0: state=done -> leave: NeMo's rank-0 work (git, log files)"].append((r0["end"] - done) * ms)
    out["r0: CPU time in exp_manager"].append(r0["cpu"] * ms)
    for r in ranks[1:]:
        t = r["trace"]
        if "_wait_for_rank_zero.start" not in t:
            continue
        polls = t.get("polls", [])
        out["rN: CPU time in exp_manager"].append(r["cpu"] * ms)
        out["rN: enter -> _wait_for_rank_zero()"].append((t["_wait_for_rank_zero.start"] - r["enter"]) * ms)
        if checking is not None:
            out["rN: wait start - r0's state=checking"].append((t["_wait_for_rank_zero.start"] - checking) * ms)
        seen = next((p for p in polls if p[2] == "done"), None)
        if seen is not None and done is not None:
            before = [p for p in polls if p[1] <= done]
            out["rN: r0's state=done -> first read seeing it"].append((seen[1] - done) * ms)
            if before:  # the read before the release and the one that saw it
                out["rN: poll gap around the release"].append((seen[0] - before[-1][0]) * ms)
        out["rN: polls per wait"].append(float(len(polls)))
        out["rN: wait end -> leave: check_resume() in r0's log_dir, NeMo's work"].append(
            (r["end"] - t["_wait_for_rank_zero.end"]) * ms
        )
        if done is not None:
            out["rN: leave - r0's state=done"].append((r["end"] - done) * ms)
    return out


PARTS = (
    "r0: enter -> _check_resume_first()",
    "r0: -> state=checking written",
    "r0: check_resume()'s work",
    "r0: check_resume() -> state=done written",
    "r0: state=done -> leave: NeMo's rank-0 work (git, log files)",
    "r0: CPU time in exp_manager",
    "rN: CPU time in exp_manager",
    "rN: enter -> _wait_for_rank_zero()",
    "rN: wait start - r0's state=checking",
    "rN: polls per wait",
    "rN: r0's state=done -> first read seeing it",
    "rN: poll gap around the release",
    "rN: wait end -> leave: check_resume() in r0's log_dir, NeMo's work",
    "rN: leave - r0's state=done",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-slurm", action="store_true")
    p.add_argument("--no-torchrun", action="store_true")
    p.add_argument("--old-files", type=int, default=OLD_FILES)
    p.add_argument("--nemo-safe-first", action="store_true", help="run nemo_safe before upstream in each process")
    p.add_argument("--per-node", type=int, default=4, help="ranks per node (1 on 2 cores: no CPU contention)")
    p.add_argument("--configs", nargs="+", default=["defaults", "resume"], choices=["defaults", "resume"])
    args = p.parse_args(argv)
    # torchrun --standalone is one node: with one rank per node it would be a single process.
    torchrun = not args.no_torchrun and args.per_node > 1
    launchers = (["torchrun"] if torchrun else []) + ([] if args.no_slurm or not slurm_answers() else ["srun"])
    world = {
        "torchrun": f"torchrun --standalone --nproc-per-node {args.per_node}",
        "srun": f"srun -N2 --ntasks-per-node={args.per_node}",
    }
    loads = [load()]
    rows, parts_rows, skew_rows = [], [], []
    for launcher in launchers:
        for config in args.configs:
            r0: dict[str, list[float]] = {v: [] for v in VARIANTS}
            others: dict[str, list[float]] = {v: [] for v in VARIANTS}
            excess: dict[str, list[float]] = {v: [] for v in VARIANTS}
            later: dict[str, list[float]] = {v: [] for v in VARIANTS}
            parts: dict[str, list[float]] = {k: [] for k in PARTS}
            old_spread: list[float] = []
            new_spread: list[float] = []
            for _ in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp:
                    runs = launch(launcher, config, Path(tmp), args.old_files, args.per_node, args.nemo_safe_first)
                loads.append(load())
                for variant, ranks in runs.items():
                    zero = ranks[0]
                    r0[variant].append(zero["seconds"])
                    others[variant].extend(r["seconds"] for r in ranks[1:])
                    excess[variant].extend(r["seconds"] - zero["seconds"] for r in ranks[1:])
                    later[variant].extend(r["end"] - zero["end"] for r in ranks[1:])
                    old_spread.append(max(r["old_gate"] for r in ranks) - min(r["old_gate"] for r in ranks))
                    new_spread.append(max(r["enter"] for r in ranks) - min(r["enter"] for r in ranks))
                for k, v in breakdown(runs["nemo_safe"]).items():
                    parts[k].extend(v)
            cells = [launcher, config if config == "defaults" else f"resume, {args.old_files:,} old files"]
            for variant in VARIANTS:
                cells += [
                    f"{med(r0[variant]):.3f}",
                    f"{med(others[variant]):.3f} (max {max(others[variant]):.3f})",
                    f"{med(excess[variant]):+.3f} (max {max(excess[variant]):+.3f})",
                    f"{med(later[variant]):+.3f} (max {max(later[variant]):+.3f})",
                ]
            cells.append(f"{med(others['upstream']) / med(others['nemo_safe']):.0f}x")
            work = med(others["upstream"]) - UPSTREAM_SLEEP
            cells.append(f"{work:.3f} ({med(others['nemo_safe']) / work:.2f}x)")
            cells.append(f"{med(r0['nemo_safe']) / med(r0['upstream']):.2f}x")
            rows.append("| " + " | ".join(cells) + " |")
            parts_rows.append(
                (f"{launcher}, {cells[1]}", {k: (med(v), max(v) if v else float("nan")) for k, v in parts.items()})
            )
            skew_rows.append(
                f"| {launcher} | {cells[1]} | {1000 * med(old_spread):.1f} (max {1000 * max(old_spread):.1f}) "
                f"| {1000 * med(new_spread):.1f} (max {1000 * max(new_spread):.1f}) |"
            )
    print(f"exp_manager seconds, medians over {args.rounds} launches ({'; '.join(world[x] for x in launchers)});")
    print(f"{os.cpu_count()} cores; {loads[0]} before, after each launch: {', '.join(x[5:] for x in loads[1:])}")
    print()
    print(
        "| launcher | config | upstream rank 0 | upstream other ranks | upstream others minus rank 0 "
        "| upstream others' end after rank 0's | nemo_safe rank 0 | nemo_safe other ranks "
        "| nemo_safe others minus rank 0 | nemo_safe others' end after rank 0's "
        "| other ranks: upstream / nemo_safe | upstream other ranks minus their 5 s sleep (nemo_safe others / that) "
        "| rank 0: nemo_safe / upstream |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("Where nemo_safe's time goes, ms (median, max over ranks and launches; r0 = rank 0, rN = the others)")
    print()
    print("| step | " + " | ".join(name for name, _ in parts_rows) + " |")
    print("|---|" + "---|" * len(parts_rows))
    for k in PARTS:
        vals = " | ".join(f"{v[k][0]:.1f} (max {v[k][1]:.1f})" for _, v in parts_rows)
        print(f"| {k} | {vals} |")
    print()
    print("Start spread (last rank in - first rank in), ms")
    print()
    print("| launcher | config | earlier gate (each rank's own 50 ms poll) | common instant (this member) |")
    print("|---|---|---|---|")
    print("\n".join(skew_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
