"""Exceptions raised by nemo_safe.

Every error says what happened, which ranks / paths were involved and what to
do, because the user usually reads it in one of hundreds of job log files.
"""

from __future__ import annotations


class NemoSafeError(RuntimeError):
    """Base class of every error nemo_safe raises."""


class ConfigurationError(NemoSafeError, ValueError):
    """Bad input or an inconsistent launcher / trainer configuration."""


class UnsafeBarrierPath(NemoSafeError):
    """Something other than a plain directory sits where the barrier directory belongs."""


class BarrierTimeout(NemoSafeError, TimeoutError):
    """A barrier did not complete within its timeout (missing ranks, or rank 0 never finished)."""


class RankZeroAbsent(NemoSafeError):
    """Rank 0 never showed up within the grace and not every other rank is present either
    (or they were, and rank 0 did not come within 120 s more, or by the timeout): the ranks
    probably do not share the barrier's directory. Callers that can do without the barrier
    (NeMo's exp_manager) carry on as upstream does."""


class RankZeroStalled(RankZeroAbsent):
    """Rank 0 is alive (it beats) but its work has not advanced for the progress limit: it is stuck in a
    call that will not return (a hung filesystem call). Callers that can do without the barrier
    (NeMo's exp_manager) carry on as upstream does instead of waiting for it without end."""


class RemoteFailure(NemoSafeError):
    """Another process's work failed, and this process waited for it: raised here with that
    process's exception type name and text (``remote_type``, ``remote_message``; both survive
    pickling, so a multiprocessing parent gets them back from a child)."""

    def __init__(self, message: str, remote_type: str = "", remote_message: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message


class RankZeroFailed(RemoteFailure):
    """Rank 0's work inside a barrier raised; re-raised on every other rank."""


class LeaderFailed(RemoteFailure):
    """The process that did a shared job (a dataset download) for the others failed;
    raised in every process that was waiting for it, with the leader's message."""


class LeaderDeposed(NemoSafeError):
    """Raised inside a shared job whose process was stalled so long that another process
    took the job over; the stalled one stops before publishing anything and waits instead."""


class WaitTimeout(NemoSafeError, TimeoutError):
    """A process waited longer than its timeout for another process's shared job."""


class UnsafeArchivePath(NemoSafeError, OSError):
    """An archive member, or a symlink already in the destination, would have an extraction
    write outside the destination folder. Nothing was written there. An ``OSError`` like the
    errors of upstream's extraction, so callers catching those still do."""
