"""The nemo-safe command as a user runs it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_safe_tools.cli import build_parser

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
    assert re.search(r"^  launcher +none$", out.stdout, flags=re.M), out.stdout
    assert "WARNING" in out.stdout and "-J" in out.stdout
    for dist in ("nemo_toolkit", "torch", "torchvision", "lightning"):
        assert dist in out.stdout


def test_doctor_reports_slurm_identity() -> None:
    out = _run("doctor", **slurm_env(2, 4, "77"))
    assert re.search(r"^  launcher +slurm$", out.stdout, flags=re.M), out.stdout
    assert re.search(r"^  world size +4$", out.stdout, flags=re.M), out.stdout


def test_doctor_rows_share_one_column() -> None:
    """Labels up to the longest patch name (34 characters) and their values: every row's value starts in one
    column, two spaces at least after the longest label (before 2026-12-05 longer patch names pushed theirs)."""
    out = _run("doctor")
    assert out.returncode == 0, out.stderr
    starts = set()
    for line in (line for line in out.stdout.splitlines() if line.startswith("  ")):
        parts = line[2:].split("  ", 1)
        assert len(parts) == 2, f"no two spaces between label and value: {line!r}"
        starts.add(len(line) - len(parts[1].lstrip()))
    assert len(starts) == 1, out.stdout
    assert "torchvision-datasets-single-flight" in out.stdout


def test_doctor_judges_every_setting() -> None:
    """Four values nemo_safe cannot use and a misspelt name: doctor names each with what nemo_safe does instead
    and exits 1 (before 2026-12-05 it said nothing and exited 0); good values are shown with what is used."""
    bad = {"NEMO_SAFE_BARRIER_TIMEOUT": "abc", "NEMO_SAFE_POLL_MAX": "100", "NEMO_SAFE_NODE_COPY": "maybe",
           "NEMO_SAFE_DISABLE": "maybe", "NEMO_SAFE_TIMEOUT": "60"}  # fmt: skip
    out = _run("doctor", **bad)
    assert out.returncode == 1 and "5 setting(s) nemo_safe cannot use" in out.stderr, out.stdout + out.stderr
    for name, says in [
        ("NEMO_SAFE_BARRIER_TIMEOUT", "'abc': INVALID: not a finite, positive number of seconds; using the default"),
        ("NEMO_SAFE_POLL_MAX", "'100': INVALID: above its maximum; using 10 s"),
        ("NEMO_SAFE_NODE_COPY", "'maybe': INVALID: not auto, 1 (on) or 0 (off); using auto"),
        ("NEMO_SAFE_DISABLE", "'maybe': INVALID: neither 1/true/yes/on nor 0/false/no/off"),
        ("NEMO_SAFE_TIMEOUT", "'60': INVALID: not a nemo_safe setting (a typo?"),
    ]:
        assert re.search(rf"^  {name} +{re.escape(says)}", out.stdout, flags=re.M), (name, out.stdout)
    good = _run("doctor", NEMO_SAFE_BARRIER_TIMEOUT="600", NEMO_SAFE_NODE_COPY="off")
    assert good.returncode == 0, good.stdout + good.stderr
    assert re.search(r"^  NEMO_SAFE_BARRIER_TIMEOUT +'600': uses 600 s$", good.stdout, flags=re.M), good.stdout
    assert re.search(r"^  NEMO_SAFE_NODE_COPY +'off': uses off$", good.stdout, flags=re.M), good.stdout


def test_doctor_bad_launcher_value_is_a_clear_error() -> None:
    out = _run("doctor", **{**slurm_env(0, 4, "77"), "SLURM_PROCID": "abc"})
    assert out.returncode == 1
    assert "SLURM_PROCID='abc' is not an integer" in out.stdout


def test_help_and_module_entry_point() -> None:
    out = _run("--help")
    assert out.returncode == 0 and "``" not in out.stdout, out.stdout  # plain text, not reStructuredText
    module = subprocess.run([sys.executable, "-m", "nemo_safe_tools", "--version"], env=clean_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert module.returncode == 0 and module.stdout.startswith("nemo_safe "), module


def test_verbose_before_or_after_the_subcommand(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert parse(["selftest", "-v"]).verbose and parse(["-v", "selftest"]).verbose and parse(["doctor", "-v"]).verbose
    assert not parse(["selftest"]).verbose
    out = _run("selftest", "-v", "--procs", "2", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "OK: every rank saw rank 0 finish first" in out.stdout


def test_bad_numbers_are_refused_before_anything_starts() -> None:
    for args, says in [
        (("selftest", "--work-seconds", "nan"), "--work-seconds: 'nan': seconds must be a finite number >= 0"),
        (("selftest", "--work-seconds", "-1"), "--work-seconds: '-1': seconds must be a finite number >= 0"),
        (("selftest", "--timeout", "0"), "--timeout: '0': seconds must be a finite number > 0"),
        (("demo", "--rank0-delay", "inf"), "--rank0-delay: 'inf': seconds must be a finite number >= 0"),
        (("demo", "--download-ranks", "0"), "--download-ranks must be at least 1"),
    ]:
        out = _run(*args)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr


def test_selftest_refuses_a_directory_it_cannot_use_in_seconds(tmp_path: Path, read_only) -> None:
    """/proc and a read-only folder: the parent says why at once (before 2026-12-05 the members waited the
    30-minute barrier timeout in silence)."""
    for directory, says in [
        ("/proc", "is on proc, a kernel filesystem"),
        (read_only(tmp_path / "ro"), "cannot create"),
    ]:
        started = time.monotonic()
        out = _run("selftest", "--procs", "2", "--dir", str(directory))
        assert out.returncode == 1 and says in out.stderr, out.stderr
        assert time.monotonic() - started < 60, "a hang guard, not a measurement"


def test_selftest_stops_every_member_when_one_fails(tmp_path: Path, read_only) -> None:
    """The barrier's folder is read-only: rank 0 cannot create its barrier there and fails at once, while the
    others only read and would wait for it; they are stopped a second later instead of waiting out the 600 s
    timeout, and rank 0's error is reported."""
    read_only(tmp_path / ".nemo_safe")
    started = time.monotonic()
    out = _run("selftest", "--procs", "3", "--dir", str(tmp_path), "--timeout", "600")
    assert out.returncode == 1 and "Read-only file system" in out.stderr, out.stderr
    assert "rank 1: stopped: another rank failed first" in out.stderr, out.stderr
    assert time.monotonic() - started < 60, "a hang guard, not a measurement"


def test_selftest_ctrl_c_ends_quietly(tmp_path: Path) -> None:
    proc = subprocess.Popen([NEMO_SAFE, "selftest", "--procs", "2", "--work-seconds", "60", "--dir", str(tmp_path)],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".nemo_safe*")):  # the members are in the barrier
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    members = subprocess.run(["pgrep", "-f", f"--dir {tmp_path}"], capture_output=True, text=True)
    assert members.stdout.strip() == "", "no member may be left running"


def test_selftest_under_an_interactive_slurm_shell_warns() -> None:
    out = _run("selftest", "--procs", "2", **{**slurm_env(0, 4, "77"), "SLURM_JOB_NAME": "bash"})
    assert out.returncode == 0 and "WARNING" in out.stderr and "-J" in out.stderr, out.stderr


def test_bad_arguments() -> None:
    assert _run("selftest", "--procs", "0").returncode == 2
    out = _run("selftest", "--dir", "/nonexistent/dir")
    assert out.returncode == 2 and "not an existing directory" in out.stderr
    out = _run("selftest", "--procs", "2", **{"NEMO_SAFE_BARRIER_TIMEOUT": "soon"})  # warned, default used
    assert out.returncode == 0 and "OK: every rank saw rank 0 finish first" in out.stdout, out
