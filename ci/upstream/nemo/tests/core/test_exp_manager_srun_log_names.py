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

"""``exp_manager`` under a real ``srun`` step: one per-rank log file per task.

exp_manager runs before ``trainer.fit()``; under srun nothing has exported ``LOCAL_RANK`` by then,
so with ``LOCAL_RANK`` defaulting to 0 every task of a node computes the node's first global rank
and all of them write ``nemo_log_globalrank-<node * devices>_localrank-0.txt``. The test starts
2 nodes x 2 tasks and requires the 4 distinct names. It needs a SLURM cluster (``srun``) and is
skipped where none answers.

Running this file as a script is one task (what srun starts).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NODES, TASKS_PER_NODE = 2, 2
HANG_GUARD = 600
#: Variables of another launcher around the test would override srun's.
FOREIGN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _slurm_answers() -> bool:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=60).returncode == 0


def _member(log_dir: Path, results: Path) -> None:
    import lightning.pytorch as pl
    from nemo.utils.exp_manager import exp_manager

    trainer = pl.Trainer(
        devices=TASKS_PER_NODE,
        num_nodes=NODES,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cfg = {"explicit_log_dir": str(log_dir), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
    exp_manager(trainer, cfg)
    rank = int(os.environ["SLURM_PROCID"])
    (results / f"{rank}.json").write_text(json.dumps({"rank": rank, "localid": os.environ["SLURM_LOCALID"]}))


@pytest.mark.unit
@pytest.mark.skipif(not _slurm_answers(), reason="needs a SLURM cluster that answers sinfo (srun)")
def test_every_srun_task_gets_its_own_log_file(tmp_path):
    log_dir, results = tmp_path / "log", tmp_path / "results"
    results.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env.update(NEMO_TESTING="1", MASTER_ADDR="127.0.0.1")  # NEMO_TESTING: per-rank log files on every rank
    cmd = ["srun", f"-N{NODES}", f"--ntasks-per-node={TASKS_PER_NODE}", "-J", "nemo-log-names"]
    cmd += [sys.executable, str(Path(__file__).resolve()), str(log_dir), str(results)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    world = NODES * TASKS_PER_NODE
    reports = sorted(int(p.stem) for p in results.glob("*.json"))
    assert reports == list(range(world)), f"srun exit {out.returncode}:\n{out.stderr[-3000:]}"
    # rglob: a release without ordered resume may archive other tasks' files into run_0 (#9952); count them too.
    names = sorted({p.name for p in log_dir.rglob("nemo_log_globalrank-*")})
    expected = sorted(
        f"nemo_log_globalrank-{node * TASKS_PER_NODE + local}_localrank-{local}.txt"
        for node in range(NODES)
        for local in range(TASKS_PER_NODE)
    )
    assert names == expected, f"{world} tasks must write {world} distinct log files, got {names}"


if __name__ == "__main__":
    _member(Path(sys.argv[1]), Path(sys.argv[2]))
