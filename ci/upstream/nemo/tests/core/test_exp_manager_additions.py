"""Tests our series appends to upstream's ``class TestExpManager`` in ``tests/core/test_exp_manager.py``.

``ci/upstream/series_nemo.py`` copies the methods of the class below, as they are, to the end of that
class (the last statement of upstream's file); the imports here only name what the methods use, and
upstream's file imports all of it already. Not collected here (pytest runs ``tests/`` only).
"""

import lightning.pytorch as pl
import pytest
from nemo.utils.exp_manager import exp_manager


class TestExpManager:
    def _per_rank_log_files(self, monkeypatch, tmp_path, launcher_env, **trainer_kwargs):
        """Names of the per-rank log files exp_manager writes for one process of a launcher (before fit())."""
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in launcher_env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("NEMO_TESTING", "1")  # per-rank log files on every rank
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **trainer_kwargs)
        cfg = {
            "explicit_log_dir": str(tmp_path),
            "create_tensorboard_logger": False,
            "create_checkpoint_callback": False,
            "seconds_to_sleep": 0,
        }
        log_dir = exp_manager(trainer, cfg)
        return sorted(p.name for p in log_dir.glob("nemo_log_*.txt"))

    @pytest.mark.unit
    def test_per_rank_log_file_under_srun(self, monkeypatch, tmp_path):
        """Task 3 of an srun step of 2 nodes x 2 tasks: nothing exports LOCAL_RANK before fit(), but the
        trainer's SLURM environment knows the local rank. Without it, tasks 2 and 3 share one log file."""
        slurm = {
            "SLURM_JOB_NAME": "train",
            "SLURM_JOB_ID": "1234",
            "SLURM_NODELIST": "node[1-2]",
            "SLURM_NTASKS": "4",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": "3",
            "SLURM_NODEID": "1",
            "SLURM_LOCALID": "1",
        }
        names = self._per_rank_log_files(monkeypatch, tmp_path, slurm, devices=2, num_nodes=2, strategy="ddp")
        assert names == ["nemo_log_globalrank-3_localrank-1.txt"]

    @pytest.mark.unit
    def test_per_rank_log_file_keeps_local_rank_env(self, monkeypatch, tmp_path):
        """torchrun starting one-device trainers: LOCAL_RANK is set, while the trainer's single-device strategy
        reports local rank 0 in every process. LOCAL_RANK keeps naming the file."""
        torchrun = {
            "RANK": "2",
            "LOCAL_RANK": "2",
            "WORLD_SIZE": "4",
            "GROUP_RANK": "0",
            "LOCAL_WORLD_SIZE": "4",
            "TORCHELASTIC_RUN_ID": "test",
        }
        names = self._per_rank_log_files(monkeypatch, tmp_path, torchrun, devices=1)
        assert names == ["nemo_log_globalrank-2_localrank-2.txt"]
