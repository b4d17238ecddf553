"""Seconds each rank spends in NeMo's exp_manager: upstream vs nemo_safe, side by side in one run.

Two configurations (NeMo's defaults on a fresh start; a resume with 2,000 old
files in log_dir) under two launchers (a real ``torchrun --standalone
--nproc-per-node 4``, which meets in the elastic agent's store, and a real
``srun -N2 --ntasks-per-node=4``, which meets in a shared directory). Every
rank enters exp_manager at the same instant; rank 0 is not delayed (the demo
and the tests show the late-rank-0 race): this is the cost every healthy
start pays. Reported: rank 0's own seconds and the non-zero ranks' (median and
slowest), absolute and minus rank 0's of the same run.

Run: .venv/bin/python benchmarks/exp_manager_time.py [--rounds 2] [--no-slurm]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nemo_safe import demo
from nemo_safe.cluster_identity import without_launchers

MEMBER = str(Path(__file__).resolve().parent / "exp_manager_member.py")
OLD_FILES = 2000


def clean_env() -> dict[str, str]:
    import os

    return {**without_launchers(os.environ), "PYTHONUNBUFFERED": "1"}


def launch(launcher: str, config: str, tmp: Path) -> dict[str, list[float]]:
    base, side = tmp / "base", tmp / "side"
    side.mkdir(parents=True)
    if config == "resume":
        for variant in ("upstream", "nemo_safe"):
            demo.make_old_log_dir(base / variant / "log", OLD_FILES)
    args = [MEMBER, "--base", str(base), "--side", str(side), "--config", config]
    env = clean_env()
    if launcher == "torchrun":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", "--nproc-per-node", "4", *args, "--devices", "4", "--nodes", "1"]
    else:
        cmd = ["srun", "-N2", "--ntasks-per-node=4", "-J", "bench-expm", sys.executable, *args, "--devices", "4"]
        cmd += ["--nodes", "2"]
        env["MASTER_ADDR"] = "127.0.0.1"
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{launcher} {config} failed:\n{out.stderr[-3000:]}")
    times: dict[str, dict[int, float]] = {"upstream": {}, "nemo_safe": {}}
    for path in side.glob("times.*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            times[r["variant"]][r["rank"]] = r["seconds"]
    return {v: [t[r] for r in sorted(t)] for v, t in times.items()}


def slurm_answers() -> bool:
    if not shutil.which("srun"):
        return False
    out = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and bool(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-slurm", action="store_true")
    args = p.parse_args(argv)
    launchers = ["torchrun"] + ([] if args.no_slurm or not slurm_answers() else ["srun"])
    rows = []
    for launcher in launchers:
        for config in ("defaults", "resume"):
            rank0: dict[str, list[float]] = {"upstream": [], "nemo_safe": []}
            others: dict[str, list[float]] = {"upstream": [], "nemo_safe": []}
            relative: list[float] = []
            for _ in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp:
                    times = launch(launcher, config, Path(tmp))
                for variant, secs in times.items():
                    rank0[variant].append(secs[0])
                    others[variant].extend(secs[1:])
                relative.extend(s - times["nemo_safe"][0] for s in times["nemo_safe"][1:])
            up, ours = statistics.median(others["upstream"]), statistics.median(others["nemo_safe"])
            rows.append(
                f"| {launcher} | {config} | {statistics.median(rank0['upstream']):.2f} | {up:.2f} "
                f"(max {max(others['upstream']):.2f}) | {statistics.median(rank0['nemo_safe']):.3f} | {ours:.3f} "
                f"(max {max(others['nemo_safe']):.3f}) | {statistics.median(relative):+.3f} "
                f"(max {max(relative):+.3f}) | {up / ours:.0f}x less |"
            )
    world = {"torchrun": "torchrun --standalone --nproc-per-node 4", "srun": "srun -N2 --ntasks-per-node=4"}
    print(f"exp_manager seconds, median over {args.rounds} runs ({'; '.join(world[x] for x in launchers)})")
    print(
        "| launcher | config | upstream rank 0 | upstream other ranks | nemo_safe rank 0 | nemo_safe other ranks "
        "| nemo_safe other ranks minus rank 0 | other ranks: ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
