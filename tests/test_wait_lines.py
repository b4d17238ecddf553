"""Issue 24, item 1: waits are visible by default, in one format, never twice, at a bounded volume.

Real processes (logging is per process: pytest's own handlers would hide the case where nothing is configured)
and a real barrier of four ranks whose rank 0 works 3 s. The in-process checks of :class:`WaitLines` shorten its
intervals, not its clock.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_safe import wait_lines

from procs import clean_env

HANG_GUARD = 120
FALLBACK_LINE = re.compile(r"^\[nemo_safe ([IW]) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [^ :]+:\d+\] (.*)$")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True, timeout=HANG_GUARD
    )


SAY = """
import logging, nemo_safe
from nemo_safe import log_output
{setup}
log = logging.getLogger("nemo_safe.barrier")
log_output.info(log, "nemo_safe: an info line")  # how nemo_safe says a wait
log.warning("nemo_safe: a warning line")
log.info("nemo_safe: a plain info line")  # shown only where the program asked for INFO
log.debug("nemo_safe: a debug line")
"""


def test_printed_where_nothing_is_configured() -> None:
    """A wait (``log_output.info``) and a warning print in nemo_safe's format; a plain INFO record does not."""
    out = _python(SAY.format(setup=""))
    lines = out.stderr.splitlines()
    assert [FALLBACK_LINE.match(line).groups() for line in lines] == [  # type: ignore[union-attr]
        ("I", "an info line"),
        ("W", "a warning line"),
    ], out.stderr


FORMAT = "format='%(levelname)s %(name)s %(message)s'"
HANDLER = "h = logging.StreamHandler(); h.setFormatter(logging.Formatter(" + FORMAT.split("=", 1)[1] + "))\n"


@pytest.mark.parametrize(
    ("setup", "levels"),
    [
        (f"logging.basicConfig({FORMAT})", ["WARNING"]),  # the root's default level, WARNING: the program's choice
        (f"logging.basicConfig({FORMAT}, level=logging.INFO)", ["INFO", "WARNING", "INFO"]),
        (f"logging.basicConfig({FORMAT})\nlogging.getLogger('nemo_safe').setLevel(logging.INFO)",
         ["INFO", "WARNING", "INFO"]),
        (f"{HANDLER}logging.getLogger().addHandler(h); h.setLevel(logging.WARNING)", ["WARNING"]),
        (f"{HANDLER}logging.getLogger('nemo_safe').addHandler(h)", ["WARNING"]),
        (f"{HANDLER}logging.getLogger('nemo_safe').addHandler(h); logging.getLogger('nemo_safe').setLevel(20)",
         ["INFO", "WARNING", "INFO"]),
    ],
    ids=["basicConfig", "basicConfig-info", "nemo_safe-info", "root-handler-warning", "handler-on-nemo_safe",
         "handler-and-level-on-nemo_safe"],
)  # fmt: skip
def test_where_the_program_configured_logging_its_levels_decide(setup: str, levels: list[str]) -> None:
    """Configured logging prints nemo_safe's lines in its own format, at its own levels, and the fallback adds no
    second copy of any line."""
    out = _python(SAY.format(setup=setup))
    assert [line.split()[0] for line in out.stderr.splitlines()] == levels, out.stderr
    assert all(line.split()[1] == "nemo_safe.barrier" for line in out.stderr.splitlines()), out.stderr


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ("logging.getLogger('nemo_safe').setLevel(logging.WARNING)", ["a warning line"]),
        ("logging.getLogger().setLevel(logging.CRITICAL)", []),
        ("logging.disable(logging.INFO)", ["a warning line"]),
    ],
)
def test_a_program_that_silenced_nemo_safe_is_obeyed(setup: str, said: list[str]) -> None:
    for before in (True, False):  # before nemo_safe's import or after it
        code = SAY.format(setup=setup) if not before else f"import logging\n{setup}\n" + SAY.format(setup="")
        out = _python(code)
        assert [line.split("] ", 1)[1] for line in out.stderr.splitlines()] == said, out.stderr


def test_a_closed_or_foreign_stderr_never_fails_a_call() -> None:
    """A line nobody can see is dropped: a closed standard error (a detached program), bytes, one without flush."""
    code = """
import io, os, sys, tempfile, nemo_safe
class NoFlush:
    def write(self, text): sys.__stdout__.write("seen: " + text)
for stderr in ("closed", io.BytesIO(), NoFlush()):
    if stderr == "closed":
        sys.stderr.close()
    else:
        sys.stderr = stderr
    folder = tempfile.mkdtemp()
    done = os.path.join(folder, "data.bin")
    nemo_safe.SingleFlight(folder, "dataset").run(lambda: open(done, "w").write("x"), lambda: os.path.exists(done))
    print("ok", flush=True)
sys.stderr = sys.stdout  # Python's own flush at exit needs one
"""
    out = _python(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 3 and "Traceback" not in out.stdout, out.stdout
    assert "seen: [nemo_safe I " in out.stdout and "does it" in out.stdout, out.stdout


def test_no_deadlock_with_a_program_reconfiguring_logging() -> None:
    """dictConfig holds logging's lock and takes every handler's; a nemo_safe line in another thread holds the
    fallback's and must not ask for logging's (the review's reproduction: the program's slow flush widens it)."""
    code = """
import logging, logging.config, os, threading, time, nemo_safe
class SlowFlush(logging.Handler):
    def emit(self, record): pass
    def flush(self): time.sleep(1.0)
logging.getLogger("app").addHandler(SlowFlush())
log = logging.getLogger("nemo_safe.barrier")  # as a module's: the thread takes no lock before the handler's
log.isEnabledFor(logging.WARNING)  # its level cached, as after any earlier line
def reconfigure():
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False, "handlers": {"h": {
        "class": "logging.StreamHandler", "stream": "ext://sys.stdout"}}, "root": {"handlers": ["h"]}})
def warn():
    time.sleep(0.3)
    log.warning("nemo_safe: a warning line")
threads = [threading.Thread(target=reconfigure, daemon=True), threading.Thread(target=warn, daemon=True)]
for t in threads: t.start()
for t in threads: t.join(10)
print("stuck" if any(t.is_alive() for t in threads) else "finished", flush=True)
os._exit(0)
"""
    out = _python(code)
    assert out.stdout.strip().splitlines()[-1] == "finished", out.stdout + out.stderr


@pytest.mark.parametrize(
    ("env", "speaks"),
    [
        ({}, True),  # no launcher numbered it
        ({"LOCAL_RANK": "0"}, True),
        ({"LOCAL_RANK": "1"}, True),  # local rank 0 often leads and does not wait
        ({"LOCAL_RANK": "2"}, False),
        ({"SLURM_LOCALID": "7"}, False),
        ({"SLURM_LOCALID": "0"}, True),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, False),
        ({"LOCAL_RANK": "5", "SLURM_LOCALID": "0"}, False),  # torchrun inside srun: torchrun's numbering
        ({"LOCAL_RANK": "x"}, True),
    ],
)
def test_who_speaks_for_a_node(env: dict[str, str], speaks: bool) -> None:
    assert wait_lines.speaks_for_its_node(env) is speaks


def test_lines_of_one_wait(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing before ANNOUNCE_AFTER, then the full line, a short one every REPEAT_EVERY, the release; a wait that
    ended before ANNOUNCE_AFTER says nothing, not even its release."""
    import time

    monkeypatch.setattr(wait_lines, "ANNOUNCE_AFTER", 0.2)
    monkeypatch.setattr(wait_lines, "REPEAT_EVERY", 0.3)
    log = logging.getLogger("nemo_safe.test")
    caplog.set_level(logging.INFO, logger="nemo_safe")
    short = wait_lines.WaitLines(log, "rank 3 waits for rank 0 at /x (rank 0 goes first)", "rank 3", speaks=True)
    short.tick(lambda: "status")
    short.released("rank 0 released it")
    assert caplog.messages == []
    lines = wait_lines.WaitLines(log, "rank 3 waits for rank 0 at /x (rank 0 goes first)", "rank 3", speaks=True)
    ends = time.monotonic() + 1.0
    while time.monotonic() < ends:
        lines.tick(lambda: "rank 0 is alive")
        time.sleep(0.01)
    lines.released("rank 0 released it")
    said = caplog.messages
    assert said[0] == "nemo_safe: rank 3 waits for rank 0 at /x (rank 0 goes first); rank 0 is alive", said
    assert 2 <= len(said[1:-1]) <= 3, said  # at 0.5 and 0.8 s (0.2 + n * 0.3), maybe late
    assert all(re.fullmatch(r"nemo_safe: rank 3 still waits after \d s; rank 0 is alive", m) for m in said[1:-1])
    assert re.fullmatch(r"nemo_safe: rank 3: rank 0 released it after 1\.\d s", said[-1]), said
    silent = wait_lines.WaitLines(log, "a wait", speaks=False)
    time.sleep(0.25)
    silent.tick(lambda: "status")
    assert len(caplog.messages) == len(said)


BARRIER_RANK = """
import os, sys, time, nemo_safe
rank = int(sys.argv[1])
with nemo_safe.rank_zero_first(sys.argv[2], world_size=4, rank=rank, attempt_key="lines"):
    if rank == 0:
        time.sleep(3)
"""


def test_four_ranks_of_one_node_two_speak(tmp_path: Path) -> None:
    """torchrun-style local ranks 0-3 on one node, nothing configured: rank 0 says once that it goes first; local
    rank 1 says that it waits, for whom, where, and is released; local ranks 2 and 3 stay quiet (the volume bound),
    though they waited as long."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER_RANK, str(rank), str(tmp_path)],
            env=clean_env(LOCAL_RANK=str(rank)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    errs = [p.communicate(timeout=HANG_GUARD)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errs
    said = [[FALLBACK_LINE.match(line)[2] for line in err.splitlines()] for err in errs]  # type: ignore[index]
    where = f"barrier 'barrier' in {tmp_path}/.nemo_safe/barrier.lines.0"
    assert said[0] == [f"rank 0 goes first at {where}; 3 other ranks wait for it"], said[0]
    assert said[1][0].startswith(f"rank 1 waits for rank 0 at {where} (rank 0 goes first); "), said[1]
    assert re.fullmatch(r"rank 1: rank 0 released it after [23]\.\d s", said[1][-1]), said[1]
    assert said[2] == said[3] == [], said
