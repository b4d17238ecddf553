"""Order a NeMo start-up step with nemo_safe's barrier: global rank 0 first, everyone after it, rank 0's ``log_dir``.

Since 2026-12-05 ``exp_manager`` itself is ordered by the upstream pull request's code
(:mod:`~nemo_safe.patches.nemo_resume_core`); it uses only :func:`launcher_agrees` from here.
:class:`ResumeOrder` orders NeMo 2.x's ``NeMoLogger.setup`` (:mod:`~nemo_safe.patches.nemo_logger_order`),
which the upstream series does not change. What follows describes it as written for ``exp_manager``.

Upstream, ``get_log_dir`` gives global rank 0 a fresh version (a date, or
TensorBoard's ``version_N``) and the other ranks, which it did not spawn, none;
then ``check_resume`` lets rank 0 move the old files of its ``log_dir`` into
``run_N/`` while the others already read theirs, and non-zero ranks sleep a
fixed ``seconds_to_sleep`` (NeMo #7460, #9952, PR #8604). Here, one
:class:`~nemo_safe.barrier.Barrier` per ``exp_manager`` call:

* **Where ranks meet** is decided only by what every rank of the attempt has
  equal: under torchrun the elastic agent's store (``MASTER_ADDR:MASTER_PORT``),
  which every worker reaches before ``init_process_group`` whatever disk each
  node logs to; elsewhere (srun, mpirun) the hidden ``.nemo_safe/`` of the
  *meeting directory*, ``exp_dir/name`` (or ``explicit_log_dir``): the part of
  ``log_dir`` that does not depend on the version, under a key from the job and
  step ids.
* **Rank 0 never waits**: it opens the barrier, runs ``check_resume`` (lookup
  and move) and publishes its outcome and its ``log_dir``; ranks that arrive
  later are accepted in the background.
* **The others wait for rank 0 only**, then return rank 0's ``log_dir`` (the
  same on every rank) and run ``check_resume``'s lookup. If rank 0 failed, they
  run it too, so that they raise NeMo's own error where NeMo would; otherwise
  they raise :class:`~nemo_safe.errors.RankZeroFailed`.
* **Never worse than upstream**: in a directory or the store alike, a rank that
  has seen no sign of rank 0 within ``seconds_to_sleep`` (the wait upstream
  promises) and does not see every *other* rank there either is probably not
  meeting rank 0 there (node-local disks, another working directory, a store
  only some ranks reached): it carries on exactly as upstream does, with one
  warning. With two ranks no other rank can vouch for a late rank 0, so rank 1
  always does so after that grace. Where every other rank is present, rank 0 is
  taken for late and waited for up to 120 s more (the one wait longer than
  upstream's for nothing, where rank 0 alone meets elsewhere). So does every rank where NeMo and the
  launcher disagree on which process is rank 0, or the trainer's
  ``num_nodes x devices`` on the number of processes.
* **Where ranks meet is each rank's own probe of the store** (2 s connect), which
  two ranks may answer differently; the grace above is what makes that safe.
  Rank 0 waits at most for that probe and the store client's connect (2 s each)
  when ``MASTER_ADDR:MASTER_PORT`` does not answer or is not a store.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_safe import cluster_identity
from nemo_safe import warn_once as once
from nemo_safe.barrier import Barrier
from nemo_safe.barrier_channels import Channel, FileChannel, StoreChannel, agent_store_address
from nemo_safe.errors import ConfigurationError, RankZeroAbsent, RankZeroFailed, RankZeroStalled
from nemo_safe.thread_progress import PROGRESS_LIMIT

log = logging.getLogger(__name__)

BARRIER_NAME = "exp_manager"


def warn_once(topic: str, message: str, *args: Any) -> None:
    """One warning per topic and process (:func:`nemo_safe.warn_once.warn_once` on this module's logger)."""
    once.warn_once(log, topic, message, *args)


def meeting_dir(log_dir_parts: tuple[Any, ...], explicit_log_dir: Any) -> str:
    """The part of ``log_dir`` every rank computes alike: ``explicit_log_dir``, else ``exp_dir/name``."""
    log_dir, exp_dir, name = log_dir_parts[:3]
    base = Path(log_dir) if explicit_log_dir else Path(exp_dir) / str(name or "")
    return os.path.abspath(base)


@dataclass
class ResumeOrder:
    """One ordered call of one rank (NeMoLogger's ``setup``): set up by :func:`resume_order_for`."""

    ident: cluster_identity.ClusterIdentity
    #: How long the other ranks wait for a sign of rank 0 before carrying on as upstream.
    grace: float
    store: tuple[str, int] | None
    barrier: Barrier | None = None
    payload: dict[str, Any] | None = None
    rank0_failure: RankZeroFailed | None = None
    #: What is being ordered, as messages name it (``nemo_logger_order`` reuses this class for NeMoLogger).
    what: str = "exp_manager"
    #: The barrier's name: the records of two ordered calls never mix.
    barrier_name: str = BARRIER_NAME

    # -- get_log_dir: where ranks meet, and rank 0's log_dir for everyone -----------------

    def agree_log_dir(self, own: tuple[Any, ...], explicit_log_dir: Any) -> tuple[Any, ...]:
        """Rank 0 opens the barrier and keeps ``own``; the others wait and return rank 0's parts."""
        meet = meeting_dir(own, explicit_log_dir)
        barrier = self.meeting_barrier(meet)
        if self.ident.rank == 0:
            barrier.open()
            self.barrier = barrier
            log_dir, exp_dir, name, version = own
            self.payload = {
                "meeting_dir": meet,
                "log_dir": str(log_dir),
                "exp_dir": exp_dir,
                "name": name,
                "version": version,
            }
            return own
        try:
            outcome = barrier.wait(grace=self.grace, stall_limit=PROGRESS_LIMIT)
        except RankZeroStalled as exc:
            warn_once(self._topic("stalled"), "%s: %s Carrying on as upstream NeMo does (log_dir %s, no ordering "
                      "with rank 0's move); check rank 0's filesystem.", self.what, exc, own[0])  # fmt: skip
            return own
        except RankZeroAbsent as exc:
            warn_once(
                self._topic("absent"),
                "%s: %s Carrying on as upstream NeMo does (log_dir %s, no ordering with rank 0's move). "
                "Expected when log_dir is on a node-local disk; otherwise give every rank the same exp_dir.",
                self.what,
                exc,
                own[0],
            )
            return own
        except RankZeroFailed as exc:
            self.rank0_failure = exc
            return own
        theirs = outcome.payload
        if theirs.get("meeting_dir") != meet:
            warn_once(
                self._topic("elsewhere"),
                "%s: rank %d computed its log_dir under %s but rank 0 under %s (another exp_dir, name or "
                "working directory); each keeps its own, as upstream NeMo does.",
                self.what,
                self.ident.rank,
                meet,
                theirs.get("meeting_dir"),
            )
            return own
        return Path(theirs["log_dir"]), theirs["exp_dir"], theirs["name"], theirs["version"]

    def meeting_barrier(self, meet: str) -> Barrier:
        """This call's barrier: in the torchrun agent's store if it answers, else in ``meet``'s hidden directory."""
        channel: Channel | None = None
        if self.store is not None:
            try:
                channel = StoreChannel(*self.store, connect_timeout=STORE_PROBE_SECONDS)
            except Exception as exc:  # any failure to reach the store means: meet in the directory
                _store_reachable[self.store] = False
                where = ":".join(map(str, self.store))
                warn_once(self._topic("store"), "%s: no torchrun agent store at %s (%s); meeting in %s", self.what,
                          where, exc, meet)  # fmt: skip
                self.store = None
        if channel is None:
            self._check_meeting_dir(meet)
            channel = FileChannel(meet)
        return Barrier(
            channel,
            self.ident.world_size,
            self.barrier_name,
            rank=self.ident.rank,
            attempt_key=self.ident.attempt_key,
            attempt_unique=self.ident.attempt_unique,
            # The hidden directory stays: removing it would make an entry vanish under ranks listing log_dir.
            keep_parent=True,
        )

    def _check_meeting_dir(self, meet: str) -> None:
        if os.path.isdir(meet) and not os.access(meet, os.W_OK):
            raise ConfigurationError(
                f"{self.what}: {meet} is not writable from rank {self.ident.rank}; rank 0 must move old "
                "files there and every rank writes logs there. Fix its permissions or choose another exp_dir."
            )
        try:
            os.makedirs(meet, exist_ok=True)  # exp_manager creates log_dir below it right after anyway
        except OSError as exc:
            raise ConfigurationError(
                f"{self.what}: rank {self.ident.rank} cannot create {meet} ({exc}); every rank writes logs "
                "there. Fix the path or its permissions, or choose another exp_dir."
            ) from exc

    def _topic(self, topic: str) -> str:
        """exp_manager's warning topics as before; another user's of its own (one warning each per process)."""
        return topic if self.what == "exp_manager" else f"{self.what}:{topic}"

    # -- the work: rank 0's first, then everyone's ------------------------------------------

    def run(self, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Rank 0 runs ``work`` and publishes how it ended; the others (after :meth:`agree_log_dir`
        waited for that) run it too and raise rank 0's failure after NeMo's own error, if any."""
        barrier, self.barrier = self.barrier, None
        if barrier is not None:
            try:
                result = work(*args, **kwargs)
            except BaseException as exc:
                barrier.release(exc, self.payload)
                raise
            barrier.release(None, self.payload)
            return result
        result = work(*args, **kwargs)  # NeMo's own error first, where rank 0's was the same
        if self.rank0_failure is not None:
            raise self.rank0_failure
        return result


def launcher_agrees(
    trainer: Any, is_global_rank_zero: Callable[[], bool], what: str = "exp_manager"
) -> cluster_identity.ClusterIdentity | None:
    """This process's place in the job where ordering ``what`` is safe: a multi-process launcher that agrees
    with NeMo on rank 0 and with the trainer on the world size. None to leave it to upstream: one process,
    no launcher, or a configuration nemo_safe cannot order safely (one warning says which)."""

    def topic(name: str) -> str:
        return name if what == "exp_manager" else f"{what}:{name}"

    try:
        ident = cluster_identity.detect()
    except ConfigurationError as exc:
        warn_once(topic("launcher"), "%s: launcher variables unusable (%s); running as upstream NeMo does", what, exc)
        return None
    if ident.launcher == "none" or not ident.is_multi_process or int(trainer.num_nodes) * int(trainer.num_devices) == 1:
        return None  # one process, or independent one-device tasks of one step (a sweep): nothing to order
    try:
        ident.validate_settings(trainer.num_devices, trainer.num_nodes)
    except ConfigurationError as exc:
        warn_once(topic("world"), "%s: %s. Until then nemo_safe cannot tell which ranks to wait for; running as "
                  "upstream NeMo does.", what, exc)  # fmt: skip
        return None
    if is_global_rank_zero() != (ident.rank == 0):
        warn_once(
            topic("rank0"),
            "%s: NeMo's is_global_rank_zero() and the %s launcher (rank %d) disagree on which process "
            "is rank 0; running as upstream NeMo does (export RANK to make them agree).",
            what,
            ident.launcher,
            ident.rank,
        )
        return None
    return ident


def resume_order_for(
    trainer: Any,
    is_global_rank_zero: Callable[[], bool],
    grace: float,
    what: str = "exp_manager",
    barrier_name: str = BARRIER_NAME,
) -> ResumeOrder | None:
    """How to order this NeMo start-up step (named ``what``), or None to leave it to upstream
    (:func:`launcher_agrees`)."""
    ident = launcher_agrees(trainer, is_global_rank_zero, what)
    if ident is None:
        return None
    store = agent_store_address(os.environ) if ident.launcher == "torchrun" else None
    if store is not None and not _store_answers(store):
        warn_once(f"{what}:store", "%s: torchrun's agent store %s:%s does not answer; meeting in exp_dir", what,
                  *store)  # fmt: skip
        store = None
    return ResumeOrder(ident, grace, store, what=what, barrier_name=barrier_name)


_store_reachable: dict[tuple[str, int], bool] = {}
STORE_PROBE_SECONDS = 2.0


def _store_answers(address: tuple[str, int]) -> bool:
    """A quick TCP connect, once per process: TCPStore's own client retries for many seconds."""
    if address not in _store_reachable:
        try:
            socket.create_connection(address, timeout=STORE_PROBE_SECONDS).close()
            _store_reachable[address] = True
        except OSError:
            _store_reachable[address] = False
    return _store_reachable[address]
