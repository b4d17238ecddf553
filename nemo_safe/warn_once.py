"""One warning per topic and process: a job of thousands of ranks logs a fallback once per rank, not per call."""

from __future__ import annotations

import logging
import threading

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(log: logging.Logger, topic: str, message: str, *args: object) -> None:
    """``log.warning(message, *args)`` unless ``log`` already warned about ``topic`` in this process."""
    with _warned_lock:
        if (log.name, topic) in _warned:
            return
        _warned.add((log.name, topic))
    log.warning(message, *args)


def forget(log: logging.Logger) -> None:
    """Warn again about every topic of ``log`` (tests)."""
    with _warned_lock:
        _warned.difference_update({key for key in _warned if key[0] == log.name})
