"""``rank_zero_first``: rank 0 never waits before its block; the per-node form (``local=True``) and the form
without a directory (torchrun's agent store), with real processes, a real srun step and a real torchrun."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_safe import rank_zero_first

from procs import RANK_ZERO_FIRST_WORKER, clean_env, start_ranks, torchrun_env

HANG_GUARD = 180


def _check_order(results: dict[int, dict], form: str, first_of) -> None:
    """Every rank that is not its group's first entered its block after the first one's block ended, and saw
    its marker; the first one ended its block before anyone else of its group started theirs."""
    for rank, res in results.items():
        times = res["forms"][form]
        first = results[first_of(rank)]["forms"][form]
        if rank != first_of(rank):
            assert times["saw_marker"], (form, rank, results)
            assert times["started"] >= first["ended"], (form, rank, results)


def test_rank_zero_starts_at_once_and_stays_until_a_late_rank_has_its_outcome(tmp_path: Path) -> None:
    """Rank 2 enters 5 s late: rank 0 starts its block at once (before 2026-12-05 it gathered every rank
    first and started at about 5 s), rank 1 is released after rank 0's 1 s of work, and rank 0 leaves the
    block only once rank 2 took its outcome (a rank arriving after rank 0 exited could not tell it from an
    earlier attempt's)."""
    (tmp_path / "meet").mkdir()
    args = ["--dir", str(tmp_path / "meet"), "--marker-dir", str(tmp_path), "--delay", "2:5", "--work", "1"]
    run_id = secrets.token_hex(4)
    env = lambda rank: torchrun_env(rank, 3, run_id)  # noqa: E731
    ranks = start_ranks(3, env, args, worker=RANK_ZERO_FIRST_WORKER).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.stderr
    r = {rank: ranks.results[rank]["forms"]["dir"] for rank in range(3)}
    assert r[0]["started"] - r[0]["entered"] < 1.5, f"rank 0 must not wait for rank 2 before its block: {r}"
    assert r[1]["started"] - r[1]["entered"] < 4, f"rank 1 is released once rank 0's block ended: {r}"
    assert r[0]["left"] >= r[2]["entered"], f"rank 0 stays until the late rank 2 has its outcome: {r}"
    assert r[0]["left"] - r[2]["entered"] < 10, f"and leaves once it has (not at its 60 s timeout): {r}"
    _check_order(ranks.results, "dir", lambda rank: 0)


@pytest.mark.slurm
def test_local_form_orders_each_node_on_its_own_under_srun(slurm_cluster, tmp_path: Path) -> None:
    """``srun -N2 --ntasks-per-node=2``, ``local=True``: global rank 0 enters 6 s late; node 1's local rank 0
    goes first there and node 1's other rank is released without waiting for node 0. The node's process
    count comes from SLURM_STEP_TASKS_PER_NODE."""
    (tmp_path / "meet").mkdir()
    cmd = ["srun", "-N2", "--ntasks-per-node=2", "-J", "nemo-safe-test", "--kill-on-bad-exit=0", sys.executable,
           RANK_ZERO_FIRST_WORKER, "--dir", str(tmp_path / "meet"), "--marker-dir", str(tmp_path),
           "--forms", "dir-local", "--delay", "0:6", "--work", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=HANG_GUARD)
    results = {r["rank"]: r for r in map(json.loads, (ln for ln in out.stdout.splitlines() if ln.startswith("{")))}
    assert out.returncode == 0 and len(results) == 4, (out.stdout, out.stderr)
    assert {r["local_world_size"] for r in results.values()} == {2}, results
    first_of = {r["rank"]: next(o["rank"] for o in results.values() if (o["node"], o["local_rank"]) == (r["node"], 0))
                for r in results.values()}  # fmt: skip
    _check_order(results, "dir-local", first_of.__getitem__)
    late_node = results[0]["node"]
    other = [r for r in results.values() if r["node"] != late_node]
    assert len(other) == 2, results
    for r in other:  # released before global rank 0 even entered: the nodes do not wait for each other
        assert r["forms"]["dir-local"]["left"] < results[0]["forms"]["dir-local"]["entered"], results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_a_directory_under_torchrun_meets_in_the_agent_store(tmp_path: Path) -> None:
    """A real ``torchrun --nnodes 2 --nproc-per-node 2`` (two agents, c10d rendezvous): ``rank_zero_first()``
    with no directory orders the job through the agent's store, then ``local=True`` orders each node
    (LOCAL_WORLD_SIZE); nothing is written to the working directory."""
    work = tmp_path / "cwd"
    work.mkdir()
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"rzf{port}",
           "--monitor-interval", "0.5", RANK_ZERO_FIRST_WORKER, "--marker-dir", str(tmp_path),
           "--forms", "store,store-local", "--delay", "3:3", "--work", "1"]  # fmt: skip
    agents = [subprocess.Popen(cmd, cwd=work, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]  # fmt: skip
    outputs = [agent.communicate(timeout=HANG_GUARD) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    lines = [ln for out, _ in outputs for ln in out.splitlines() if ln.startswith("{")]
    results = {r["rank"]: r for r in map(json.loads, lines)}
    assert sorted(results) == [0, 1, 2, 3], outputs
    assert {r["agent_store"] for r in results.values()} == {"True"}, "torchrun must serve its store to workers"
    _check_order(results, "store", lambda rank: 0)
    first_of = {r["rank"]: next(o["rank"] for o in results.values() if (o["node"], o["local_rank"]) == (r["node"], 0))
                for r in results.values()}  # fmt: skip
    _check_order(results, "store-local", first_of.__getitem__)
    assert list(work.iterdir()) == [], "the store form writes no file"


def test_rank_zero_keeps_its_own_exception_when_a_rank_is_rejected(tmp_path: Path) -> None:
    """Rank 0's block raises (with a cause) while rank 1, another process, comes with another world size: rank 0
    raises its own exception, traceback and cause untouched (the rejection is said in a warning); rank 1 is
    told why. (A first version raised it ``from None``, dropping the cause.)"""
    rank_one = (
        "from nemo_safe import rank_zero_first, ConfigurationError\n"
        "try:\n"
        f"    with rank_zero_first({str(tmp_path)!r}, 3, 'chain', rank=1, attempt_key='k', timeout=30): pass\n"
        "except ConfigurationError as exc:\n"
        "    print('rank 1:', exc)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", rank_one], env=clean_env(), stdout=subprocess.PIPE, text=True)
    with pytest.raises(ValueError, match="the block failed") as raised:
        with rank_zero_first(tmp_path, 2, "chain", rank=0, attempt_key="k", timeout=30):
            time.sleep(3)  # rank 1 arrives meanwhile (its interpreter starts in about a second)
            raise ValueError("the block failed") from KeyError("its cause")
    out, _ = other.communicate(timeout=HANG_GUARD)
    assert isinstance(raised.value.__cause__, KeyError), raised.value.__cause__
    assert "rank 1:" in out and "rank 0 rejected this rank 1" in out and "world size 3" in out, out
