"""Tests PR 2 of our series puts into upstream's ``class TestExpManager`` in ``tests/core/test_exp_manager.py``.

``ci/upstream/series_nemo.py`` inserts the methods of the class below, as they are, after ``test_resume``; the
imports here only name what the methods use and upstream's file imports already (anything else is imported inside
the methods). Not collected here (pytest runs ``tests/`` only). Ranks other than the one exp_manager() runs as are
played by threads; waits run on a fake clock (``_fake_time``), so no test measures wall-clock time.
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
        import itertools
        import time

        import nemo.utils.exp_manager as exp_manager_module

        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
            monkeypatch.delenv(name, raising=False)
        # exp_manager exports both into the process's environment: let monkeypatch restore them
        monkeypatch.setenv("NEMO_EXPM_RESUME_CHECKED", "")
        monkeypatch.delenv(NEMO_ENV_VARNAME_VERSION, raising=False)
        for name, value in launcher_env.items():
            monkeypatch.setenv(name, str(value))
        # A process of its own: started a minute ago (states written now are this run's), no exp_manager() call yet.
        monkeypatch.setattr(exp_manager_module, "_RESUME_ORDER_STARTED", time.time() - 60, raising=False)
        monkeypatch.setattr(exp_manager_module, "_RESUME_ORDER_CALLS", itertools.count(), raising=False)
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
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": 29500,
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

    def _sleeps(self, monkeypatch):
        """Record the main thread's time.sleep() calls instead of sleeping (the fixed sleep of the non-zero ranks)."""
        import threading
        import time

        slept, real_sleep = [], time.sleep

        def sleep(seconds):
            if threading.current_thread() is threading.main_thread():
                slept.append(seconds)
            else:
                real_sleep(seconds)

        monkeypatch.setattr(time, "sleep", sleep)
        return slept

    def _fake_time(self, on_sleep=lambda now: None):
        """A clock and a sleep for _wait_for_rank_zero: sleeping advances the clock, then calls on_sleep(now)."""
        now = [0.0]

        def sleep(seconds):
            now[0] += seconds
            on_sleep(now[0])

        return (lambda: now[0]), sleep, now

    def _join_beats(self, before, guard=10):
        """Wait until the beat threads started since ``before`` (threads then) ended (hang guard only)."""
        import threading

        for thread in [t for t in threading.enumerate() if t.name.endswith("(beat)") and t not in before]:
            thread.join(guard)
            assert not thread.is_alive(), "rank 0 still rewrites its state"

    def _meeting_dir(self, base, guard=10):
        """The folder under base/.exp_manager/ where the ranks meet, once a rank made it."""
        import time

        deadline = time.monotonic() + guard  # hang guard only
        while time.monotonic() < deadline:
            for folder in (base / ".exp_manager").glob("*"):
                return folder
            time.sleep(0.01)
        return None

    def _play_rank_zero(self, base, work, version):
        """A thread playing global rank 0: once rank 1 made the meeting folder under base, it runs work as its
        check_resume() and publishes its version."""
        import threading

        from nemo.utils.exp_manager import _check_resume_first

        errors = []

        def rank_zero():
            meeting = self._meeting_dir(base)
            if meeting is not None:
                try:
                    _check_resume_first(meeting, work, version)
                except Exception as error:
                    errors.append(error)

        thread = threading.Thread(target=rank_zero)
        thread.start()
        return thread, errors

    @pytest.mark.unit
    def test_resume_order_rank_zero_moves_then_releases(self, monkeypatch, tmp_path):
        """Global rank 0 of torchrun moves the old files, then releases rank 1 (a thread)."""
        import threading

        from nemo.utils.exp_manager import _wait_for_rank_zero

        trainer = self._torchrun_rank(monkeypatch, 0, 2)
        (tmp_path / "old.log").write_text("old")
        released = []

        def rank_one():
            meeting = self._meeting_dir(tmp_path)
            released.append(_wait_for_rank_zero(meeting, 1, grace=600) if meeting is not None else None)

        thread = threading.Thread(target=rank_one)
        thread.start()
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=5))
        thread.join()
        assert released[0]["phase"] == "done" and released[0]["error"] is None
        assert (tmp_path / "run_0" / "old.log").read_text() == "old"
        left = [p.name for p in self._meeting_dir(tmp_path).iterdir() if not p.name.startswith(".state.")]
        assert left == ["state"]  # (rank 0 still rewrites its done, through temporaries, for _RESUME_ORDER_SILENCE s)

    @pytest.mark.unit
    def test_resume_order_rank_released_with_rank_zero_version(self, monkeypatch, tmp_path):
        """Unversioned rank 1 of torchrun (get_log_dir() gives it no version, #8604) waits for global rank 0 (a
        thread), then logs into rank 0's version folder and skips the fixed sleep."""
        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        slept = self._sleeps(monkeypatch)
        version = tmp_path / "default" / "2025-01-01_00-00-00"
        rank_zero, errors = self._play_rank_zero(tmp_path / "default", lambda: None, version.name)
        cfg = {"exp_dir": str(tmp_path), "create_tensorboard_logger": False, "create_checkpoint_callback": False}
        log_dir = exp_manager(trainer, {**cfg, "seconds_to_sleep": 5})
        rank_zero.join()
        assert not errors and log_dir == version
        assert not [seconds for seconds in slept if seconds > 0]

    @pytest.mark.unit
    def test_resume_order_rank_zero_failure_reaches_the_others(self, monkeypatch, tmp_path):
        """Global rank 0's check_resume() fails: rank 1 raises, naming rank 0's error, instead of going on."""

        def fail():
            raise OSError(28, "No space left on device")

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        rank_zero, errors = self._play_rank_zero(tmp_path, fail, None)
        with pytest.raises(RuntimeError, match="rank 0 .* failed checking .*No space left on device"):
            exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=5))
        rank_zero.join()
        assert [type(error) for error in errors] == [OSError]

    @pytest.mark.unit
    def test_resume_order_rank_zero_failure_every_rank_meets_is_nemos_own(self, monkeypatch, tmp_path):
        """Global rank 0 finds no checkpoint to resume from: rank 1 raises the same NotFoundError from its own lookup,
        which a script catching NotFoundError on every rank catches, as without ordering."""
        from nemo.utils.exp_manager import NotFoundError

        def not_found():
            raise NotFoundError("There were no checkpoints found")

        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        rank_zero, errors = self._play_rank_zero(tmp_path, not_found, None)
        cfg = {**self._resume_cfg(tmp_path, seconds_to_sleep=5), "resume_ignore_no_checkpoint": False}
        with pytest.raises(NotFoundError):
            exp_manager(trainer, cfg)
        rank_zero.join()
        assert [type(error) for error in errors] == [NotFoundError]

    @pytest.mark.unit
    def test_resume_order_rank_zero_done_before_rank_looks(self, tmp_path):
        """Rank 0 of this run finished before rank 1 first looked, in a state written 10 s after rank 1's process
        started: rank 1 is released at once, without waiting for seconds_to_sleep (fake clock)."""
        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        written = exp_manager_module._RESUME_ORDER_STARTED + 10  # this process's real start
        done = {"session": "s", "phase": "done", "error": None, "version": None, "time": written}
        (tmp_path / "state").write_text(json.dumps(done))
        clock, sleep, now = self._fake_time()
        assert _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep)["session"] == "s" and now[0] == 0

    @pytest.mark.unit
    def test_resume_order_working_rank_zero_is_waited_for(self, tmp_path):
        """Rank 0 beats while it moves: rank 1 waits past seconds_to_sleep and the silence limit, up to the
        process-group timeout (fit() could not start before rank 0 anyway), then carries on as without ordering (fake
        clock)."""
        from datetime import timedelta

        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        silence = exp_manager_module._RESUME_ORDER_SILENCE

        def rank_zero_beating_until(end):
            def beat(now):
                phase = {"phase": "checking", "beat": int(now)} if now < end else {"phase": "done", "error": None}
                (tmp_path / "state").write_text(json.dumps({"session": "s", "time": 0, **phase}))

            return beat

        clock, sleep, now = self._fake_time(rank_zero_beating_until(3 * silence))
        timeout = timedelta(seconds=10 * silence)
        assert _wait_for_rank_zero(tmp_path, 1, 5, timeout, clock=clock, sleep=sleep)["phase"] == "done"
        assert now[0] >= 3 * silence
        (tmp_path / "state").unlink()
        clock, sleep, now = self._fake_time(rank_zero_beating_until(20 * silence))
        assert _wait_for_rank_zero(tmp_path, 1, 5, timeout, clock=clock, sleep=sleep) is None
        assert 10 * silence <= now[0] <= 10 * silence + 3

    @pytest.mark.unit
    def test_resume_order_stopped_rank_zero_holds_nobody(self, monkeypatch, tmp_path):
        """Rank 0 of this run stopped beating (SIGSTOP, its host cut off from the folder): rank 1 carries on as without
        ordering once its state has not changed for _RESUME_ORDER_SILENCE, so that a rank 0 that recovers finds it in
        fit() as it would without ordering (fake clock)."""
        import time

        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        state = {"session": "s", "phase": "checking", "beat": 3, "time": time.time() + 60}
        (tmp_path / "state").write_text(json.dumps(state))
        clock, sleep, now = self._fake_time()
        assert _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep) is None
        silence = exp_manager_module._RESUME_ORDER_SILENCE
        assert silence <= now[0] <= silence + 2
        # Every read hangs for 11 s (a soft NFS mount): no silence across a hung read, but the timeout ends the wait.
        read = exp_manager_module._read_resume_state
        clock, sleep, now = self._fake_time()
        monkeypatch.setattr(
            exp_manager_module, "_read_resume_state", lambda path: now.__setitem__(0, now[0] + 11) or read(path)
        )
        timeout = exp_manager_module._RESUME_ORDER_TIMEOUT.total_seconds()
        assert _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep) is None
        assert timeout <= now[0] <= timeout + 30  # (each poll takes 11-12 s here)

    @pytest.mark.unit
    def test_resume_order_suspended_job_keeps_waiting_for_rank_zero(self, tmp_path):
        """The whole job is suspended for longer than the timeout (scontrol suspend) while rank 0 checks: rank 1 counts
        that time neither as rank 0's silence nor against the timeout, and takes rank 0's "done" (fake clock)."""
        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        suspended = exp_manager_module._RESUME_ORDER_TIMEOUT.total_seconds() + 100

        def rank_zero(now):
            phase = (
                {"phase": "checking", "beat": int(now)} if now < suspended + 15 else {"phase": "done", "error": None}
            )
            (tmp_path / "state").write_text(json.dumps({"session": "s", "time": 0, **phase}))

        def suspend_once(now):
            rank_zero(now)
            if 10 <= now < 11 and not resumed:
                resumed.append(now)
                clock_now[0] += suspended  # this rank and rank 0 stopped alike

        resumed = []
        clock, sleep, clock_now = self._fake_time(suspend_once)
        rank_zero(0)
        state = _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep)
        assert resumed and state is not None and state["phase"] == "done"

    @pytest.mark.unit
    def test_resume_order_failed_read_after_seconds_to_sleep_keeps_waiting(self, tmp_path):
        """Rank 0 of this run is still checking after seconds_to_sleep when one read of its state fails (a rename on a
        FUSE mount): rank 1 keeps waiting for it instead of going on while rank 0 moves files (fake clock)."""
        from nemo.utils.exp_manager import _wait_for_rank_zero

        def rank_zero(now):
            if 10 < now < 11:
                (tmp_path / "state").unlink(missing_ok=True)
            else:
                phase = {"phase": "checking", "beat": int(now)} if now < 20 else {"phase": "done", "error": None}
                (tmp_path / "state").write_text(json.dumps({"session": "s", "time": 0, **phase}))

        clock, sleep, now = self._fake_time(rank_zero)
        state = _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep)
        assert state is not None and state["phase"] == "done" and now[0] >= 20

    @pytest.mark.unit
    def test_resume_order_state_of_an_earlier_run_does_not_release(self, tmp_path):
        """A state an earlier run left (written before this process started) neither releases rank 1 nor counts as
        rank 0, not even when one read of it fails in between; rank 1 goes on after seconds_to_sleep, as without
        ordering (fake clock)."""
        import time

        from nemo.utils.exp_manager import _wait_for_rank_zero

        earlier = {"session": "old", "phase": "done", "error": None, "version": "v", "time": time.time() - 3600}
        earlier = json.dumps(earlier)
        (tmp_path / "state").write_text(earlier)

        def one_failed_read(now):
            if 1 < now < 2:
                (tmp_path / "state").unlink(missing_ok=True)
            else:
                (tmp_path / "state").write_text(earlier)

        clock, sleep, now = self._fake_time(one_failed_read)
        assert _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep) is None
        assert 5 <= now[0] <= 7 and [p.name for p in tmp_path.iterdir()] == ["state"]

    @pytest.mark.unit
    def test_resume_order_late_rank_zero_is_waited_for_while_every_other_rank_waits(self, tmp_path):
        """Rank 0 of 3 comes after seconds_to_sleep (a slower start): rank 2 waiting in the folder too shows that rank 0
        is late, not meeting elsewhere, so rank 1 keeps waiting for it, also after an earlier run's "done" (a restart).
        Without rank 2, or with a record an earlier run's rank 2 left, rank 1 carries on after seconds_to_sleep, as
        without ordering (fake clock)."""
        import time

        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        earlier, seen_waiting = exp_manager_module._RESUME_ORDER_STARTED - 60, []

        def rank_zero_from_30_s(now):
            seen_waiting.append(len(list(tmp_path.glob("rank1.*"))))
            if now >= 30:
                phase = {"phase": "checking", "beat": int(now)} if now < 40 else {"phase": "done", "error": None}
                (tmp_path / "state").write_text(json.dumps({"session": "s", "time": time.time(), **phase}))

        cases = ((time.time(), None, True), (None, None, False), (earlier, None, False), (time.time(), "done", True))
        for rank_two, earlier_phase, waited in cases:
            for path in tmp_path.iterdir():
                path.unlink()
            if rank_two is not None:
                (tmp_path / f"rank2.{rank_two:.0f}").touch()
            if earlier_phase is not None:
                state = {"session": "old", "phase": earlier_phase, "error": None, "time": earlier}
                (tmp_path / "state").write_text(json.dumps(state))
            seen_waiting.clear()
            clock, sleep, now = self._fake_time(rank_zero_from_30_s)
            state = _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep, world_size=3)
            if waited:
                assert state["phase"] == "done" and 40 <= now[0] <= 42
            else:
                assert state is None and 5 <= now[0] <= 7
            assert set(seen_waiting) == {1} and not list(tmp_path.glob("rank1*"))  # its record while it waits only

    @pytest.mark.unit
    def test_resume_order_rank_zero_republishes_done(self, monkeypatch, tmp_path):
        """After check_resume(), global rank 0 publishes its "done" again every _RESUME_ORDER_BEAT s for
        _RESUME_ORDER_SILENCE s (so a rank that starts later tells it from an earlier run's by its time), then stops;
        an error it publishes once."""
        import threading
        import time

        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _check_resume_first

        monkeypatch.setattr(exp_manager_module, "_RESUME_ORDER_BEAT", 0.01)
        monkeypatch.setattr(exp_manager_module, "_RESUME_ORDER_SILENCE", 0.3)
        before = set(threading.enumerate())
        _check_resume_first(tmp_path, lambda: None, "v")
        first = json.loads((tmp_path / "state").read_text())
        deadline = time.monotonic() + 10  # hang guard only
        while json.loads((tmp_path / "state").read_text())["beat"] == first["beat"] and time.monotonic() < deadline:
            time.sleep(0.01)
        again = json.loads((tmp_path / "state").read_text())
        assert first["phase"] == again["phase"] == "done" and again["beat"] > first["beat"]
        assert again["session"] == first["session"] and again["version"] == "v" and again["time"] >= first["time"]
        self._join_beats(before)  # the republishing ends after its 0.3 s
        assert json.loads((tmp_path / "state").read_text())["phase"] == "done"
        assert [p.name for p in tmp_path.iterdir()] == ["state"]
        failed = tmp_path / "failed"  # an error is not republished (a retry must not take it for its own run's)
        failed.mkdir()
        with pytest.raises(OSError):
            _check_resume_first(failed, lambda: (_ for _ in ()).throw(OSError("move failed")), "v")
        error = json.loads((failed / "state").read_text())
        self._join_beats(before)
        last = json.loads((failed / "state").read_text())
        assert last["error"] == error["error"] == "OSError: move failed"
        assert last["beat"] - error["beat"] <= 1  # at most a beat already under way; republished, it would be ~30 more

    @pytest.mark.unit
    def test_resume_order_rank_zero_listed_but_not_found_is_waited_for(self, tmp_path):
        """Two ranks: rank 0 comes 3 s late, within seconds_to_sleep, but rank 1's client keeps answering "no such
        file" for the state until 8 s (a FUSE client caching the failed lookup of rank 1's first poll; played by a
        dangling symlink). At seconds_to_sleep rank 1 finds the state listed in the folder, so it waits for rank 0
        instead of going on while rank 0 moves files (fake clock)."""
        from nemo.utils.exp_manager import _wait_for_rank_zero

        def rank_zero(now):
            state = tmp_path / "state"
            if 3 <= now < 8 and not state.is_symlink():
                state.symlink_to(tmp_path / "nowhere")  # listed, but not found by its name
            elif now >= 8:
                state.unlink(missing_ok=True)
                phase = {"phase": "checking", "beat": int(now)} if now < 10 else {"phase": "done", "error": None}
                state.write_text(json.dumps({"session": "s", "time": 0, **phase}))

        clock, sleep, now = self._fake_time(rank_zero)
        state = _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep)
        assert state is not None and state["phase"] == "done" and 10 <= now[0] <= 12

    @pytest.mark.unit
    def test_resume_order_late_rank_zero_is_waited_for_a_bounded_time(self, tmp_path):
        """Every other rank waits in the folder but rank 0 never comes (it checked elsewhere): rank 1 carries on
        _RESUME_ORDER_SILENCE s after seconds_to_sleep, as without ordering (fake clock)."""
        import time

        import nemo.utils.exp_manager as exp_manager_module
        from nemo.utils.exp_manager import _wait_for_rank_zero

        for rank in (2, 3):
            (tmp_path / f"rank{rank}.{time.time():.0f}").touch()
        clock, sleep, now = self._fake_time()
        assert _wait_for_rank_zero(tmp_path, 1, 5, clock=clock, sleep=sleep, world_size=4) is None
        silence = exp_manager_module._RESUME_ORDER_SILENCE
        assert 5 + silence <= now[0] <= 7 + silence

    @pytest.mark.unit
    def test_resume_order_counts_from_the_exec_of_a_shell(self, monkeypatch):
        """A shell runs its last command in its own process (`python train.py; python train.py`), which started before
        the first run: this run starts no earlier than now minus the CPU time this thread spent (fake clocks)."""
        import time

        from nemo.utils.exp_manager import _process_start_time

        now = time.time()  # later than this process's start
        monkeypatch.setattr(time, "time", lambda: now + 3600)
        monkeypatch.setattr(time, "thread_time", lambda: 10.0)
        assert _process_start_time() == now + 3590

    @pytest.mark.unit
    def test_resume_order_two_ranks_not_sharing_the_folder(self, monkeypatch, tmp_path):
        """Rank 1 of 2 alone in its folder (node-local disks): nothing shows that rank 0 shares it, so rank 1 keeps
        its log_dir and carries on after seconds_to_sleep, as without ordering."""
        trainer = self._torchrun_rank(monkeypatch, 1, 2)
        (tmp_path / "old.log").write_text("old")
        assert exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=1)) == tmp_path
        assert (tmp_path / "old.log").exists()

    @pytest.mark.unit
    def test_resume_order_lightning_launcher(self, monkeypatch, tmp_path):
        """Lightning's own launcher: its main process (rank 0) runs exp_manager before the other ranks exist and
        must not wait; the ranks it starts in fit() inherit its environment and do not meet or wait (the token is
        its pid and the call, so this holds where their log_dir differs from rank 0's, too)."""
        slept = self._sleeps(monkeypatch)
        trainer = self._resume_rank(monkeypatch, {}, 2)
        (tmp_path / "old.log").write_text("old")
        exp_manager(trainer, self._resume_cfg(tmp_path, seconds_to_sleep=30))
        assert (tmp_path / "run_0" / "old.log").exists() and not (tmp_path / ".exp_manager").exists()
        assert os.environ["NEMO_EXPM_RESUME_CHECKED"] == f"{os.getpid()}:0"

        # The started rank: LOCAL_RANK=1, and this process's parent plays the main process.
        checked = f"{os.getppid()}:0"
        trainer = self._resume_rank(monkeypatch, {"LOCAL_RANK": 1, "NEMO_EXPM_RESUME_CHECKED": checked}, 2)
        exp_manager(trainer, self._resume_cfg(tmp_path / "version_1", seconds_to_sleep=30))
        assert not [seconds for seconds in slept if seconds > 0]
        assert not list(tmp_path.glob("**/.exp_manager"))
