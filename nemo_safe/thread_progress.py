"""Whether one thread of this process advanced since the last look: liveness as progress, not presence.

Why: a process that exists is not necessarily working. A thread blocked in ``recv`` on a half-open
socket (``urlopen`` has no timeout), or in a hung NFS call, never returns, while the process's other
threads (a heartbeat) carry on. Whoever waits for its work must see that the *working* thread is
stuck, without knowing what it does.

How: a thread that works changes at least one of these every second, a stuck one none:

* its I/O counters (``/proc/self/task/<tid>/io``: bytes and calls of reads and writes): a download,
  an md5 pass, an extraction;
* its CPU time (``/proc/self/task/<tid>/stat``: utime + stime): any computation;
* its voluntary context switches (``/proc/self/task/<tid>/status``): a loop that sleeps or polls
  between steps (each sleep is a switch), where a blocked call is one switch and then nothing;
* its Python position (``sys._current_frames()``: the innermost frame's code object and
  instruction): a Python loop.

Where /proc is missing (not Linux) or a file of it is, the other measures do; the Python
position always exists. A thread waiting for a child process (``subprocess.run``) shows no
progress of its own: judged stuck, which costs the waiters running the work themselves, as
they would without nemo_safe.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["PROGRESS_LIMIT", "ThreadProgress"]

#: Seconds a beating process's work may show no progress (no I/O, no CPU, no sleep ended, no Python step)
#: before those waiting for it carry on as without nemo_safe (a download leader's waiters download
#: themselves; exp_manager's ranks stop waiting for rank 0). A download, an md5 pass, an extraction or a
#: loop of file moves advances every second; 10 s without any of it is a call that will not return (a
#: half-open socket, a hung NFS call), or one that costs little to double (a slow first byte).
PROGRESS_LIMIT = 10.0

_IO_FIELDS = (b"rchar", b"wchar", b"syscr", b"syscw")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def _io_counters(raw: bytes) -> tuple[bytes, ...]:
    values = dict(line.split(b":", 1) for line in raw.splitlines() if b":" in line)
    return tuple(values.get(name, b"").strip() for name in _IO_FIELDS)


def _cpu_time(raw: bytes) -> tuple[bytes, ...]:
    fields = raw.rsplit(b")", 1)[-1].split()
    return tuple(fields[11:13])  # utime, stime (fields 14 and 15 of proc(5), counted after the name)


def _switches(raw: bytes) -> tuple[bytes, ...]:
    return tuple(line for line in raw.splitlines() if line.startswith(b"voluntary_ctxt_switches"))


class ThreadProgress:
    """``ThreadProgress(thread)``, then ``advanced()`` once in a while (from any thread): True when
    ``thread`` did any I/O, used CPU, switched voluntarily or moved in its Python code since the
    previous call (or since construction)."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        thread = thread or threading.current_thread()
        self.ident = thread.ident
        task = f"/proc/self/task/{thread.native_id}"
        sources = ((f"{task}/io", _io_counters), (f"{task}/stat", _cpu_time), (f"{task}/status", _switches))
        #: The /proc files this sampler reads (the readable ones at construction), with their parsers.
        self.sources = [(path, parse) for path, parse in sources if _read(path) is not None]
        self._last = self._sample()

    def _position(self) -> tuple[int, int] | None:
        frame = sys._current_frames().get(self.ident)  # type: ignore[arg-type]
        return None if frame is None else (id(frame.f_code), frame.f_lasti)

    def _sample(self) -> tuple[object, ...]:
        counters = []
        for path, parse in self.sources:
            raw = _read(path)
            counters.append(None if raw is None else parse(raw))
        return (*counters, self._position())

    def advanced(self) -> bool:
        """Whether the thread advanced since the last call."""
        now = self._sample()
        changed, self._last = now != self._last, now
        return changed
