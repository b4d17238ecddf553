"""Tests PR 3 of our series puts into upstream's ``class TestExpManager`` in ``tests/core/test_exp_manager.py``.

``ci/upstream/series_nemo.py`` puts the methods of the class below, as they are, in place of PR 2's
``test_resume_order_not_for_unversioned_ranks``; they use PR 2's helpers ``_torchrun_rank`` of that class. The
imports here only name what the methods use and upstream's file imports already (anything else is imported inside
the methods). Not collected here (pytest runs ``tests/`` only).
"""

import json
import os
from pathlib import Path

import pytest
from nemo.constants import NEMO_ENV_VARNAME_VERSION
from nemo.utils.exp_manager import exp_manager


class TestExpManager:
    _JOB = (  # exp_manager's RESUME_ORDER_JOB_VARIABLES: the same on every rank of one job
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
    )

    def _meeting_dir(self, exp_dir, job):
        """Where the unversioned ranks of the job with these RESUME_ORDER_JOB_VARIABLES values meet."""
        import uuid

        return exp_dir / "default" / ".exp_manager" / uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(job)).hex[:12]

    def _unversioned_rank_one(self, monkeypatch, tmp_path, rank_zero_port, marker_in_rank_one_folder=False):
        """Rank 1 of 2 under torchrun (MASTER_PORT 29500) without explicit_log_dir, resume_if_exists or a version;
        global rank 0 of a job with MASTER_PORT rank_zero_port (played by a thread) answers the arrival file it finds
        in its job's meeting folder (or, with marker_in_rank_one_folder, in rank 1's) with the marker it writes after
        picking a new version. Returns rank 1's log_dir, rank 0's and the seconds rank 1 spent in exp_manager."""
        import threading
        import time

        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        job = [os.environ.get(variable) for variable in self._JOB]
        meeting = self._meeting_dir(tmp_path, job)
        job[self._JOB.index("MASTER_PORT")] = rank_zero_port
        if not marker_in_rank_one_folder:
            meeting = self._meeting_dir(tmp_path, job)
        rank_zero_log_dir = tmp_path / "default" / "2026-12-01_06-00-00"
        stop = threading.Event()

        def rank_zero():
            while not stop.is_set():
                arrived = sorted(meeting.glob("arrived.1.*")) if meeting.is_dir() else []
                if arrived:
                    done = {
                        "tokens": [arrived[0].name.split(".")[2]],
                        "ranks": [1],
                        "log_dir": str(rank_zero_log_dir),
                        "exp_dir": str(tmp_path),
                        "name": "default",
                        "version": rank_zero_log_dir.name,
                        "job": job,
                    }
                    (meeting / ".done").write_text(json.dumps(done))
                    os.replace(meeting / ".done", meeting / "done")
                    return
                time.sleep(0.01)

        thread = threading.Thread(target=rank_zero)
        thread.start()
        cfg = {"exp_dir": str(tmp_path), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
        started = time.monotonic()
        try:
            log_dir = exp_manager(trainer, {**cfg, "seconds_to_sleep": 3})
        finally:
            stop.set()
            thread.join()
        return log_dir, rank_zero_log_dir, time.monotonic() - started

    @pytest.mark.unit
    def test_log_dir_unversioned_rank_takes_rank_zero_version(self, monkeypatch, tmp_path):
        """Without explicit_log_dir, resume_if_exists or a version, get_log_dir() gives only global rank 0 a version
        (#8604). Rank 1 of torchrun meets rank 0 and logs into rank 0's version folder, not into exp_dir/default."""
        log_dir, rank_zero_log_dir, seconds = self._unversioned_rank_one(monkeypatch, tmp_path, "29500")
        assert log_dir == rank_zero_log_dir
        assert seconds < 3, "released by rank 0, rank 1 skips the fixed sleep"

    @pytest.mark.unit
    @pytest.mark.parametrize("marker_in_rank_one_folder", [False, True])
    def test_log_dir_not_from_another_job(self, monkeypatch, tmp_path, marker_in_rank_one_folder):
        """Global rank 0 of another job that shares exp_dir/default (another MASTER_PORT) meets its own ranks in
        another folder: it neither releases rank 1 nor hands it its version folder, not even through a marker in
        rank 1's folder. Rank 1 keeps its own log_dir after seconds_to_sleep, as before."""
        log_dir, _, seconds = self._unversioned_rank_one(monkeypatch, tmp_path, "29501", marker_in_rank_one_folder)
        assert log_dir == tmp_path / "default"
        assert seconds >= 3 or marker_in_rank_one_folder, "rank 1 was released by another job's rank 0"

    @pytest.mark.unit
    def test_log_dir_rank_zero_releases_with_its_version(self, monkeypatch, tmp_path):
        """Global rank 0 of an unversioned torchrun job waits for rank 1 (played by a thread) and releases it with
        its new version folder."""
        import threading

        from nemo.utils.exp_manager import _wait_for_rank_zero

        trainer = self._torchrun_rank(monkeypatch, 0, 2)
        meeting = self._meeting_dir(tmp_path, [os.environ.get(variable) for variable in self._JOB])
        meeting.mkdir(parents=True)
        released = []
        rank_one = threading.Thread(target=lambda: released.append(_wait_for_rank_zero(meeting, 1, 2, 30)))
        rank_one.start()
        cfg = {"exp_dir": str(tmp_path), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
        log_dir = exp_manager(trainer, {**cfg, "seconds_to_sleep": 30})
        rank_one.join()
        seconds, done = released[0]
        version = os.environ[NEMO_ENV_VARNAME_VERSION]
        assert log_dir == tmp_path / "default" / version and seconds == 0.0
        assert (Path(done["log_dir"]), done["exp_dir"], done["name"], done["version"]) == (
            log_dir,
            str(tmp_path),
            "default",
            version,
        )
        assert done["job"] == [os.environ.get(variable) for variable in self._JOB]

    @pytest.mark.unit
    def test_log_dir_unversioned_rank_without_rank_zero(self, monkeypatch, tmp_path):
        """Rank 1 of 2 of an unversioned run whose rank 0 never comes (here: exp_dir on another node's disk) carries
        on after seconds_to_sleep, as before, and keeps its own log_dir."""
        import time

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        cfg = {"exp_dir": str(tmp_path), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
        started = time.monotonic()
        log_dir = exp_manager(trainer, {**cfg, "seconds_to_sleep": 1})
        assert 1 <= time.monotonic() - started < 5
        assert log_dir == tmp_path / "default"
        meeting = self._meeting_dir(tmp_path, [os.environ.get(variable) for variable in self._JOB])
        assert list(meeting.iterdir()) == []
