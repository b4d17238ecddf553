"""The barrier's rank 0: open a session, gather the other ranks (or not), publish the outcome, keep
accepting late ranks and clean up in the background (see :mod:`nemo_safe.barrier`)."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from nemo_safe.barrier_channels import Arrival
from nemo_safe.barrier_state import is_this_process, process_gone, published_before_start, ranges, this_process
from nemo_safe.errors import BarrierTimeout, ConfigurationError
from nemo_safe.records import new_nonce
from nemo_safe.thread_progress import ThreadProgress
from nemo_safe.wait_lines import WaitLines
from nemo_safe.waiting import POLL_MIN, Backoff

if TYPE_CHECKING:
    from nemo_safe.barrier import Barrier

log = logging.getLogger("nemo_safe.barrier")

#: Rank 0 is the only lister, so it can afford to poll this much faster than the waiters.
RANK0_POLL_SPEEDUP = 5.0
#: Rank 0 republishes its state this often while it works (a sign of life for the waiters).
RANK0_HEARTBEAT = 2.0
#: At exit the background threads end on their own (late acceptance after one last look, clean-up once
#: no rank has taken the outcome for CLEANUP_QUIET_POLLS waiter polls); this only caps a call that hangs.
CLEANUP_GRACE_AT_EXIT = 10.0
CLEANUP_QUIET_POLLS, CLEANUP_QUIET_MIN = 2, 1.0

#: Background threads of rank 0 (heartbeat, late acceptance, clean-up); stopped and joined at exit,
#: so that none is still inside a store client while the interpreter shuts down.
_threads: list[threading.Thread] = []
_stopping = threading.Event()
#: Stop signals of rank 0's heartbeats, set at exit (a rank 0 that exits without releasing).
_heartbeat_stops: set[threading.Event] = set()


def _start_thread(target: Any, name: str, *args: Any) -> threading.Thread:
    def body() -> None:
        try:
            target(*args)
        finally:
            try:
                _threads.remove(threading.current_thread())
            except ValueError:
                pass

    thread = threading.Thread(target=body, daemon=True, name=name)
    _threads.append(thread)
    thread.start()
    return thread


@atexit.register
def _finish_threads() -> None:
    """Late acceptance stops at once (publishing the outcome as final); clean-up goes on only while the
    other ranks are still taking the outcome (a stopped or stuck rank holds no exit); the join caps a hung call."""
    _stopping.set()
    for stop in list(_heartbeat_stops):
        stop.set()
    deadline = time.monotonic() + CLEANUP_GRACE_AT_EXIT
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


class RankZero:
    """Rank 0's side of one :class:`~nemo_safe.barrier.Barrier`."""

    def __init__(self, barrier: Barrier, open_session: bool) -> None:
        self.b = barrier
        self.open = open_session
        self.session = ""
        self.accepted: dict[int, Arrival] = {}
        self.rejected: dict[str, str] = {}
        self.opened_at = time.monotonic()
        self._heartbeat: tuple[threading.Event, threading.Thread] | None = None

    def publish_state(self, phase: str, **extra: Any) -> None:
        b = self.b
        body = {"v": 1, "phase": phase, "session": self.session, "name": b.name, "world_size": b.world_size,
                "attempt_unique": b.attempt_unique, "rank0": {**this_process(), "nonce": b.nonce},
                "time": time.time(), **extra}  # fmt: skip
        b.channel.publish_state(body)

    def start(self) -> None:
        """Open a session (claiming rank 0's place first where the key names one attempt). A start that
        fails once the records exist publishes that failure as a closed session, so that no waiter waits
        for a barrier that will never open, unless the state is the live other claimant's (its barrier
        opens). It leaves nothing to release."""
        b = self.b
        b.channel.prepare()
        self.opened_at = time.monotonic()
        self.session = new_nonce()
        holder: dict[str, Any] | None = None
        try:
            holder = self._claim() if b.attempt_unique else None
            if holder is not None:
                raise self._rival_error(holder)
            self.publish_state("collect")
        except BaseException as exc:
            self._publish_failed_open(exc, holder if isinstance(exc, ConfigurationError) else None)
            raise
        stop = threading.Event()
        _heartbeat_stops.add(stop)
        self._work = ThreadProgress()  # this thread's: the one that goes on to do rank 0's work
        thread = _start_thread(self._beat, f"nemo_safe-barrier-beat-{b.name}", stop)
        self._heartbeat = (stop, thread)

    def _claim(self) -> dict[str, Any] | None:
        """Claim rank 0's place of this attempt; the other claim if a live process holds it. A retry is a
        new attempt, not a rival: a claim whose process has exited (same host and pid namespace), one of
        this same process (an earlier call) or one older than this process (by the clock) is taken over."""
        b = self.b
        claim = {**this_process(), "nonce": b.nonce, "time": time.time()}
        other = b.channel.claim_leader(claim)
        if other is None:
            return None
        if process_gone(other) or is_this_process(other) or published_before_start(other):
            b.channel.replace_leader(claim)
            return None
        return other

    def _rival_error(self, other: dict[str, Any]) -> ConfigurationError:
        b = self.b
        return ConfigurationError(
            f"{b.where()}: two processes claim rank 0 of this attempt: this one (host {b.host}, "
            f"pid {os.getpid()}) and host {other.get('host')} pid {other.get('pid')}, which got there "
            "first and still runs. Only one may move files; check the launcher variables (SLURM_PROCID / RANK)."
        )

    def _publish_failed_open(self, error: BaseException, holder: dict[str, Any] | None) -> None:
        b = self.b
        try:
            if holder is not None:
                state = b.channel.read_state() or {}
                if (state.get("rank0") or {}).get("nonce") == holder.get("nonce"):
                    return  # the rival's own barrier: it opens (or opened) it; ours must not replace it
            outcome = {"ok": False, "payload": {}, "error_type": type(error).__name__, "error": str(error)}
            self.publish_state("done", accepted={}, rejected={}, accepting=False, **outcome)
        except Exception as publish_error:  # the records are unreachable too: the waiters time out
            log.warning("%s: could not publish the failure to open: %s", b.where(), publish_error)

    def _beat(self, stop: threading.Event) -> None:
        """Republish the collecting state with a growing beat until :meth:`release`, and with ``idle``: the
        beats since the thread that opened the barrier (rank 0's work) last advanced. A rank 0 stuck in a
        call that will not return (a hung NFS move) beats on; ``idle`` lets the waiters tell."""
        n = idle = 0
        try:
            while not stop.wait(RANK0_HEARTBEAT):
                n += 1
                idle = 0 if self._work.advanced() else idle + 1
                try:
                    self.publish_state("collect", beat=n, idle=idle)
                except Exception as exc:  # one failed write (a failover): the next beat may get through
                    log.debug("%s: heartbeat %d not published: %s", self.b.where(), n, exc)
        finally:
            _heartbeat_stops.discard(stop)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            stop, thread = self._heartbeat
            stop.set()
            thread.join()
            self._heartbeat = None

    def scan(self) -> dict[int, Arrival]:
        """The arrivals answering this session, by rank (one per rank: the accepted one, or among
        new ones the lowest nonce; a second claimant is an error in gather mode)."""
        b, found = self.b, dict(self.accepted)
        for arrival in sorted(b.channel.arrivals(self.session), key=lambda a: a.nonce):
            if arrival.rank in found or arrival.nonce in self.rejected:
                other = found.get(arrival.rank)
                if other is not None and other.nonce != arrival.nonce and not self.open:
                    raise ConfigurationError(
                        f"{b.where()}: two processes claim rank {arrival.rank} ({b.channel.describe(other)} "
                        f"and {b.channel.describe(arrival)}); check the launcher variables (SLURM_PROCID / RANK) "
                        "of this job"
                    )
                continue
            problem = self._problem(arrival)
            if problem and not self.open:
                raise ConfigurationError(f"{b.where()}: {problem}")
            if problem:
                self.rejected[arrival.nonce] = problem
                continue
            found[arrival.rank] = arrival
        return found

    def _problem(self, arrival: Arrival) -> str | None:
        b = self.b
        if arrival.world_size != b.world_size:
            return (
                f"rank {arrival.rank} ({b.channel.describe(arrival)}) uses world size {arrival.world_size} but "
                f"rank 0 uses {b.world_size}; every rank must agree (check devices x num_nodes against the launcher)"
            )
        if not 0 < arrival.rank < b.world_size:
            where = b.channel.describe(arrival)
            return f"a process on {where} claims rank {arrival.rank}, outside world size {b.world_size}"
        return None

    def gather(self) -> None:
        """Wait until every other rank has answered; whatever ends the wait early (a failing read
        included) is published as rank 0's outcome and stops its heartbeat, so that no waiter goes
        on waiting for a rank 0 that left."""
        try:
            self._gather()
        except BaseException as exc:
            try:
                self.release(exc)
            except Exception as release_error:  # the records are unreachable too: the waiters time out
                log.warning("%s: could not publish rank 0's failure: %s", self.b.where(), release_error)
            raise

    def _gather(self) -> None:
        b = self.b
        others = f"the other {b.world_size - 1} ranks" if b.world_size > 2 else "rank 1"
        lines = WaitLines(log, f"rank 0 waits at {b.where()} for {others} to arrive", "rank 0")
        backoff = Backoff(max(POLL_MIN, b.poll_max / RANK0_POLL_SPEEDUP))
        deadline = time.monotonic() + b.timeout
        while True:
            arrived = self.scan()
            if len(arrived) == b.world_size - 1:
                self.accepted = arrived
                lines.released("every rank arrived")
                return
            missing = ranges([r for r in range(1, b.world_size) if r not in arrived])
            if time.monotonic() >= deadline:
                hosts = sorted({b.channel.describe(a).split(" pid")[0] for a in arrived.values()})
                self.accepted = arrived
                raise BarrierTimeout(
                    f"{b.where()}: rank 0 waited {b.timeout:.0f} s but ranks {missing} never arrived "
                    f"({len(arrived) + 1} of {b.world_size} did, from {', '.join(hosts) or 'no other host'}). "
                    "Those processes died or never started, or the world size is wrong (compare devices x "
                    "nodes with the launcher's task count)."
                )
            here = f"{len(arrived) + 1} of {b.world_size} here, missing ranks {missing}"
            lines.tick(lambda here=here: f"{here}; waits {deadline - time.monotonic():.0f} s more")
            backoff.sleep(deadline)

    def release(
        self, error: BaseException | None, payload: dict[str, Any] | None = None, stay: bool = False
    ) -> list[int]:
        """Publish the outcome. With ``stay`` (after :meth:`Barrier.open`), wait here until every other rank
        arrived (:meth:`_stay`); returns the ranks that never came when the timeout ended that wait."""
        self._stop_heartbeat()
        outcome: dict[str, Any] = {"ok": error is None, "payload": payload or {}}
        if error is not None:
            outcome["error_type"], outcome["error"] = type(error).__name__, str(error)
        if self.open:
            self.accepted = self.scan()
        accepting = self.open and len(self.accepted) < self.b.world_size - 1
        self._publish_outcome(outcome, accepting)
        missing: list[int] = []
        if stay and accepting:
            try:
                missing, accepting = self._stay(outcome), False
            except BaseException:  # Ctrl-C or a rejected rank: the outcome stands as published, closed
                self._publish_outcome(outcome, accepting=False)
                raise
        if error is not None and not accepting:
            # Keep the failure visible so that ranks arriving late stop with rank 0's
            # reason instead of timing out; the next attempt replaces it.
            return missing
        _start_thread(self._finish, f"nemo_safe-barrier-{self.b.name}", outcome, accepting)
        return missing

    def _stay(self, outcome: dict[str, Any]) -> list[int]:
        """Accept late ranks in this thread until every other rank arrived (its nonce is listed, or it took
        the outcome unlisted), as a barrier after rank 0's work (Fabric's ``rank_zero_first`` waits there
        too): a rank arriving after rank 0's process exited could not tell its outcome from an earlier
        attempt's. Ends at the timeout counted from the opening (never sooner than a few polls of the
        waiters); returns the ranks still missing then. A rank rank 0 rejected (another world size, a rank
        outside it) is a :class:`ConfigurationError` as soon as it is seen."""
        b = self.b
        deadline = max(self.opened_at + b.timeout, time.monotonic() + max(1.0, 2 * b.poll_max))
        backoff = Backoff(max(POLL_MIN, b.poll_max / RANK0_POLL_SPEEDUP))
        ended = "finished first" if outcome["ok"] else f"failed ({outcome['error_type']}: {outcome['error']})"
        lines = WaitLines(log, f"rank 0 {ended} at {b.where()} and waits for the other ranks to take its outcome",
                          "rank 0")  # fmt: skip
        said_failure = outcome["ok"]
        while True:
            before = len(self.accepted)
            self.accepted = self.scan()
            accounted = set(self.accepted) | b.channel.taken_ranks(self.session)  # took it unlisted
            missing = [r for r in range(1, b.world_size) if r not in accounted]
            if self.rejected:  # a rank that can never be counted (another world size): say so now, not at the timeout
                raise ConfigurationError(f"{b.where()}: {next(iter(self.rejected.values()))}")
            if not missing or time.monotonic() >= deadline:
                self._publish_outcome(outcome, accepting=False)
                if not missing:
                    lines.released("every rank arrived")
                return missing
            if not said_failure:  # the traceback waits for them: say at once what rank 0 raises
                said_failure = True
                log.warning("nemo_safe: %s: rank 0's block raised %s: %s; it raises that once ranks %s have taken it "
                            "(at most %.0f s)", b.where(), outcome["error_type"], outcome["error"], ranges(missing),
                            deadline - time.monotonic())  # fmt: skip
            if len(self.accepted) != before:
                self._publish_outcome(outcome, accepting=True)
            here = f"{b.world_size - len(missing)} of {b.world_size} have it, missing ranks {ranges(missing)}"
            lines.tick(lambda here=here: f"{here}; waits {deadline - time.monotonic():.0f} s more")
            backoff.sleep(deadline)

    def _publish_outcome(self, outcome: dict[str, Any], accepting: bool) -> None:
        accepted = {str(r): a.nonce for r, a in self.accepted.items()}
        self.publish_state("done", accepted=accepted, rejected=dict(self.rejected), accepting=accepting, **outcome)

    def _finish(self, outcome: dict[str, Any], accepting: bool) -> None:
        """Accept ranks that answer late (after ``open``), then wait until every accepted rank has
        marked the outcome taken and remove what rank 0 created."""
        b = self.b
        backoff = Backoff(max(b.poll_max, 0.25))
        deadline = time.monotonic() + b.timeout
        try:
            if accepting and not self._accept_late(outcome, backoff, deadline):
                return
            if not outcome["ok"] or not b.channel.needs_cleanup:
                return
            # At exit it goes on only while ranks keep taking the outcome: a rank that stopped polling
            # (SIGSTOP, hung) must not hold rank 0's exit; its records then stay, as after a failure.
            everyone, quiet = set(range(1, b.world_size)), max(CLEANUP_QUIET_MIN, CLEANUP_QUIET_POLLS * b.poll_max)
            taken, progressed = set(), time.monotonic()
            while not everyone <= (now := b.channel.taken_ranks(self.session)):
                if len(now) > len(taken):
                    taken, progressed = now, time.monotonic()
                stop_at = min(deadline, progressed + quiet) if _stopping.is_set() else deadline
                if time.monotonic() >= stop_at:
                    log.debug("%s: not every rank took the outcome; leaving the records", b.where())
                    return
                delay = backoff.delay(stop_at)
                if _stopping.is_set():
                    time.sleep(delay)  # the event no longer pauses anyone once set
                else:
                    _stopping.wait(delay)
            b.channel.remove(b.keep_parent)
        except Exception as exc:  # a store gone with its agent, a directory removed: nothing left to do
            log.debug("%s: background acceptance/clean-up stopped: %s", b.where(), exc)

    def _accept_late(self, outcome: dict[str, Any], backoff: Backoff, deadline: float) -> bool:
        """Accept ranks answering after the outcome; True once every rank is accounted for."""
        b, accepting = self.b, True
        while accepting and time.monotonic() < deadline:
            stopping = _stopping.wait(backoff.delay(deadline))  # at exit: one last look, then final
            before = len(self.accepted)
            self.accepted = self.scan()
            accounted = set(self.accepted) | b.channel.taken_ranks(self.session)  # took it unlisted
            accepting = len(accounted) < b.world_size - 1
            if stopping or not accepting or len(self.accepted) != before:
                self._publish_outcome(outcome, accepting and not stopping)
            if stopping and accepting:
                return False  # this process exits with ranks missing: the outcome stands as published
        if accepting:
            missing = ranges([r for r in range(1, b.world_size) if r not in self.accepted])
            log.warning("nemo_safe: %s: ranks %s never answered within %.0f s; later arrivals get rank 0's "
                        "outcome as it is", b.where(), missing, b.timeout)  # fmt: skip
            self._publish_outcome(outcome, accepting=False)
            return False
        return True
