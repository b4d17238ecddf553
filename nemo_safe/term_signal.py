"""Give up shared work at once when SIGTERM kills this process, then die of it exactly as without nemo_safe.

Why: ``scancel``, preemption and torchrun's teardown send SIGTERM, and by default Python dies of it
running no clean-up: a download leader's lock would still say "running" (the others would wait the
stale limit for it, on other hosts) and its temporary file, up to a whole archive, would stay a day.

While :func:`released_on_sigterm` blocks are open in the main thread and SIGTERM's handler is the
default (``SIG_DFL``), a handler is installed that runs their release callbacks (a lock marked
abandoned), removes this process's own temporaries
(:func:`~nemo_safe.atomic_files.remove_own_temps`), restores ``SIG_DFL`` and sends SIGTERM to
this process again: it dies of the signal, its exit status is upstream's. The last block to close
restores ``SIG_DFL``. Where the handler is a Python callable (Lightning's, the user's), ``SIG_IGN``,
or the block opens in another thread, nothing is installed: an exception such a handler raises
unwinds through the block like any other.

Python runs a handler once the main thread is back in the interpreter: a blocking read, a sleep,
a wait are interrupted at once (EINTR); a long computation in C that holds the interpreter delays
the exit until it returns.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from nemo_safe.atomic_files import remove_own_temps

__all__ = ["released_on_sigterm"]

_releases: dict[int, Callable[[], None]] = {}
_keys = itertools.count()
#: The process whose leads :data:`_releases` holds: a forked child inherits the handler and the
#: table, but a child that gets SIGTERM (``Process.terminate()``) must not give up its parent's lead.
_installed_by: list[int] = []


def _on_sigterm(signum: int, frame: Any) -> None:
    if _installed_by != [os.getpid()]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked child: die of it, as without nemo_safe
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for release in list(_releases.values()):
        try:
            release()
        except Exception:  # dying anyway: the others then find the lock stale
            pass
    _releases.clear()
    remove_own_temps()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install() -> bool:
    """Whether this thread may (and now does) handle SIGTERM for the open blocks."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    if handler is _on_sigterm:
        if _installed_by != [os.getpid()]:  # a forked child leading a flight of its own: not its parent's
            _releases.clear()
            _installed_by[:] = [os.getpid()]
        return True
    if handler is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed_by[:] = [os.getpid()]
    return True


@contextlib.contextmanager
def released_on_sigterm(release: Callable[[], None]) -> Iterator[bool]:
    """Run ``release`` (and remove this process's temporaries) if SIGTERM kills the process inside the
    block; yields whether that is so (False: another handler, or not the main thread)."""
    if not _install():
        yield False
        return
    key = next(_keys)
    _releases[key] = release
    try:
        yield True
    finally:
        _releases.pop(key, None)
        if not _releases and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
