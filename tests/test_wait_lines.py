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
{setup}
log = logging.getLogger("nemo_safe.barrier")
log.info("nemo_safe: an info line")
log.warning("nemo_safe: a warning line")
log.debug("nemo_safe: a debug line")
"""


def test_printed_where_nothing_is_configured() -> None:
    out = _python(SAY.format(setup=""))
    lines = out.stderr.splitlines()
    assert [FALLBACK_LINE.match(line).groups() for line in lines] == [  # type: ignore[union-attr]
        ("I", "an info line"),
        ("W", "a warning line"),
    ], out.stderr


@pytest.mark.parametrize(
    "setup",
    [
        "logging.basicConfig(format='%(levelname)s %(name)s %(message)s')",
        "logging.basicConfig(format='%(levelname)s %(name)s %(message)s', level=logging.WARNING)",
        "h = logging.StreamHandler(); h.setFormatter(logging.Formatter('%(levelname)s %(name)s %(message)s'))\n"
        "logging.getLogger('nemo_safe').addHandler(h)",
    ],
    ids=["basicConfig", "basicConfig-warning", "handler-on-nemo_safe"],
)
def test_the_programs_configuration_prints_it_once(setup: str) -> None:
    """Configured logging prints nemo_safe's lines in its own format, and the fallback adds no second copy. The
    root's level does not hide nemo_safe's waits (its logger says INFO); a level set on ``nemo_safe`` does."""
    out = _python(SAY.format(setup=setup))
    assert out.stderr.splitlines() == [
        "INFO nemo_safe.barrier nemo_safe: an info line",
        "WARNING nemo_safe.barrier nemo_safe: a warning line",
    ], out.stderr


def test_a_level_the_program_set_is_kept() -> None:
    for before in (True, False):  # set before nemo_safe's import (kept) or after it (wins)
        setup = "logging.getLogger('nemo_safe').setLevel(logging.WARNING)"
        code = SAY.format(setup=setup) if not before else f"import logging\n{setup}\n" + SAY.format(setup="")
        out = _python(code)
        assert [line.split("] ", 1)[1] for line in out.stderr.splitlines()] == ["a warning line"], out.stderr


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
