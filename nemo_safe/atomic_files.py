"""Small files published atomically: written under a temporary name, then renamed.

Same-directory rename is atomic on local filesystems, NFSv3+, Lustre and GPFS,
so a reader sees either nothing or the complete file, never a partial one.
Temporary names carry the writer's pid and a random part, so two writers never
share one (NFS can answer a retransmitted exclusive create with a spurious EEXIST).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time

TMP_PREFIX = ".tmp."
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def temp_name(final_name: str) -> str:
    """A temporary sibling name no other process can pick."""
    return f"{TMP_PREFIX}{final_name}.{os.getpid()}.{secrets.token_hex(4)}"


def publish(directory: str, name: str, data: bytes, *, fsync: bool = False) -> None:
    """Atomically make ``directory/name`` hold ``data`` (replacing an older file of that name)."""
    tmp = os.path.join(directory, temp_name(name))
    fd = os.open(tmp, _OPEN_NEW, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_if_exists(path: str) -> bytes | None:
    """The content of ``path``, or None when it does not exist. Never follows a symlink."""
    try:
        fd = os.open(path, _OPEN_READ)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def unlink_if_exists(path: str) -> None:
    """Remove a file this process created; already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_OWNER_SEP = "~"


def owned_temp_name(final_name: str) -> str:
    """A temporary sibling name that also says who writes it (host and pid), so that
    :func:`sweep_stale_temps` can tell a dead writer's leftover from live work."""
    host = socket.gethostname().replace(_OWNER_SEP, "-")
    return f"{TMP_PREFIX}{final_name}{_OWNER_SEP}{host}{_OWNER_SEP}{os.getpid()}{_OWNER_SEP}{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (unknown pids count as alive)."""
    if pid <= 0:
        return True  # kill(0 or -1, 0) would address process groups, not one process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_stale_temps(directory: str, max_age: float = 24 * 3600.0) -> list[str]:
    """Remove temporaries of :func:`owned_temp_name` whose writer is gone: on this host
    when its pid no longer exists, on other hosts once untouched for ``max_age``
    (mtimes lag across hosts on some filesystems, hence the generous age).
    Returns the names removed. They were never published, so nothing else refers to them."""
    host = socket.gethostname().replace(_OWNER_SEP, "-")
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(TMP_PREFIX) or name.count(_OWNER_SEP) < 3:
            continue
        _, owner, pid, _ = name.rsplit(_OWNER_SEP, 3)
        path = os.path.join(directory, name)
        try:
            if owner == host and pid.isdigit():
                stale = not pid_alive(int(pid))
            else:
                stale = now - os.lstat(path).st_mtime > max_age
            if not stale:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed


def sibling_temp(final: str) -> str:
    """A fresh :func:`owned_temp_name` next to ``final``, after sweeping dead writers' leftovers there."""
    directory, name = os.path.split(final)
    sweep_stale_temps(directory)
    return os.path.join(directory, owned_temp_name(name))


def seal(tmp: str, final: str) -> None:
    """Make the complete temporary durable, then the final name."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def merge_tree(staging: str, dest: str) -> None:
    """Move every file of ``staging`` to the same place under ``dest``, one atomic rename each."""
    for top, dirs, files in os.walk(staging):
        rel = os.path.relpath(top, staging)
        target = os.path.normpath(os.path.join(dest, rel))
        os.makedirs(target, exist_ok=True)
        for name in list(dirs):
            if os.path.islink(os.path.join(top, name)):
                dirs.remove(name)
                files.append(name)
        for name in files:
            os.replace(os.path.join(top, name), os.path.join(target, name))
