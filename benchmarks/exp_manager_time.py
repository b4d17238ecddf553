"""Seconds a non-zero rank spends in NeMo's exp_manager: upstream vs nemo_safe, side by side.

Two cases, each run for both variants in the same invocation: a fresh start
(no log_dir) and a resume with 2,000 old files in log_dir. Rank 0 is not
delayed here (the demo shows the late-rank-0 race); what is measured is the
cost every healthy multi-rank start pays. Uses a real srun step when a SLURM
cluster answers, else local processes with torchrun-style variables.

Run: .venv/bin/python benchmarks/exp_manager_time.py [--rounds 2] [--local]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from nemo_safe import demo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--tasks-per-node", type=int, default=4)
    p.add_argument("--local", action="store_true")
    args = p.parse_args(argv)
    rows = []
    where = ""
    for case, old_files in (("fresh start", None), ("resume, 2,000 old files", 2000)):
        seconds: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp:
                where, _world, variants = demo.run(
                    Path(tmp), old_files, 0.0, args.nodes, args.tasks_per_node, False if args.local else None
                )
            for v in variants:
                failed = [r for r, res in v.results.items() if res["status"] != "ok"]
                if failed or not v.results:
                    raise SystemExit(f"{case} / {v.name}: ranks {failed or 'all'} failed")
                seconds.setdefault(v.name, []).extend(
                    res["exp_manager_seconds"] for r, res in v.results.items() if r != 0
                )
        up, safe = statistics.median(seconds["upstream NeMo"]), statistics.median(seconds["with nemo_safe"])
        rows.append(f"| {case} | {up:.2f} | {safe:.3f} | {up / safe:.0f}x less |")
    print(f"exp_manager seconds on non-zero ranks (median over {args.rounds} runs x all non-zero ranks); {where}")
    print("| case | upstream NeMo | with nemo_safe | ratio |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
