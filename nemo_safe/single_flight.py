"""One process does a shared job in a directory (a dataset download) while the others wait.

Why not the barrier: nobody knows how many processes will build a dataset (not
every rank need build it, a node-local root sees only its node's ranks, and
``mp.spawn`` before ``init_process_group`` knows no ranks at all). So the leader
is whoever first creates ``<dir>/.nemo_safe/<name>.<generation>``: a ``link(2)``
of a unique temporary file, atomic on local disks, NFS, Lustre and GPFS, with
the link count checked against NFS's spurious EEXIST. Where the filesystem has
no hard links (gcsfuse, s3fs, blobfuse, FAT, some NFS exports), an exclusive
create of the same name (``O_EXCL``: atomic and retransmit-safe on NFSv3+,
whose exclusive create carries a verifier) elects the leader instead. No file locks.

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
  when it ran on this host, in this pid namespace, and its pid is gone. Silence
  is counted only across this waiter's own successful, timely reads: its own
  stall or failed reads (an NFS failover) are not the leader's silence. Then the
  next generation's lock is created, again by exactly one process; locks are
  never stolen by deleting.
* A leader that was only slow (stopped, swapped out) and finds a newer
  generation is *deposed*: :func:`check_still_leading`, called before anything
  is published (the torchvision patches do), raises :class:`LeaderDeposed`; its
  job's error is then not published, and it waits for the new leader instead.
* Waiters time out on silence, not on work: every new beat restarts their
  timeout, so a slow download is never reported as a hung one.
* Files in the lock folder that nemo_safe cannot have written (other users can
  write shared folders) are ignored with a warning, never trusted.
* A process known as a preferred leader (rank 0) gets a short head start.

``run(job, done)`` runs the job; :meth:`SingleFlight.hold` is the same as a context
manager (the leader runs the ``with`` block, the others come out of ``__enter__``
once ``done()`` holds): the MNIST overlay uses it in place of upstream torchvision's
``_download_lock``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nemo_safe.atomic_files import (
    listdir_if_exists,
    pid_alive,
    pid_namespace,
    publish,
    read_if_exists,
    temp_name,
    unlink_if_exists,
)
from nemo_safe.errors import ConfigurationError, LeaderDeposed, LeaderFailed, WaitTimeout
from nemo_safe.waiting import Backoff, Progress, default_timeout, env_seconds, positive_seconds

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
#: A waiter's own pause between two successful reads longer than this (or than a third of the
#: stale limit): its stall, or reads that failed, restart its count of the leader's silence.
OWN_STALL = 5.0
#: What ``link(2)`` answers on filesystems without hard links.
NO_LINK_ERRNOS = frozenset(
    e for e in (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None), errno.EXDEV) if e
)
STATES = ("running", "failed", "done")
#: Reading a lock-folder entry failed because it is no lock nemo_safe wrote (not a failing server).
_NOT_A_LOCK_ERRNOS = frozenset((errno.EISDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO))
#: Field types of a lock file; anything else was not written by nemo_safe.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"beat": int, "host": str, "pid": int, "nonce": str}
_UNREADABLE: dict[str, Any] = {"state": "unreadable"}

_leading = threading.local()
#: Lock folders whose filesystem refused a hard link (asked once per process and folder).
_NO_LINKS: dict[str, bool] = {}


def lock_folder_usable(directory: str) -> bool:
    """Whether ``directory`` exists and its lock folder exists or can be created, and this process may
    create and list entries in it. A patch calls upstream's code instead where it is not (a read-only
    root, another user's lock folder left by a failure): waiting on a lock it cannot take or read
    could only fail or hang where upstream completes."""
    if not os.path.isdir(directory):
        return False  # upstream fails there (or creates it); nemo_safe creates no folders for it
    lock_dir = os.path.join(directory, LOCK_DIRNAME)
    # Nothing is created here: a process that finds the work done must leave no lock folder behind.
    where = lock_dir if os.path.isdir(lock_dir) else directory
    if not os.access(where, os.W_OK | os.X_OK | os.R_OK):  # also False on a read-only mount
        log.debug("nemo_safe: cannot create entries in %s; running as upstream does", where)
        return False
    return True


def run_else_upstream(flight: SingleFlight, job: Callable[[], None], done: Callable[[], bool]) -> bool:
    """``flight.run(job, done)`` for a patch whose ``job`` is upstream's own code; where the lock folder
    refuses this process before it was elected (it vanished for good, or the filesystem refused a write
    the permission bits allowed), ``job`` runs here unordered, as upstream. Whether ``job`` ran here."""
    started = False

    def run_job() -> None:
        nonlocal started
        started = True
        job()

    try:
        flight.run(run_job, done)
    except (ConfigurationError, PermissionError) as exc:
        if started:
            raise
        log.debug("nemo_safe: %s: cannot lock (%s); running as upstream does", flight.what, exc)
        job()
        return True
    return started


def check_still_leading() -> None:
    """Raise :class:`LeaderDeposed` when the calling thread leads a flight that another
    process has taken over (this one was stalled past the stale limit). Call it before
    publishing or deleting anything inside a job; outside a job it does nothing."""
    flight: SingleFlight | None = getattr(_leading, "flight", None)
    if flight is not None:
        flight._check_not_deposed()


def _validated(info: Any) -> dict[str, Any] | None:
    """A lock file's content as nemo_safe writes it, or None."""
    if not isinstance(info, dict) or info.get("state") not in STATES:
        return None
    for key, kind in _FIELD_TYPES.items():
        value = info.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
    return info


class _Watch:
    """What a waiter has seen of one generation's leader. Silence is counted between this
    waiter's own successful reads only, so its own stalls never look like the leader's."""

    def __init__(self, generation: int, stale_after: float) -> None:
        self.generation = generation
        self.own_stall = min(OWN_STALL, stale_after / 3)
        self.beat: Any = None
        self.changed_at = time.monotonic()
        self.read_at = self.changed_at
        self.saw_running = False

    def observe(self, info: dict[str, Any]) -> bool:
        """Record one successful read; True when the leader showed life since the last one."""
        now = time.monotonic()
        if now - self.read_at > self.own_stall:
            self.changed_at = now  # we were away (stalled, or our reads failed): we saw no silence
        self.read_at = now
        if info.get("state") == "running":
            self.saw_running = True
        if info.get("beat") != self.beat:
            self.beat = info.get("beat")
            self.changed_at = now
            return True
        return False

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
        self.timeout = default_timeout() if timeout is None else positive_seconds(f"{self.what}: timeout", timeout)
        self.stale_after = (
            env_seconds(STALE_AFTER_ENV, DEFAULT_STALE_AFTER)
            if stale_after is None
            else positive_seconds(f"{self.what}: stale_after", stale_after)
        )
        self.host = socket.gethostname()
        self.pidns = pid_namespace()  # None where unknown: a pid is then never judged
        self.nonce = os.urandom(8).hex()
        #: True when this process ran the job (tests and the demo report it).
        self.led = False
        self._generation: int | None = None  # the generation this process leads
        self._deposed = threading.Event()
        self._warned_foreign: set[str] = set()

    # -- lock files ---------------------------------------------------------------

    def _lock_name(self, generation: int) -> str:
        return f"{self.name}.{generation}"

    def _generations(self) -> list[int]:
        names = listdir_if_exists(self.lock_dir) or []
        prefix = self.name + "."
        return sorted(int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit())

    def _read(self, generation: int) -> dict[str, Any] | None:
        """The lock's content; None when it is gone; ``{"state": "unreadable"}`` while it is being
        created (exclusive create without links) or when it is not nemo_safe's (ignored, with a
        warning); raises OSError when this process could not read it (its own problem, not the leader's)."""
        path = os.path.join(self.lock_dir, self._lock_name(generation))
        try:
            raw = read_if_exists(path)
        except OSError as exc:
            if exc.errno not in _NOT_A_LOCK_ERRNOS:
                raise
            raw = f"<{exc.strerror}>".encode()  # a directory, a symlink, another user's unreadable file
        if raw is None:
            return None
        try:
            info = _validated(json.loads(raw))
        except ValueError:
            info = None
            if raw == b"" or raw.startswith(b"{"):
                return dict(_UNREADABLE)  # empty or half-written by an exclusive create
        if info is None:
            if path not in self._warned_foreign:
                self._warned_foreign.add(path)
                log.warning(
                    "nemo_safe: %s: %s is not a lock nemo_safe wrote (content %r); ignoring it. Another user or "
                    "program writes into %s: remove it if this repeats.",
                    self.what,
                    path,
                    raw[:80],
                    self.lock_dir,
                )
            return {"state": "foreign"}
        return info

    def _info(self, state: str, beat: int, **extra: Any) -> bytes:
        body = {
            "state": state,
            "beat": beat,
            "host": self.host,
            "pid": os.getpid(),
            "pidns": self.pidns,
            "nonce": self.nonce,
            **extra,
        }
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
            try:
                won = self._link_lock(final) if not _NO_LINKS.get(self.lock_dir) else None
                if won is None:
                    won = self._create_lock(final)
                return won
            except FileNotFoundError:
                continue  # the lock directory was removed under us by a finishing leader: recreate it
        raise ConfigurationError(f"{self.what}: {self.lock_dir} keeps disappearing; is something deleting it?")

    def _link_lock(self, final: str) -> bool | None:
        """Publish the lock complete by ``link(2)``; None when this filesystem has no hard links."""
        tmp = os.path.join(self.lock_dir, temp_name(os.path.basename(final)))
        try:
            with open(tmp, "xb") as fh:
                fh.write(self._info("running", 0))
            try:
                os.link(tmp, final)
            except FileExistsError:
                # NFS may report EEXIST for a link whose first reply was lost: the link count tells.
                return os.stat(tmp).st_nlink == 2
            except OSError as exc:
                if exc.errno not in NO_LINK_ERRNOS:
                    raise
                _NO_LINKS[self.lock_dir] = True
                log.info("nemo_safe: %s: no hard links in %s (%s); electing by exclusive create", self.what,
                         self.lock_dir, exc.strerror)  # fmt: skip
                return None
            return True
        finally:
            unlink_if_exists(tmp)

    def _create_lock(self, final: str) -> bool:
        """Elect by exclusive create where links are missing; readers that meet the file before
        its content see it unreadable, which only a long silence turns into a takeover."""
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return False
        try:
            data = self._info("running", 0)
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        return True

    def _is_stale(self, info: dict[str, Any], watch: _Watch) -> bool:
        if info.get("state") == "foreign":
            return True  # not a leader at all
        if info.get("state") not in ("running", "unreadable"):
            return False
        frozen = watch.frozen_for()
        if frozen >= self.stale_after:
            return True
        same_process_space = (
            self.pidns is not None and info.get("host") == self.host and info.get("pidns") == self.pidns
        )
        if not same_process_space or frozen < DEAD_PID_BEATS * HEARTBEAT:
            return False
        pid = info.get("pid")
        return isinstance(pid, int) and not pid_alive(pid)

    # -- the leader ----------------------------------------------------------------

    def _still_holds(self, generation: int) -> bool:
        """Whether this process still leads ``generation``: no newer one exists and the lock still
        carries its nonce (a new leader that finished has removed it; a later flight may reuse the name).
        Unknown (a read failing on our side) counts as yes."""
        try:
            if any(g > generation for g in self._generations()):
                return False
            raw = read_if_exists(os.path.join(self.lock_dir, self._lock_name(generation)))
        except OSError:
            return True
        try:
            info = json.loads(raw) if raw is not None else None
        except ValueError:
            return False
        return isinstance(info, dict) and info.get("nonce") == self.nonce

    def _check_not_deposed(self) -> None:
        if self._generation is None:
            return
        if self._deposed.is_set() or not self._still_holds(self._generation):
            raise self._deposed_error(self._generation)

    @contextlib.contextmanager
    def _lead(self, generation: int) -> Iterator[None]:
        """Run the block as this generation's leader. Raises :class:`LeaderDeposed` when this process
        was taken over while it ran: its outcome is not published, the caller waits again."""
        self.led = True
        self._generation = generation
        self._deposed.clear()
        name = self._lock_name(generation)
        stop = threading.Event()
        beat = [0]

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT):
                beat[0] += 1
                try:
                    if not self._still_holds(generation):
                        self._deposed.set()  # stalled past the limit and replaced: stop beating
                        return
                    publish(self.lock_dir, name, self._info("running", beat[0]))
                except OSError as exc:
                    log.warning("nemo_safe: %s: heartbeat failed: %s", self.what, exc)

        thread = threading.Thread(target=heartbeat, daemon=True, name=f"nemo_safe-heartbeat-{self.name}")
        thread.start()
        _leading.flight = self
        log.info("nemo_safe: %s: this process (pid %d) does it; others wait", self.what, os.getpid())
        try:
            yield
            self._check_not_deposed()
        except Exception as exc:
            stop.set()
            thread.join()
            if self._was_deposed(generation):
                log.warning("nemo_safe: %s: taken over while stalled (%s: %s); waiting for the new leader",
                            self.what, type(exc).__name__, exc)  # fmt: skip
                raise self._deposed_error(generation) from exc
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
        finally:
            _leading.flight = None
            self._generation = None
        stop.set()
        thread.join()
        try:
            if not self._still_holds(generation):
                raise FileNotFoundError(errno.ENOENT, "the lock is another process's now", name)
            publish(self.lock_dir, name, self._info("done", beat[0] + 1))
        except OSError as exc:
            if not self._was_deposed(generation):
                raise
            log.warning("nemo_safe: %s: taken over while stalled (%s); waiting for the new leader", self.what, exc)
            raise self._deposed_error(generation) from exc
        self._remove_locks(generation)

    def _deposed_error(self, generation: int) -> LeaderDeposed:
        self._deposed.set()  # what run() and hold()'s callers check before waiting again
        return LeaderDeposed(
            f"{self.what}: this process (pid {os.getpid()}) was taken over as the one doing it "
            f"(generation {generation}) while it was stalled; it stops and waits for the new one"
        )

    def _remove_locks(self, generation: int) -> None:
        """After success: this generation's lock and older ones, then the folder if empty."""
        try:
            for g in self._generations():
                if g <= generation:
                    unlink_if_exists(os.path.join(self.lock_dir, self._lock_name(g)))
            os.rmdir(self.lock_dir)
        except OSError:
            pass  # another job's lock, a process about to lead, or a foreign entry: not ours to remove

    def _was_deposed(self, generation: int) -> bool:
        return self._deposed.is_set() or not self._still_holds(generation)

    # -- everyone ------------------------------------------------------------------

    def leader_running(self) -> bool:
        """Whether a process is doing the job right now (its lock says running). A ``done()`` that can hold
        on part of a job's output (a dataset checked by one of the folders it downloads) adds ``not
        leader_running()``, so that nobody leaves before the leader is through. Unknown counts as yes."""
        try:
            generations = self._generations()
            info = self._read(generations[-1]) if generations else None
        except OSError:
            return True
        return info is not None and info.get("state") in ("running", "unreadable")

    def run(self, job: Callable[[], None], done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, having run ``job`` here or waited for the process that did."""
        while True:
            try:
                with self.hold(done):
                    if not done():
                        job()
                return
            except LeaderDeposed:
                if not self._deposed.is_set():
                    raise  # another flight's, raised inside the job
                # taken over while stalled: wait for the new leader (or lead again)

    @contextlib.contextmanager
    def hold(self, done: Callable[[], bool]) -> Iterator[bool]:
        """:meth:`run` as a context manager. The block runs in the process that leads (it gets True and
        re-checks ``done()`` itself: someone may just have finished); every other process gets False from
        ``__enter__`` only once ``done()`` holds, or raises the leader's failure (:class:`LeaderFailed`). The
        leader's error is recorded for the waiters. A leader taken over while it ran (stalled past the stale
        limit) raises :class:`LeaderDeposed` from ``__exit__``: call again to wait for the new one.

        A hold of a flight this thread already leads (a patch applied over its own wrapper, a download
        method calling itself) runs the block as part of the outer one instead of waiting for itself."""
        key = (self.lock_dir, self.name)
        held: set[tuple[str, str]] = _leading.__dict__.setdefault("held", set())
        if key in held:
            yield True
            return
        generation = self._wait(done)
        if generation is None:
            yield False
            return
        held.add(key)
        try:
            with self._lead(generation):
                yield True
        finally:
            held.discard(key)

    def _wait(self, done: Callable[[], bool]) -> int | None:
        """None once ``done()`` holds; the generation this process won the lock of, when it must lead."""
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(POLL_CAP, start=0.01)
        progress = Progress()
        grace_until = None if self.preferred is not False else time.monotonic() + PREFERRED_GRACE
        watch: _Watch | None = None
        while True:
            if done():
                return None
            try:
                generations = self._generations()
            except OSError as exc:  # listing failed on our side (a failover): not a verdict on anyone
                log.debug("nemo_safe: %s: listing the lock folder failed: %s", self.what, exc)
                if time.monotonic() > deadline:
                    message = f"{self.what}: could not list {self.lock_dir} for {self.timeout:.0f} s: {exc}"
                    raise WaitTimeout(message) from exc
                backoff.sleep(deadline)
                continue
            if not generations:
                if grace_until is not None and time.monotonic() < grace_until:
                    backoff.sleep(grace_until)
                    continue
                if self._try_lead(0):
                    return 0
                continue
            current = generations[-1]
            try:
                info = self._read(current)
            except OSError as exc:  # our own read failed (an NFS failover): not the leader's silence
                log.debug("nemo_safe: %s: reading the lock failed: %s", self.what, exc)
                info = {}
            if info is None:
                backoff.sleep(deadline)  # removed by a finishing leader just now
                continue
            if watch is None or watch.generation != current:
                watch = _Watch(current, self.stale_after)
            if info and watch.observe(info):
                deadline = max(deadline, time.monotonic() + self.timeout)  # the timeout is for silence
            state = info.get("state")
            if state == "failed" and watch.saw_running:
                raise LeaderFailed(
                    f"{self.what} failed in the process that did it for this one (host {info.get('host')}, "
                    f"pid {info.get('pid')}): {info.get('error_type')}: {info.get('error')}",
                    str(info.get("error_type", "")),
                    str(info.get("error", "")),
                )
            if state in ("failed", "done") or (info and self._is_stale(info, watch)):
                # An earlier attempt's failure, a leader whose job did not cover this process,
                # a dead leader or a file that is no lock: one process starts the next generation.
                if state not in ("failed", "done", "foreign"):
                    log.warning(
                        "nemo_safe: %s: the process doing it (host %s, pid %s) stopped answering for %.0f s; "
                        "taking over",
                        self.what,
                        info.get("host"),
                        info.get("pid"),
                        watch.frozen_for(),
                    )
                if state == "done" and done():
                    return None
                if self._try_lead(current + 1):
                    return current + 1
                continue
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.what}: waited {progress.elapsed:.0f} s for the process doing it (host "
                    f"{info.get('host')}, pid {info.get('pid')}), and for the last {self.timeout:.0f} s it "
                    f"showed no sign of progress (its lock {self.lock_dir} did not change) although it was not "
                    "found dead. Check that process; raise NEMO_SAFE_BARRIER_TIMEOUT if it is merely slow."
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
