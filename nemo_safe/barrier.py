"""A barrier over a shared directory that works before ``torch.distributed`` exists.

Protocol (only atomic create/rename, no file locks: flock is node-local or a
no-op on many NFS, Lustre and GPFS mounts)::

    <directory>/.nemo_safe/<name>.<attempt key>.<n>/
        state                                 rank 0 only: {phase: collect|done, session, ...}
        arrive.<session>.<rank>.<world>.<nonce>   one per waiting rank, answering that session

1. Rank 0 creates the directory and publishes ``state`` = collect with a fresh
   random *session*.
2. Every other rank polls ``state`` (one file per poll, after re-opening the
   directory so NFS revalidates cached negative lookups). When it sees a
   collect state it publishes its arrival for that session (rank, host, pid
   and a random nonce, written to a temporary name and renamed).
3. Rank 0 lists the directory until every rank has answered its session, runs
   its work, and publishes ``state`` = done with the accepted nonces and the
   outcome (ok, or the exception type and text).
4. A waiter accepts only a done state listing its own nonce, so files left by
   an earlier attempt with the same key can never release anyone: stale
   arrivals answered a dead session, and a stale outcome lists dead nonces.
5. Each waiter deletes its arrival when released; rank 0 deletes ``state`` and
   the empty directories once every accepted arrival is gone. Each process
   deletes only what it created, and a successful barrier leaves nothing. A
   failed one leaves ``state`` (the failure) so that late ranks stop with rank
   0's reason; the next attempt replaces it.

A rank that never arrives makes rank 0 time out naming the missing ranks, and
rank 0 publishes that failure so the arrived ranks stop too. A rank 0 that
dies makes the others time out saying rank 0 never finished.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from nemo_safe import cluster_identity
from nemo_safe.atomic_files import publish, read_if_exists, unlink_if_exists
from nemo_safe.errors import (
    BarrierTimeout,
    ConfigurationError,
    NemoSafeError,
    RankZeroFailed,
    UnsafeBarrierPath,
)
from nemo_safe.waiting import POLL_MIN, Backoff, Progress, default_timeout, env_seconds

log = logging.getLogger(__name__)

BARRIER_DIRNAME = ".nemo_safe"
STATE_NAME = "state"
ARRIVE_PREFIX = "arrive."
POLL_MAX_ENV = "NEMO_SAFE_POLL_MAX"
#: Poll cap: 50 ms for small jobs, growing with the world size so that all
#: waiting ranks together make at most ~2,000 polls/s on a metadata server.
POLL_MAX_FLOOR, POLL_MAX_CEIL, POLLS_PER_SECOND_BUDGET = 0.05, 1.0, 2000.0
RANK0_POLL_SPEEDUP = 5.0
#: Waiters outlast rank 0's timeout by this much so that they hear its verdict.
WAITER_GRACE_MIN, WAITER_GRACE_POLLS = 5.0, 20
CLEANUP_GRACE_AT_EXIT = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class _Arrival:
    name: str
    session: str
    rank: int
    world_size: int
    nonce: str

    @classmethod
    def parse(cls, name: str) -> _Arrival | None:
        parts = name.split(".")
        if len(parts) != 5 or parts[0] + "." != ARRIVE_PREFIX:
            return None
        try:
            return cls(name, parts[1], int(parts[2]), int(parts[3]), parts[4])
        except ValueError:
            return None


def _describe(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


# Per-process call counters, so that the n-th barrier of one name uses its own directory.
_sequence: dict[tuple[str, str, str], int] = {}
_sequence_lock = threading.Lock()
_cleanups: list[threading.Thread] = []


def _next_sequence(directory: str, name: str, key: str) -> int:
    with _sequence_lock:
        n = _sequence.get((directory, name, key), 0)
        _sequence[(directory, name, key)] = n + 1
        return n


@atexit.register
def _finish_cleanups() -> None:
    deadline = time.monotonic() + CLEANUP_GRACE_AT_EXIT
    for thread in list(_cleanups):
        thread.join(max(0.0, deadline - time.monotonic()))


class Barrier:
    """One use of a filesystem barrier by one process.

    Rank 0 calls :meth:`gather` then :meth:`release`; every other rank calls
    :meth:`wait`. :func:`rank_zero_first` wraps that into a context manager.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        world_size: int,
        name: str,
        *,
        rank: int | None = None,
        attempt_key: str | None = None,
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
        self.timeout = default_timeout() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise ConfigurationError(f"barrier {name!r}: timeout must be positive, got {timeout!r}")
        if poll_max is None:
            scaled = min(POLL_MAX_CEIL, max(POLL_MAX_FLOOR, world_size / POLLS_PER_SECOND_BUDGET))
            poll_max = env_seconds(POLL_MAX_ENV, scaled)
        self.poll_max = poll_max
        self.root = os.path.abspath(os.fspath(directory))
        seq = _next_sequence(self.root, self.name, self.attempt_key)
        self.parent = os.path.join(self.root, BARRIER_DIRNAME)
        #: Leave the (empty) hidden parent after success. For directories other ranks keep
        #: listing and stat-ing (NeMo's log_dir): removing it would be an entry vanishing
        #: between their listdir and stat, the very race this barrier is there to remove.
        self.keep_parent = keep_parent
        self.path = os.path.join(self.parent, f"{self.name}.{self.attempt_key}.{seq}")
        self.nonce = secrets.token_hex(8)
        self.host = socket.gethostname()
        #: How many times wait() read the state file (benchmarks report load per poll).
        self.polls = 0
        self._session: str | None = None
        self._accepted: dict[int, _Arrival] = {}

    # -- shared helpers -------------------------------------------------------------

    def _where(self) -> str:
        return f"barrier {self.name!r} in {self.path}"

    def _check_real_dir(self, path: str, missing_ok: bool = False) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UnsafeBarrierPath(
                f"{path} is {kind}; nemo_safe refuses to use it as a barrier directory. "
                "Remove it (someone or something planted it there) and restart the job."
            )

    def _read_state(self) -> dict[str, Any] | None:
        """Re-open the directory (NFS revalidates its cached lookups), then read ``state``."""
        try:
            dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if os.path.islink(self.path):
                self._check_real_dir(self.path)
            raise NemoSafeError(f"{self._where()}: cannot open the directory: {exc}") from exc
        try:
            try:
                fd = os.open(STATE_NAME, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except FileNotFoundError:
                return None
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
        finally:
            os.close(dir_fd)
        try:
            state = json.loads(raw)
        except ValueError:
            return None  # not ours (state is only ever replaced whole)
        return state if isinstance(state, dict) else None

    # -- waiter side ----------------------------------------------------------------

    def wait(self) -> None:
        """Non-zero ranks: block until rank 0 has finished its work; raise if it failed."""
        if self.rank == 0:
            raise ConfigurationError(f"{self._where()}: rank 0 must call gather()/release(), not wait()")
        self._check_real_dir(self.parent, missing_ok=True)
        progress = Progress()
        backoff = Backoff(self.poll_max)
        deadline = time.monotonic() + self.timeout
        answered: dict[str, str] = {}  # session -> arrival file we wrote
        last: dict[str, Any] | None = None
        try:
            while True:
                self.polls += 1
                state = self._read_state()
                if state is not None:
                    last = state
                    session = str(state.get("session", ""))
                    if state.get("phase") == "collect" and session not in answered:
                        self._withdraw(answered)
                        answered[session] = self._arrive(session)
                        backoff.reset()
                        # Outlast rank 0's own timeout (it started about now), so that its
                        # verdict naming the missing ranks reaches us before we give up.
                        deadline = max(deadline, time.monotonic() + self.timeout + self._grace())
                    elif state.get("phase") == "done" and self._outcome_is_mine(state, answered):
                        self._raise_if_failed(state)
                        return
                if time.monotonic() >= deadline:
                    self._check_real_dir(self.parent, missing_ok=True)
                    raise BarrierTimeout(self._waiter_timeout_message(last, progress.elapsed))
                if progress.due():
                    log.info(
                        "rank %d waiting for rank 0 at %s (%.0f s of %.0f s)",
                        self.rank,
                        self._where(),
                        progress.elapsed,
                        self.timeout,
                    )
                backoff.sleep(deadline)
        finally:
            self._withdraw(answered)

    def _grace(self) -> float:
        return max(WAITER_GRACE_MIN, WAITER_GRACE_POLLS * self.poll_max)

    def _arrive(self, session: str) -> str:
        self._check_real_dir(self.parent)
        name = f"{ARRIVE_PREFIX}{session}.{self.rank}.{self.world_size}.{self.nonce}"
        body = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "nonce": self.nonce,
            "session": session,
            "world_size": self.world_size,
            "time": time.time(),
        }
        publish(self.path, name, json.dumps(body).encode())
        return name

    def _withdraw(self, answered: dict[str, str]) -> None:
        for name in answered.values():
            unlink_if_exists(os.path.join(self.path, name))
        answered.clear()

    def _outcome_is_mine(self, state: dict[str, Any], answered: dict[str, str]) -> bool:
        accepted = state.get("accepted") or {}
        if accepted.get(str(self.rank)) == self.nonce:
            return True
        if str(state.get("session")) in answered:
            # Rank 0 closed the session we answered without counting us.
            if state.get("ok"):
                raise NemoSafeError(
                    f"{self._where()}: rank 0 accepted another process as rank {self.rank} "
                    f"(nonce {accepted.get(str(self.rank))}, ours {self.nonce}); two processes "
                    "claim the same rank. Check the launcher variables (SLURM_PROCID / RANK)."
                )
            return True
        return False  # an outcome of another attempt: never releases us

    def _raise_if_failed(self, state: dict[str, Any]) -> None:
        if state.get("ok"):
            return
        rtype, rmsg = str(state.get("error_type", "")), str(state.get("error", ""))
        r0 = state.get("rank0") or {}
        where = f"rank 0 (host {r0.get('host')}, pid {r0.get('pid')})"
        if rtype == BarrierTimeout.__name__:
            raise BarrierTimeout(f"{self._where()}: {where} gave up: {rmsg}")
        raise RankZeroFailed(
            f"{self._where()}: {where} failed while this rank {self.rank} waited: "
            f"{rtype}: {rmsg}. Fix the cause reported in rank 0's log and restart the job.",
            rtype,
            rmsg,
        )

    def _waiter_timeout_message(self, last: dict[str, Any] | None, elapsed: float) -> str:
        head = f"{self._where()}: rank {self.rank} of {self.world_size} waited {elapsed:.0f} s"
        if last is None:
            return (
                f"{head} and rank 0 never started the barrier (no state file appeared). "
                "Rank 0 may have crashed or be stuck before this point, or it uses another "
                "directory or attempt key; check rank 0's log."
            )
        r0 = last.get("rank0") or {}
        if last.get("phase") == "collect":
            return (
                f"{head}; rank 0 (host {r0.get('host')}, pid {r0.get('pid')}) opened session "
                f"{last.get('session')} but never finished: it died or hangs in its work. "
                f"If that process is not part of this job, {self.path} is left over from an "
                "earlier attempt with the same key: delete it and restart."
            )
        return (
            f"{head}; rank 0 never started this attempt's barrier: the only outcome found is "
            f"from another attempt (session {last.get('session')}, rank 0 host "
            f"{r0.get('host')} pid {r0.get('pid')}). Check rank 0's log."
        )

    # -- rank 0 side ----------------------------------------------------------------

    def _make_dirs(self) -> None:
        for _ in range(100):
            try:
                for path in (self.parent, self.path):
                    try:
                        os.mkdir(path, 0o755)
                    except FileExistsError:
                        self._check_real_dir(path)
                return
            except FileNotFoundError:
                # Another barrier's rank 0 removed the empty parent just now: retry.
                if not os.path.isdir(self.root):
                    raise NemoSafeError(
                        f"{self._where()}: the directory {self.root} does not exist; create it before the barrier"
                    ) from None
            except OSError as exc:  # read-only, permission denied, disk full, quota
                raise NemoSafeError(
                    f"{self._where()}: rank 0 cannot create the barrier directory ({exc}); make {self.root} "
                    "writable for this job. The other ranks will time out saying rank 0 never started."
                ) from exc
        raise NemoSafeError(f"{self._where()}: could not create the barrier directory")

    def _publish_state(self, phase: str, **extra: Any) -> None:
        body = {
            "v": 1,
            "phase": phase,
            "session": self._session,
            "name": self.name,
            "world_size": self.world_size,
            "rank0": {"host": self.host, "pid": os.getpid()},
            "time": time.time(),
            **extra,
        }
        publish(self.path, STATE_NAME, json.dumps(body).encode())

    def _scan(self) -> dict[int, _Arrival]:
        """Rank 0 only: the arrivals answering this session, by rank."""
        found: dict[int, _Arrival] = {}
        with os.scandir(self.path) as entries:
            for entry in entries:
                arrival = _Arrival.parse(entry.name)
                if arrival is None or arrival.session != self._session:
                    continue
                if arrival.world_size != self.world_size:
                    raise ConfigurationError(
                        f"{self._where()}: rank {arrival.rank} ({self._host_of(arrival)}) uses "
                        f"world size {arrival.world_size} but rank 0 uses {self.world_size}; "
                        "every rank must agree (check devices x num_nodes against the launcher)"
                    )
                if not 0 < arrival.rank < self.world_size:
                    raise ConfigurationError(
                        f"{self._where()}: a process on {self._host_of(arrival)} claims rank "
                        f"{arrival.rank}, outside world size {self.world_size}"
                    )
                other = found.get(arrival.rank)
                if other is not None and other.nonce != arrival.nonce:
                    raise ConfigurationError(
                        f"{self._where()}: two processes claim rank {arrival.rank} "
                        f"({self._host_of(other)} and {self._host_of(arrival)}); check the "
                        "launcher variables (SLURM_PROCID / RANK) of this job"
                    )
                found[arrival.rank] = arrival
        return found

    def _host_of(self, arrival: _Arrival) -> str:
        raw = read_if_exists(os.path.join(self.path, arrival.name))
        try:
            body = json.loads(raw) if raw else {}
            return f"host {body.get('host')} pid {body.get('pid')}"
        except ValueError:
            return "host unknown"

    def gather(self) -> None:
        """Rank 0: open a session and wait until every other rank has answered it."""
        if self.rank != 0:
            raise ConfigurationError(f"{self._where()}: only rank 0 gathers; rank {self.rank} must wait()")
        self._make_dirs()
        self._session = secrets.token_hex(8)
        self._publish_state("collect")
        progress = Progress()
        # Rank 0 is the only lister, so it can afford to poll faster than the waiters.
        backoff = Backoff(max(POLL_MIN, self.poll_max / RANK0_POLL_SPEEDUP))
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                arrived = self._scan()
            except ConfigurationError as exc:
                self.release(exc)
                raise
            if len(arrived) == self.world_size - 1:
                self._accepted = arrived
                return
            missing = [r for r in range(1, self.world_size) if r not in arrived]
            if time.monotonic() >= deadline:
                hosts = sorted({self._host_of(a).split(" pid")[0] for a in arrived.values()})
                self._accepted = arrived
                error = BarrierTimeout(
                    f"{self._where()}: rank 0 waited {self.timeout:.0f} s but ranks "
                    f"{_ranges(missing)} never arrived ({len(arrived) + 1} of {self.world_size} "
                    f"did, from {', '.join(hosts) or 'no other host'}). Those processes died "
                    "or never started, or the world size is wrong (compare devices x nodes "
                    "with the launcher's task count)."
                )
                self.release(error)
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

    def release(self, error: BaseException | None = None) -> None:
        """Rank 0: publish the outcome to every accepted rank, then clean up in the background."""
        if self._session is None:
            raise ConfigurationError(f"{self._where()}: release() before gather()")
        outcome: dict[str, Any] = {
            "ok": error is None,
            "accepted": {str(r): a.nonce for r, a in self._accepted.items()},
        }
        if error is not None:
            outcome["error_type"], outcome["error"] = _describe(error)
        self._publish_state("done", **outcome)
        if error is not None:
            # Keep the failure visible so that ranks arriving late stop with rank 0's
            # reason instead of timing out; the next attempt replaces it.
            return
        names = {a.name for a in self._accepted.values()}
        thread = threading.Thread(
            target=self._cleanup, args=(names,), daemon=True, name=f"nemo_safe-cleanup-{self.name}"
        )
        _cleanups.append(thread)
        thread.start()

    def _cleanup(self, names: set[str]) -> None:
        """Wait until every accepted rank has removed its arrival (it saw the outcome),
        then remove what rank 0 created: ``state`` and the directories if empty."""
        backoff = Backoff(self.poll_max)
        deadline = time.monotonic() + self.timeout
        try:
            while names and time.monotonic() < deadline:
                names &= set(os.listdir(self.path))
                if names:
                    backoff.sleep(deadline)
            if names:
                log.warning("%s: ranks did not collect the outcome; leaving %s", self._where(), self.path)
                return
            unlink_if_exists(os.path.join(self.path, STATE_NAME))
            os.rmdir(self.path)
            if not self.keep_parent:
                os.rmdir(self.parent)
        except OSError:
            pass  # not empty (another barrier, or leftovers of an earlier attempt): not ours
        finally:
            try:
                _cleanups.remove(threading.current_thread())
            except ValueError:
                pass

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
