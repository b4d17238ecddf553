"""The nemo-safe command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from procs import clean_env, slurm_env

NEMO_SAFE = str(Path(sys.executable).with_name("nemo-safe"))


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([NEMO_SAFE, *args], env=clean_env(**env), capture_output=True, text=True, timeout=120)


def test_selftest_local_processes(tmp_path: Path) -> None:
    out = _run("selftest", "--procs", "6", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "world size        6" in out.stdout
    assert "OK: every rank saw rank 0 finish first" in out.stdout
    # The filesystem type as util-linux reads it from the mount table, not as nemo_safe does.
    fstype = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(tmp_path)], capture_output=True, text=True)
    assert f"directory         {tmp_path} ({fstype.stdout.strip()})" in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == [], "selftest must leave nothing behind"


def test_selftest_default_dir() -> None:
    out = _run("selftest", "--procs", "2")
    assert out.returncode == 0, out.stderr
    assert "release latency" in out.stdout


def test_doctor_warns_about_slurm_job_named_bash() -> None:
    out = _run("doctor", **{**slurm_env(0, 4, "77"), "SLURM_JOB_NAME": "bash"})
    assert out.returncode == 0, out.stderr
    assert "launcher           none" in out.stdout
    assert "WARNING" in out.stdout and "-J" in out.stdout
    for dist in ("nemo_toolkit", "torch", "torchvision", "lightning"):
        assert dist in out.stdout


def test_doctor_reports_slurm_identity() -> None:
    out = _run("doctor", **slurm_env(2, 4, "77"))
    assert "launcher           slurm" in out.stdout and "world size         4" in out.stdout


def test_doctor_bad_launcher_value_is_a_clear_error() -> None:
    out = _run("doctor", **{**slurm_env(0, 4, "77"), "SLURM_PROCID": "abc"})
    assert out.returncode == 1
    assert "SLURM_PROCID='abc' is not an integer" in out.stdout


def test_bad_arguments() -> None:
    assert _run("selftest", "--procs", "0").returncode == 2
    out = _run("selftest", "--dir", "/nonexistent/dir")
    assert out.returncode == 2 and "not an existing directory" in out.stderr
    out = _run("selftest", "--procs", "2", **{"NEMO_SAFE_BARRIER_TIMEOUT": "soon"})  # warned, default used
    assert out.returncode == 0 and "OK: every rank saw rank 0 finish first" in out.stdout, out
