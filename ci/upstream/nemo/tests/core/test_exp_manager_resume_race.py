# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Race test for ``exp_manager`` resume under a real multi-process launch (NeMo issues #7460, #9952).

With ``resume_if_exists=True``, ``check_resume`` lets global rank 0 move every old regular file of
``log_dir`` into ``log_dir/run_N/``. The other ranks are only held back by a fixed
``time.sleep(cfg.seconds_to_sleep)`` (5 s by default) at the end of ``exp_manager``; nothing tells
them that rank 0 has finished the move. When rank 0 reaches ``exp_manager`` later than the others (a
slow node, a slow import), the other ranks return from ``exp_manager`` before the move happened:
they still see the old files in ``log_dir`` and then watch them vanish, and rank 0 archives files
the current run has already written (for example the per-rank log files) into ``run_0``.

The test starts 4 ranks with the real ``torchrun`` on a ``log_dir`` that a previous run left behind
(2000 old files and a last checkpoint), with ``seconds_to_sleep`` 3 s. All ranks line up at a start
gate after their imports, then rank 0 sleeps 6 s before calling ``exp_manager``, longer than
``seconds_to_sleep``: the other ranks each write their per-rank log file into ``log_dir``
(``NEMO_TESTING``) 6 s before rank 0 even starts to move, so without a real ordering rank 0 always
archives them into ``run_0`` (#9952), and with one they keep the order only because every one of
them waits in the meeting folder (rank 0 is late, not elsewhere). The failure is
deterministic by construction and needs no timing threshold. With the move ordered (rank 0 first,
the other ranks after it), ``run_0`` holds exactly the old files, no non-zero rank sees an old file
after ``exp_manager`` returned, and every rank resumes from the last checkpoint.

The same file is the per-rank member: ``torchrun`` runs it as a script (see ``__main__`` below).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed (torchrun) is not available"
)

WORLD_SIZE = 4
OLD_FILES = 2000
OLD_PREFIX = "old_"
LAST_CKPT = "model--step=2-last.ckpt"
# Rank 0 is later than seconds_to_sleep: the others keep waiting for it because they all wait in the folder.
RANK0_DELAY, SECONDS_TO_SLEEP = 6.0, 3.0
# Hang guard only: 4 NeMo imports on a small CPU machine take well under a minute.
HANG_GUARD = 600
RANK0_DONE = "rank0_done"


def _old_content(i: int) -> bytes:
    return f"old file {i}\n".encode() * (1 + i % 7)


def _make_old_log_dir(log_dir: Path) -> dict:
    """A log_dir as a previous run leaves it: files to archive and a last checkpoint."""
    (log_dir / "checkpoints").mkdir(parents=True)
    contents = {}
    for i in range(OLD_FILES):
        name = f"{OLD_PREFIX}{i:04d}.txt"
        contents[name] = _old_content(i)
        (log_dir / name).write_bytes(contents[name])
    (log_dir / "checkpoints" / LAST_CKPT).write_text("checkpoint")
    return contents


def _launch(log_dir: Path, side: Path, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD_SIZE),
        str(Path(__file__).resolve()),
        str(log_dir),
        str(side),
    ]
    # SLURM variables of a surrounding allocation would make Lightning pick its SLURM environment
    # (one rank for all 4 processes) instead of torchrun's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    # NEMO_TESTING: every rank writes its own log file into log_dir (files of the current run).
    env.update(MASTER_ADDR="127.0.0.1", NEMO_TESTING="1")
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish within {HANG_GUARD} s (hang):\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.integration  # starts torchrun with 4 ranks (about 30 s)
def test_check_resume_moves_old_files_before_other_ranks_continue(tmp_path):
    log_dir = tmp_path / "log"
    side = tmp_path / "side"
    side.mkdir()
    old = _make_old_log_dir(log_dir)

    out = _launch(log_dir, side, cwd=tmp_path)

    results = {}
    for rank in range(WORLD_SIZE):
        result_file = side / f"result.{rank}.json"
        if result_file.exists():
            results[rank] = json.loads(result_file.read_text())
    context = f"torchrun exit code {out.returncode}, stderr tail:\n{out.stderr[-3000:]}"
    assert sorted(results) == list(range(WORLD_SIZE)), f"missing rank results {results}; {context}"
    errors = {rank: res for rank, res in results.items() if res["status"] != "ok"}
    assert not errors, f"ranks failed: {errors}; {context}"

    run0 = log_dir / "run_0"
    archived = sorted(p.name for p in run0.iterdir()) if run0.is_dir() else []
    archived_current = [name for name in archived if not name.startswith(OLD_PREFIX)]
    problems = []
    for rank in range(1, WORLD_SIZE):
        res = results[rank]
        if res["old_seen"] or res["vanished"]:
            problems.append(
                f"rank {rank} returned from exp_manager before rank 0 archived the old files: it then saw "
                f"{res['old_seen']} old files in log_dir and {res['vanished']} entries vanished under it"
            )
    if archived_current:
        problems.append(f"files of the current run were archived into run_0: {archived_current}")
    assert not problems, "\n".join(problems)

    last = str(log_dir / "checkpoints" / LAST_CKPT)
    assert {rank: res["ckpt_path"] for rank, res in results.items()} == dict.fromkeys(range(WORLD_SIZE), last)
    assert archived == sorted(old), "run_0 must hold exactly the old files"
    assert all((run0 / name).read_bytes() == data for name, data in old.items()), "old files changed in the move"
    assert not any(log_dir.glob(f"{OLD_PREFIX}*")), "old files left in log_dir"
    for entry in log_dir.iterdir():
        if entry.name.startswith("."):  # only global rank 0's state stays, in a folder check_resume never moves
            left = [p.relative_to(entry).as_posix() for p in entry.rglob("*") if not p.is_dir()]
            assert entry.name == ".exp_manager" and [name.split("/")[-1] for name in left] == ["state"], left


# ---------------------------------------------------------------------------------------------
# Member: torchrun runs this file as a script, once per rank.
# ---------------------------------------------------------------------------------------------


def _start_gate(side: Path, rank: int, world: int, timeout: float = 300) -> None:
    """Line all ranks up after their slow imports, so the only start skew is RANK0_DELAY."""
    (side / f"imported.{rank}").write_text("x")
    deadline = time.monotonic() + timeout
    while sum(1 for p in side.iterdir() if p.name.startswith("imported.")) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {world} ranks reached the start gate within {timeout:.0f} s")
        time.sleep(0.05)


def _watch(log_dir: Path, done: Path, timeout: float = 300) -> tuple:
    """List and stat log_dir until rank 0 is done: (most old files seen at once, entries that vanished)."""
    old_seen = vanished = 0
    final = False
    deadline = time.monotonic() + timeout
    while True:
        finished = done.exists()
        names = os.listdir(log_dir)
        old_seen = max(old_seen, sum(1 for name in names if name.startswith(OLD_PREFIX)))
        for name in names:
            try:
                os.stat(log_dir / name)
            except FileNotFoundError:
                vanished += 1
        if final:
            return old_seen, vanished
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not finish exp_manager within {timeout:.0f} s")
        final = finished  # one more pass after rank 0's marker
        time.sleep(0.02)


def _member(log_dir: Path, side: Path) -> int:
    rank = int(os.environ["RANK"])
    result = {"rank": rank, "status": "ok"}
    try:
        from nemo.utils.exp_manager import exp_manager

        trainer = pl.Trainer(
            devices=WORLD_SIZE,
            num_nodes=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        cfg = {
            "explicit_log_dir": str(log_dir),
            "resume_if_exists": True,
            "resume_ignore_no_checkpoint": True,
            "create_tensorboard_logger": False,
            "create_checkpoint_callback": False,
            "seconds_to_sleep": SECONDS_TO_SLEEP,
        }
        _start_gate(side, rank, int(os.environ["WORLD_SIZE"]))
        if rank == 0:
            time.sleep(RANK0_DELAY)
        try:
            exp_manager(trainer, cfg)
            result["ckpt_path"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
        finally:
            if rank == 0:
                (side / RANK0_DONE).write_text("x")
        if rank != 0:
            result["old_seen"], result["vanished"] = _watch(log_dir, side / RANK0_DONE)
    except Exception as exc:  # reported to the test through the result file
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    tmp = side / f".result.{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(side / f"result.{rank}.json")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(_member(Path(sys.argv[1]), Path(sys.argv[2])))
