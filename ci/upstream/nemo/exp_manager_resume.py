"""Upstream source for NeMo PR 2: global rank 0 runs check_resume() before the other ranks use log_dir.

``ci/upstream/series_nemo.py`` inserts the definitions below (everything after the imports), verbatim and
by name, into nemo/utils/exp_manager.py right before ``def check_resume``; the imports here only name what
exp_manager.py already imports (plus json and uuid, which the series adds there). Not imported by nemo_safe.
"""

import json
import os
import time
import uuid
from pathlib import Path

from nemo.utils import logging
from nemo.utils.get_rank import is_global_rank_zero


def check_resume(*args):  # stand-in: exp_manager.py's own check_resume (not copied)
    raise NotImplementedError


# Where the ranks meet around check_resume(): a folder, because check_resume() moves files only.
RESUME_ORDER_DIR = ".exp_manager"
# How long a non-zero rank waits for a late global rank 0 while every other rank waits with it.
RESUME_ORDER_MAX_SECONDS = 600
# Set by global rank 0 of Lightning's own launcher (its pid) once check_resume() ran, for the ranks it starts.
NEMO_ENV_VARNAME_RESUME_CHECKED = "NEMO_EXPM_RESUME_CHECKED"


def _resume_arrivals(meeting_dir: Path, world_size: int) -> dict:
    """The arrival files ``arrived.<rank>.<token>`` of non-zero ranks in meeting_dir, name -> rank."""
    arrivals = {}
    try:
        entries = os.listdir(meeting_dir)
    except OSError:  # removed or unreadable: no rank seen
        return arrivals
    for entry in entries:
        parts = entry.split(".")
        if len(parts) == 3 and parts[0] == "arrived" and parts[1].isdigit() and 0 < int(parts[1]) < world_size:
            arrivals[entry] = int(parts[1])
    return arrivals


def _resume_done(meeting_dir: Path) -> dict:
    """What global rank 0 published in ``done``: the tokens it released and their ranks ({} if none)."""
    try:
        with open(meeting_dir / "done", encoding="utf-8") as done:
            return json.load(done)
    except (OSError, ValueError):
        return {}


def _check_resume_first(meeting_dir: Path, world_size: int, seconds_to_sleep: float, run_check_resume) -> None:
    """Global rank 0: wait up to seconds_to_sleep for the other ranks to arrive, run check_resume(), release them."""
    deadline = time.monotonic() + seconds_to_sleep
    delay = 0.01
    # Arrival files of an earlier, killed start-up must not count: remove what is here; waiting ranks make theirs anew.
    try:
        for name in _resume_arrivals(meeting_dir, world_size):
            (meeting_dir / name).unlink(missing_ok=True)
    except OSError:  # a folder this rank cannot write: the others fall back after seconds_to_sleep
        pass
    while len(set(_resume_arrivals(meeting_dir, world_size).values())) < world_size - 1:
        if time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(2 * delay, 0.5)
    try:
        run_check_resume()
    finally:
        # Also when check_resume() raised: the other ranks then raise NeMo's own error from their own lookup.
        try:
            arrivals = _resume_arrivals(meeting_dir, world_size)
            done = {"tokens": sorted(name.split(".")[2] for name in arrivals), "ranks": sorted(set(arrivals.values()))}
            temporary = meeting_dir / f".done.{uuid.uuid4().hex}"
            temporary.write_text(json.dumps(done), encoding="utf-8")
            os.replace(temporary, meeting_dir / "done")
            for name in arrivals:
                (meeting_dir / name).unlink(missing_ok=True)
        except OSError as error:  # the others then carry on after seconds_to_sleep, as before this ordering
            logging.warning(f"Global rank 0 could not tell the other ranks in {meeting_dir} that it is done: {error}")


def _wait_for_rank_zero(meeting_dir: Path, rank: int, world_size: int, seconds_to_sleep: float) -> float:
    """A non-zero rank: wait until global rank 0 ran check_resume(). Returns the seconds still to sleep."""
    token = uuid.uuid4().hex
    arrival = meeting_dir / f"arrived.{rank}.{token}"
    try:
        arrival.touch()
    except OSError as error:  # e.g. a read-only log_dir: carry on as before this ordering
        logging.warning(f"Rank {rank} cannot wait for global rank 0 in {meeting_dir} ({error}); continuing.")
        return seconds_to_sleep
    started = last_note = time.monotonic()
    delay, listed, everyone = 0.01, 0.0, False
    rank_zero_came = False
    while True:
        done = _resume_done(meeting_dir)
        if token in done.get("tokens", ()):
            arrival.unlink(missing_ok=True)
            return 0.0
        if not arrival.exists():  # global rank 0 came and cleared the arrivals it found: it is here; arrive again
            rank_zero_came = True
            try:
                arrival.touch()
            except OSError:
                pass
        waited = time.monotonic() - started
        if waited >= seconds_to_sleep:
            # Wait longer only while global rank 0 is here or all other non-zero ranks (at least one) wait here too
            # (the directory is shared and rank 0 is late), and no marker says rank 0 went on without this rank.
            if time.monotonic() - listed >= 10:  # every non-zero rank lists: not often
                others = set(_resume_arrivals(meeting_dir, world_size).values()) - {rank}
                everyone, listed = world_size > 2 and len(others) == world_size - 2, time.monotonic()
            shared = rank_zero_came or everyone
            if not shared or rank not in done.get("ranks", [rank]) or waited >= RESUME_ORDER_MAX_SECONDS:
                break
            if time.monotonic() - last_note >= 30:
                logging.info(f"Rank {rank} waits for global rank 0 to check {meeting_dir.parent} ({waited:.0f} s)")
                last_note = time.monotonic()
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    arrival.unlink(missing_ok=True)
    logging.warning(
        f"Rank {rank} did not see global rank 0 finish checking {meeting_dir.parent} for resuming within "
        f"{waited:.0f} s; continuing as if it had."
    )
    return max(0.0, seconds_to_sleep - waited)


def check_resume_in_order(trainer, cfg, log_dir: Path, unversioned: bool) -> float:
    """Run check_resume() on global rank 0 before the other ranks (#7460, #9952), which meet it in
    ``log_dir/.exp_manager/``. Returns the seconds a non-zero rank still has to sleep (seconds_to_sleep)."""

    def run_check_resume():
        check_resume(
            trainer,
            log_dir,
            cfg.resume_if_exists,
            cfg.resume_past_end,
            cfg.resume_ignore_no_checkpoint,
            cfg.checkpoint_callback_params.dirpath,
            cfg.resume_from_checkpoint,
        )

    world_size = trainer.num_nodes * trainer.num_devices
    # Ranks a launcher started (torchrun, SLURM, ...), not Lightning's own launcher before fit().
    external = getattr(getattr(trainer.strategy, "cluster_environment", None), "creates_processes_externally", False)
    started_by_rank_zero = os.environ.get(NEMO_ENV_VARNAME_RESUME_CHECKED) == f"{os.getppid()}:{log_dir}"
    if world_size > 1 and not is_global_rank_zero() and started_by_rank_zero:
        run_check_resume()  # a rank Lightning's launcher started in fit(), after global rank 0's check_resume()
        return 0.0
    meeting_dir = None
    if world_size > 1 and external and not unversioned and (is_global_rank_zero() or trainer.global_rank > 0):
        meeting_dir = Path(log_dir) / RESUME_ORDER_DIR
        try:
            meeting_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            logging.warning(f"Ranks cannot meet in {meeting_dir} ({error}); rank 0 may move files under the others.")
            meeting_dir = None
    if world_size > 1 and is_global_rank_zero():
        if meeting_dir is not None:
            _check_resume_first(meeting_dir, world_size, cfg.seconds_to_sleep, run_check_resume)
        else:
            run_check_resume()
        if not external:  # the ranks Lightning's launcher starts in fit() find check_resume() done
            os.environ[NEMO_ENV_VARNAME_RESUME_CHECKED] = f"{os.getpid()}:{log_dir}"
        return cfg.seconds_to_sleep
    seconds_to_sleep = cfg.seconds_to_sleep
    if meeting_dir is not None:
        seconds_to_sleep = _wait_for_rank_zero(meeting_dir, trainer.global_rank, world_size, seconds_to_sleep)
    run_check_resume()
    return seconds_to_sleep
