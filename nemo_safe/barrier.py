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
so that the caller can carry on without the barrier; if every other rank was present,
rank 0 is only late and is waited for up to 120 s more (never past the timeout).
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from nemo_safe import cluster_identity, node_copy
from nemo_safe.barrier_channels import Channel, FileChannel, StoreChannel, agent_store_address
from nemo_safe.barrier_rank_zero import RANK0_POLL_SPEEDUP, RankZero
from nemo_safe.barrier_state import Outcome, ranges
from nemo_safe.barrier_waiter import Waiter
from nemo_safe.errors import BarrierTimeout, ConfigurationError
from nemo_safe.records import new_nonce
from nemo_safe.wait_lines import say
from nemo_safe.waiting import poll_cap, positive_seconds, timeout_or_default

#: The poll constant rank 0 uses is here too, where the benchmarks look for it.
__all__ = ["CALLS_PER_POLL", "RANK0_POLL_SPEEDUP", "Barrier", "Outcome", "rank_zero_first"]


log = logging.getLogger("nemo_safe.barrier")
T = TypeVar("T")

#: Metadata calls of one waiter's poll of a directory's ``state`` (open the folder, open the file;
#: measured by benchmarks/barrier_scale.py): the poll cap budgets calls, not polls.
CALLS_PER_POLL = 2
#: How long ``rank_zero_first()`` without a directory gives torchrun's agent store to accept a connection.
STORE_PROBE_SECONDS = 5.0

# Per-process call counters, so that the n-th barrier of one name uses its own records.
_sequence: dict[tuple[str, str, str], int] = {}
_sequence_lock = threading.Lock()


def _next_sequence(where: str, name: str, key: str) -> int:
    with _sequence_lock:
        n = _sequence.get((where, name, key), 0)
        _sequence[(where, name, key)] = n + 1
        return n


class Barrier:
    """One use of a barrier by one process.

    Rank 0 calls :meth:`gather` (or :meth:`open`) then :meth:`release`; every
    other rank calls :meth:`wait`. :meth:`first` (and :func:`rank_zero_first`)
    wraps that into a context manager. ``where`` is a directory, or a channel
    such as :class:`~nemo_safe.barrier_channels.StoreChannel`. The two sides live
    in :class:`~nemo_safe.barrier_waiter.Waiter` and
    :class:`~nemo_safe.barrier_rank_zero.RankZero`.
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
        _check_world_size(name, world_size)
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
        self.timeout = timeout_or_default(f"barrier {name!r}", timeout)
        channel = where if isinstance(where, Channel) else FileChannel(where)
        #: Waiting ranks of one node may read rank 0's state through one reader (:mod:`nemo_safe.node_copy`).
        self.channel = node_copy.around(channel, self.rank, world_size)
        if poll_max is None:
            poll_max = poll_cap(self.channel.shared_pollers(world_size), CALLS_PER_POLL)
        self.poll_max = positive_seconds(f"barrier {name!r}: poll_max", poll_max)
        seq = _next_sequence(self.channel.identity, self.name, self.attempt_key)
        self.channel.bind(f"{self.name}.{self.attempt_key}.{seq}")
        #: Leave the (empty) hidden parent directory after success. For directories other ranks
        #: keep listing and stat-ing (NeMo's log_dir): removing it would be an entry vanishing
        #: between their listdir and stat, the very race this barrier is there to remove.
        self.keep_parent = keep_parent
        self.nonce = new_nonce()
        self.host = socket.gethostname()
        #: How many times wait() read the state (benchmarks report load per poll).
        self.polls = 0
        self._rank_zero: RankZero | None = None

    def where(self) -> str:
        """The barrier and its records' location, as messages name it."""
        return f"barrier {self.name!r} in {self.channel.where()}"

    def wait(self, grace: float | None = None, stall_limit: float | None = None) -> Outcome:
        """Non-zero ranks: block until rank 0 has finished its work; raise if it failed.

        With ``grace``: raise :class:`~nemo_safe.errors.RankZeroAbsent` once ``grace`` seconds
        passed without any sign of rank 0 unless every other rank is present here, and if they
        were, :data:`~nemo_safe.barrier_waiter.VOUCHED_WAIT` seconds later (or at the timeout). With
        ``stall_limit``: raise :class:`~nemo_safe.errors.RankZeroStalled` once rank 0, still beating,
        has shown no progress of its work for that many seconds (for callers that can carry on
        without it; others wait while it beats, a long subprocess of rank 0's included)."""
        if self.rank == 0:
            raise ConfigurationError(f"{self.where()}: rank 0 must call gather()/release(), not wait()")
        return Waiter(self, grace, stall_limit).wait()

    def open(self) -> None:
        """Rank 0: open a session without waiting for anyone; :meth:`release` publishes the
        outcome and keeps accepting ranks that answer later, in a background thread."""
        self._start(open_session=True)

    def gather(self) -> None:
        """Rank 0: open a session and wait until every other rank has answered it (a true barrier).
        A failure of the wait itself is published as rank 0's outcome before it is raised."""
        self._start(open_session=False).gather()

    def _start(self, open_session: bool) -> RankZero:
        if self.rank != 0:
            raise ConfigurationError(f"{self.where()}: only rank 0 gathers; rank {self.rank} must wait()")
        rank_zero = RankZero(self, open_session)
        rank_zero.start()  # a start that fails (a second rank 0, an unsafe path) leaves nothing to release
        self._rank_zero = rank_zero
        return rank_zero

    def release(self, error: BaseException | None = None, payload: dict[str, Any] | None = None) -> None:
        """Rank 0: publish the outcome (``error``'s type and text, or success with ``payload``) to every
        accepted rank, then (in the background) accept late ranks after :meth:`open` and clean up."""
        if self._rank_zero is None:
            raise ConfigurationError(f"{self.where()}: release() before gather()")
        self._rank_zero.release(error, payload)

    @contextmanager
    def first(self) -> Iterator[Outcome | None]:
        """Rank 0 enters the block at once (after :meth:`open`); every other rank enters it once rank 0's block
        finished (getting rank 0's :class:`Outcome`), or gets :class:`~nemo_safe.errors.RankZeroFailed` if it
        raised. Rank 0 leaves the block once every other rank has arrived, so is sure to get the outcome (as
        after Fabric's ``rank_zero_first``): a rank arriving after rank 0's process exited would wait its timeout.
        Ranks still missing at the timeout are a :class:`~nemo_safe.errors.BarrierTimeout` on rank 0."""
        if self.rank != 0:
            yield self.wait()
            return
        others = f"{self.world_size - 1} other ranks wait" if self.world_size > 2 else "rank 1 waits"
        say(log, "nemo_safe: rank 0 goes first at %s; %s for it", self.where(), others)
        self.open()
        assert self._rank_zero is not None
        try:
            yield None
        except Exception as exc:
            try:
                missing = self._rank_zero.release(exc, stay=True)
            except ConfigurationError as problem:  # rank 0's own error comes first; this one is said
                log.warning("nemo_safe: %s", problem)
                missing = []
            if missing:
                log.warning("nemo_safe: %s: ranks %s never arrived to take rank 0's failure", self.where(),
                            ranges(missing))  # fmt: skip
            raise  # the block's own exception, its traceback and chain untouched
        except BaseException as exc:  # an interrupt or exit: leave now
            self.release(exc)
            raise
        missing = self._rank_zero.release(None, stay=True)
        if missing:
            raise BarrierTimeout(
                f"{self.where()}: rank 0 finished its block, but ranks {ranges(missing)} never arrived within "
                f"{self.timeout:.0f} s of its start ({self.world_size - len(missing)} of {self.world_size} did). "
                "Those processes died or never started, or the world size is wrong (compare devices x nodes "
                "with the launcher's task count)."
            )

    def run(self, work: Callable[[], T]) -> T | None:
        """Rank 0 runs ``work`` after every rank arrived (a true barrier: :meth:`gather`); the others wait for
        it to finish. Rank 0 returns ``work()``, the others None."""
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


@contextmanager
def rank_zero_first(
    directory: str | os.PathLike[str] | Channel | None = None,
    world_size: int | None = None,
    name: str = "barrier",
    *,
    local: bool = False,
    **kwargs: Any,
) -> Iterator[Barrier | None]:
    """Run the body on rank 0 first; every other rank enters the body only after
    rank 0's body finished, and gets :class:`~nemo_safe.errors.RankZeroFailed` if it raised.

    Rank 0 starts at once; it leaves its body once every other rank has arrived (:meth:`Barrier.first`).
    ``local=True``: per node, local rank 0 first (for node-local files); ``world_size`` is then the node's
    process count. ``directory`` is where the ranks meet (shared by every rank of the group); None: torchrun's
    agent store. The group's size defaults to the launcher's; with one process nothing is written, but
    unknown keywords, ``timeout``, ``poll_max`` and ``world_size`` are checked as with many (a script tried
    alone must not fail first on the cluster over them; the directory and ``rank`` are checked where a
    barrier is made).
    """
    _check_arguments(world_size, name, kwargs)
    if not isinstance(local, bool):
        raise ConfigurationError(f"rank_zero_first(): local must be True or False, got {local!r}")
    needs_launcher = local or world_size is None or directory is None
    ident = cluster_identity.detect() if needs_launcher else None
    if ident is not None and local:
        size = _node_size(ident, world_size)
        kwargs.setdefault("rank", ident.local_rank)
        name = f"{name}.node{ident.node_rank}"
    else:
        size = world_size if ident is None or world_size is not None else ident.world_size
    if size == 1:
        yield None
        return
    where = _agent_store(ident) if ident is not None and directory is None else directory
    barrier = Barrier(where, size, name, **kwargs)
    with barrier.first():
        yield barrier


def _node_size(ident: cluster_identity.ClusterIdentity, world_size: int | None) -> int:
    """The per-node group's size: the launcher's, which also numbers the nodes (a ``world_size`` given must agree)."""
    if ident.local_world_size is None:
        raise ConfigurationError(
            f"rank_zero_first(local=True): the launcher ({ident.launcher}) does not say which node this process is "
            "on and how many processes run there (torchrun and srun do). Order each node yourself: "
            "rank_zero_first(<a node-local directory>, world_size=<processes on this node>, rank=<local rank>)"
        )
    if world_size is not None and world_size != ident.local_world_size:
        raise ConfigurationError(
            f"rank_zero_first(local=True, world_size={world_size}): the launcher ({ident.launcher}) runs "
            f"{ident.local_world_size} process(es) on this node (node {ident.node_rank}); leave world_size out"
        )
    return ident.local_world_size


def _agent_store(ident: cluster_identity.ClusterIdentity) -> StoreChannel:
    """torchrun's agent store, where ``rank_zero_first`` is given no directory. A quick connect first: the
    store's own client retries a refused port for its whole timeout and prints C++ frames."""
    address = agent_store_address(os.environ) if ident.launcher == "torchrun" else None
    if address is None:
        raise ConfigurationError(
            f"rank_zero_first() without a directory meets in torchrun's agent store, but this process was "
            f"started by {ident.launcher!r} without one (torchrun sets TORCHELASTIC_USE_AGENT_STORE=True, "
            "MASTER_ADDR and MASTER_PORT); pass a directory every rank shares"
        )
    try:
        socket.create_connection(address, timeout=STORE_PROBE_SECONDS).close()
    except OSError as exc:
        raise ConfigurationError(
            f"rank_zero_first() without a directory: torchrun's agent store {address[0]}:{address[1]} does not "
            f"answer ({exc}); pass a directory every rank shares"
        ) from None
    return StoreChannel(*address)


def _check_world_size(name: str, world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"barrier {name!r}: world_size must be an int >= 1, got {world_size!r}")


def _check_arguments(world_size: int | None, name: str, kwargs: dict[str, Any]) -> None:
    """What :class:`Barrier` refuses, refused before one is made (one process makes none)."""
    keywords = [p.name for p in inspect.signature(Barrier).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(keywords))
    if unknown:
        raise TypeError(f"rank_zero_first() got unexpected keyword arguments {unknown}; it takes {keywords}")
    if world_size is not None:
        _check_world_size(name, world_size)
    for seconds in ("timeout", "poll_max"):
        if kwargs.get(seconds) is not None:
            positive_seconds(f"barrier {name!r}: {seconds}", kwargs[seconds])
