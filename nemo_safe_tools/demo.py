"""``nemo-safe demo``: NeMo's exp_manager resume race, upstream vs nemo_safe, side by side.

Both variants start the same job on a log_dir holding old files and a last
checkpoint, with rank 0 entering ``exp_manager`` late (as on a cluster where
one node starts slower). After ``exp_manager`` returns, every non-zero rank
watches ``log_dir`` (listdir + stat) until rank 0 is done and reports the old
files it still saw and the entries that vanished under it. On a reachable
SLURM cluster the job is a real ``srun`` step; otherwise local processes with
torchrun-style variables.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from nemo_safe import cluster_identity
from nemo_safe.errors import NemoSafeError
from nemo_safe_tools import download_race, local_ranks

RESULT_PREFIX = "result."
OLD_PREFIX = "old_"


def old_file_contents(count: int) -> dict[str, bytes]:
    """Name -> contents of the earlier run's files: sizes differ, so a file moved partly or mixed up shows."""
    return {f"{OLD_PREFIX}{i:04d}.txt": f"old file {i}\n".encode() * (1 + i % 7) for i in range(count)}


def make_old_log_dir(log_dir: Path, old_files: int | None) -> None:
    """A log_dir as a previous run leaves it: files to archive and a last checkpoint (also into a
    log_dir that exists already). ``None`` means a fresh start: no log_dir at all."""
    if old_files is None:
        return
    (log_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    for name, data in old_file_contents(old_files).items():
        (log_dir / name).write_bytes(data)
    (log_dir / "checkpoints" / "model--step=2-last.ckpt").write_text("checkpoint")


def start_gate(side: Path, rank: int, world: int, name: str, timeout: float = 900) -> None:
    """Line all ranks up after their slow imports, so the start skew is exactly the one asked for."""
    (side / f"{name}.{rank}").write_text("x")
    deadline = time.monotonic() + timeout
    while sum(1 for p in side.iterdir() if p.name.startswith(name + ".")) < world:
        if time.monotonic() > deadline:
            raise NemoSafeError(f"demo: not all {world} ranks reached {name} within {timeout:.0f} s")
        time.sleep(0.05)


def watch_log_dir(log_dir: Path, done: Path) -> tuple[int, int]:
    """List and stat log_dir until rank 0 is done: (most old files seen at once, entries that vanished)."""
    old_seen = vanished = 0
    final = False
    while True:
        finished = done.exists()
        names = os.listdir(log_dir)
        old_seen = max(old_seen, sum(1 for n in names if n.startswith(OLD_PREFIX)))
        for n in names:
            try:
                os.stat(log_dir / n)
            except FileNotFoundError:
                vanished += 1
        if final:
            return old_seen, vanished
        final = finished
        time.sleep(0.02)


def cpu_trainer_kwargs(devices: int, nodes: int) -> dict[str, Any]:
    """A quiet CPU Trainer; exp_manager adds its own logger and checkpointing."""
    return {
        "devices": devices,
        "num_nodes": nodes,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }


def resume_cfg(log_dir: Path) -> dict[str, Any]:
    """exp_manager settings of a job that resumes in ``log_dir`` whenever it holds a checkpoint."""
    return {
        "explicit_log_dir": str(log_dir),
        "resume_if_exists": True,
        "resume_ignore_no_checkpoint": True,
        "create_tensorboard_logger": False,
    }


def nemo_lightning() -> ModuleType:
    """The Lightning NeMo's ``exp_manager`` is written against: ``pytorch_lightning`` up to nemo_toolkit 2.2,
    ``lightning.pytorch`` from 2.3 on (the trainer a user builds for that NeMo)."""
    import nemo.utils.exp_manager as em

    found = vars(em).get("pytorch_lightning")
    return found if isinstance(found, ModuleType) else importlib.import_module("lightning.pytorch")


def run_member(log_dir: Path, side: Path, devices: int, nodes: int, rank0_delay: float) -> dict[str, Any]:
    """One rank: exp_manager on ``log_dir`` (resume), timed; non-zero ranks then watch ``log_dir``."""
    from nemo.utils.exp_manager import exp_manager

    pl = nemo_lightning()

    from nemo_safe import cluster_identity

    ident = cluster_identity.detect()
    trainer = pl.Trainer(**cpu_trainer_kwargs(devices, nodes))
    cfg = {**resume_cfg(log_dir), "create_checkpoint_callback": False}
    start_gate(side, ident.rank, ident.world_size, "imported")
    if ident.rank == 0:
        time.sleep(rank0_delay)
    result: dict[str, Any] = {"rank": ident.rank, "status": "ok"}
    started = time.monotonic()
    try:
        exp_manager(trainer, cfg)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
        return result
    result["exp_manager_seconds"] = time.monotonic() - started
    result["ckpt_path"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
    if ident.rank == 0:
        (side / "rank0_done").write_text("x")
    else:
        result["old_seen"], result["vanished"] = watch_log_dir(log_dir, side / "rank0_done")
    return result


def write_result(side: Path, result: dict[str, Any]) -> None:
    """A file per rank, not a line on stdout: srun forwards output in chunks of about 1 KiB, so another
    task's chunk of a long line (NeMo's config dump) can land in front of a result line."""
    final = side / f"{RESULT_PREFIX}{result['rank']}.json"
    tmp = final.with_name(f".{final.name}.{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, final)


def read_results(side: Path) -> dict[int, dict[str, Any]]:
    """The results the ranks of one run wrote with :func:`write_result`, by rank."""
    return download_race.read_results(side, f"{RESULT_PREFIX}*.json")


@dataclass
class Variant:
    name: str
    results: dict[int, dict[str, Any]]
    archived_current: int

    def row(self, world: int) -> str:
        waiters = [self.results[r] for r in range(1, world) if r in self.results]
        errors = [r for r, res in self.results.items() if res["status"] != "ok"]
        if errors or len(waiters) < world - 1:
            return f"| {self.name} | job failed on ranks {errors or 'missing'} | | | |"
        vanished = sum(1 for w in waiters if w["vanished"])
        saw_old = sum(1 for w in waiters if w["old_seen"])
        secs = [w["exp_manager_seconds"] for w in waiters]
        return (
            f"| {self.name} | {vanished} of {world - 1} | {saw_old} of {world - 1} | {self.archived_current} | "
            f"{min(secs):.2f}-{max(secs):.2f} |"
        )


def _slurm_available() -> bool:
    if not shutil.which("srun") or not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and bool(out.stdout.strip())


def run(
    workdir: Path, old_files: int | None, rank0_delay: float, nodes: int, tasks_per_node: int, use_slurm: bool | None
) -> tuple[str, int, list[Variant]]:
    """Run upstream then nemo_safe; returns the launcher description, the world size and both variants.
    ``use_slurm`` None means: a real srun step when a SLURM cluster answers."""
    reason = "--local"
    if use_slurm is None:
        use_slurm = _slurm_available()
        reason = "no SLURM cluster reachable"
    if not use_slurm:
        nodes = 1
    world = nodes * tasks_per_node
    variants = []
    for name, disable in (("upstream NeMo", "1"), ("with nemo_safe", "0")):
        base = Path(tempfile.mkdtemp(prefix="nemo_safe_demo_", dir=workdir))
        log_dir, side = base / "log", base / "side"
        side.mkdir()
        make_old_log_dir(log_dir, old_files)
        member = [
            sys.executable,
            "-m",
            "nemo_safe_tools.cli",
            "demo",
            "--member",
            "--log-dir",
            str(log_dir),
            "--side",
            str(side),
            "--devices",
            str(tasks_per_node),
            "--nodes",
            str(nodes),
            "--rank0-delay",
            str(rank0_delay),
        ]
        # NEMO_TESTING: 3.0.0 writes its per-rank log files only then (2.7.3 always does).
        overrides = {"NEMO_SAFE_DISABLE": disable, "NEMO_TESTING": "1"}
        if use_slurm:
            cmd = [
                "srun",
                f"-N{nodes}",
                f"--ntasks-per-node={tasks_per_node}",
                "-J",
                "nemo-safe-demo",
                "--kill-on-bad-exit=0",
                *member,
            ]
            env = {**cluster_identity.without_launchers(os.environ), **overrides}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if not read_results(side):
                tail = "\n".join(out.stderr.strip().splitlines()[-5:])
                raise NemoSafeError(
                    f"demo: `{' '.join(cmd[:5])} ...` produced no result (exit {out.returncode}):\n"
                    f"{tail}\nUse --nodes/--tasks-per-node to fit your partition, or --local."
                )
        else:
            procs = local_ranks.start(member, world, overrides, stderr=subprocess.DEVNULL)
            for proc in procs:
                proc.communicate(timeout=3600)
        run0 = log_dir / "run_0"
        moved = [p.name for p in run0.iterdir()] if run0.is_dir() else []
        variants.append(Variant(name, read_results(side), sum(1 for n in moved if not n.startswith(OLD_PREFIX))))
        shutil.rmtree(base, ignore_errors=True)
    where = (
        f"srun -N{nodes} --ntasks-per-node={tasks_per_node} (real SLURM step)"
        if use_slurm
        else f"{world} local processes with torchrun-style variables ({reason})"
    )
    return where, world, variants


def format_table(where: str, variants: list[Variant], world: int, old_files: int, rank0_delay: float) -> str:
    lines = [
        f"nemo-safe demo: NeMo exp_manager resume, {old_files} old files in log_dir, rank 0 enters "
        f"{rank0_delay:g} s late; {where}",
        "",
        "| variant | non-zero ranks that saw files vanish | ...that saw old files after exp_manager returned "
        "| current-run files archived into run_0 | seconds each non-zero rank spent in exp_manager |",
        "|---|---|---|---|---|",
        *(v.row(world) for v in variants),
    ]
    return "\n".join(lines)
