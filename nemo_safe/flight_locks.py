"""The lock files of a :class:`~nemo_safe.single_flight.SingleFlight`: ``<dir>/.nemo_safe/<name>.<generation>``.

Creating a generation's file elects its leader: a ``link(2)`` of a complete temporary file (atomic
on local disks, NFS, Lustre and GPFS; the link count settles NFS's spurious EEXIST), or an exclusive
create where the filesystem has no hard links. The leader rewrites the file (atomically) with each
beat; readers trust only what has the fields nemo_safe writes."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from typing import Any

from nemo_safe.atomic_files import (
    listdir_if_exists,
    pid_namespace,
    publish,
    read_if_exists,
    temp_name,
    unlink_if_exists,
)
from nemo_safe.download_lock import _DownloadLock
from nemo_safe.errors import ConfigurationError
from nemo_safe.records import HIDDEN_DIRNAME, has_field_types, new_nonce
from nemo_safe.wait_lines import say
from nemo_safe.warn_once import warn_once

log = logging.getLogger("nemo_safe.single_flight")

LOCK_DIRNAME = HIDDEN_DIRNAME
#: What ``link(2)`` answers on filesystems without hard links.
NO_LINK_ERRNOS = frozenset(
    e for e in (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None), errno.EXDEV) if e
)
#: ``abandoned``: the leader stopped without a verdict on the job (SIGTERM, Ctrl-C): take over at once.
STATES = ("running", "failed", "done", "abandoned")
#: Reading a lock-folder entry failed because it is no lock nemo_safe wrote (not a failing server).
_NOT_A_LOCK_ERRNOS = frozenset((errno.EISDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO))
#: Field types of a lock file (all required); anything else was not written by nemo_safe.
_REQUIRED: dict[str, type | tuple[type, ...]] = {"beat": int, "host": str, "pid": int, "nonce": str}
#: ``progress`` (beats at which the job's thread had advanced) and ``idle`` (beats since it last did):
#: absent from locks of versions that did not measure progress.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {**_REQUIRED, "progress": int, "idle": int}
_UNREADABLE: dict[str, Any] = {"state": "unreadable"}
#: Pauses before reading again a lock that read as missing: a path-based FUSE mount (object-store mounts,
#: passthroughs) answers ENOENT for a file while a rename replaces it (each beat), for one look; a lock
#: missing through all of them (70 ms) is gone. The listing is not asked: some mounts cache it for minutes.
_MISSING_REREADS = _DownloadLock.missing_rereads
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
    if os.path.lexists(lock_dir) and not os.path.isdir(lock_dir):
        # A file, a FIFO, a dangling symlink of that name: no lock can live there, and waiting on one could
        # only end in a timeout. Upstream's code never looks at it.
        warn_once(log, f"not-a-folder:{lock_dir}", "nemo_safe: %s is not a folder; running as upstream does (every "
                  "process downloads, each file still written atomically). Remove it to get one download.",
                  lock_dir)  # fmt: skip
        return False
    # Nothing is created here: a process that finds the work done must leave no lock folder behind.
    where = lock_dir if os.path.isdir(lock_dir) else directory
    if not os.access(where, os.W_OK | os.X_OK | os.R_OK):  # also False on a read-only mount
        log.debug("nemo_safe: cannot create entries in %s; running as upstream does", where)
        return False
    return True


def _read_through_replacement(path: str) -> bytes | None:
    """The lock file's bytes, or None when it is gone: one that reads as missing is read again after
    each of :data:`_MISSING_REREADS`, as it may just be being replaced by a beat."""
    raw = read_if_exists(path)
    for pause in _MISSING_REREADS:
        if raw is not None:
            break
        time.sleep(pause)
        raw = read_if_exists(path)
    return raw


def _validated(info: Any) -> dict[str, Any] | None:
    """A lock file's content as nemo_safe writes it, or None."""
    if not isinstance(info, dict) or info.get("state") not in STATES:
        return None
    return info if has_field_types(info, _FIELD_TYPES, required=_REQUIRED) else None


class FlightLocks:
    """One flight's lock files, as this process reads and writes them."""

    def __init__(self, directory: str, name: str, what: str) -> None:
        self.lock_dir = os.path.join(directory, LOCK_DIRNAME)
        self.name = name
        self.what = what
        self.host = socket.gethostname()
        self.pidns = pid_namespace()  # None where unknown: a pid is then never judged
        self.nonce = new_nonce()
        self._warned_foreign: set[str] = set()

    def lock_name(self, generation: int) -> str:
        return f"{self.name}.{generation}"

    def generations(self) -> list[int]:
        names = listdir_if_exists(self.lock_dir) or []
        prefix = self.name + "."
        return sorted(int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit())

    def read(self, generation: int) -> dict[str, Any] | None:
        """The lock's content; None when it is gone; ``{"state": "unreadable"}`` while it is being
        created (exclusive create without links) or when it is not nemo_safe's (ignored, with a
        warning); raises OSError when this process could not read it (its own problem, not the leader's)."""
        path = os.path.join(self.lock_dir, self.lock_name(generation))
        try:
            raw = _read_through_replacement(path)
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

    def info(self, state: str, beat: int, **extra: Any) -> bytes:
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

    def try_lead(self, generation: int) -> bool:
        """Create this generation's lock; True when this process won it."""
        final = os.path.join(self.lock_dir, self.lock_name(generation))
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
                fh.write(self.info("running", 0))
            try:
                os.link(tmp, final)
            except FileExistsError:
                # NFS may report EEXIST for a link whose first reply was lost: the link count tells.
                return os.stat(tmp).st_nlink == 2
            except OSError as exc:
                if exc.errno not in NO_LINK_ERRNOS:
                    raise
                _NO_LINKS[self.lock_dir] = True
                say(log, "nemo_safe: %s: no hard links in %s (%s); electing by exclusive create", self.what,
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
            data = self.info("running", 0)
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        return True

    def publish(self, generation: int, body: bytes) -> None:
        publish(self.lock_dir, self.lock_name(generation), body)

    def still_holds(self, generation: int) -> bool:
        """Whether this process still leads ``generation``: no newer one exists and the lock still
        carries its nonce (a new leader that finished has removed it; a later flight may reuse the name).
        Unknown (a read failing on our side) counts as yes."""
        try:
            if any(g > generation for g in self.generations()):
                return False
            raw = _read_through_replacement(os.path.join(self.lock_dir, self.lock_name(generation)))
        except OSError:
            return True
        try:
            info = json.loads(raw) if raw is not None else None
        except ValueError:
            return False
        return isinstance(info, dict) and info.get("nonce") == self.nonce

    def remove_folder(self) -> None:
        """After success (the leader has removed its generations): the lock folder, if nothing is left in it."""
        try:
            os.rmdir(self.lock_dir)
        except OSError:
            pass  # another job's lock, a process about to lead, or a foreign entry: not ours to remove
