"""The barrier on a real 2-node SLURM step: srun -N2 --ntasks-per-node=4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import WORKER, clean_env

pytestmark = pytest.mark.slurm
HANG_GUARD = 180


def srun(args: list[str], cwd: Path) -> tuple[dict[int, dict], subprocess.CompletedProcess]:
    cmd = ["srun", "-N2", "--ntasks-per-node=4", "-J", "nemo-safe-test", "--kill-on-bad-exit=0", *args]
    out = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            results[res["rank"]] = res
    return results, out


def test_srun_two_nodes_barrier_orders(slurm_cluster, tmp_path: Path) -> None:
    results, out = srun([sys.executable, WORKER, "--dir", str(tmp_path), "--work-seconds", "1.5"], tmp_path)
    assert sorted(results) == list(range(8)), out.stderr
    assert {r["launcher"] for r in results.values()} == {"slurm"}
    assert {r["world"] for r in results.values()} == {8}
    assert len({r["key"] for r in results.values()}) == 1
    assert all(results[r]["status"] == "ok" and results[r]["saw_marker"] for r in range(1, 8)), results
    assert sorted(os.listdir(tmp_path)) == ["marker"]


def test_srun_without_barrier_shows_the_race(slurm_cluster, tmp_path: Path) -> None:
    results, out = srun(
        [sys.executable, WORKER, "--dir", str(tmp_path), "--work-seconds", "1.5", "--no-barrier"], tmp_path
    )
    assert sorted(results) == list(range(8)), out.stderr
    assert [r for r in range(1, 8) if not results[r]["saw_marker"]], results


def test_selftest_under_srun(slurm_cluster, tmp_path: Path) -> None:
    nemo_safe = str(Path(sys.executable).with_name("nemo-safe"))
    cmd = [
        "srun",
        "-N2",
        "--ntasks-per-node=4",
        "-J",
        "nemo-safe-selftest",
        nemo_safe,
        "selftest",
        "--dir",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr
    assert "launcher          slurm" in out.stdout
    assert "world size        8" in out.stdout
    assert "OK: every rank saw rank 0 finish first" in out.stdout
    assert os.listdir(tmp_path) == []
