"""What a waiting process says, and which processes say it: waits visible by default, at a bounded volume.

A wait says three things: once it has lasted :data:`ANNOUNCE_AFTER`, who it waits for, where and why;
every :data:`REPEAT_EVERY`, how long it has waited, whether the awaited process is alive (its heartbeat)
and how long that one may stay silent before this one stops waiting; and, when it ends, that it was
released. A wait of milliseconds (most of them) says nothing.

Volume: local ranks 0 and 1 of each node speak (1 because 0 is often the one that leads and does not
wait); a process that no launcher numbered speaks. At 1,000 nodes of 8 ranks that is at most 2,000
lines per :data:`REPEAT_EVERY`, not 8,000. Warnings are not thinned: each concerns its own rank and is
said once per process (:mod:`nemo_safe.warn_once`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

from nemo_safe import log_output

__all__ = ["ANNOUNCE_AFTER", "REPEAT_EVERY", "WaitLines", "say", "speaks_for_its_node"]

#: A wait says nothing before this many seconds.
ANNOUNCE_AFTER = 1.0
#: Seconds between two "still waiting" lines of one wait.
REPEAT_EVERY = 15.0
#: Where launchers put a process's rank on its node (torchrun and Lightning, SLURM, Open MPI, PMIx, MPICH).
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMIX_LOCAL_RANK",
    "MPI_LOCALRANKID",
)


def speaks_for_its_node(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints its waits: local rank 0 or 1, or no local rank known."""
    env = os.environ if env is None else env
    for name in LOCAL_RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value) <= 1
    return True


def say(log: logging.Logger, message: str, *args: object) -> None:
    """:func:`nemo_safe.log_output.info` where this process speaks for its node (once-per-process news, at scale)."""
    if speaks_for_its_node():
        log_output.info(log, message, *args)


class WaitLines:
    """The lines of one wait. ``waiting`` says it in full, once ("rank 3 waits for rank 0 at /x (rank 0 goes
    first)"), ``short`` in the later lines ("rank 3"); :meth:`tick`'s ``status`` is asked only when a line is due."""

    def __init__(self, log: logging.Logger, waiting: str, short: str = "", speaks: bool | None = None) -> None:
        self.log, self.waiting, self.short = log, waiting, short or waiting
        self.speaks = speaks_for_its_node() if speaks is None else speaks
        self.started = time.monotonic()
        self.announced = False
        self._due = self.started + ANNOUNCE_AFTER

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def tick(self, status: Callable[[], str]) -> None:
        """Called at each poll: says the first line or the next "still waiting" one when it is due."""
        now = time.monotonic()
        if not self.speaks or now < self._due:
            return
        self._due = now + REPEAT_EVERY
        if self.announced:
            log_output.info(self.log, "nemo_safe: %s still waits after %.0f s; %s", self.short, now - self.started,
                            status())  # fmt: skip
        else:
            self.announced = True
            log_output.info(self.log, "nemo_safe: %s; %s", self.waiting, status())

    def released(self, how: str) -> None:
        """The wait ended as the caller hoped (``how``: "rank 0 released it"); said only if it was announced."""
        if self.announced:
            log_output.info(self.log, "nemo_safe: %s: %s after %.1f s", self.short, how, self.elapsed)
