"""Tests PR 2 of our series appends to upstream's ``class TestExpManager`` in ``tests/core/test_exp_manager.py``.

``ci/upstream/series_nemo.py`` copies the methods of the class below, as they are, to the end of that class; the
imports here only name what the methods use and upstream's file imports already (anything else is imported inside
the methods). Not collected here (pytest runs ``tests/`` only).
"""

import json
import os

import lightning.pytorch as pl
import pytest
from nemo.constants import NEMO_ENV_VARNAME_VERSION
from nemo.utils.exp_manager import exp_manager


class TestExpManager:
    def _resume_rank(self, monkeypatch, launcher_env, world_size):
        """A trainer of one process of a job of world_size processes on one node, before fit()."""
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
            monkeypatch.delenv(name, raising=False)
        # exp_manager exports both into the process's environment: let monkeypatch restore them
        monkeypatch.setenv("NEMO_EXPM_RESUME_CHECKED", "")
        monkeypatch.delenv(NEMO_ENV_VARNAME_VERSION, raising=False)
        for name, value in launcher_env.items():
            monkeypatch.setenv(name, str(value))
        return pl.Trainer(
            accelerator="cpu", devices=world_size, strategy="ddp", logger=False, enable_checkpointing=False
        )

    def _torchrun_rank(self, monkeypatch, rank, world_size):
        torchrun = {
            "RANK": rank,
            "LOCAL_RANK": rank,
            "WORLD_SIZE": world_size,
            "GROUP_RANK": 0,
            "LOCAL_WORLD_SIZE": world_size,
            "TORCHELASTIC_RUN_ID": "test",
        }
        return self._resume_rank(monkeypatch, torchrun, world_size)

    def _resume_cfg(self, log_dir, seconds_to_sleep):
        return {
            "explicit_log_dir": str(log_dir),
            "resume_if_exists": True,
            "resume_ignore_no_checkpoint": True,
            "create_tensorboard_logger": False,
            "create_checkpoint_callback": False,
            "seconds_to_sleep": seconds_to_sleep,
        }

    @pytest.mark.unit
    def test_resume_order_rank_zero_moves_then_releases(self, monkeypatch, tmp_path):
        """Global rank 0 of torchrun: rank 1 (played by a thread) waits already, so rank 0 moves at once and
        releases it."""
        import threading
        import time

        from nemo.utils.exp_manager import _wait_for_rank_zero

        trainer = self._torchrun_rank(monkeypatch, 0, 2)
        (tmp_path / "old.log").write_text("old")
        meeting = tmp_path / ".exp_manager"
        meeting.mkdir()
        left = []
        rank_one = threading.Thread(target=lambda: left.append(_wait_for_rank_zero(meeting, 1, 2, 30)))
        rank_one.start()
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=30))
        rank_one.join()
        assert time.monotonic() - started < 10 and left == [0.0]
        assert (tmp_path / "run_0" / "old.log").read_text() == "old"
        assert json.loads((meeting / "done").read_text())["ranks"] == [1]
        assert sorted(p.name for p in meeting.iterdir()) == ["done"]

    @pytest.mark.unit
    def test_resume_order_stale_arrivals_do_not_count(self, monkeypatch, tmp_path):
        """Arrival files of a start-up that was killed while rank 1 waited do not make rank 0 go on before the
        real rank 1 arrived: rank 0 clears them and waits (here, for a rank 1 that never comes: seconds_to_sleep)."""
        import time

        trainer = self._torchrun_rank(monkeypatch, 0, 2)
        (tmp_path / "old.log").write_text("old")
        meeting = tmp_path / ".exp_manager"
        meeting.mkdir()
        (meeting / "arrived.1.killed").touch()
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=1))
        assert time.monotonic() - started >= 1
        assert json.loads((meeting / "done").read_text()) == {"tokens": [], "ranks": []}
        assert sorted(p.name for p in meeting.iterdir()) == ["done"]

    @pytest.mark.unit
    def test_resume_order_rank_released_by_rank_zero(self, monkeypatch, tmp_path):
        """Rank 1 of torchrun waits for rank 0 (played by a thread) and then skips the fixed sleep."""
        import threading
        import time

        from nemo.utils.exp_manager import _check_resume_first

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        (tmp_path / ".exp_manager").mkdir()
        moved = []
        rank_zero = threading.Thread(
            target=_check_resume_first, args=(tmp_path / ".exp_manager", 2, 30, lambda: moved.append(True))
        )
        rank_zero.start()
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=30))
        rank_zero.join()
        assert moved and time.monotonic() - started < 10
        assert sorted(p.name for p in (tmp_path / ".exp_manager").iterdir()) == ["done"]

    @pytest.mark.unit
    def test_resume_order_stale_marker_does_not_release(self, monkeypatch, tmp_path):
        """A marker of an earlier run does not release rank 1 of 4; rank 0 never comes and the other ranks do not
        share the directory, so rank 1 carries on after seconds_to_sleep, as without ordering."""
        import time

        trainer = self._torchrun_rank(monkeypatch, 1, 4)
        (tmp_path / "old.log").write_text("old")
        meeting = tmp_path / ".exp_manager"
        meeting.mkdir()
        (meeting / "done").write_text(json.dumps({"tokens": ["stale"], "ranks": [1, 2, 3]}))
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=1))
        assert 1 <= time.monotonic() - started < 5
        assert (tmp_path / "old.log").exists()
        assert sorted(p.name for p in meeting.iterdir()) == ["done"]

    @pytest.mark.unit
    def test_resume_order_two_ranks_not_sharing_the_folder(self, monkeypatch, tmp_path):
        """Rank 1 of 2 alone in its folder (node-local disks): its own arrival is no sign that the folder is
        shared, so it carries on after seconds_to_sleep, as without ordering."""
        import time

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=1))
        assert 1 <= time.monotonic() - started < 5

    @pytest.mark.unit
    def test_resume_order_rank_zero_went_on_without_rank(self, monkeypatch, tmp_path):
        """Rank 1 of 2 is the only other rank, so it sees everyone waiting; but rank 0's marker says it went on
        without rank 1 (rank 1 came late, or the marker is old): rank 1 stops waiting after seconds_to_sleep."""
        import time

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        meeting = tmp_path / ".exp_manager"
        meeting.mkdir()
        (meeting / "done").write_text(json.dumps({"tokens": [], "ranks": []}))
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=1))
        assert 1 <= time.monotonic() - started < 5

    @pytest.mark.unit
    def test_resume_order_lightning_launcher(self, monkeypatch, tmp_path):
        """Lightning's own launcher: its main process (rank 0) runs exp_manager before the other ranks exist and
        must not wait; the ranks it starts in fit() inherit its environment and go on at once."""
        import time

        trainer = self._resume_rank(monkeypatch, {}, 2)
        (tmp_path / "old.log").write_text("old")
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=30))
        assert time.monotonic() - started < 10
        assert (tmp_path / "run_0" / "old.log").exists() and not (tmp_path / ".exp_manager").exists()
        assert os.environ["NEMO_EXPM_RESUME_CHECKED"] == f"{os.getpid()}:{tmp_path}"

        # The started rank: LOCAL_RANK=1, and this process's parent plays the main process.
        checked = f"{os.getppid()}:{tmp_path}"
        trainer = self._resume_rank(monkeypatch, {"LOCAL_RANK": 1, "NEMO_EXPM_RESUME_CHECKED": checked}, 2)
        started = time.monotonic()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=30))
        assert time.monotonic() - started < 10

    @pytest.mark.unit
    def test_resume_order_not_for_unversioned_ranks(self, monkeypatch, tmp_path):
        """Without explicit_log_dir, resume_if_exists or a version, rank 0 logs into a new version folder: the other
        ranks (no version) do not wait for it."""
        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        cfg = {"exp_dir": str(tmp_path), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
        exp_manager(trainer, {**cfg, "seconds_to_sleep": 0})
        assert not (tmp_path / "default" / ".exp_manager").exists()
