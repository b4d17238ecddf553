"""One process does a shared job in a directory (a dataset download) while the others wait.

Why not the barrier: nobody knows how many processes will build a dataset (not
every rank need build it, a node-local root sees only its node's ranks, and
``mp.spawn`` before ``init_process_group`` knows no ranks at all). So the leader
is whoever first creates ``<dir>/.nemo_safe/<name>.<generation>``: a ``link(2)``
of a unique temporary file, atomic on local disks, NFS, Lustre and GPFS, with
the link count checked against NFS's spurious EEXIST. No file locks.

* The leader re-checks ``done()`` after winning (someone may just have
  finished), runs the job, and rewrites its lock file every second with a
  growing ``beat`` so that waiters can tell it is alive without trusting mtimes
  (GPFS mtimes lag) or clocks of other hosts.
* Success: the lock files are removed; waiters see ``done()`` and return.
  Failure: the lock says ``failed`` with the error, and every process that saw
  that leader running raises :class:`LeaderFailed` with its message. A process
  that only finds an old failure leads a new attempt instead.
* A leader killed with ``kill -9`` is stale when its beat stops for
  ``NEMO_SAFE_STALE_AFTER`` seconds (default 30), or after a few missed beats
  when it ran on this host and its pid is gone. Then the next generation's lock
  is created, again by exactly one process; locks are never stolen by deleting.
* A process known as a preferred leader (rank 0) gets a short head start.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from nemo_safe.atomic_files import pid_alive, publish, read_if_exists, temp_name, unlink_if_exists
from nemo_safe.errors import ConfigurationError, LeaderFailed, WaitTimeout
from nemo_safe.waiting import Backoff, Progress, default_timeout, env_seconds

log = logging.getLogger(__name__)

LOCK_DIRNAME = ".nemo_safe"
STALE_AFTER_ENV = "NEMO_SAFE_STALE_AFTER"
DEFAULT_STALE_AFTER = 30.0
HEARTBEAT = 1.0
#: Missed beats after which a same-host leader whose pid is gone counts as dead.
DEAD_PID_BEATS = 3
#: Head start of the preferred leader when no lock exists yet.
PREFERRED_GRACE = 2.0
POLL_CAP = 0.25


class _Watch:
    """What a waiter has seen of one generation's leader."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.beat: int | None = None
        self.changed_at = time.monotonic()
        self.saw_running = False

    def observe(self, info: dict[str, Any]) -> None:
        if info.get("state") == "running":
            self.saw_running = True
        if info.get("beat") != self.beat:
            self.beat = info.get("beat")
            self.changed_at = time.monotonic()

    def frozen_for(self) -> float:
        return time.monotonic() - self.changed_at


class SingleFlight:
    """``run()`` in every process; the job runs once per directory at a time."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str,
        *,
        what: str | None = None,
        preferred: bool | None = None,
        timeout: float | None = None,
        stale_after: float | None = None,
    ) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.lock_dir = os.path.join(self.directory, LOCK_DIRNAME)
        self.name = name
        self.what = what or f"{name} in {self.directory}"
        self.preferred = preferred
        self.timeout = default_timeout() if timeout is None else timeout
        self.stale_after = env_seconds(STALE_AFTER_ENV, DEFAULT_STALE_AFTER) if stale_after is None else stale_after
        self.host = socket.gethostname()
        self.nonce = os.urandom(8).hex()
        #: True when this process ran the job (tests and the demo report it).
        self.led = False

    # -- lock files ---------------------------------------------------------------

    def _lock_name(self, generation: int) -> str:
        return f"{self.name}.{generation}"

    def _generations(self) -> list[int]:
        try:
            names = os.listdir(self.lock_dir)
        except FileNotFoundError:
            return []
        prefix = self.name + "."
        return sorted(int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit())

    def _read(self, generation: int) -> dict[str, Any] | None:
        raw = read_if_exists(os.path.join(self.lock_dir, self._lock_name(generation)))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"state": "unreadable"}

    def _info(self, state: str, beat: int, **extra: Any) -> bytes:
        body = {"state": state, "beat": beat, "host": self.host, "pid": os.getpid(), "nonce": self.nonce, **extra}
        return json.dumps(body).encode()

    def _make_lock_dir(self) -> None:
        try:
            os.makedirs(self.lock_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"{self.what}: cannot create {self.lock_dir} ({exc.strerror}). The data is missing or invalid and "
                "must be written there: make the root writable, or download once with write access and "
                "point the job at the finished copy."
            ) from exc

    def _try_lead(self, generation: int) -> bool:
        """Create this generation's lock; True when this process won it."""
        final = os.path.join(self.lock_dir, self._lock_name(generation))
        for _ in range(20):
            self._make_lock_dir()
            tmp = os.path.join(self.lock_dir, temp_name(self._lock_name(generation)))
            try:
                with open(tmp, "xb") as fh:
                    fh.write(self._info("running", 0))
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    # NFS may report EEXIST for a link whose first reply was lost: the link count tells.
                    return os.stat(tmp).st_nlink == 2
                return True
            except FileNotFoundError:
                continue  # the lock directory was removed under us by a finishing leader: recreate it
            finally:
                unlink_if_exists(tmp)
        raise ConfigurationError(f"{self.what}: {self.lock_dir} keeps disappearing; is something deleting it?")

    def _is_stale(self, info: dict[str, Any], watch: _Watch) -> bool:
        if info.get("state") not in ("running", "unreadable"):
            return False
        frozen = watch.frozen_for()
        if frozen >= self.stale_after:
            return True
        if info.get("host") != self.host or frozen < DEAD_PID_BEATS * HEARTBEAT:
            return False
        try:
            pid = int(info.get("pid", 0))
        except (TypeError, ValueError):
            return False
        return not pid_alive(pid)

    # -- the leader ----------------------------------------------------------------

    def _lead(self, generation: int, job: Callable[[], None], done: Callable[[], bool]) -> None:
        self.led = True
        name = self._lock_name(generation)
        stop = threading.Event()
        beat = [0]

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT):
                beat[0] += 1
                try:
                    publish(self.lock_dir, name, self._info("running", beat[0]))
                except OSError as exc:
                    log.warning("nemo_safe: %s: heartbeat failed: %s", self.what, exc)

        thread = threading.Thread(target=heartbeat, daemon=True, name=f"nemo_safe-heartbeat-{self.name}")
        thread.start()
        try:
            if not done():
                log.info("nemo_safe: %s: this process (pid %d) does it; others wait", self.what, os.getpid())
                job()
        except Exception as exc:
            stop.set()
            thread.join()
            try:
                failed = self._info("failed", beat[0] + 1, error_type=type(exc).__name__, error=str(exc))
                publish(self.lock_dir, name, failed)
            except OSError as publish_error:  # e.g. the same full disk: waiters then see a dead leader instead
                log.warning("nemo_safe: %s: could not record the failure for the others: %s", self.what, publish_error)
            raise
        except BaseException:
            # Interrupted (SIGTERM, Ctrl-C): not a verdict on the job, so let another process take over.
            stop.set()
            thread.join()
            unlink_if_exists(os.path.join(self.lock_dir, name))
            raise
        stop.set()
        thread.join()
        publish(self.lock_dir, name, self._info("done", beat[0] + 1))
        for g in self._generations():
            if g <= generation:
                unlink_if_exists(os.path.join(self.lock_dir, self._lock_name(g)))
        try:
            os.rmdir(self.lock_dir)
        except OSError:
            pass  # another job's lock, or a process about to lead: not ours to remove

    # -- everyone ------------------------------------------------------------------

    def run(self, job: Callable[[], None], done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, having run ``job`` here or waited for the process that did."""
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(POLL_CAP, start=0.01)
        progress = Progress()
        grace_until = None if self.preferred is not False else time.monotonic() + PREFERRED_GRACE
        watch: _Watch | None = None
        while True:
            if done():
                return
            generations = self._generations()
            if not generations:
                if grace_until is not None and time.monotonic() < grace_until:
                    backoff.sleep(grace_until)
                    continue
                if self._try_lead(0):
                    return self._lead(0, job, done)
                continue
            current = generations[-1]
            info = self._read(current)
            if info is None:
                backoff.sleep(deadline)  # removed by a finishing leader just now
                continue
            if watch is None or watch.generation != current:
                watch = _Watch(current)
            watch.observe(info)
            state = info.get("state")
            if state == "failed" and watch.saw_running:
                raise LeaderFailed(
                    f"{self.what} failed in the process that did it for this one (host {info.get('host')}, "
                    f"pid {info.get('pid')}): {info.get('error_type')}: {info.get('error')}",
                    str(info.get("error_type", "")),
                    str(info.get("error", "")),
                )
            if state == "failed" or state == "done" or self._is_stale(info, watch):
                # An earlier attempt's failure, a leader whose job did not cover this process,
                # or a dead leader: one process starts the next generation.
                if state not in ("failed", "done"):
                    log.warning(
                        "nemo_safe: %s: the process doing it (host %s, pid %s) stopped answering for %.0f s; "
                        "taking over",
                        self.what,
                        info.get("host"),
                        info.get("pid"),
                        watch.frozen_for(),
                    )
                if state == "done" and done():
                    return
                if self._try_lead(current + 1):
                    return self._lead(current + 1, job, done)
                continue
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.what}: waited {self.timeout:.0f} s for the process doing it (host {info.get('host')}, "
                    f"pid {info.get('pid')}), which is still alive. Raise NEMO_SAFE_BARRIER_TIMEOUT for slow "
                    f"downloads, or check that process; its lock is {self.lock_dir}."
                )
            if progress.due():
                log.info(
                    "nemo_safe: %s: waiting %.0f s for host %s pid %s",
                    self.what,
                    progress.elapsed,
                    info.get("host"),
                    info.get("pid"),
                )
            backoff.sleep(deadline)
