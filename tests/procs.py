"""Start real rank processes for the tests and collect their JSON results, with hang guards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nemo_safe.cluster_identity import without_launchers

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "barrier_worker.py")
RANK_ZERO_FIRST_WORKER = str(HERE / "rank_zero_first_worker.py")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher variables (the test runner may itself run under one)."""
    env = without_launchers(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def demo_rows(race: str, ranks: int, timeout: float) -> tuple[dict[str, list[str]], str]:
    """Run ``nemo-safe demo --only race`` with ``ranks`` download ranks: its table's cells by variant (the rows
    starting "upstream ..." or "with ..."), and its whole output for the assertions' messages."""
    cli = str(Path(sys.executable).with_name("nemo-safe"))
    cmd = [cli, "demo", "--only", race, "--download-ranks", str(ranks)]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.stdout.splitlines()
        if line.startswith(("| upstream", "| with"))
    }
    return rows, out.stdout


def torchrun_env(rank: int, world: int, run_id: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def slurm_env(rank: int, world: int, job_id: str, restart: int = 0) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_CLUSTER_NAME": "testcluster",
        "SLURM_RESTART_COUNT": str(restart),
    }


@dataclass
class Ranks:
    procs: dict[int, subprocess.Popen]
    results: dict[int, dict] = field(default_factory=dict)
    codes: dict[int, int] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)

    def finish(self, hang_guard: float) -> Ranks:
        """Wait for every rank; a rank still running after ``hang_guard`` s is a hang and fails the test."""
        deadline = time.monotonic() + hang_guard
        hung = []
        for rank, proc in self.procs.items():
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
                continue
            self.codes[rank] = proc.returncode
            self.stderr[rank] = err
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if lines:
                self.results[rank] = json.loads(lines[-1])
        for rank in hung:
            self.procs[rank].kill()
            self.procs[rank].communicate()
        assert not hung, f"ranks {hung} hung: still running {hang_guard:.0f} s after start"
        return self


def start_ranks(
    world: int, env_for_rank, args: list[str], ranks: list[int] | None = None, worker: str = WORKER
) -> Ranks:
    procs = {}
    for rank in ranks if ranks is not None else range(world):
        env = clean_env(**env_for_rank(rank))
        procs[rank] = subprocess.Popen(
            [sys.executable, worker, *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    return Ranks(procs)


def wait_for_files(directory: Path, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((directory / n).exists() for n in names):
            return
        time.sleep(0.05)
    raise AssertionError(f"{names} did not appear in {directory} within {timeout} s")


T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, timeout: float) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that value: a caller that needs it
    must not compute it again, the state may have moved on (a second upstream download truncating the file
    the first one wrote, CI of f7b1c80)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


FLIGHT_WORKER = str(HERE / "flight_worker.py")


def start_flights(n: int, directory: Path, *args: str, **env: str) -> list[subprocess.Popen]:
    """``n`` processes of tests/flight_worker.py (one SingleFlight job each) on ``directory``."""
    return [
        subprocess.Popen(
            [sys.executable, FLIGHT_WORKER, "--dir", str(directory), *args],
            env=clean_env(**env),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(n)
    ]


def finish_flights(procs: list[subprocess.Popen], hang_guard: float) -> tuple[list[dict], str]:
    """Their JSON results (each must exit 0 within ``hang_guard``) and their joined stderr."""
    results, logs = [], ""
    for p in procs:
        out, err = p.communicate(timeout=hang_guard)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
        logs += err
    return results, logs
