"""Where nemo_safe's log lines go when the program configured no logging: standard error.

Why: a wait nobody sees looks like a hang. Python drops INFO records where no handler is configured and
prints warnings bare (``logging.lastResort``); a training script started by ``srun`` or ``torchrun``
seldom configures logging, and NeMo removes its own handlers on every rank but 0. So a rank that waited
for another said nothing.

How: the ``nemo_safe`` logger gets level INFO (unless the program set one) and one handler,
:class:`WhereNothingIsConfigured`, that prints a record only if no other handler on its way up to the
root would take it. Once the program configures logging (``logging.basicConfig``, a handler on the root
or on ``nemo_safe``), its handlers print nemo_safe's lines in its format and this one stays quiet: no
line shows twice. ``logging.getLogger("nemo_safe").setLevel(logging.WARNING)`` keeps only warnings.
How many processes print a wait is bounded by :mod:`nemo_safe.wait_lines`.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["FORMAT", "WhereNothingIsConfigured", "install"]

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


class WhereNothingIsConfigured(logging.Handler):
    """Prints to standard error (looked up at each line: a redirect or pytest's capture) the records that no
    other handler between their logger and the root would take."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        if self._taken_elsewhere(record):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)

    def _taken_elsewhere(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent  # type: ignore[assignment]
        return False


def install() -> None:
    """Give ``nemo_safe``'s logger the fallback handler and level INFO where the program set no level (idempotent)."""
    logger = logging.getLogger("nemo_safe")
    if not any(isinstance(h, WhereNothingIsConfigured) for h in logger.handlers):
        logger.addHandler(WhereNothingIsConfigured())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
