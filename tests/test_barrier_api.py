"""Barrier API misuse and single-process behaviour, in this process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nemo_safe import Barrier, ConfigurationError, NemoSafeError, rank_zero_first
from nemo_safe.barrier_state import ranges


@pytest.mark.parametrize("world", [0, -1, 1.5, True, "8"])
def test_bad_world_size(tmp_path: Path, world) -> None:
    with pytest.raises(ConfigurationError, match="world_size must be an int"):
        Barrier(tmp_path, world, "x", rank=0, attempt_key="k")


def test_rank_outside_world(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="rank 4 is outside world size 4"):
        Barrier(tmp_path, 4, "x", rank=4, attempt_key="k")


def test_bad_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="timeout must be a finite, positive number of seconds"):
        Barrier(tmp_path, 2, "x", rank=0, attempt_key="k", timeout=0)
    monkeypatch.setenv("NEMO_SAFE_BARRIER_TIMEOUT", "-3")  # a setting: the default, with a warning
    assert Barrier(tmp_path, 2, "x", rank=0, attempt_key="k").timeout == 1800.0


def test_wrong_side_calls(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="rank 0 must call gather"):
        Barrier(tmp_path, 2, "x", rank=0, attempt_key="k").wait()
    with pytest.raises(ConfigurationError, match="only rank 0 gathers"):
        Barrier(tmp_path, 2, "x", rank=1, attempt_key="k").gather()
    with pytest.raises(ConfigurationError, match="release\\(\\) before gather"):
        Barrier(tmp_path, 2, "x", rank=0, attempt_key="k").release()


def test_release_after_a_start_that_failed_publishes_nothing(tmp_path: Path) -> None:
    """A rank 0 whose gather() failed before it opened a session (here: the barrier folder is a symlink)
    has no outcome to give: the usual ``except: barrier.release(exc)`` must not write a failure over the
    records, where the real rank 0's waiters would take it for theirs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / ".nemo_safe").symlink_to(elsewhere)
    barrier = Barrier(tmp_path / "work", 2, "x", rank=0, attempt_key="k", timeout=1)
    with pytest.raises(NemoSafeError) as started:
        barrier.gather()
    with pytest.raises(ConfigurationError, match="release\\(\\) before gather"):
        barrier.release(started.value)
    assert list(elsewhere.rglob("*")) == [], "nothing may be written through the refused path"


def test_single_process_writes_nothing(tmp_path: Path) -> None:
    with rank_zero_first(tmp_path, 1, "solo") as barrier:
        assert barrier is None
    assert list(tmp_path.iterdir()) == []


BAD_ARGUMENTS = [
    ({"timeot": 60}, TypeError, "unexpected keyword arguments \\['timeot'\\]"),
    ({"local": True}, TypeError, "unexpected keyword arguments \\['local'\\]"),
    ({"timeout": -1}, ConfigurationError, "timeout must be a finite, positive number"),
    ({"timeout": float("nan")}, ConfigurationError, "timeout must be a finite, positive number"),
    ({"poll_max": 0}, ConfigurationError, "poll_max must be a finite, positive number"),
]


@pytest.mark.parametrize(
    ("world_size", "kwargs", "error", "says"),
    [(w, *case) for w in (1, 2) for case in BAD_ARGUMENTS]
    + [(0, {}, ConfigurationError, "world_size must be an int >= 1")],
)
def test_rank_zero_first_refuses_bad_arguments_in_every_world_size(
    tmp_path: Path, world_size: int, kwargs: dict, error: type, says: str
) -> None:
    """One process (where no barrier is made) refuses what two do, before anything is written: a script tried
    alone must not first fail on the cluster. Before 2026-12-05 one process accepted all of these silently."""
    arguments = {"world_size": world_size, **kwargs}
    with pytest.raises(error, match=says), rank_zero_first(tmp_path, name="x", rank=0, attempt_key="k", **arguments):
        pytest.fail("the block must not run")
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_is_named(tmp_path: Path) -> None:
    barrier = Barrier(tmp_path / "nope", 2, "x", rank=0, attempt_key="k", timeout=1)
    with pytest.raises(Exception, match="does not exist; create it"):
        barrier.gather()


def test_ranges() -> None:
    assert ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    assert ranges([]) == "none"


def test_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A read-only bind mount (root ignores permission bits)."""
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("needs root to make a read-only bind mount")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], check=True)
    try:
        barrier = Barrier(ro, 2, "x", rank=0, attempt_key="k", timeout=1)
        with pytest.raises(NemoSafeError, match="cannot create the barrier directory.*Read-only"):
            barrier.gather()
    finally:
        subprocess.run(["umount", str(ro)], check=True)
