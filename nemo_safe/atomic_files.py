"""Small files published atomically: written under a temporary name, then renamed.

Same-directory rename is atomic on local filesystems, NFSv3+, Lustre and GPFS,
so a reader sees either nothing or the complete file, never a partial one.
Temporary names carry the writer's pid and a random part, so two writers never
share one (NFS can answer a retransmitted exclusive create with a spurious EEXIST).
"""

from __future__ import annotations

import os
import secrets

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
