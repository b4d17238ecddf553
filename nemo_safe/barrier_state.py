"""The barrier's records read back: rank 0's outcome, whether a state record is one nemo_safe wrote,
and whether a record is this attempt's: by when it was published against when this process started,
and (where the writer shares this host and pid namespace) by whether its process still runs."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from nemo_safe.atomic_files import pid_namespace
from nemo_safe.errors import BarrierTimeout, RankZeroFailed
from nemo_safe.records import has_field_types

#: The session waiters answer with their presence, before rank 0 has opened one.
PRESENCE = "-"


@dataclass(frozen=True)
class Outcome:
    """What rank 0 published when it finished: how its work ended, and its payload."""

    ok: bool
    error_type: str = ""
    error: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    rank0: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Outcome:
        payload = state.get("payload")
        rank0 = state.get("rank0")
        return cls(
            bool(state.get("ok")),
            str(state.get("error_type", "")),
            str(state.get("error", "")),
            payload if isinstance(payload, dict) else {},
            rank0 if isinstance(rank0, dict) else {},
        )

    def raise_if_failed(self, where: str, rank: int) -> None:
        if self.ok:
            return
        who = f"rank 0 (host {self.rank0.get('host')}, pid {self.rank0.get('pid')})"
        if self.error_type == BarrierTimeout.__name__:
            raise BarrierTimeout(f"{where}: {who} gave up: {self.error}")
        raise RankZeroFailed(
            f"{where}: {who} failed while this rank {rank} waited: {self.error_type}: {self.error}. "
            "Fix the cause reported in rank 0's log and restart the job.",
            self.error_type,
            self.error,
        )


def _start_ticks(pid: int | str = "self") -> int | None:
    """A process's start, in clock ticks since boot (Linux), or None when it does not exist (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


#: This boot's pid namespace: pids compare only within one; "" where unknown (nothing is judged gone then).
_PID_NAMESPACE = pid_namespace() or ""


def this_process() -> dict[str, Any]:
    """Who writes a record (host, pid namespace, pid and start): enough for a reader on the same host and
    namespace to tell, without clocks, whether the writer still runs (a pid reused later starts later)."""
    return {"host": socket.gethostname(), "pidns": _PID_NAMESPACE, "pid": os.getpid(), "start": _start_ticks()}


def _same_namespace(record: dict[str, Any]) -> bool:
    ns = record.get("pidns")
    return bool(ns) and ns == _PID_NAMESPACE and record.get("host") == socket.gethostname()


def process_gone(record: dict[str, Any]) -> bool:
    """True only when the record's writer ran on this host and pid namespace and has exited
    (its pid is free or now names a process started at another tick); False where unknown."""
    pid, start = record.get("pid"), record.get("start")
    if not _same_namespace(record) or not isinstance(pid, int) or not isinstance(start, int):
        return False
    return _start_ticks(pid) != start


def is_this_process(record: dict[str, Any]) -> bool:
    """The record was written by this very process (an earlier call of it)."""
    return _same_namespace(record) and record.get("pid") == os.getpid() and record.get("start") == _start_ticks()


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux: from /proc, right after a fork too), else now."""
    try:
        ticks = _start_ticks()
        if ticks is None:
            raise OSError("no /proc")
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return time.time()


#: When this process started. Every process of an earlier attempt with the same key (a torchrun
#: round, an earlier run inside one srun step) was gone before it, so a record published more than
#: CLOCK_SKEW after it is this attempt's, and one published before it is not. Assumes host clocks
#: agree within CLOCK_SKEW (NTP keeps them within milliseconds).
STARTED_AT = _process_start_time()
#: When this *program* started: a wrapper's last command is often exec'd in place of the shell
#: (``bash -c 'python train.py || python train.py'``), so the retry keeps the shell's pid and start,
#: from before the first attempt. Linux keeps no exec time; this thread's CPU time, which the exec
#: does not reset (the shell's part is milliseconds), bounds it: the wall time since the exec is at
#: least the CPU time this thread spent since. Later than the exec (never earlier) when it waited.
PROGRAM_STARTED_AT = max(STARTED_AT, time.time() - time.thread_time())
CLOCK_SKEW = 5.0


def published_since_start(record: dict[str, Any]) -> bool:
    published = record.get("time")
    return isinstance(published, int | float) and published > PROGRAM_STARTED_AT + CLOCK_SKEW


def published_before_start(record: dict[str, Any]) -> bool:
    published = record.get("time")
    return isinstance(published, int | float) and published < STARTED_AT - CLOCK_SKEW


#: Field types of a ``state`` record (absent fields are fine); anything else was not written by nemo_safe.
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "phase": str,
    "session": str,
    "accepted": dict,
    "rejected": dict,
    "accepting": bool,
    "ok": bool,
    "error_type": str,
    "error": str,
    "payload": dict,
    "rank0": dict,
    "time": (int, float),
    "beat": int,
    "world_size": int,
}


def valid_state(state: dict[str, Any]) -> bool:
    """Whether ``state`` has the shape rank 0 publishes (other users can write shared folders)."""
    if state.get("phase") not in ("collect", "done") or not has_field_types(state, _STATE_FIELDS):
        return False
    for table in ("accepted", "rejected"):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in state.get(table, {}).items()):
            return False
    return True


def ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7': keeps error lines short for thousands of ranks."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"
