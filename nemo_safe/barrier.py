"""Rank 0 first, every other rank after it: a barrier that works before ``torch.distributed`` exists.

The records live in a :class:`~nemo_safe.barrier_channels.Channel`: a shared
directory (no file locks: flock is node-local or a no-op on many NFS, Lustre and
GPFS mounts) or torchrun's agent store. Protocol::

    state       rank 0 only: {phase: collect|done, session, accepted, outcome, payload, ...}
    arrive.<session>.<rank>.<world>.<nonce>   one per waiting rank, answering that session

1. Rank 0 publishes ``state`` = collect with a fresh random *session*.
2. Every other rank polls ``state`` (one record per poll). When it sees a
   session it has not answered, it publishes its arrival for that session
   (rank, host, pid and a random nonce).
3. Rank 0 either waits until every rank has answered (:meth:`Barrier.gather`,
   a true barrier) or does not wait at all (:meth:`Barrier.open`); it runs its
   work and publishes ``state`` = done with the nonces it accepted, the
   outcome (ok, or the exception type and text) and an optional payload. After
   :meth:`~Barrier.open`, a background thread keeps accepting ranks that answer
   later, so nobody waits for anyone but rank 0.
4. A waiter takes a done state that lists its own nonce, or that cannot be
   another attempt's: published since this process started (every process
   of an earlier attempt with the same key was gone by then), or closing a
   session it answered. Records left by an earlier attempt (a torchrun round,
   an earlier run inside one srun step) never release anyone: stale arrivals
   answered a dead session, a stale outcome lists dead nonces and predates
   this process. Where the key names one attempt only (SLURM, MPI), rank 0
   also claims its place exclusively; a claim older than this process is an
   earlier run's and is taken over.
5. Over a directory, each waiter that took a successful outcome leaves
   ``taken.<session>.<rank>.<nonce>``; once every rank did, rank 0 removes the
   records. A failed barrier leaves ``state`` (the failure) so that late ranks
   stop with rank 0's reason.

While rank 0 works (between opening a session and publishing its outcome) it
republishes ``state`` every few seconds with a growing ``beat``: a waiter's
timeout counts rank 0's silence, not its work, so a slow move of 100k files is
never reported as a dead rank 0. A ``state`` that nemo_safe cannot have written
(shared folders are writable by others) is ignored and named in the timeout error.

A waiter given a *grace* also publishes its presence at once; if rank 0 has
shown no sign within the grace and not every other rank is present either, the
ranks may not share this directory at all (node-local disks, different
working directories), and it raises :class:`~nemo_safe.errors.RankZeroAbsent`
so that the caller can carry on without the barrier.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nemo_safe import cluster_identity
from nemo_safe.barrier_channels import Arrival, Channel, FileChannel
from nemo_safe.errors import (
    BarrierTimeout,
    ConfigurationError,
    NemoSafeError,
    RankZeroAbsent,
    RankZeroFailed,
)
from nemo_safe.waiting import POLL_MIN, Backoff, Progress, default_timeout, env_seconds, positive_seconds

log = logging.getLogger(__name__)

POLL_MAX_ENV = "NEMO_SAFE_POLL_MAX"
#: Poll cap: 50 ms for small jobs, growing with the world size so that all
#: waiting ranks together make at most ~2,000 polls/s on a metadata server.
POLL_MAX_FLOOR, POLL_MAX_CEIL, POLLS_PER_SECOND_BUDGET = 0.05, 1.0, 2000.0
RANK0_POLL_SPEEDUP = 5.0
#: Waiters outlast rank 0's timeout by this much so that they hear its verdict.
WAITER_GRACE_MIN, WAITER_GRACE_POLLS = 5.0, 20
CLEANUP_GRACE_AT_EXIT = 10.0
#: Rank 0 republishes its state this often while it works (a sign of life for the waiters).
RANK0_HEARTBEAT = 2.0
#: The session waiters answer with their presence, before rank 0 has opened one.
PRESENCE = "-"

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """What rank 0 published when it finished: how its work ended, and its payload."""

    ok: bool
    error_type: str = ""
    error: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    rank0: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Outcome:
        payload = state.get("payload")
        rank0 = state.get("rank0")
        return cls(
            bool(state.get("ok")),
            str(state.get("error_type", "")),
            str(state.get("error", "")),
            payload if isinstance(payload, dict) else {},
            rank0 if isinstance(rank0, dict) else {},
        )

    def raise_if_failed(self, where: str, rank: int) -> None:
        if self.ok:
            return
        who = f"rank 0 (host {self.rank0.get('host')}, pid {self.rank0.get('pid')})"
        if self.error_type == BarrierTimeout.__name__:
            raise BarrierTimeout(f"{where}: {who} gave up: {self.error}")
        raise RankZeroFailed(
            f"{where}: {who} failed while this rank {rank} waited: {self.error_type}: {self.error}. "
            "Fix the cause reported in rank 0's log and restart the job.",
            self.error_type,
            self.error,
        )


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux: from /proc, right after a fork too), else now."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return time.time()


#: When this process started. Every process of an earlier attempt with the same key (a torchrun
#: round, an earlier run inside one srun step) was gone before it, so a record published more than
#: CLOCK_SKEW after it is this attempt's, and one published before it is not. Assumes host clocks
#: agree within CLOCK_SKEW (NTP keeps them within milliseconds).
STARTED_AT = _process_start_time()
CLOCK_SKEW = 5.0


def _published_since_start(record: dict[str, Any]) -> bool:
    published = record.get("time")
    return isinstance(published, int | float) and published > STARTED_AT + CLOCK_SKEW


def _published_before_start(record: dict[str, Any]) -> bool:
    published = record.get("time")
    return isinstance(published, int | float) and published < STARTED_AT - CLOCK_SKEW


#: Field types of a ``state`` record (absent fields are fine); anything else was not written by nemo_safe.
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "phase": str,
    "session": str,
    "accepted": dict,
    "rejected": dict,
    "accepting": bool,
    "ok": bool,
    "error_type": str,
    "error": str,
    "payload": dict,
    "rank0": dict,
    "time": (int, float),
    "beat": int,
    "world_size": int,
}


def valid_state(state: dict[str, Any]) -> bool:
    """Whether ``state`` has the shape rank 0 publishes (other users can write shared folders)."""
    if state.get("phase") not in ("collect", "done"):
        return False
    for key, kind in _STATE_FIELDS.items():
        if key in state and not isinstance(state[key], kind):
            return False
    for table in ("accepted", "rejected"):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in state.get(table, {}).items()):
            return False
    return True


def _describe(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


# Per-process call counters, so that the n-th barrier of one name uses its own records.
_sequence: dict[tuple[str, str, str], int] = {}
_sequence_lock = threading.Lock()
#: Background threads of rank 0 (late acceptance, clean-up); stopped and joined at exit, so that
#: none is still inside a store client while the interpreter shuts down.
_threads: list[threading.Thread] = []
_stopping = threading.Event()
#: Stop signals of rank 0's heartbeats, set at exit (a rank 0 that exits without releasing).
_heartbeat_stops: set[threading.Event] = set()


def _next_sequence(where: str, name: str, key: str) -> int:
    with _sequence_lock:
        n = _sequence.get((where, name, key), 0)
        _sequence[(where, name, key)] = n + 1
        return n


def _forget_this_thread() -> None:
    """A background thread ending: nothing left for the exit handler to join."""
    try:
        _threads.remove(threading.current_thread())
    except ValueError:
        pass


@atexit.register
def _finish_threads() -> None:
    """Late acceptance stops at once (publishing the outcome as final); clean-up gets a short grace."""
    _stopping.set()
    for stop in list(_heartbeat_stops):
        stop.set()
    deadline = time.monotonic() + CLEANUP_GRACE_AT_EXIT
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


class Barrier:
    """One use of a barrier by one process.

    Rank 0 calls :meth:`gather` (or :meth:`open`) then :meth:`release`; every
    other rank calls :meth:`wait`. :func:`rank_zero_first` wraps that into a
    context manager. ``where`` is a directory, or a channel such as
    :class:`~nemo_safe.barrier_channels.StoreChannel`.
    """

    def __init__(
        self,
        where: str | os.PathLike[str] | Channel,
        world_size: int,
        name: str,
        *,
        rank: int | None = None,
        attempt_key: str | None = None,
        attempt_unique: bool = False,
        timeout: float | None = None,
        poll_max: float | None = None,
        keep_parent: bool = False,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigurationError(f"barrier {name!r}: world_size must be an int >= 1, got {world_size!r}")
        identity = None
        if rank is None or attempt_key is None:
            identity = cluster_identity.detect()
        self.rank = identity.rank if rank is None else rank
        if not 0 <= self.rank < world_size:
            raise ConfigurationError(
                f"barrier {name!r}: rank {self.rank} is outside world size {world_size}; "
                "the world size given to nemo_safe does not match the launcher "
                "(compare trainer devices x nodes with srun --ntasks / torchrun --nproc-per-node)"
            )
        self.world_size = world_size
        self.name = cluster_identity.sanitize_component(name)
        key = identity.attempt_key if attempt_key is None else attempt_key
        self.attempt_key = cluster_identity.sanitize_component(key)
        #: The key names this attempt only (SLURM, MPI): records carrying it are never an earlier attempt's.
        self.attempt_unique = attempt_unique
        self.timeout = default_timeout() if timeout is None else positive_seconds(f"barrier {name!r}: timeout", timeout)
        if poll_max is None:
            scaled = min(POLL_MAX_CEIL, max(POLL_MAX_FLOOR, world_size / POLLS_PER_SECOND_BUDGET))
            poll_max = env_seconds(POLL_MAX_ENV, scaled)
        self.poll_max = positive_seconds(f"barrier {name!r}: poll_max", poll_max)
        self.channel = where if isinstance(where, Channel) else FileChannel(where)
        seq = _next_sequence(self.channel.identity, self.name, self.attempt_key)
        self.channel.bind(f"{self.name}.{self.attempt_key}.{seq}")
        #: Leave the (empty) hidden parent directory after success. For directories other ranks
        #: keep listing and stat-ing (NeMo's log_dir): removing it would be an entry vanishing
        #: between their listdir and stat, the very race this barrier is there to remove.
        self.keep_parent = keep_parent
        self.nonce = secrets.token_hex(8)
        self.host = socket.gethostname()
        #: How many times wait() read the state (benchmarks report load per poll).
        self.polls = 0
        self._session: str | None = None
        self._accepted: dict[int, Arrival] = {}
        self._rejected: dict[str, str] = {}
        self._open = False
        self._collecting_seen: set[str] = set()
        self._heartbeat: tuple[threading.Event, threading.Thread] | None = None
        self._foreign_state: str | None = None  # what a malformed state looked like, for the error

    def _where(self) -> str:
        return f"barrier {self.name!r} in {self.channel.where()}"

    # -- waiter side ----------------------------------------------------------------

    def wait(self, grace: float | None = None) -> Outcome:
        """Non-zero ranks: block until rank 0 has finished its work; raise if it failed.

        With ``grace``: raise :class:`RankZeroAbsent` once ``grace`` seconds passed
        without any sign of rank 0 unless every other rank is present here."""
        if self.rank == 0:
            raise ConfigurationError(f"{self._where()}: rank 0 must call gather()/release(), not wait()")
        self.channel.check_safe()
        progress = Progress()
        backoff = Backoff(self.poll_max)
        deadline = time.monotonic() + self.timeout
        answered: dict[str, Arrival] = {}
        presence = None
        if grace is not None:
            self.channel.prepare()
            presence = self._arrive(PRESENCE)
        last: dict[str, Any] | None = None
        alive: tuple[Any, Any] | None = None  # rank 0's (session, beat) last seen
        try:
            while True:
                self.polls += 1
                state = self._read_valid_state()
                if state is not None:
                    if (state.get("session"), state.get("beat")) != alive:
                        if alive is not None:  # rank 0 is alive and working: the timeout counts silence
                            deadline = max(deadline, time.monotonic() + self.timeout)
                        alive = (state.get("session"), state.get("beat"))
                    last = state
                    if not _published_before_start(state):
                        grace = None  # rank 0 showed up here (not a record older than this process): wait
                    session = str(state.get("session", ""))
                    if state.get("phase") == "collect":
                        self._collecting_seen.add(session)
                    if session and session not in answered and self._answers(state):
                        self._withdraw(answered)
                        answered[session] = self._arrive(session)
                        backoff.reset()
                        # Outlast rank 0's own timeout (it started about now), so that its
                        # verdict naming the missing ranks reaches us before we give up.
                        deadline = max(deadline, time.monotonic() + self.timeout + self._grace())
                    if state.get("phase") == "done":
                        outcome = self._outcome_for_me(state, answered)
                        if outcome is not None:
                            if outcome.ok and self.channel.needs_cleanup:
                                self.channel.mark_taken(str(state.get("session")), self.rank, self.nonce)
                            outcome.raise_if_failed(self._where(), self.rank)
                            return outcome
                if grace is not None and progress.elapsed >= grace:
                    present = {a.rank for a in self.channel.arrivals(PRESENCE)}
                    if len(present) < self.world_size - 1:
                        raise RankZeroAbsent(self._absent_message(progress.elapsed, present))
                    grace = None  # every other rank is here: rank 0 is late, wait for it
                if time.monotonic() >= deadline:
                    self.channel.check_safe()
                    raise BarrierTimeout(self._waiter_timeout_message(last, progress.elapsed))
                if progress.due():
                    log.info(
                        "rank %d waiting for rank 0 at %s (%.0f s of %.0f s)",
                        self.rank,
                        self._where(),
                        progress.elapsed,
                        self.timeout,
                    )
                until = deadline if grace is None else min(deadline, progress.start + grace)
                backoff.sleep(until)
        finally:
            self._withdraw(answered)
            if presence is not None:
                self.channel.withdraw(presence)

    def _read_valid_state(self) -> dict[str, Any] | None:
        state = self.channel.read_state()
        if state is None or valid_state(state):
            return state
        if self._foreign_state is None:
            self._foreign_state = repr(state)[:200]
            log.warning("%s: ignoring a state record nemo_safe did not write: %s", self._where(), self._foreign_state)
        return None

    def _answers(self, state: dict[str, Any]) -> bool:
        """Answer a session that is collecting, or done but still accepting late ranks."""
        return state.get("phase") == "collect" or bool(state.get("accepting"))

    def _grace(self) -> float:
        return max(WAITER_GRACE_MIN, WAITER_GRACE_POLLS * self.poll_max)

    def _arrive(self, session: str) -> Arrival:
        arrival = Arrival(session, self.rank, self.world_size, self.nonce)
        body = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "nonce": self.nonce,
            "session": session,
            "world_size": self.world_size,
            "time": time.time(),
        }
        self.channel.arrive(arrival, body)
        return arrival

    def _withdraw(self, answered: dict[str, Arrival]) -> None:
        for arrival in answered.values():
            self.channel.withdraw(arrival)
        answered.clear()

    def _outcome_for_me(self, state: dict[str, Any], answered: dict[str, Arrival]) -> Outcome | None:
        """This attempt's outcome for this rank, or None while it may be another attempt's (or pending)."""
        accepted = state.get("accepted") or {}
        mine = accepted.get(str(self.rank))
        if mine == self.nonce:
            return Outcome.from_state(state)
        session = str(state.get("session"))
        answered_it = session in answered
        fresh = _published_since_start(state)
        # A state this process saw collecting, or published since it started, is this attempt's; a
        # done-but-accepting state met only after the fact may be an earlier round's, frozen when its
        # rank 0 was killed, and its accepted nonces then belong to dead processes.
        current = fresh or session in self._collecting_seen
        if answered_it and mine is not None and current:
            raise NemoSafeError(
                f"{self._where()}: rank 0 accepted another process as rank {self.rank} "
                f"(nonce {mine}, ours {self.nonce}); two processes claim the same rank. "
                "Check the launcher variables (SLURM_PROCID / RANK)."
            )
        reason = (state.get("rejected") or {}).get(self.nonce)
        if reason:
            raise ConfigurationError(f"{self._where()}: rank 0 rejected this rank {self.rank}: {reason}")
        if fresh:
            return Outcome.from_state(state)  # no process of an earlier attempt was alive to publish it
        if state.get("accepting"):
            return None  # rank 0 will accept us at its next look
        if answered_it:
            # Rank 0 closed a session we answered without counting us: only a live rank 0 closes one
            # (a dead one's state never changes), so it is this attempt's outcome, reached without us.
            return Outcome.from_state(state)
        return None  # an outcome of another attempt: never releases us

    def _absent_message(self, elapsed: float, present: set[int]) -> str:
        missing = [r for r in range(1, self.world_size) if r not in present]
        return (
            f"{self._where()}: rank {self.rank} waited {elapsed:.1f} s and rank 0 never showed up, "
            f"while ranks {_ranges(missing)} of 1-{self.world_size - 1} are not here either: this "
            "directory is probably not shared with them (node-local disk, another working directory)."
        )

    def _waiter_timeout_message(self, last: dict[str, Any] | None, elapsed: float) -> str:
        head = f"{self._where()}: rank {self.rank} of {self.world_size} waited {elapsed:.0f} s"
        if last is None and self._foreign_state is not None:
            return (
                f"{head}; the only state record there is not one nemo_safe writes ({self._foreign_state}): "
                f"another user or program writes into {self.channel.where()}. Remove it and restart."
            )
        if last is None:
            return (
                f"{head} and rank 0 never started the barrier (no state appeared). "
                "Rank 0 may have crashed or be stuck before this point, or it uses another "
                "directory or attempt key; check rank 0's log."
            )
        r0 = last.get("rank0") or {}
        if last.get("phase") == "collect":
            return (
                f"{head}; rank 0 (host {r0.get('host')}, pid {r0.get('pid')}) opened session "
                f"{last.get('session')} but never finished, and showed no sign of life for the last "
                f"{self.timeout:.0f} s: it died, or it hangs with its heartbeat stopped too. "
                f"If that process is not part of this job, {self.channel.where()} is left over from an "
                "earlier attempt with the same key: delete it and restart."
            )
        return (
            f"{head}; rank 0 never started this attempt's barrier: the only outcome found is "
            f"from another attempt (session {last.get('session')}, rank 0 host "
            f"{r0.get('host')} pid {r0.get('pid')}). Check rank 0's log."
        )

    # -- rank 0 side ----------------------------------------------------------------

    def _publish_state(self, phase: str, **extra: Any) -> None:
        body = {
            "v": 1,
            "phase": phase,
            "session": self._session,
            "name": self.name,
            "world_size": self.world_size,
            "attempt_unique": self.attempt_unique,
            "rank0": {"host": self.host, "pid": os.getpid(), "nonce": self.nonce},
            "time": time.time(),
            **extra,
        }
        self.channel.publish_state(body)

    def _start(self) -> None:
        if self.rank != 0:
            raise ConfigurationError(f"{self._where()}: only rank 0 gathers; rank {self.rank} must wait()")
        self.channel.prepare()
        if self.attempt_unique:
            claim = {"host": self.host, "pid": os.getpid(), "nonce": self.nonce, "time": time.time()}
            other = self.channel.claim_leader(claim)
            if other is not None and _published_before_start(other):
                # Rank 0 of an earlier run inside the same job step (a retry loop): gone before we started.
                self.channel.replace_leader(claim)
            elif other is not None:
                raise ConfigurationError(
                    f"{self._where()}: two processes claim rank 0 of this attempt: this one (host {self.host}, "
                    f"pid {os.getpid()}) and host {other.get('host')} pid {other.get('pid')}, which got there "
                    "first. Only one may move files; check the launcher variables (SLURM_PROCID / RANK)."
                )
        self._session = secrets.token_hex(8)
        self._publish_state("collect")
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        """Republish the collecting state with a growing beat until :meth:`release`."""
        stop = threading.Event()

        def beat() -> None:
            n = 0
            try:
                while not stop.wait(RANK0_HEARTBEAT):
                    n += 1
                    try:
                        self._publish_state("collect", beat=n)
                    except Exception as exc:  # one failed write (a failover): the next beat may get through
                        log.debug("%s: heartbeat %d not published: %s", self._where(), n, exc)
            finally:
                _heartbeat_stops.discard(stop)
                _forget_this_thread()

        thread = threading.Thread(target=beat, daemon=True, name=f"nemo_safe-barrier-beat-{self.name}")
        self._heartbeat = (stop, thread)
        _heartbeat_stops.add(stop)
        _threads.append(thread)
        thread.start()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            stop, thread = self._heartbeat
            stop.set()
            thread.join()
            self._heartbeat = None

    def _scan(self) -> dict[int, Arrival]:
        """Rank 0 only: the arrivals answering this session, by rank (one per rank: the accepted one, or
        among new ones the lowest nonce; a second claimant is an error in gather mode)."""
        found: dict[int, Arrival] = dict(self._accepted)
        for arrival in sorted(self.channel.arrivals(self._session or ""), key=lambda a: a.nonce):
            if arrival.rank in found or arrival.nonce in self._rejected:
                other = found.get(arrival.rank)
                if other is not None and other.nonce != arrival.nonce and not self._open:
                    raise ConfigurationError(
                        f"{self._where()}: two processes claim rank {arrival.rank} "
                        f"({self.channel.describe(other)} and {self.channel.describe(arrival)}); check the "
                        "launcher variables (SLURM_PROCID / RANK) of this job"
                    )
                continue
            problem = None
            if arrival.world_size != self.world_size:
                problem = (
                    f"rank {arrival.rank} ({self.channel.describe(arrival)}) uses world size "
                    f"{arrival.world_size} but rank 0 uses {self.world_size}; every rank must agree "
                    "(check devices x num_nodes against the launcher)"
                )
            elif not 0 < arrival.rank < self.world_size:
                problem = (
                    f"a process on {self.channel.describe(arrival)} claims rank {arrival.rank}, "
                    f"outside world size {self.world_size}"
                )
            if problem and not self._open:
                raise ConfigurationError(f"{self._where()}: {problem}")
            if problem:
                self._rejected[arrival.nonce] = problem
                continue
            found[arrival.rank] = arrival
        return found

    def open(self) -> None:
        """Rank 0: open a session without waiting for anyone; :meth:`release` publishes the
        outcome and keeps accepting ranks that answer later, in a background thread."""
        self._start()
        self._open = True

    def gather(self) -> None:
        """Rank 0: open a session and wait until every other rank has answered it. Whatever ends
        the wait early (a failing read included) is published as rank 0's outcome and stops its
        heartbeat, so that no waiter goes on waiting for a rank 0 that left."""
        self._start()
        try:
            self._gather()
        except BaseException as exc:
            try:
                self.release(exc)
            except Exception as release_error:  # the records are unreachable too: the waiters time out
                log.warning("%s: could not publish rank 0's failure: %s", self._where(), release_error)
            raise

    def _gather(self) -> None:
        progress = Progress()
        # Rank 0 is the only lister, so it can afford to poll faster than the waiters.
        backoff = Backoff(max(POLL_MIN, self.poll_max / RANK0_POLL_SPEEDUP))
        deadline = time.monotonic() + self.timeout
        while True:
            arrived = self._scan()
            if len(arrived) == self.world_size - 1:
                self._accepted = arrived
                return
            missing = [r for r in range(1, self.world_size) if r not in arrived]
            if time.monotonic() >= deadline:
                hosts = sorted({self.channel.describe(a).split(" pid")[0] for a in arrived.values()})
                self._accepted = arrived
                error = BarrierTimeout(
                    f"{self._where()}: rank 0 waited {self.timeout:.0f} s but ranks "
                    f"{_ranges(missing)} never arrived ({len(arrived) + 1} of {self.world_size} "
                    f"did, from {', '.join(hosts) or 'no other host'}). Those processes died "
                    "or never started, or the world size is wrong (compare devices x nodes "
                    "with the launcher's task count)."
                )
                raise error
            if progress.due():
                log.info(
                    "rank 0 waiting at %s: %d of %d ranks arrived, missing %s (%.0f s of %.0f s)",
                    self._where(),
                    len(arrived) + 1,
                    self.world_size,
                    _ranges(missing),
                    progress.elapsed,
                    self.timeout,
                )
            backoff.sleep(deadline)

    def release(self, error: BaseException | None = None, payload: dict[str, Any] | None = None) -> None:
        """Rank 0: publish the outcome to every accepted rank, then (in the background)
        accept late ranks after :meth:`open` and clean up."""
        if self._session is None:
            raise ConfigurationError(f"{self._where()}: release() before gather()")
        self._stop_heartbeat()
        outcome: dict[str, Any] = {"ok": error is None, "payload": payload or {}}
        if error is not None:
            outcome["error_type"], outcome["error"] = _describe(error)
        if self._open:
            self._accepted = self._scan()
        accepting = self._open and len(self._accepted) < self.world_size - 1
        self._publish_outcome(outcome, accepting)
        if error is not None and not accepting:
            # Keep the failure visible so that ranks arriving late stop with rank 0's
            # reason instead of timing out; the next attempt replaces it.
            return
        thread = threading.Thread(
            target=self._finish, args=(outcome, accepting), daemon=True, name=f"nemo_safe-barrier-{self.name}"
        )
        _threads.append(thread)
        thread.start()

    def _publish_outcome(self, outcome: dict[str, Any], accepting: bool) -> None:
        self._publish_state(
            "done",
            accepted={str(r): a.nonce for r, a in self._accepted.items()},
            rejected=dict(self._rejected),
            accepting=accepting,
            **outcome,
        )

    def _finish(self, outcome: dict[str, Any], accepting: bool) -> None:
        """Accept ranks that answer late (after :meth:`open`), then wait until every accepted
        rank has withdrawn its arrival (it saw the outcome) and remove what rank 0 created."""
        backoff = Backoff(max(self.poll_max, 0.25))
        deadline = time.monotonic() + self.timeout
        try:
            while accepting and time.monotonic() < deadline:
                stopping = _stopping.wait(backoff.delay(deadline))  # at exit: one last look, then final
                before = len(self._accepted)
                self._accepted = self._scan()
                accounted = set(self._accepted) | self.channel.taken_ranks(self._session or "")  # took it unlisted
                accepting = len(accounted) < self.world_size - 1
                if stopping or not accepting or len(self._accepted) != before:
                    self._publish_outcome(outcome, accepting and not stopping)
                if stopping and accepting:
                    return  # this process exits with ranks missing: the outcome stands as published
            if accepting:
                missing = [r for r in range(1, self.world_size) if r not in self._accepted]
                log.warning(
                    "%s: ranks %s never answered within %.0f s; later arrivals get rank 0's outcome as it is",
                    self._where(),
                    _ranges(missing),
                    self.timeout,
                )
                self._publish_outcome(outcome, accepting=False)
                return
            if not outcome["ok"]:
                return
            if not self.channel.needs_cleanup:
                return
            # Files only (no store client here), so at exit this goes on for the short join grace.
            everyone = set(range(1, self.world_size))
            while not everyone <= self.channel.taken_ranks(self._session or ""):
                if time.monotonic() >= deadline:
                    log.debug("%s: not every rank took the outcome; leaving the records", self._where())
                    return
                backoff.sleep(deadline)
            self.channel.remove(self.keep_parent)
        except Exception as exc:  # a store gone with its agent, a directory removed: nothing left to do
            log.debug("%s: background acceptance/clean-up stopped: %s", self._where(), exc)
        finally:
            _forget_this_thread()

    def run(self, work: Callable[[], T]) -> T | None:
        """Rank 0 runs ``work`` after every rank arrived; the others wait for it to finish."""
        if self.rank != 0:
            self.wait()
            return None
        self.gather()
        try:
            result = work()
        except BaseException as exc:
            self.release(exc)
            raise
        self.release()
        return result


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7': keeps error lines short for thousands of ranks."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


@contextmanager
def rank_zero_first(
    directory: str | os.PathLike[str],
    world_size: int | None = None,
    name: str = "barrier",
    **kwargs: Any,
) -> Iterator[Barrier | None]:
    """Run the body on rank 0 first; every other rank enters the body only after
    rank 0's body finished, and gets :class:`RankZeroFailed` if it raised.

    ``world_size`` defaults to the launcher's; with one process nothing is written.
    """
    if world_size is None:
        world_size = cluster_identity.detect().world_size
    if world_size == 1:
        yield None
        return
    barrier = Barrier(directory, world_size, name, **kwargs)
    if barrier.rank != 0:
        barrier.wait()
        yield barrier
        return
    barrier.gather()
    try:
        yield barrier
    except BaseException as exc:
        barrier.release(exc)
        raise
    barrier.release()
