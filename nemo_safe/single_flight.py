"""One process does a shared job in a directory (a dataset download) while the others wait.

Why not the barrier: nobody knows how many processes will build a dataset (not
every rank need build it, a node-local root sees only its node's ranks, and
``mp.spawn`` before ``init_process_group`` knows no ranks at all). So the leader
is whoever first creates ``<dir>/.nemo_safe/<name>.<generation>``: a ``link(2)``
of a unique temporary file, atomic on local disks, NFS, Lustre and GPFS, with
the link count checked against NFS's spurious EEXIST. Where the filesystem has
no hard links (gcsfuse, s3fs, blobfuse, FAT, some NFS exports), an exclusive
create of the same name (``O_EXCL``: atomic and retransmit-safe on NFSv3+,
whose exclusive create carries a verifier) elects the leader instead. No file locks.

* The leader re-checks ``done()`` after winning (someone may just have
  finished), runs the job, and rewrites its lock file every second with a
  growing ``beat`` so that waiters can tell it is alive without trusting mtimes
  (GPFS mtimes lag) or clocks of other hosts. Each beat also counts whether the
  thread running the job advanced (:mod:`nemo_safe.thread_progress`: its I/O,
  CPU time, sleeps ended, Python position): ``progress``, and ``idle``, the beats
  since it last did. Liveness is progress, not presence.
* Success: the lock files are removed; waiters see ``done()`` and return.
  Failure: the lock says ``failed`` with the error, and every process that saw
  that leader running raises :class:`LeaderFailed` with its message. A process
  that only finds an old failure leads a new attempt instead.
* A leader alive but stuck (its job blocked in ``recv`` on a half-open socket,
  ``urlopen`` has no timeout, or in a hung NFS call) beats on without progress:
  once it has been idle for :data:`PROGRESS_LIMIT` (10 s, by its own count of
  beats), it is taken over as a dead one is (the next generation, created by
  exactly one waiter, which does the job again, with one warning naming the
  stuck leader; the others wait for the new leader): what upstream would have
  done, downloading again, but once, not in every waiter (one staged copy
  per waiter could fill a tight disk). If the stuck leader comes back it is
  deposed and publishes nothing. Such a leader never makes a waiter raise
  :class:`WaitTimeout`.
* A leader killed by SIGTERM (``scancel``, preemption, torchrun's teardown),
  where SIGTERM's handler is the default, marks its lock ``abandoned`` and
  removes its temporaries before it dies of the signal (exit status as
  upstream's, see :mod:`nemo_safe.term_signal`): waiters on every host take
  over at their next poll. Ctrl-C and exceptions a handler raises do the same
  on their way out.
* A leader killed with ``kill -9``, or stopped whole (SIGSTOP, its host gone),
  is stale when its beat stops for ``NEMO_SAFE_STALE_AFTER`` seconds (default
  15; 30 before a stuck job was told apart by its progress: a beat now stops
  only when the whole process does, and one that comes back late is deposed
  safely), or after a few missed beats when it ran on this host, in this pid
  namespace, and its pid is gone. Silence is counted only across this waiter's
  own successful, timely reads: its own stall or failed reads (an NFS failover)
  are not the leader's silence. Then the next generation's lock is created,
  again by exactly one process; locks are never stolen by deleting.
* A leader that was only slow (stopped, swapped out) and finds a newer
  generation is *deposed*: :func:`check_still_leading`, called before anything
  is published (the torchvision patches do), raises :class:`LeaderDeposed`; its
  job's error is then not published, and it waits for the new leader instead.
* Waiters time out on standstill, not on work: every new ``progress`` count
  restarts their timeout, so a slow download is never reported as a hung one.
* Files in the lock folder that nemo_safe cannot have written (other users can
  write shared folders) are ignored with a warning, never trusted.
* Nobody gets a head start, rank 0 included: a process that needs what rank 0 never
  asks for (its own shard, an evaluation on one rank) would wait for nothing.

``run(job, done)`` runs the job; :meth:`SingleFlight.hold` is the same as a context
manager (the leader runs the ``with`` block, the others come out of ``__enter__``
once ``done()`` holds).

The protocol above is not written here: :class:`SingleFlight` is a subclass of
:class:`~nemo_safe.download_lock._DownloadLock`, the lock torchvision's pull request
carries, and runs its ``hold``/``_wait``/``_finish``/``_beat``; this module swaps in the
lock files of :class:`~nemo_safe.flight_locks.FlightLocks` (election by ``link(2)``,
foreign entries), the job's progress in each beat, the dead-pid and stuck-leader
takeovers (``_takes_over``), SIGTERM, logging and nemo_safe's errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nemo_safe import log_output
from nemo_safe.atomic_files import pid_alive
from nemo_safe.cluster_identity import detect as detect_identity
from nemo_safe.download_lock import _LOCK_BEAT, _LOCK_STALE, _DownloadLock
from nemo_safe.errors import ConfigurationError, LeaderDeposed, LeaderFailed, NemoSafeError, WaitTimeout
from nemo_safe.flight_locks import LOCK_DIRNAME, FlightLocks, lock_folder_usable
from nemo_safe.term_signal import released_on_sigterm
from nemo_safe.thread_progress import PROGRESS_LIMIT, ThreadProgress
from nemo_safe.wait_lines import WaitLines
from nemo_safe.waiting import (
    POLL_MAX_ENV,
    POLL_MAX_SETTING_CEIL,
    POLL_MIN,
    Backoff,
    env_seconds,
    poll_cap,
    positive_seconds,
    timeout_or_default,
)

__all__ = ["LOCK_DIRNAME", "SingleFlight", "check_still_leading", "lock_folder_usable", "run_else_upstream"]

log = logging.getLogger(__name__)

STALE_AFTER_ENV = "NEMO_SAFE_STALE_AFTER"
#: A leader whose beat stopped this long is dead or frozen whole (kill -9, SIGSTOP, its host gone).
#: 15 beats: a live leader's beat stops only when its process is stopped or its writes hang, and one
#: that comes back after the limit is deposed safely (:class:`LeaderDeposed`); a live leader whose
#: job is stuck keeps beating and is handled by :data:`PROGRESS_LIMIT` instead.
DEFAULT_STALE_AFTER = _LOCK_STALE
HEARTBEAT = _LOCK_BEAT
#: Shortest stale limit a setting may ask for: two beats (a smaller one takes over from every live leader).
MIN_STALE_AFTER = 2 * HEARTBEAT
#: Missed beats after which a same-host leader whose pid is gone counts as dead.
DEAD_PID_BEATS = 3
_leading = threading.local()


def run_else_upstream(flight: SingleFlight, job: Callable[[], None], done: Callable[[], bool]) -> bool:
    """``flight.run(job, done)`` for a patch whose ``job`` is upstream's own code; where the lock folder
    refuses this process before it was elected (it vanished for good, or the filesystem refused a write
    the permission bits allowed), ``job`` runs here unordered, as upstream. Whether ``job`` ran here."""
    started = False

    def run_job() -> None:
        nonlocal started
        started = True
        job()

    try:
        flight.run(run_job, done)
    except (ConfigurationError, PermissionError) as exc:
        if started:
            raise
        log.debug("nemo_safe: %s: cannot lock (%s); running as upstream does", flight.what, exc)
        job()
        return True
    return started


def check_still_leading() -> None:
    """Raise :class:`LeaderDeposed` when the calling thread leads a flight that another
    process has taken over (this one was stalled past the stale limit). Call it before
    publishing or deleting anything inside a job; outside a job it does nothing."""
    flight: SingleFlight | None = getattr(_leading, "flight", None)
    if flight is not None:
        flight._check_not_deposed()


#: Poll cap of a waiter where no launcher says how many processes there are (``mp.spawn``, Lightning's own
#: launcher, an interactive allocation): any number may wait, so not the 50 ms of a small job.
POLL_CAP_UNKNOWN_JOB = 0.25
#: Metadata calls of one waiter's poll: ``done()`` (a stat or a few), listing the lock folder, reading the lock.
CALLS_PER_POLL = 3


def _job_size() -> int | None:
    """How many processes the job has: the launcher's world size, else an initialized default process
    group's (``mp.spawn`` + ``init_process_group``, as in PyTorch's FSDP tutorial), else unknown."""
    try:
        ident = detect_identity()
    except NemoSafeError:
        ident = None
    if ident is not None and ident.launcher != "none":
        return ident.world_size
    dist = sys.modules.get("torch.distributed")  # never imported here: only asked where the job already did
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # a half-torn-down group: as unknown
        return None
    return None


def _poll_cap() -> float:
    """The barrier's poll cap for the job's size (every rank may wait on one shared root)."""
    size = _job_size()
    if size is None:
        return env_seconds(POLL_MAX_ENV, POLL_CAP_UNKNOWN_JOB, minimum=POLL_MIN, maximum=POLL_MAX_SETTING_CEIL)
    return poll_cap(size, CALLS_PER_POLL)


def _block_sigterm() -> None:
    """Keep SIGTERM off this (helper) thread: the main thread, which handles it, must be interrupted."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class SingleFlight(_DownloadLock):
    """``run()`` in every process; the job runs once per directory at a time. The protocol (waiting, leading,
    the heartbeat, takeover, outcomes) is :class:`~nemo_safe.download_lock._DownloadLock`'s, the code that
    torchvision's ``utils.py`` gets; this class adds the lock files of :class:`FlightLocks` (election by
    ``link(2)``, foreign entries ignored), the job thread's progress in each beat (a stuck job is taken over),
    a dead pid seen on this host, SIGTERM, logging and nemo_safe's errors."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str,
        *,
        what: str | None = None,
        timeout: float | None = None,
        stale_after: float | None = None,
        poll_max: float | None = None,
    ) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.what = what or f"{name} in {self.directory}"
        self.locks = FlightLocks(self.directory, name, self.what)
        super().__init__(self.locks.lock_dir, name)
        self.token = self.locks.nonce
        self.lock_dir = self.locks.lock_dir
        self.timeout = timeout_or_default(self.what, timeout)
        self.stale_after = (
            env_seconds(STALE_AFTER_ENV, DEFAULT_STALE_AFTER, minimum=MIN_STALE_AFTER)
            if stale_after is None
            else positive_seconds(f"{self.what}: stale_after", stale_after)
        )
        self.progress_limit = min(PROGRESS_LIMIT, self.stale_after)
        #: A waiter's poll cap: as the barrier's, for the launcher's world size (every rank may wait here).
        self.poll_max = _poll_cap() if poll_max is None else positive_seconds(f"{self.what}: poll_max", poll_max)
        #: True when this process ran the job (tests and the demo report it).
        self.led = False
        self._generation: int | None = None  # the generation this process leads
        #: While leading: the job thread's progress, and the beats at which it had advanced / since it last did.
        self._job: ThreadProgress | None = None
        self.progress = self.idle = 0
        self._was_deposed = False
        self._won = -1  # the generation this process created last
        self._why = ""  # why this waiter is about to take over (logged by the one that does)
        self._backoff = Backoff(self.poll_max, start=0.01)
        self._lines = WaitLines(log, self.what, speaks=False)  # replaced by each wait
        #: The leader's last (nonce, beat) this waiter read, and when it saw one change (None: not yet).
        self._beat_seen: tuple[Any, Any] | None = None
        self._beat_changed_at: float | None = None

    # -- the lock files: FlightLocks' ----------------------------------------------------

    def _generations(self) -> list[int]:
        return self.locks.generations()

    def _read(self, generation: int) -> dict[str, Any] | None:
        return self.locks.read(generation)

    def _write(self, generation: int, state: str, beat: int, **extra: Any) -> None:
        if state == "running" and beat > 0:  # a beat (from the heartbeat thread): how the job fares
            extra.update(self._job_progress())
        self.locks.publish(generation, self.locks.info(state, beat, **extra))

    def _create(self, generation: int) -> bool:
        won = self.locks.try_lead(generation)
        if won:
            self._won = generation
        if won and self._why:
            log.warning("nemo_safe: %s: %s", self.what, self._why)  # once: by the process that took over
        self._why = ""
        return won

    def _holds(self, generation: int) -> bool:
        return self.locks.still_holds(generation)

    def _finish(self, generation: int, state: str, **extra: Any) -> bool:
        """The outcome, as upstream's; a leader taken over while stalled raises :class:`LeaderDeposed` (it
        publishes nothing and waits for the new one), and a successful one also removes the lock folder.
        A job stopped by :func:`check_still_leading` may have wrapped :class:`LeaderDeposed` in its own error
        (MNIST's ``download`` turns every RuntimeError into "Error downloading ..."): that is no verdict on the
        job, so the lock, if still ours, says "abandoned" (the next process takes over at once) and
        :class:`LeaderDeposed` is raised here, for the caller to wait or lead again."""
        deposed = self._was_deposed and state == "failed"
        if deposed:
            log.warning("nemo_safe: %s: this process was told it no longer leads, and its job stopped with %s: %s; "
                        "no verdict on the job, the next process does it", self.what, extra.get("error_type"),
                        extra.get("error"))  # fmt: skip
            state, extra = "abandoned", {}
        held = super()._finish(generation, state, **extra)
        if deposed or (not held and state != "abandoned"):
            if not held:
                log.warning("nemo_safe: %s: taken over while stalled; waiting for the new leader", self.what)
            raise self._deposed_error(generation)
        if held and state == "done":
            self.locks.remove_folder()  # _DownloadLock removed the generations
        return held

    # -- what this class adds to the protocol --------------------------------------------

    def _job_progress(self) -> dict[str, int]:
        """Whether the job's thread advanced since the last beat: a beat proves the process alive, not its job."""
        if self._job is not None and self._job.advanced():
            self.progress, self.idle = self.progress + 1, 0
        else:
            self.idle += 1
        return {"progress": self.progress, "idle": self.idle}

    def _beat(self, generation: int) -> None:
        _block_sigterm()
        super()._beat(generation)

    def _takes_over(self, info: dict[str, Any], silent: float, overdue: bool) -> bool:
        """Dead (its beat stopped, or its pid is gone on this host), a file that is no lock, or alive but stuck
        (its job made no progress for :data:`PROGRESS_LIMIT` by its own count, or for this waiter's whole
        timeout: a live leader is taken over, never timed out). Remembers why, for :meth:`_create`'s warning."""
        self._why = ""
        state = info.get("state")
        if state == "foreign":
            return True  # not a leader at all (read() warned)
        beating = silent < DEAD_PID_BEATS * HEARTBEAT
        if state == "running" and (info.get("idle", 0) * HEARTBEAT >= self.progress_limit or (overdue and beating)):
            self._why = (
                f"the process doing it (host {info.get('host')}, pid {info.get('pid')}) is alive but its work made no "
                f"progress for {max(info.get('idle', 0) * HEARTBEAT, self.timeout if overdue else 0):.0f} s (stuck in "
                "a call that does not return?); this process does it again instead (the stuck one publishes nothing "
                "if it comes back)"
            )
            return True
        if state not in ("running", "unreadable"):
            return False
        here = (self.locks.host, self.locks.pidns)
        same_process_space = self.locks.pidns is not None and (info.get("host"), info.get("pidns")) == here
        pid = info.get("pid")
        dead_pid = same_process_space and not beating and isinstance(pid, int) and not pid_alive(pid)
        if silent >= self.stale_after or dead_pid:
            self._why = (
                f"the process doing it (host {info.get('host')}, pid {pid}) stopped answering for {silent:.0f} s; "
                "taking over"
            )
            return True
        return False

    def _pause(self, delay: float, info: dict[str, Any], deadline: float) -> float:
        if info.get("state") == "running":  # a leader at work (not an outcome read between two leaders)
            beat = (info.get("nonce"), info.get("beat"))
            if beat != self._beat_seen:
                if self._beat_seen is not None:
                    self._beat_changed_at = time.monotonic()
                self._beat_seen = beat
            self._lines.tick(lambda: self._leader_status(info))
        self._backoff.sleep(deadline)
        return delay

    def _leader_status(self, info: dict[str, Any]) -> str:
        """Who does the job and whether it is alive and advancing, for :class:`WaitLines`."""
        if self._beat_changed_at is None:
            beat = f"no beat seen yet in {self._lines.elapsed:.0f} s"
        else:
            beat = f"beat {time.monotonic() - self._beat_changed_at:.0f} s ago"
        if "idle" in info:  # the leader's own count, as of its last beat
            beat += f", its work idle {info['idle'] * HEARTBEAT:.0f} s then"
        return (
            f"host {info.get('host')} pid {info.get('pid')} does it ({info.get('state')}; {beat}); taken over after "
            f"{self.stale_after:.0f} s without a beat or {self.progress_limit:.0f} s without progress"
        )

    def _error(self, info: dict[str, Any]) -> Exception:
        if info.get("state") == "failed":
            return LeaderFailed(
                f"{self.what} failed in the process that did it for this one (host {info.get('host')}, "
                f"pid {info.get('pid')}): {info.get('error_type')}: {info.get('error')}",
                str(info.get("error_type", "")),
                str(info.get("error", "")),
            )
        if not info:
            return WaitTimeout(f"{self.what}: could not list or read {self.lock_dir} for {self.timeout:.0f} s")
        return WaitTimeout(
            f"{self.what}: waited {self._lines.elapsed:.0f} s for the process doing it (host "
            f"{info.get('host')}, pid {info.get('pid')}), and for the last {self.timeout:.0f} s it "
            f"showed no sign of progress (its lock {self.lock_dir} did not change) although it was not "
            "found dead. Check that process; raise NEMO_SAFE_BARRIER_TIMEOUT if it is merely slow."
        )

    def _deposed_error(self, generation: int) -> LeaderDeposed:
        self._was_deposed = True  # what run() and hold()'s callers check before waiting again
        return LeaderDeposed(
            f"{self.what}: this process (pid {os.getpid()}) was taken over as the one doing it "
            f"(generation {generation}) while it was stalled; it stops and waits for the new one"
        )

    def _check_not_deposed(self) -> None:
        if self._generation is None:
            return
        if not self._holds(self._generation):
            raise self._deposed_error(self._generation)
        self._was_deposed = False  # an earlier "deposed" was a misreading the job carried on from

    def _abandon(self, generation: int) -> None:
        """SIGTERM: mark the lock abandoned (still ours): waiters on every host take over at their next look."""
        self._finish(generation, "abandoned")

    def _wait(self, done: Callable[[], bool]) -> int | None:
        self._backoff = Backoff(self.poll_max, start=0.01)
        self._lines = WaitLines(log, f"{self.what}: this process waits for the one doing it", self.what)
        self._beat_seen, self._beat_changed_at = None, None
        generation = super()._wait(done)
        self._lines.released("it is done" if generation is None else "this process does it now")
        return generation

    # -- everyone ------------------------------------------------------------------

    def leader_running(self) -> bool:
        """Whether a process is doing the job right now (its lock says running). A ``done()`` that can hold
        on part of a job's output (a dataset checked by one of the folders it downloads) adds ``not
        leader_running()``, so that nobody leaves before the leader is through. Unknown counts as yes."""
        try:
            generations = self.locks.generations()
            info = self.locks.read(generations[-1]) if generations else None
        except OSError:
            return True
        return info is not None and info.get("state") in ("running", "unreadable")

    def run(self, job: Callable[[], None], done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, having run ``job`` here or waited for the process that did."""
        while True:
            try:
                with self.hold(done) as leading:
                    if leading and not done():  # a waiter got here because done() held: no second pass
                        job()
                return
            except LeaderDeposed:
                if not self._was_deposed:
                    raise  # another flight's, raised inside the job
                self._was_deposed = False
                # taken over while stalled: wait for the new leader (or lead again)

    @contextlib.contextmanager
    def hold(self, done: Callable[[], bool]) -> Iterator[bool]:
        """:meth:`run` as a context manager. The block runs in the process that leads (it gets True and
        re-checks ``done()`` itself: someone may just have finished); every other process gets False from
        ``__enter__`` only once ``done()`` holds, or raises the leader's failure (:class:`LeaderFailed`). The
        leader's error is recorded for the waiters. A leader taken over while it ran (stalled past the stale
        limit) raises :class:`LeaderDeposed` from ``__exit__``: call again to wait for the new one.

        A hold of a flight this thread already leads (a patch applied over its own wrapper, a download
        method calling itself) runs the block as part of the outer one instead of waiting for itself."""
        key = (self.lock_dir, self.name)
        held: set[tuple[str, str]] = _leading.__dict__.setdefault("held", set())
        if key in held:
            yield True
            return
        with super().hold(done) as leading:  # waited; a leader's heartbeat has started
            if not leading:
                yield False
                return
            generation = self._generation = self._won
            self.led, self._was_deposed = True, False
            self._job = ThreadProgress(threading.current_thread())
            self.progress = self.idle = 0
            outer, _leading.flight = getattr(_leading, "flight", None), self
            held.add(key)
            log_output.info(log, "nemo_safe: %s: this process (pid %d) does it; others that need it wait", self.what,
                            os.getpid())  # fmt: skip
            try:
                with released_on_sigterm(lambda: self._abandon(generation)):
                    yield True
            finally:
                held.discard(key)
                _leading.flight = outer  # a nested flight's end: the outer job's checks apply again
                self._generation = self._job = None
