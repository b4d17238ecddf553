# ruff: noqa: UP006, UP007, UP035, UP038  (exp_manager.py's typing idiom: Dict, Optional, Tuple)
"""What the upstream NeMo pull request puts into ``nemo/utils/exp_manager.py``, verbatim.

``ci/make_patches.py`` copies the definitions below by name into NeMo 3.0.0's
``exp_manager.py``, right before ``check_resume``, and makes ``exp_manager()`` call
``_check_resume_in_order()`` where it called ``check_resume()``: global rank 0 moves
the old files of ``log_dir`` before the other ranks use it, its failure reaches them,
and every rank takes rank 0's ``log_dir`` (patch 0002 of ``patches/nemo/``).

Written in that file's idiom (``Dict`` / ``Optional``, NeMo's ``logging``); the names
the functions find in ``nemo.utils.exp_manager`` are imported for type checkers only.
"""

import contextlib
import itertools
import json
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

if TYPE_CHECKING:  # found in nemo.utils.exp_manager, where these functions run
    from nemo.constants import NEMO_ENV_VARNAME_RESUME_CHECKED
    from nemo.utils import logging
    from nemo.utils.exp_manager import check_resume
    from nemo.utils.get_rank import is_global_rank_zero


# Global rank 0 rewrites its state every _RESUME_ORDER_BEAT s while it checks. The others carry on as without ordering
# once it is unchanged for _RESUME_ORDER_SILENCE s (> NFS/FUSE attribute caches) or unfinished after the group timeout.
_RESUME_ORDER_BEAT, _RESUME_ORDER_SILENCE, _RESUME_ORDER_TIMEOUT = 1.0, 120.0, timedelta(minutes=30)
_RESUME_ORDER_CALLS = itertools.count()  # the n-th multi-rank exp_manager() call of a process meets the others' n-th


def _resume_order_run() -> Optional[list]:
    """What is equal on every rank of this run and differs between concurrent runs: torchrun's store address (bound by
    one process at a time; a loopback one is per host), else SLURM's job, step and restart count; else None."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("MASTER_PORT"):
        address = os.environ.get("MASTER_ADDR", "")
        host = socket.gethostname() if address in ("", "localhost", "::1") or address.startswith("127.") else None
        return [os.environ["TORCHELASTIC_RUN_ID"], address, os.environ["MASTER_PORT"], host]
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"):
        return [os.environ.get(name) for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")]
    return None


def _process_start_time() -> float:
    """When this program started (Linux), else now: a state written well after it is this run's (a restart starts after
    the earlier run ended). A shell execs its last command in its process: this thread's CPU time moves past that."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return max(boot + ticks / os.sysconf("SC_CLK_TCK"), time.time() - time.thread_time())
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return time.time()


_RESUME_ORDER_STARTED, _RESUME_ORDER_SKEW = _process_start_time(), 5.0  # host clocks may differ by _SKEW s


def _read_resume_state(path: Path) -> Dict[str, Any]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_resume_state(path: Path, state: Dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        temporary.write_text(json.dumps(state), encoding="utf-8")
        for _ in range(49):
            with contextlib.suppress(PermissionError):  # Windows, while another rank reads the old state (for ms)
                return os.replace(temporary, path)  # the others read the old state or the new one, never half of one
            time.sleep(0.1)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _rank_zero_is_late(meeting_dir: Path, rank: int, world_size: int) -> bool:
    """Every other non-zero rank of this run waits here too (a rank<N>.<time> since this process started, less skew),
    or the state is listed but not found by its name (a FUSE client caching a lookup that found nothing)."""
    with contextlib.suppress(OSError):
        listed = os.listdir(meeting_dir)
        names = [n.partition(".") for n in listed if n.startswith("rank")]
        here = {r for r, _, t in names if t.isdigit() and int(t) > _RESUME_ORDER_STARTED - _RESUME_ORDER_SKEW}
        late = world_size > 2 and here >= {f"rank{r}" for r in range(1, world_size) if r != rank}
        return late or ("state" in listed and not (meeting_dir / "state").exists())
    return False


def _check_resume_first(meeting_dir: Path, run_check_resume: Callable[[], None], version: Optional[str]) -> None:
    """Global rank 0: beat while check_resume() runs, then publish its outcome (a success: again, for 120 s)."""
    state_file, lock, progress = meeting_dir / "state", threading.Lock(), {"phase": "checking", "beat": 0}
    who = {"session": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "version": version}

    def publish(**fields) -> None:
        with lock:  # a beat never overwrites the final state with an older one
            progress.update(fields)
            _write_resume_state(state_file, {**who, "time": time.time(), **progress})

    def beat() -> None:
        for beats in itertools.count(1):
            time.sleep(_RESUME_ORDER_BEAT)
            if time.monotonic() > ends:
                return
            with contextlib.suppress(Exception):  # one lost beat; the others give up only after _RESUME_ORDER_SILENCE
                publish(beat=beats)

    try:
        publish()
    except OSError as error:
        logging.warning(f"Global rank 0 cannot tell the other ranks in {meeting_dir} that it checks ({error})")
        run_check_resume()
        return
    logging.info(f"Global rank 0 checks {meeting_dir.parent.parent} for resuming; the other ranks wait for it")
    outcome, ends = {"phase": "done", "error": None}, float("inf")
    threading.Thread(target=beat, daemon=True).start()
    try:
        run_check_resume()
    except BaseException as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:  # an error is not republished: a retry seconds later must not take it as its own run's
        ends = time.monotonic() + (_RESUME_ORDER_SILENCE if outcome["error"] is None else 0)
        try:
            publish(**outcome)
        except OSError as error:  # a success: its next beat tries again; an error: silence, then as today
            logging.warning(f"Global rank 0 could not tell the other ranks in {meeting_dir} that it is done: {error}")


def _wait_for_rank_zero(
    meeting_dir: Path,
    rank: int,
    grace: float,
    timeout: timedelta = _RESUME_ORDER_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    world_size: int = 2,
) -> Optional[Dict[str, Any]]:
    """A non-zero rank: wait until global rank 0 of this run finished check_resume(): its state (error included), or
    None (go on as without this wait) if no rank 0 came in grace s (+_RESUME_ORDER_SILENCE if late) or it went quiet."""
    logging.info(f"Rank {rank} waits for global rank 0 to check {meeting_dir.parent.parent} for resuming")
    arrival, state_file, live_sessions = meeting_dir / f"rank{rank}.{time.time():.0f}", meeting_dir / "state", set()
    started = noted = polled = clock()
    first_seen = changed = last = vouched = None
    try:
        if world_size > 2:  # the others see that it waits here (unseen, it vouches for nobody)
            with contextlib.suppress(OSError):
                arrival.touch()
        for polls in itertools.count():
            stopped, state, now = clock() - polled, _read_resume_state(state_file), clock()
            if changed is not None and now - polled > 10:  # this rank stopped, or its read hung: not rank 0's silence
                changed, first_seen = now, first_seen + (stopped if stopped > 10 else 0)  # hung reads: the timeout
            polled, seen = now, (state.get("session"), state.get("phase"), state.get("beat"))
            if state and last is not None and seen != last:  # only a live rank 0 changes its state: this run's
                live_sessions.add(state.get("session"))
                changed = now
            last = seen if state else last  # a failed read is no change
            written = state.get("time")
            this_run = bool(state) and (
                state.get("session") in live_sessions
                or (isinstance(written, (int, float)) and written > _RESUME_ORDER_STARTED + _RESUME_ORDER_SKEW)
            )
            if this_run and state.get("phase") == "done":
                logging.info(f"Rank {rank}: global rank 0 checked {meeting_dir.parent.parent} ({now - started:.1f} s)")
                return state
            if this_run:
                first_seen = now if first_seen is None else first_seen
                changed, known = now if changed is None else changed, state
            if first_seen is not None:  # then a failed read is no absence, but no sign of life either
                if now - changed >= _RESUME_ORDER_SILENCE or now - first_seen >= timeout.total_seconds():
                    logging.warning(
                        f"Rank {rank}: global rank 0 (host {known.get('host')}, pid {known.get('pid')}) has not "
                        f"finished checking {meeting_dir.parent.parent}: its state last changed {now - changed:.0f} s "
                        f"ago, {now - first_seen:.0f} s after it was first seen (stopped, cut off or stuck); going on"
                    )
                    return None
            elif now - started >= grace:
                vouched = _rank_zero_is_late(meeting_dir, rank, world_size) if vouched is None else vouched
                if not vouched or now - started >= grace + _RESUME_ORDER_SILENCE:
                    logging.warning(
                        f"Rank {rank} saw no global rank 0 of this run in {meeting_dir} in {now - started:.0f} s "
                        "(later, done before this rank started, or in an exp_dir not shared); going on without it"
                    )
                    return None
            if now - noted >= 30:  # rank 0's beats change its state; _RESUME_ORDER_SILENCE s without one end the wait
                noted, doing = now, f"beat {now - changed:.0f} s ago" if first_seen is not None else "not seen yet"
                limit = f"going on after {_RESUME_ORDER_SILENCE:.0f} s without a beat"
                logging.info(f"Rank {rank} still waits for global rank 0 ({doing}; {now - started:.0f} s; {limit})")
            sleep(min(0.01 * 2 ** min(polls, 7), 1.0))
    finally:
        with contextlib.suppress(OSError):  # Windows, while another rank reads it
            arrival.unlink(missing_ok=True)


def _check_resume_in_order(
    trainer, cfg, log_dir: Path, exp_dir: str, name: str, version: Optional[str]
) -> Tuple[float, Path, Optional[str]]:
    """Run check_resume() on global rank 0 before the other ranks (#7460, #9952), which then take rank 0's version
    (#8604). Returns the seconds a non-zero rank still has to sleep, and the log_dir and version to use."""

    def run_check_resume(directory: Path) -> None:
        check_resume(
            trainer,
            directory,
            cfg.resume_if_exists,
            cfg.resume_past_end,
            cfg.resume_ignore_no_checkpoint,
            cfg.checkpoint_callback_params.dirpath,
            cfg.resume_from_checkpoint,
        )

    world_size = trainer.num_nodes * trainer.num_devices
    call = next(_RESUME_ORDER_CALLS) if world_size > 1 else None
    # Ranks a launcher started (torchrun, SLURM, ...), not Lightning's own launcher before fit().
    external = getattr(getattr(trainer.strategy, "cluster_environment", None), "creates_processes_externally", False)
    run = _resume_order_run()
    if world_size > 1 and os.environ.get(NEMO_ENV_VARNAME_RESUME_CHECKED) == f"{os.getppid()}:{call}":
        run_check_resume(log_dir)  # started by Lightning's launcher in fit(), after global rank 0 checked
        return 0.0, log_dir, version
    if world_size == 1 or not external or run is None or is_global_rank_zero() != (trainer.global_rank == 0):
        run_check_resume(log_dir)
        if world_size > 1 and is_global_rank_zero() and not external:  # the ranks it starts in fit() find it done
            os.environ[NEMO_ENV_VARNAME_RESUME_CHECKED] = f"{os.getpid()}:{call}"
        return cfg.seconds_to_sleep, log_dir, version
    base = Path(log_dir) if cfg.explicit_log_dir else Path(exp_dir) / str(name)  # the same on every rank of the run
    meeting_dir = base / ".exp_manager" / uuid.uuid5(uuid.NAMESPACE_OID, json.dumps([*run, call])).hex[:12]
    try:
        meeting_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        logging.warning(f"Ranks cannot meet in {meeting_dir} ({error}); rank 0 may move files under the others.")
        run_check_resume(log_dir)
        return cfg.seconds_to_sleep, log_dir, version
    if is_global_rank_zero():
        _check_resume_first(meeting_dir, lambda: run_check_resume(log_dir), version)
        return cfg.seconds_to_sleep, log_dir, version
    started, timeout = time.monotonic(), getattr(trainer.strategy, "_timeout", None)  # DDPStrategy(timeout=...)
    timeout = timeout if isinstance(timeout, timedelta) else _RESUME_ORDER_TIMEOUT
    state = _wait_for_rank_zero(meeting_dir, trainer.global_rank, cfg.seconds_to_sleep, timeout, world_size=world_size)
    if state is None:
        run_check_resume(log_dir)
        return max(0.0, cfg.seconds_to_sleep - (time.monotonic() - started)), log_dir, version
    if state.get("error"):
        run_check_resume(log_dir)  # NeMo's own error first, where every rank meets the one rank 0 met
        raise RuntimeError(
            f"Rank {trainer.global_rank}: global rank 0 (host {state.get('host')}, pid {state.get('pid')}) failed "
            f"checking {meeting_dir.parent.parent} for resuming: {state['error']}. See rank 0's log for the cause."
        )
    if not cfg.explicit_log_dir and state.get("version"):  # get_log_dir() gave only rank 0 a version
        version = state["version"]
        log_dir = Path(exp_dir) / str(name) / str(version)
    run_check_resume(log_dir)  # the lookup of the last checkpoint, in rank 0's log_dir
    return 0.0, log_dir, version
