"""The barrier's non-zero ranks: answer rank 0's session, wait for its outcome, and tell
an outcome of this attempt from one an earlier attempt left behind (see :mod:`nemo_safe.barrier`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from nemo_safe.barrier_channels import Arrival
from nemo_safe.barrier_rank_zero import RANK0_HEARTBEAT
from nemo_safe.barrier_state import (
    PRESENCE,
    PROGRAM_STARTED_AT,
    Outcome,
    process_gone,
    published_before_start,
    published_since_start,
    ranges,
    this_process,
    valid_state,
)
from nemo_safe.errors import BarrierTimeout, ConfigurationError, NemoSafeError, RankZeroAbsent, RankZeroStalled
from nemo_safe.wait_lines import WaitLines
from nemo_safe.waiting import Backoff

if TYPE_CHECKING:
    from nemo_safe.barrier import Barrier

log = logging.getLogger("nemo_safe.barrier")

#: Waiters outlast rank 0's timeout by this much so that they hear its verdict.
WAITER_GRACE_MIN, WAITER_GRACE_POLLS = 5.0, 20
#: A rank 0 that every other rank vouches for (present after the grace: it is late, not elsewhere) is waited
#: for this much longer, and never past the timeout; one that has not come by then met elsewhere after all
#: (another working directory, a meeting folder it could not use): the waiter gives up as on an absent one
#: instead of failing at its timeout where upstream completes. NeMo's upstream PR bounds it alike.
VOUCHED_WAIT = 120.0


class Waiter:
    """One call of :meth:`Barrier.wait <nemo_safe.barrier.Barrier.wait>` on a non-zero rank."""

    def __init__(self, barrier: Barrier, grace: float | None, stall_limit: float | None = None) -> None:
        self.b = barrier
        self.grace = grace
        self.stall_limit = stall_limit
        #: Rank 0's beat changed while this rank watched: it is alive now (not a state frozen by a kill).
        self.saw_beat = False
        self.backoff = Backoff(barrier.poll_max)
        self.deadline = time.monotonic() + barrier.timeout
        self.answered: dict[str, Arrival] = {}
        self.collecting_seen: set[str] = set()
        self.last: dict[str, Any] | None = None
        self.alive: tuple[Any, Any] | None = None  # rank 0's (session, beat) last seen
        self.beat_seen_at: float | None = None  # when it last changed (monotonic)
        self.lines = WaitLines(
            log,
            f"rank {barrier.rank} waits for rank 0 at {barrier.where()} (rank 0 goes first)",
            f"rank {barrier.rank}",
        )
        self.foreign_state: str | None = None  # what a malformed state looked like, for the error
        #: The session of the first state read: it may be an earlier attempt's; a session opened after it
        #: was opened by a rank 0 alive while this waiter waited, so it is this attempt's.
        self.first_session: str | None = None
        #: Every other rank was present when the grace ended: rank 0 is waited for until then (monotonic).
        self.vouched_until: float | None = None

    def wait(self) -> Outcome:
        b = self.b
        b.channel.check_safe()
        presence = None
        if self.grace is not None:
            b.channel.prepare()
            presence = self._arrive(PRESENCE)
        try:
            while True:
                b.polls += 1
                state = self._read_valid_state()
                if self.first_session is None:  # "": there was none
                    self.first_session = str(state.get("session", "")) if state is not None else ""
                outcome = self._take(state) if state is not None else None
                if outcome is not None:
                    self.lines.released("rank 0 released it")
                    return outcome
                self._check_rank_zero_present()
                if time.monotonic() >= self.deadline:
                    b.channel.check_safe()
                    if self.grace is not None:  # a timeout shorter than the grace: rank 0 never showed up either
                        raise RankZeroAbsent(self._timeout_message())
                    raise BarrierTimeout(self._timeout_message())
                self.lines.tick(self._status)
                self.backoff.set_cap(b.channel.poll_cap(b.poll_max))
                self.backoff.sleep(min(self.deadline, self._gives_up_at()))
        finally:
            b.channel.finish()
            self._withdraw()
            if presence is not None:
                b.channel.withdraw(presence)

    def _take(self, state: dict[str, Any]) -> Outcome | None:
        """Follow one state read: extend the deadline while rank 0 beats, answer a new session, and
        return this attempt's outcome once it is published (raising rank 0's failure)."""
        b = self.b
        if (state.get("session"), state.get("beat")) != self.alive:
            if self.alive is not None:  # rank 0 is alive and working: the timeout counts silence
                self.deadline = max(self.deadline, time.monotonic() + b.timeout)
                self.saw_beat, self.beat_seen_at = True, time.monotonic()
            self.alive = (state.get("session"), state.get("beat"))
        self.last = state
        self._check_rank_zero_advances(state)
        session = str(state.get("session", ""))
        if self._sign_of_rank_zero(state):
            self.grace = None  # rank 0 of this attempt showed up here: wait for it
        if state.get("phase") == "collect":
            self.collecting_seen.add(session)
        if session and session not in self.answered and self._answers(state):
            self._withdraw()
            self.answered[session] = self._arrive(session)
            self.backoff.reset()
            # Outlast rank 0's own timeout (it started about now), so that its
            # verdict naming the missing ranks reaches us before we give up.
            self.deadline = max(self.deadline, time.monotonic() + b.timeout + self._grace())
        if state.get("phase") != "done":
            return None
        outcome = self._outcome_for_me(state)
        if outcome is not None:
            if b.channel.needs_cleanup:  # a failure too: rank 0 then stops accepting this rank (a retry's)
                b.channel.mark_taken(str(state.get("session")), b.rank, b.nonce)
            outcome.raise_if_failed(b.where(), b.rank)
        return outcome

    def _status(self) -> str:
        """Rank 0's liveness and how long this rank goes on without a sign of it, for :class:`WaitLines`."""
        now = time.monotonic()
        left = min(self.deadline, self._gives_up_at()) - now
        if self.beat_seen_at is not None:
            return f"rank 0 is alive (beat {now - self.beat_seen_at:.0f} s ago); waits {left:.0f} s more without a beat"
        seen = "rank 0's record is here, no beat seen yet" if self.alive is not None else "rank 0 not seen yet"
        return f"{seen}; waits {left:.0f} s more without it"

    def _check_rank_zero_present(self) -> None:
        """After the grace without rank 0: raise :class:`RankZeroAbsent` unless every other rank is here,
        and after :data:`VOUCHED_WAIT` more (or at the timeout) if they were. This rank is no evidence
        (with two ranks nothing tells a late rank 0 from one that does not share this place, so rank 1
        gives up), nor is a presence left by a process that has exited."""
        if self.grace is None or self.lines.elapsed < self.grace:
            return
        b = self.b
        if self.vouched_until is not None:
            if time.monotonic() >= self._gives_up_at():
                ended = "its timeout" if self.deadline <= self.vouched_until else f"{VOUCHED_WAIT:g} s past the grace"
                raise RankZeroAbsent(
                    f"{b.where()}: rank {b.rank} waited {self.lines.elapsed:.1f} s ({ended}) and rank 0 never "
                    f"showed up, although every other rank was here after the {self.grace:g} s grace: rank 0 "
                    f"probably meets elsewhere (another working directory or meeting folder), or is later still."
                )
            return
        present = {a.rank for a in b.channel.arrivals(PRESENCE) if a.rank != b.rank and self._live(a)}
        if b.world_size == 2 or len(present) < b.world_size - 2:
            raise RankZeroAbsent(self._absent_message(present))
        self.vouched_until = time.monotonic() + VOUCHED_WAIT  # every other rank is here: rank 0 is late

    def _gives_up_at(self) -> float:
        """When this waiter next decides without rank 0: the grace's end, the vouched wait's, or the deadline."""
        if self.grace is None:
            return self.deadline
        if self.vouched_until is not None:
            return min(self.vouched_until, self.deadline)
        return self.lines.started + self.grace

    def _live(self, arrival: Arrival) -> bool:
        """A presence counts unless its process exited (same host) or it predates this process (by the clock)."""
        body = self.b.channel.arrival_body(arrival)
        return body is None or not (process_gone(body) or published_before_start(body))

    def _sign_of_rank_zero(self, state: dict[str, Any]) -> bool:
        """A state that shows this attempt's rank 0: one that is working or accepting (it will take us
        in), or one that is this attempt's by time or by session. A closed outcome met at the first
        look and not newer than this process may be an earlier attempt's: no sign."""
        if state.get("phase") == "collect" or state.get("accepting"):
            rank0 = state.get("rank0") or {}
            return not (published_before_start(state) or process_gone(rank0))  # a frozen one of a dead rank 0
        return self._current(state)

    def _current(self, state: dict[str, Any]) -> bool:
        """This attempt's state: published since this process started, seen collecting, or a session
        opened after this waiter's first look (only a rank 0 alive meanwhile opened it)."""
        session = str(state.get("session", ""))
        return published_since_start(state) or session in self.collecting_seen or session != self.first_session

    def _check_rank_zero_advances(self, state: dict[str, Any]) -> None:
        """With a stall limit: raise :class:`RankZeroStalled` when rank 0's own beat says its work has not
        advanced for that long (its count, so a waiter that arrives late sees it after one beat). Only for
        this attempt's rank 0 whose beat this rank saw move: a state frozen by a killed rank 0 is silence,
        which the timeout judges, not a stall."""
        idle = state.get("idle")
        if self.stall_limit is None or state.get("phase") != "collect" or type(idle) is not int:
            return
        if not self.saw_beat or not self._sign_of_rank_zero(state):
            return
        if idle * RANK0_HEARTBEAT < self.stall_limit:
            return
        r0 = state.get("rank0") or {}
        raise RankZeroStalled(
            f"{self.b.where()}: rank 0 (host {r0.get('host')}, pid {r0.get('pid')}) is alive but its work has "
            f"not advanced for {idle * RANK0_HEARTBEAT:.0f} s (no I/O, CPU or Python step: stuck in a call that "
            f"does not return, e.g. a hung filesystem); rank {self.b.rank} stops waiting for it."
        )

    def _read_valid_state(self) -> dict[str, Any] | None:
        state = self.b.channel.read_state()
        if state is None or valid_state(state):
            return state
        if self.foreign_state is None:
            self.foreign_state = repr(state)[:200]
            log.warning("nemo_safe: %s: ignoring a state record nemo_safe did not write: %s", self.b.where(),
                        self.foreign_state)  # fmt: skip
        return None

    @staticmethod
    def _answers(state: dict[str, Any]) -> bool:
        """Answer a session that is collecting, or done but still accepting late ranks."""
        return state.get("phase") == "collect" or bool(state.get("accepting"))

    def _grace(self) -> float:
        return max(WAITER_GRACE_MIN, WAITER_GRACE_POLLS * self.b.poll_max)

    def _arrive(self, session: str) -> Arrival:
        b = self.b
        arrival = Arrival(session, b.rank, b.world_size, b.nonce)
        body = {"rank": b.rank, **this_process(), "nonce": b.nonce, "session": session,
                "world_size": b.world_size, "time": time.time()}  # fmt: skip
        b.channel.arrive(arrival, body)
        return arrival

    def _withdraw(self) -> None:
        for arrival in self.answered.values():
            self.b.channel.withdraw(arrival)
        self.answered.clear()

    def _outcome_for_me(self, state: dict[str, Any]) -> Outcome | None:
        """This attempt's outcome for this rank, or None while it may be another attempt's (or pending)."""
        b = self.b
        mine = (state.get("accepted") or {}).get(str(b.rank))
        if mine == b.nonce:
            return Outcome.from_state(state)
        answered_it = str(state.get("session")) in self.answered
        current = self._current(state)
        if answered_it and mine is not None and current:
            raise NemoSafeError(
                f"{b.where()}: rank 0 accepted another process as rank {b.rank} "
                f"(nonce {mine}, ours {b.nonce}); two processes claim the same rank. "
                "Check the launcher variables (SLURM_PROCID / RANK)."
            )
        reason = (state.get("rejected") or {}).get(b.nonce)
        if reason:
            raise ConfigurationError(f"{b.where()}: rank 0 rejected this rank {b.rank}: {reason}")
        if current:
            log.debug("%s: rank %d takes session %s (first seen %s, published %s, started %s)", b.where(), b.rank,
                      state.get("session"), self.first_session, state.get("time"), PROGRAM_STARTED_AT)  # fmt: skip
            return Outcome.from_state(state)  # no process of an earlier attempt was alive to publish it
        if state.get("accepting"):
            return None  # rank 0 will accept us at its next look
        if answered_it and mine is None:
            # Rank 0 closed a session we answered without counting us: only a live rank 0 closes one
            # (a dead one's state never changes), so it is this attempt's outcome, reached without us.
            # One that counts another process as our rank is an earlier attempt's (that process was our
            # rank there): it never releases or fails this one.
            log.debug(
                "%s: rank %d takes session %s it answered, closed without it", b.where(), b.rank, state.get("session")
            )
            return Outcome.from_state(state)
        return None  # an outcome of another attempt: never releases us

    def _absent_message(self, present: set[int]) -> str:
        b = self.b
        if b.world_size == 2:
            return (
                f"{b.where()}: rank 1 waited {self.lines.elapsed:.1f} s and rank 0 never showed up; with two "
                "ranks nothing tells a late rank 0 from one that does not share this place (node-local disk, "
                "another working directory, a torchrun store one rank could not reach)."
            )
        missing = [r for r in range(1, b.world_size) if r not in present and r != b.rank]
        return (
            f"{b.where()}: rank {b.rank} waited {self.lines.elapsed:.1f} s and rank 0 never showed up, "
            f"while ranks {ranges(missing)} of 1-{b.world_size - 1} are not here either: this place is "
            "probably not shared with them (node-local disk, another working directory, a torchrun store "
            "one rank could not reach)."
        )

    def _timeout_message(self) -> str:
        b, last = self.b, self.last
        head = f"{b.where()}: rank {b.rank} of {b.world_size} waited {self.lines.elapsed:.0f} s"
        if last is None and self.foreign_state is not None:
            return (
                f"{head}; the only state record there is not one nemo_safe writes ({self.foreign_state}): "
                f"another user or program writes into {b.channel.where()}. Remove it and restart."
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
                f"{b.timeout:.0f} s: it died, or it hangs with its heartbeat stopped too. "
                f"If that process is not part of this job, {b.channel.where()} is left over from an "
                "earlier attempt with the same key: delete it and restart."
            )
        return (
            f"{head}; rank 0 never started this attempt's barrier: the only outcome found is "
            f"from another attempt (session {last.get('session')}, rank 0 host "
            f"{r0.get('host')} pid {r0.get('pid')}). Check rank 0's log."
        )
