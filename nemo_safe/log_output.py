"""Where nemo_safe's log lines go when the program configured no logging: standard error.

Why: a wait nobody sees looks like a hang. Python drops INFO records where no handler is configured and
prints warnings bare (``logging.lastResort``); a training script started by ``srun`` or ``torchrun``
seldom configures logging, and NeMo removes its own handlers on every rank but 0. So a rank that waited
for another said nothing.

How, never overriding what the program chose:

* The ``nemo_safe`` logger gets one handler, :class:`WhereNothingIsConfigured`, that prints a record only
  where the program configured no handler between its logger and the root (a warning, or an INFO line let
  through by :func:`info`). Once the program configures logging (``logging.basicConfig``, ``dictConfig``,
  a handler on the root or on ``nemo_safe``), its handlers and levels decide, and this one stays quiet: no
  line shows twice and nemo_safe sets no level.
* :func:`info` is how nemo_safe says news a user should see (waits, turned-off patches): a normal INFO
  record where the program enabled INFO for ``nemo_safe``; printed by the fallback where nothing is
  configured, unless the program silenced nemo_safe (a level above INFO on ``nemo_safe``, the root raised
  above its default WARNING, ``logging.disable``).
* A line that cannot be printed (standard error closed, replaced by something that is no text stream) is
  dropped: printing must never fail the job.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["FORMAT", "WhereNothingIsConfigured", "configured_elsewhere", "info", "install", "silenced", "write_line"]

#: The fallback's line: which library, level, time, and which process of which host (a job's lines interleave).
FORMAT = "[nemo_safe %(levelname).1s %(asctime)s %(host)s:%(process)d] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
#: Messages start with this so that they stand out in a foreign format; the fallback's own names the library.
_PREFIX = "nemo_safe: "


class _Formatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(FORMAT, DATE_FORMAT)
        uname = getattr(os, "uname", None)  # not socket: `import nemo_safe` stays cheap (test_import_is_cheap)
        self.host = (uname().nodename if uname else os.environ.get("COMPUTERNAME", "?")).split(".")[0]

    def format(self, record: logging.LogRecord) -> str:
        record.host = self.host
        text = super().format(record)
        head, _, message = text.partition("] ")
        return f"{head}] {message.removeprefix(_PREFIX)}"


def configured_elsewhere(logger: logging.Logger) -> bool:
    """Whether the program put a handler (other than this module's) on ``logger`` or an ancestor it propagates to.
    Reads the loggers without logging's global lock: taking it while a handler's lock is held (in ``emit``)
    deadlocks against ``logging.config.dictConfig``, which takes them the other way round."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, WhereNothingIsConfigured) for h in list(current.handlers)):
            return True
        if not current.propagate:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


class WhereNothingIsConfigured(logging.Handler):
    """Prints to standard error (looked up at each line: a redirect or pytest's capture) the records of loggers
    for which the program configured no handler."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.Logger.manager.loggerDict.get(record.name)  # no lock: see configured_elsewhere
        if isinstance(logger, logging.Logger) and configured_elsewhere(logger):
            return
        write_line(self.format(record))


def write_line(text: str) -> None:
    """``text`` on standard error (looked up now); dropped where it cannot be written (closed, or no text
    stream, or without ``flush``): a line nobody can see must not fail the job."""
    try:
        sys.stderr.write(text + "\n")
        flush = getattr(sys.stderr, "flush", None)
        if flush is not None:
            flush()
    except Exception:
        pass


_FALLBACK = WhereNothingIsConfigured()


def install() -> None:
    """Give ``nemo_safe``'s logger the fallback handler (idempotent); no level is set."""
    logger = logging.getLogger("nemo_safe")
    if not any(isinstance(h, WhereNothingIsConfigured) for h in logger.handlers):
        logger.addHandler(_FALLBACK)


def silenced(logger: logging.Logger) -> bool:
    """The program asked for less than INFO from nemo_safe: a level above it on ``logger`` or an ancestor below
    the root, the root raised above its default (WARNING), or ``logging.disable``."""
    if logging.root.manager.disable >= logging.INFO or logging.root.level > logging.WARNING:
        return True
    current: logging.Logger | None = logger
    while current is not None and current is not logging.root:
        if current.level > logging.INFO:
            return True
        if current.level != logging.NOTSET:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


def info(logger: logging.Logger, message: str, *args: object) -> None:
    """``logger.info(message, *args)`` where the program enabled INFO for it; where the program configured no
    logging at all, printed by the fallback anyway (unless it silenced nemo_safe, see :func:`silenced`)."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, *args)
    elif not configured_elsewhere(logger) and not silenced(logger):
        _FALLBACK.handle(logger.makeRecord(logger.name, logging.INFO, "(nemo_safe)", 0, message, args, None))
