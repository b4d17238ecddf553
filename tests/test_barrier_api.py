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
    ({"local": "yes"}, ConfigurationError, "local must be True or False"),
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


def test_one_process_needs_neither_directory_nor_store(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    with rank_zero_first() as barrier:
        assert barrier is None
    with rank_zero_first(local=True) as barrier:
        assert barrier is None


def test_no_directory_without_torchrun_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only torchrun serves a store to its workers; elsewhere the call says what to pass."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "9", "SLURM_JOB_NAME": "train"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match="started by 'slurm' without one.*pass a directory"):
        with rank_zero_first():
            pytest.fail("the block must not run")


@pytest.mark.parametrize(
    ("env", "world_size", "says"),
    [
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "9", "SLURM_JOB_NAME": "train"}, None,
         "does not say which node this process is on"),
        # deepspeed-style: no GROUP_RANK, so every node would meet as node 0; a count given does not help
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 2,
         "does not say which node this process is on"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, None,
         "launcher \\(openmpi\\) does not say"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, 3,
         "runs 2 process\\(es\\) on this node"),
    ],
)  # fmt: skip
def test_local_form_refuses_a_launcher_that_does_not_number_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], world_size: int | None, says: str
) -> None:
    """Per node needs a node index equal on a node's processes and different between nodes: without one, every
    node's first process would act as rank 0 of one group at once."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=says):
        with rank_zero_first(tmp_path, world_size, local=True):
            pytest.fail("the block must not run")
    assert list(tmp_path.iterdir()) == []


def test_no_directory_with_a_store_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused port is named in seconds (the store's own client retries for its timeout)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=f"agent store 127.0.0.1:{port} does not answer"):
        with rank_zero_first():
            pytest.fail("the block must not run")


def test_one_process_with_a_world_size_reads_no_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rank_zero_first(directory, 1)`` with a directory needs nothing of the launcher: variables it cannot read
    (a PMIx job without a size) do not make it fail."""
    monkeypatch.setenv("PMIX_RANK", "0")
    monkeypatch.setenv("PMIX_NAMESPACE", "x")
    with rank_zero_first(tmp_path, 1) as barrier:
        assert barrier is None
