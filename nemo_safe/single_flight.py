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
once ``done()`` holds): the MNIST overlay uses it in place of upstream torchvision's
``_download_lock``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nemo_safe.atomic_files import pid_alive, unlink_if_exists
from nemo_safe.cluster_identity import detect as detect_identity
from nemo_safe.errors import ConfigurationError, LeaderDeposed, LeaderFailed, NemoSafeError, WaitTimeout
from nemo_safe.flight_locks import LOCK_DIRNAME, FlightLocks, lock_folder_usable
from nemo_safe.term_signal import released_on_sigterm
from nemo_safe.thread_progress import PROGRESS_LIMIT, ThreadProgress
from nemo_safe.waiting import (
    POLL_MAX_ENV,
    POLL_MIN,
    Backoff,
    Progress,
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
DEFAULT_STALE_AFTER = 15.0
HEARTBEAT = 1.0
#: Shortest stale limit a setting may ask for: two beats (a smaller one takes over from every live leader).
MIN_STALE_AFTER = 2 * HEARTBEAT
#: How long the final beat may take to be written when the leader is interrupted (SIGTERM).
ABANDON_JOIN = 2.0
#: Missed beats after which a same-host leader whose pid is gone counts as dead.
DEAD_PID_BEATS = 3
#: A waiter's own pause between two successful reads longer than this (or than a third of the
#: stale limit): its stall, or reads that failed, restart its count of the leader's silence.
OWN_STALL = 5.0
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
        return env_seconds(POLL_MAX_ENV, POLL_CAP_UNKNOWN_JOB, minimum=POLL_MIN)
    return poll_cap(size, CALLS_PER_POLL)


class _Watch:
    """What a waiter has seen of one generation's leader. Silence is counted between this
    waiter's own successful reads only, so its own stalls never look like the leader's."""

    def __init__(self, generation: int, stale_after: float, poll_max: float) -> None:
        self.generation = generation
        # At least two polls: a waiter's own pause between two reads is not the leader's silence.
        self.own_stall = max(min(OWN_STALL, stale_after / 3), 2 * poll_max)
        self.beat: Any = None
        self.progress: Any = None
        self.changed_at = self.progressed_at = time.monotonic()
        self.read_at = self.changed_at
        self.saw_running = False

    def observe(self, info: dict[str, Any]) -> bool:
        """Record one successful read; True when the leader's job progressed since the last one (a lock
        of a version that did not measure progress: when it beat)."""
        now = time.monotonic()
        if now - self.read_at > self.own_stall:
            self.changed_at = now  # we were away (stalled, or our reads failed): we saw no silence
        self.read_at = now
        if info.get("state") == "running":
            self.saw_running = True
        if info.get("beat") != self.beat:
            self.beat = info.get("beat")
            self.changed_at = now
        progress = info.get("progress", info.get("beat"))
        if progress != self.progress:
            self.progress, self.progressed_at = progress, now
            return True
        return False

    def standstill(self, info: dict[str, Any]) -> float:
        """Seconds the leader's job showed no progress: by the leader's own count of idle beats, or
        since this waiter last saw its progress counter change, whichever is longer."""
        return max(info.get("idle", 0) * HEARTBEAT, time.monotonic() - self.progressed_at)

    def frozen_for(self) -> float:
        return time.monotonic() - self.changed_at


#: What :meth:`SingleFlight._look` returns while neither done nor elected.
_KEEP_WAITING = -1


def _block_sigterm() -> None:
    """Keep SIGTERM off this (helper) thread: the main thread, which handles it, must be interrupted."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class _Heartbeat:
    """The leader's sign of life: its lock rewritten every :data:`HEARTBEAT` seconds with a growing
    ``beat``, until stopped, or until it finds that another process took the flight over. Each beat
    also says whether the thread running the job advanced (``progress``, ``idle``): a beat proves
    the process alive, not its job."""

    def __init__(self, flight: SingleFlight, generation: int) -> None:
        self.flight = flight
        self.generation = generation
        self.count = 0
        #: Beats at which the job's thread had advanced, and beats since it last did.
        self.progress = self.idle = 0
        self._job = ThreadProgress(threading.current_thread())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"nemo_safe-heartbeat-{flight.name}")
        self._thread.start()

    def _run(self) -> None:
        _block_sigterm()
        locks = self.flight.locks
        while not self._stop.wait(HEARTBEAT):
            self.count += 1
            if self._job.advanced():
                self.progress, self.idle = self.progress + 1, 0
            else:
                self.idle += 1
            try:
                if not locks.still_holds(self.generation):
                    self.flight._deposed.set()  # stalled past the limit and replaced: stop beating
                    return
                body = locks.info("running", self.count, progress=self.progress, idle=self.idle)
                if not self._stop.is_set():
                    locks.publish(self.generation, body)
            except OSError as exc:
                log.warning("nemo_safe: %s: heartbeat failed: %s", self.flight.what, exc)

    def stop(self, timeout: float | None = None) -> int:
        """Stop beating; the beat number the leader's next (final) record carries."""
        self._stop.set()
        self._thread.join(timeout)
        return self.count + 1


class SingleFlight:
    """``run()`` in every process; the job runs once per directory at a time."""

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
        self.name = name
        self.what = what or f"{name} in {self.directory}"
        self.locks = FlightLocks(self.directory, name, self.what)
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
        self._deposed = threading.Event()

    def _is_stale(self, info: dict[str, Any], watch: _Watch) -> bool:
        if info.get("state") == "foreign":
            return True  # not a leader at all
        if info.get("state") not in ("running", "unreadable"):
            return False
        frozen = watch.frozen_for()
        if frozen >= self.stale_after:
            return True
        here = (self.locks.host, self.locks.pidns)
        same_process_space = self.locks.pidns is not None and (info.get("host"), info.get("pidns")) == here
        if not same_process_space or frozen < DEAD_PID_BEATS * HEARTBEAT:
            return False
        pid = info.get("pid")
        return isinstance(pid, int) and not pid_alive(pid)

    # -- the leader ----------------------------------------------------------------

    def _check_not_deposed(self) -> None:
        if self._generation is None:
            return
        if self._deposed.is_set() or not self.locks.still_holds(self._generation):
            raise self._deposed_error(self._generation)

    @contextlib.contextmanager
    def _lead(self, generation: int) -> Iterator[None]:
        """Run the block as this generation's leader. Raises :class:`LeaderDeposed` when this process
        was taken over while it ran: its outcome is not published, the caller waits again."""
        self.led = True
        self._generation = generation
        self._deposed.clear()
        beat = _Heartbeat(self, generation)
        _leading.flight = self
        log.info("nemo_safe: %s: this process (pid %d) does it; others wait", self.what, os.getpid())
        try:
            with released_on_sigterm(lambda: self._abandon(generation, beat)):
                yield
            self._check_not_deposed()
        except Exception as exc:
            self._record_failure(generation, beat.stop(), exc)
            raise
        except BaseException:
            # Interrupted (Ctrl-C, a SIGTERM handler's exception): no verdict on the job, so the others take over now.
            self._abandon(generation, beat)
            raise
        finally:
            _leading.flight = None
            self._generation = None
        self._record_success(generation, beat.stop())

    def _abandon(self, generation: int, beat: _Heartbeat) -> None:
        """Mark the lock abandoned (still ours): waiters on every host take over at their next look."""
        final_beat = beat.stop(ABANDON_JOIN)
        try:
            if self.locks.still_holds(generation):
                self.locks.publish(generation, self.locks.info("abandoned", final_beat))
        except OSError:
            unlink_if_exists(os.path.join(self.lock_dir, self.locks.lock_name(generation)))

    def _record_failure(self, generation: int, beat: int, exc: Exception) -> None:
        """The job raised: record it for the waiters, unless this process was deposed meanwhile."""
        if self._was_deposed(generation):
            log.warning("nemo_safe: %s: taken over while stalled (%s: %s); waiting for the new leader",
                        self.what, type(exc).__name__, exc)  # fmt: skip
            raise self._deposed_error(generation) from exc
        try:
            self.locks.publish(
                generation, self.locks.info("failed", beat, error_type=type(exc).__name__, error=str(exc))
            )
        except OSError as publish_error:  # e.g. the same full disk: waiters then see a dead leader instead
            log.warning("nemo_safe: %s: could not record the failure for the others: %s", self.what, publish_error)

    def _record_success(self, generation: int, beat: int) -> None:
        """Mark the lock done (the waiters' ``done()`` then holds), and remove it and older generations."""
        try:
            if not self.locks.still_holds(generation):
                raise FileNotFoundError(
                    errno.ENOENT, "the lock is another process's now", self.locks.lock_name(generation)
                )
            self.locks.publish(generation, self.locks.info("done", beat))
        except OSError as exc:
            if not self._was_deposed(generation):
                raise
            log.warning("nemo_safe: %s: taken over while stalled (%s); waiting for the new leader", self.what, exc)
            raise self._deposed_error(generation) from exc
        self.locks.remove_through(generation)

    def _deposed_error(self, generation: int) -> LeaderDeposed:
        self._deposed.set()  # what run() and hold()'s callers check before waiting again
        return LeaderDeposed(
            f"{self.what}: this process (pid {os.getpid()}) was taken over as the one doing it "
            f"(generation {generation}) while it was stalled; it stops and waits for the new one"
        )

    def _was_deposed(self, generation: int) -> bool:
        return self._deposed.is_set() or not self.locks.still_holds(generation)

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
                if not self._deposed.is_set():
                    raise  # another flight's, raised inside the job
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
        generation = self._wait(done)
        if generation is None:
            yield False
            return
        held.add(key)
        try:
            with self._lead(generation):
                yield True
        finally:
            held.discard(key)

    def _wait(self, done: Callable[[], bool]) -> int | None:
        """None once ``done()`` holds; the generation this process won the lock of, when it must lead."""
        waiting = _Waiting(self)
        while True:
            if done():
                return None
            outcome = waiting.look(done)
            if outcome is not _KEEP_WAITING:
                return outcome


class _Waiting:
    """One process's wait in :meth:`SingleFlight.hold`: its deadline (extended by each sign of the
    leader's progress, not by its mere beat), its poll schedule and what it has seen of the current leader."""

    def __init__(self, flight: SingleFlight) -> None:
        self.flight = flight
        self.deadline = time.monotonic() + flight.timeout
        self.backoff = Backoff(flight.poll_max, start=0.01)
        self.progress = Progress()
        self.watch: _Watch | None = None

    def look(self, done: Callable[[], bool]) -> int | None:
        """One look at the lock folder: lead where no generation exists yet, else follow the newest one's leader."""
        f = self.flight
        try:
            generations = f.locks.generations()
        except OSError as exc:  # listing failed on our side (a failover): not a verdict on anyone
            log.debug("nemo_safe: %s: listing the lock folder failed: %s", f.what, exc)
            if time.monotonic() > self.deadline:
                message = f"{f.what}: could not list {f.lock_dir} for {f.timeout:.0f} s: {exc}"
                raise WaitTimeout(message) from exc
            self.backoff.sleep(self.deadline)
            return _KEEP_WAITING
        if not generations:
            if f.locks.try_lead(0):
                return 0
            self.backoff.sleep(self.deadline)  # another process won; this listing did not show it yet
            return _KEEP_WAITING
        current = generations[-1]
        try:
            info = f.locks.read(current)
        except OSError as exc:  # our own read failed (an NFS failover): not the leader's silence
            log.debug("nemo_safe: %s: reading the lock failed: %s", f.what, exc)
            info = {}
        if info is None:
            self.backoff.sleep(self.deadline)  # removed by a finishing leader just now
            return _KEEP_WAITING
        return self._follow(current, info, done)

    def _follow(self, current: int, info: dict[str, Any], done: Callable[[], bool]) -> int | None:
        """Judge generation ``current``'s lock (``{}`` when this process could not read it): raise the
        leader's failure, take over from a dead or finished one, or wait on."""
        f = self.flight
        if self.watch is None or self.watch.generation != current:
            self.watch = _Watch(current, f.stale_after, f.poll_max)
        watch = self.watch
        if info and watch.observe(info):
            self.deadline = max(self.deadline, time.monotonic() + f.timeout)  # the timeout is for standstill
        state = info.get("state")
        if state == "failed" and watch.saw_running:
            raise LeaderFailed(
                f"{f.what} failed in the process that did it for this one (host {info.get('host')}, "
                f"pid {info.get('pid')}): {info.get('error_type')}: {info.get('error')}",
                str(info.get("error_type", "")),
                str(info.get("error", "")),
            )
        if state in ("failed", "done", "abandoned") or (info and f._is_stale(info, watch)):
            # An earlier attempt's failure, a leader whose job did not cover this process, one
            # interrupted, a dead leader or a file that is no lock: one process starts the next generation.
            if state not in ("failed", "done", "foreign", "abandoned"):
                log.warning(
                    "nemo_safe: %s: the process doing it (host %s, pid %s) stopped answering for %.0f s; taking over",
                    f.what, info.get("host"), info.get("pid"), watch.frozen_for(),
                )  # fmt: skip
            if state == "done" and done():
                return None
            if f.locks.try_lead(current + 1):
                return current + 1
            self.backoff.sleep(self.deadline)  # another process took over first
            return _KEEP_WAITING
        idle = info.get("idle", 0) * HEARTBEAT if state == "running" else 0.0
        beating = state == "running" and watch.frozen_for() < DEAD_PID_BEATS * HEARTBEAT
        if idle >= f.progress_limit or (beating and time.monotonic() > self.deadline):
            if f.locks.try_lead(current + 1):
                log.warning(
                    "nemo_safe: %s: the process doing it (host %s, pid %s) is alive but its work made no progress "
                    "for %.0f s (stuck in a call that does not return?); this process does it again instead (the "
                    "stuck one publishes nothing if it comes back)", f.what, info.get("host"), info.get("pid"),
                    watch.standstill(info),
                )  # fmt: skip
                return current + 1
            self.backoff.sleep(self.deadline)  # another waiter took over first: wait for that one
            return _KEEP_WAITING
        if time.monotonic() > self.deadline:
            raise WaitTimeout(
                f"{f.what}: waited {self.progress.elapsed:.0f} s for the process doing it (host "
                f"{info.get('host')}, pid {info.get('pid')}), and for the last {f.timeout:.0f} s it "
                f"showed no sign of progress (its lock {f.lock_dir} did not change) although it was not "
                "found dead. Check that process; raise NEMO_SAFE_BARRIER_TIMEOUT if it is merely slow."
            )
        if self.progress.due():
            log.info("nemo_safe: %s: waiting %.0f s for host %s pid %s", f.what, self.progress.elapsed,
                     info.get("host"), info.get("pid"))  # fmt: skip
        self.backoff.sleep(self.deadline)
        return _KEEP_WAITING
