"""Waiting on other processes through a shared filesystem: backoff, progress lines, timeouts.

Polling is the only portable way to wait on NFS, Lustre and GPFS (no inotify,
node-local flock), so it has to be quick when the wait is about to end and
gentle on a shared metadata server when it is not.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time

from nemo_safe.errors import ConfigurationError
from nemo_safe.warn_once import warn_once

log = logging.getLogger("nemo_safe")

DEFAULT_TIMEOUT = 1800.0
TIMEOUT_ENV = "NEMO_SAFE_BARRIER_TIMEOUT"
POLL_MIN = 0.002
POLL_MAX_ENV = "NEMO_SAFE_POLL_MAX"
#: Poll cap of a waiting process: 50 ms for small jobs, growing with the number of processes that may
#: poll one folder so that together they make at most ~2,000 metadata calls/s on its server, at most 1 s.
POLL_MAX_FLOOR, POLL_MAX_CEIL, POLLS_PER_SECOND_BUDGET = 0.05, 1.0, 2000.0
#: The most ``NEMO_SAFE_POLL_MAX`` may ask for: a waiter then learns of a release up to this late.
POLL_MAX_SETTING_CEIL = 10.0
#: :class:`Backoff` pauses 0.75-1.0 x its cap at the cap: the mean interval is this fraction of it.
MEAN_PAUSE_AT_CAP = 0.875


def positive_seconds(what: str, value: object) -> float:
    """``value`` as a finite, positive number of seconds, or :class:`ConfigurationError` naming ``what``.

    NaN and infinity are refused: a NaN poll cap makes every ``min``/``max`` with it NaN, so
    the waits become zero-length sleeps (a busy loop of thousands of polls a second on the shared
    filesystem), and a NaN or infinite timeout never expires. ``bool`` is refused too (``True`` is 1)."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be a positive number of seconds, got {value!r}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what} must be a positive number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{what} must be a finite, positive number of seconds, got {value!r}")
    return seconds


def judge_seconds(raw: str, default: float, minimum: float = 0.0, maximum: float = math.inf) -> tuple[float, str]:
    """A setting's text as seconds, and what is wrong with it ("" when nothing): not a finite, positive number
    gives ``default``; below ``minimum`` or above ``maximum``, the bound. Unset or empty is ``default``."""
    if raw.strip() == "":
        return default, ""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        return default, f"not a finite, positive number of seconds; using the default ({default:g} s)"
    if value < minimum:
        return minimum, f"below its minimum; using {minimum:g} s"
    if value > maximum:
        return maximum, f"above its maximum; using {maximum:g} s"
    return value, ""


def env_seconds(name: str, default: float, minimum: float = 0.0, maximum: float = math.inf) -> float:
    """The environment variable ``name`` as a finite, positive number of seconds; ``default`` when unset or empty.

    Any other value (not a number, NaN, infinity, zero, negative) gives one warning naming the variable
    and its value, and ``default`` is used. A setting must never stop a job, or only those of its ranks
    whose environment has the bad value, least of all work that needs no waiting at all (a complete
    dataset); a NaN cap or timeout is never used (it would busy-poll or never expire). A value below
    ``minimum`` (where smaller ones break the mechanism, e.g. a stale limit shorter than two beats)
    warns once and ``minimum`` is used."""
    raw = os.environ.get(name, "")
    value, problem = judge_seconds(raw, default, minimum, maximum)
    if problem:
        warn_once(log, f"env:{name}={raw}", "nemo_safe: %s=%r is %s. Set a number such as %g, or unset it.", name,
                  raw, problem, default)  # fmt: skip
    return value


def default_timeout() -> float:
    """Seconds to wait for other processes: ``NEMO_SAFE_BARRIER_TIMEOUT`` or 30 minutes."""
    return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def poll_cap(processes: int, calls_per_poll: int = 1) -> float:
    """The poll cap for ``processes`` waiting processes whose one poll makes ``calls_per_poll`` metadata
    calls on the shared server: ``NEMO_SAFE_POLL_MAX``, else scaled (see above) on the mean pause."""
    calls = processes * calls_per_poll / (POLLS_PER_SECOND_BUDGET * MEAN_PAUSE_AT_CAP)
    scaled = min(POLL_MAX_CEIL, max(POLL_MAX_FLOOR, calls))
    return env_seconds(POLL_MAX_ENV, scaled, minimum=POLL_MIN, maximum=POLL_MAX_SETTING_CEIL)


def timeout_or_default(what: str, timeout: object) -> float:
    """A caller's timeout, validated (:func:`positive_seconds`), or :func:`default_timeout` when None."""
    return default_timeout() if timeout is None else positive_seconds(f"{what}: timeout", timeout)


class Backoff:
    """Jittered exponential backoff with a cap: quick when the barrier is about to
    open, gentle on a shared metadata server when it is not."""

    def __init__(self, cap: float, start: float = POLL_MIN, factor: float = 1.6) -> None:
        self.cap, self.start, self.factor = cap, start, factor
        self.reset()

    def reset(self) -> None:
        self._next = self.start

    def set_cap(self, cap: float) -> None:
        """Change the cap; a lower one applies from the next pause."""
        self.cap = cap
        self._next = min(self._next, cap)

    def delay(self, deadline: float) -> float:
        """The next pause, never past ``deadline`` (a ``time.monotonic()`` value)."""
        delay = self._next * random.uniform(0.75, 1.0)
        self._next = min(self.cap, self._next * self.factor)
        return max(0.0, min(delay, deadline - time.monotonic()))

    def sleep(self, deadline: float) -> None:
        # time.sleep is restarted after signal handlers (PEP 475), so SIGUSR1
        # handlers run and SIGTERM still ends the process.
        time.sleep(self.delay(deadline))
