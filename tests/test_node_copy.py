"""One reader per node (nemo_safe/node_copy.py): on a real 2-node SLURM step, a node's waiting ranks follow
rank 0's state through a copy in /dev/shm, and without one (private /dev/shm, a killed reader) read the
shared state themselves. Each case runs next to its twin with the copies off (the flat barrier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_safe import node_copy
from nemo_safe.barrier import CALLS_PER_POLL, Barrier
from nemo_safe.barrier_channels import FileChannel
from nemo_safe.barrier_state import STARTED_AT
from nemo_safe.errors import BarrierTimeout
from nemo_safe.waiting import POLL_MAX_ENV, POLL_MAX_FLOOR, poll_cap
from nemo_safe.warn_once import forget

from procs import WORKER, clean_env

HANG_GUARD = 180
#: srun -N2 --ntasks-per-node=3 (block): node 1 holds ranks 0-2 (reader 1), node 2 ranks 3-5 (reader 3).
READERS, FOLLOWERS = (1, 3), (2, 4, 5)


def srun(tmp_path: Path, copies: str, *args: str, prefix: tuple[str, ...] = ()) -> tuple[dict[int, dict], str]:
    cmd = ["srun", "-N2", "--ntasks-per-node=3", "-J", "nemo-safe-copy", "--kill-on-bad-exit=0", *prefix]
    cmd += [sys.executable, WORKER, "--dir", str(tmp_path), *args]
    env = clean_env(NEMO_SAFE_NODE_COPY=copies)
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            results[res["rank"]] = res
    return results, out.stderr


def _released_after_rank_zero(results: dict[int, dict], ranks) -> None:
    for r in ranks:
        assert results[r]["status"] == "ok" and results[r]["saw_marker"], results[r]


@pytest.mark.slurm
@pytest.mark.parametrize("mode", [["--open", "--grace", "5"], []], ids=["open+grace (exp_manager)", "gather"])
@pytest.mark.parametrize("copies", ["1", "0"], ids=["node copies", "flat twin"])
def test_one_reader_per_node_reads_the_shared_state(slurm_cluster, tmp_path: Path, copies: str, mode) -> None:
    """With copies, only the readers poll the shared state and their nodes' other ranks follow the copy;
    the flat twin has every waiting rank poll it. Both release every rank after rank 0's work."""
    results, err = srun(tmp_path, copies, "--work-seconds", "1.5", *mode)
    assert sorted(results) == list(range(6)), err
    _released_after_rank_zero(results, range(1, 6))
    reads = {r: results[r]["reads"] for r in range(1, 6)}
    if copies == "0":
        assert {v["role"] for v in reads.values()} == {"flat"}, reads
        assert all(v["shared"] >= 10 and v["copy"] == 0 for v in reads.values()), reads
        return
    assert {r: reads[r]["role"] for r in READERS} == dict.fromkeys(READERS, "reader"), reads
    assert all(reads[r]["shared"] >= 10 and reads[r]["copy"] == 0 for r in READERS), reads
    # A follower may poll the shared state until a reader's first copy appears, then only the copy.
    assert all(reads[r]["copy"] >= 10 and reads[r]["copy"] > 2 * reads[r]["shared"] for r in FOLLOWERS), reads


@pytest.mark.slurm
@pytest.mark.parametrize("copies", ["1", "0"], ids=["node copies", "flat twin"])
def test_each_node_with_its_own_dev_shm_follows_its_own_reader(slurm_cluster, tmp_path: Path, copies) -> None:
    """The two slurmd "nodes" of this machine share one /dev/shm; here each node's tasks get their own (bound
    over /dev/shm in a private mount namespace per task, one folder per SLURM_NODEID), as on a real cluster:
    each node's followers follow their own node's reader, whose copy is the only one in that node's folder."""
    shm = tmp_path / "shm"
    own_shm = f'd={shm}/node$SLURM_NODEID && mkdir -p "$d" && mount --bind "$d" /dev/shm && exec "$@"'
    per_node = ("unshare", "-m", "--propagation", "private", "sh", "-c", own_shm, "sh")
    meet = tmp_path / "meet"
    meet.mkdir()
    results, err = srun(meet, copies, "--work-seconds", "1.5", "--open", "--grace", "5", prefix=per_node)
    assert sorted(results) == list(range(6)), err
    _released_after_rank_zero(results, range(1, 6))
    copies_by_node = {n: sorted((shm / n).glob(f"nemo_safe-{os.getuid()}/*")) for n in ("node0", "node1")}
    if copies == "0":
        assert copies_by_node == {"node0": [], "node1": []}, copies_by_node
        return
    assert [len(c) for c in copies_by_node.values()] == [1, 1], copies_by_node
    assert all(results[r]["reads"]["copy"] >= 10 for r in FOLLOWERS), results


@pytest.mark.slurm
@pytest.mark.parametrize("copies", ["1", "0"], ids=["node copies", "flat twin"])
def test_private_dev_shm_per_task_falls_back_to_the_shared_state(slurm_cluster, tmp_path: Path, copies) -> None:
    """Each task in its own mount namespace with its own /dev/shm (a container per task): no follower finds a
    copy, so each reads the shared state itself, like the flat twin, and nobody waits longer."""
    own_shm = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    private = ("unshare", "-m", "--propagation", "private", "sh", "-c", own_shm, "sh")
    results, err = srun(tmp_path, copies, "--work-seconds", "1.5", "--open", "--grace", "5", prefix=private)
    assert sorted(results) == list(range(6)), err
    _released_after_rank_zero(results, range(1, 6))
    assert all(results[r]["reads"]["copy"] == 0 and results[r]["reads"]["shared"] >= 10 for r in FOLLOWERS), results


@pytest.mark.slurm
@pytest.mark.parametrize("copies", ["1", "0"], ids=["node copies", "flat twin"])
def test_followers_of_a_killed_reader_read_the_shared_state(slurm_cluster, tmp_path: Path, copies) -> None:
    """Both readers are SIGKILLed 0.5 s into a 4 s wait: their copies stop being refreshed, and within a few
    seconds their followers read the shared state and are released by rank 0's outcome (the twin: the
    same ranks killed, no copies)."""
    kill = ("--kill-ranks", ",".join(map(str, READERS)), "--kill-after", "0.5")
    started = time.monotonic()
    results, err = srun(tmp_path, copies, "--work-seconds", "4", "--open", "--grace", "5", *kill)
    assert time.monotonic() - started < HANG_GUARD
    assert sorted(results) == [0, *FOLLOWERS], err
    _released_after_rank_zero(results, FOLLOWERS)
    if copies == "1":
        assert all(results[r]["reads"]["copy"] >= 1 and results[r]["reads"]["shared"] >= 1 for r in FOLLOWERS), results


def test_node_copy_setting(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not node_copy.copies_wanted(node_copy.AUTO_FROM_RANKS - 1, {})
    assert node_copy.copies_wanted(node_copy.AUTO_FROM_RANKS, {"NEMO_SAFE_NODE_COPY": "auto"})
    assert node_copy.copies_wanted(2, {"NEMO_SAFE_NODE_COPY": "1"})
    assert not node_copy.copies_wanted(4096, {"NEMO_SAFE_NODE_COPY": "off"})
    # A value it does not know is auto, with one warning: a performance switch never stops a job.
    assert not node_copy.copies_wanted(8, {"NEMO_SAFE_NODE_COPY": "sometimes"})
    assert node_copy.copies_wanted(4096, {"NEMO_SAFE_NODE_COPY": "sometimes"})
    assert caplog.text.count("NEMO_SAFE_NODE_COPY='sometimes' is not auto, 1 (on) or 0 (off)") == 1
    # auto starts exactly where the flat barrier's cap would rise above its floor.
    monkeypatch.delenv(POLL_MAX_ENV, raising=False)
    flat_pollers = node_copy.AUTO_FROM_RANKS - 1
    assert poll_cap(flat_pollers - 1, CALLS_PER_POLL) == POLL_MAX_FLOOR < poll_cap(flat_pollers, CALLS_PER_POLL)
    env = {"SLURM_STEP_NUM_NODES": "²", "LOCAL_WORLD_SIZE": "8"}
    assert node_copy.node_count(env, 4096) == 512  # a count that is no number is skipped, not raised


def test_a_copy_folder_others_could_write_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / f"nemo_safe-{os.getuid()}"
    assert node_copy.copy_folder(str(tmp_path)) == str(folder)
    assert (folder.stat().st_mode & 0o777) == 0o700
    folder.chmod(0o777)
    assert node_copy.copy_folder(str(tmp_path)) is None
    assert "not a private folder" in caplog.text
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    caplog.clear()
    forget(node_copy.log)
    assert node_copy.copy_folder(str(tmp_path)) is None
    assert "not a private folder" in caplog.text
    assert node_copy.copy_folder(str(tmp_path / "missing")) is None
    folder.unlink()
    tmp_path.chmod(0o777)  # anyone could swap the folder: refused
    assert node_copy.copy_folder(str(tmp_path)) is None
    tmp_path.chmod(0o1777)  # sticky, like /dev/shm: only its owner can rename or remove it
    assert node_copy.copy_folder(str(tmp_path)) == str(folder)


def _pair(tmp_path: Path) -> tuple[node_copy.NodeCopy, node_copy.NodeCopy]:
    shared_dir, folder = tmp_path / "shared", tmp_path / "copies"
    shared_dir.mkdir()
    folder.mkdir(mode=0o700)
    reader = node_copy.NodeCopy(FileChannel(shared_dir), str(folder), reader=True, nodes=2)
    follower = node_copy.NodeCopy(FileChannel(shared_dir), str(folder), reader=False, nodes=2)
    for ch in (reader, follower):
        ch.bind("b.key.0")
    reader.prepare()
    return reader, follower


@pytest.mark.parametrize("copies", [True, False], ids=["node copy", "flat twin"])
def test_a_copy_left_by_an_earlier_attempt_never_releases_anyone(tmp_path: Path, copies: bool) -> None:
    """A torchrun restart reuses the label: the earlier round's reader, killed, left a copy showing
    ``collect`` of a session whose frozen shared state is ``done``. A follower of the new round must not
    take that outcome (it would if it believed the copy: it saw the session collecting); like the flat
    twin, it waits for this round's rank 0 and times out."""
    _, follower = _pair(tmp_path)
    barrier = Barrier(follower if copies else follower.shared, 3, "exp_manager", rank=2,
                      attempt_key="torchrun-none-h_1", timeout=1.5)  # fmt: skip
    old = {"v": 1, "phase": "done", "session": "SOLD", "name": "exp_manager", "world_size": 3,
           "rank0": {"host": "h", "pid": 1, "nonce": "x"}, "time": STARTED_AT - 2, "ok": True,
           "accepted": {"1": "deadnonce"}, "rejected": {}, "accepting": False,
           "payload": {"log_dir": "OLD"}}  # fmt: skip
    follower.shared.prepare()
    follower.shared.publish_state(old)
    old_copy = {"refreshed": time.time() - 1.0, "stale_after": 5.0, "final": False,
                "state": {**old, "phase": "collect", "accepted": {}, "time": STARTED_AT - 3}}  # fmt: skip
    Path(follower.copy).write_text(json.dumps(old_copy))
    with pytest.raises(BarrierTimeout, match="rank 0 never started this attempt's barrier"):
        barrier.wait()
    assert follower.copy_reads == 0


def test_a_read_only_copy_folder_leaves_the_reader_waiting_as_flat(tmp_path: Path, read_only) -> None:
    """The copy cannot be written (``/dev/shm`` read-only or full): the reader warns once and reads on;
    its wait completes with rank 0's outcome as a flat waiter's does."""
    reader, _ = _pair(tmp_path)
    read_only(tmp_path / "copies")
    barrier = Barrier(reader, 2, "b", rank=1, attempt_key="k", timeout=30.0)
    rank_zero = (
        "import time\nfrom nemo_safe.barrier import Barrier\n"
        f"b = Barrier({str(tmp_path / 'shared')!r}, 2, 'b', rank=0, attempt_key='k', timeout=30.0)\n"
        "b.gather(); time.sleep(0.5); b.release(None, {'answer': 42})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", rank_zero], env=clean_env())
    try:
        assert barrier.wait().payload == {"answer": 42}
    finally:
        assert proc.wait(timeout=HANG_GUARD) == 0
    assert reader.copy is None and reader.shared_reads >= 1


def test_a_stale_or_used_final_copy_is_not_followed(tmp_path: Path) -> None:
    """A follower reads the shared state when the copy's reader stopped refreshing it, and takes a final
    copy (its reader finished) once."""
    reader, follower = _pair(tmp_path)
    reader.publish_state({"phase": "collect", "session": "s1"})
    assert reader.read_state() == {"phase": "collect", "session": "s1"}
    assert follower.read_state() == {"phase": "collect", "session": "s1"}
    assert (follower.copy_reads, follower.shared_reads) == (1, 0)
    reader.publish_state({"phase": "done", "session": "s1"})  # not read by the reader yet: the copy lags
    assert follower.read_state() == {"phase": "collect", "session": "s1"}
    reader.read_state()
    reader.finish()
    assert follower.read_state() == {"phase": "done", "session": "s1"}  # the final copy, once
    assert follower.read_state() == {"phase": "done", "session": "s1"}
    assert (follower.copy_reads, follower.shared_reads) == (3, 1)
    envelope = json.loads(Path(reader.copy).read_text())
    envelope.update(final=False, refreshed=time.time() - 60)  # a reader that stopped a minute ago
    Path(reader.copy).write_text(json.dumps(envelope))
    reader.publish_state({"phase": "done", "session": "s2"})
    assert follower.read_state() == {"phase": "done", "session": "s2"}
    assert follower.shared_reads == 2
