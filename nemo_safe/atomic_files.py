"""Small files published atomically: written under a temporary name, then renamed.

Same-directory rename is atomic on local filesystems, NFSv3+, Lustre and GPFS,
so a reader sees either nothing or the complete file, never a partial one.
Temporary names carry the writer's pid and a random part, so two writers never
share one (NFS can answer a retransmitted exclusive create with a spurious EEXIST).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

TMP_PREFIX = ".tmp."
# getattr: importing this module must not fail where a flag is missing (Windows has no O_NOFOLLOW and
# O_CLOEXEC, and needs O_BINARY, or os.write translates newlines). nemo_safe patches nothing on such
# platforms (see nemo_safe.platform_support), so no library goes through these without O_NOFOLLOW.
_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_OPEN_READ = os.O_RDONLY | _FLAGS
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS


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


#: Consecutive ESTALE answers after which a read gives up (each retry looks the path up afresh).
ESTALE_RETRIES = 20


def _again_on_estale(look: Callable[[], T]) -> T | None:
    """``look()``, or None when what it looks at does not exist. NFS answers ESTALE when another
    client replaced it (renamed a new file over it, recreated the directory) between our lookup
    and use: that is "changed", so it is looked up afresh, up to ESTALE_RETRIES times."""
    for attempt in range(ESTALE_RETRIES):
        try:
            return look()
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ESTALE or attempt == ESTALE_RETRIES - 1:
                raise
            time.sleep(0.001 * (attempt + 1))
    raise AssertionError("unreachable")


def _read_whole(path: str) -> bytes:
    fd = os.open(path, _OPEN_READ)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_if_exists(path: str) -> bytes | None:
    """The content of ``path``, or None when it does not exist. Never follows a symlink;
    read again on ESTALE (see :func:`_again_on_estale`)."""
    return _again_on_estale(lambda: _read_whole(path))


def listdir_if_exists(path: str) -> list[str] | None:
    """The names in ``path``, or None when it does not exist; looked up again on ESTALE."""
    return _again_on_estale(lambda: os.listdir(path))


def unlink_if_exists(path: str) -> None:
    """Remove a file this process created; already gone is fine."""
    _own_temps.discard((os.getpid(), path))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_OWNER_SEP = "~"


def _host() -> str:
    return socket.gethostname().replace(_OWNER_SEP, "-")


def pid_namespace() -> str | None:
    """Where a pid of this process means this process: the boot (16 hex digits of the boot id) and
    the pid namespace (its inode), ``<boot>-<inode>``; None when unknown (no Linux /proc).

    Containers sharing a hostname (docker ``--net=host``, Kubernetes ``hostNetwork``) have pid
    namespaces of their own, so host and pid alone cannot tell a live writer from a dead one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip().replace("-", "")[:16]
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}-{inode}" if len(boot) == 16 else None


def _owner() -> str | None:
    """``<host>@<pid namespace>``: where the pid in a temporary's name can be looked up; None if unknown."""
    pidns = pid_namespace()
    return f"{_host()}@{pidns}" if pidns else None


def owned_temp_name(final_name: str) -> str:
    """A temporary sibling name that also says who writes it, ``.tmp.<name>~<host>@<pidns>~<pid>~<random>``,
    so that :func:`sweep_stale_temps` can tell a dead writer's leftover from live work.

    Older versions of this module compare the owner part with their bare hostname: it never
    matches, so they judge these names by age only, never by a pid of another namespace."""
    owner = _owner() or f"{_host()}@unknown"
    suffix = f"{_OWNER_SEP}{owner}{_OWNER_SEP}{os.getpid()}{_OWNER_SEP}{secrets.token_hex(4)}"
    # Cut a long final name so that the whole stays within NAME_MAX (255) where the final name itself fits.
    return f"{TMP_PREFIX}{final_name[: max(16, 255 - len(TMP_PREFIX) - len(suffix))]}{suffix}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in this pid namespace (unknown pids count as alive)."""
    if pid <= 0:
        return True  # kill(0 or -1, 0) would address process groups, not one process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """A killed process its parent has not reaped yet: it still has a pid, but it will never write again
    (a launcher that waits for its children in rank order reaps a dead downloader late)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def _checkable_pid(name: str, owner: str | None) -> int | None:
    """The writer's pid when ``name`` was made on this host, boot and pid namespace (``owner``), so
    that its pid can be looked up here; None otherwise. Old names (``~<host>~<pid>~``) say no
    namespace: their writer may be alive in another container of this host, so they get None."""
    _, name_owner, pid, _ = name.rsplit(_OWNER_SEP, 3)
    if owner is None or name_owner != owner or not pid.isdigit():
        return None
    return int(pid)


def sweep_stale_temps(directory: str, max_age: float = 24 * 3600.0) -> list[str]:
    """Remove temporaries of :func:`owned_temp_name` whose writer is gone: when it ran on this host,
    boot and pid namespace, once its pid no longer exists; any other (another host, another
    container sharing this hostname, an old name without a namespace) once untouched for
    ``max_age`` (mtimes lag across hosts on some filesystems, hence the generous age).
    Returns the names removed. They were never published, so nothing else refers to them."""
    owner = _owner()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(TMP_PREFIX) or name.count(_OWNER_SEP) < 3:
            continue
        path = os.path.join(directory, name)
        pid = _checkable_pid(name, owner)
        try:
            if pid is not None:
                stale = not pid_alive(pid)
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


#: Temporaries of :func:`sibling_temp` this process may still be writing, with the pid that named them
#: (a forked child inherits the set, not the files): what :func:`remove_own_temps` removes.
_own_temps: set[tuple[int, str]] = set()


def sibling_temp(final: str) -> str:
    """A fresh :func:`owned_temp_name` next to ``final``, after sweeping dead writers' leftovers there."""
    directory, name = os.path.split(final)
    sweep_stale_temps(directory)
    tmp = os.path.join(directory, owned_temp_name(name))
    _own_temps.add((os.getpid(), tmp))
    return tmp


def remove_own_temps() -> list[str]:
    """Remove the temporaries this process named with :func:`sibling_temp` and has not published or
    removed yet (files, or folders an extraction staged in). For a process about to die of a signal:
    on another host its leftovers would otherwise stay for :func:`sweep_stale_temps`' day. Returns them."""
    pid, removed = os.getpid(), []
    for owner, path in list(_own_temps):
        _own_temps.discard((owner, path))
        if owner != pid or not os.path.lexists(path):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def seal(tmp: str, final: str) -> None:
    """Make the complete temporary durable, then the final name."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    replace_file(tmp, final)
    _own_temps.discard((os.getpid(), tmp))


def replace_file(src: str, dst: str) -> None:
    """``os.replace``, except where the folder forbids replacing ``dst`` but ``dst`` may be written:
    a sticky shared folder (``+t``) with another user's group- or world-writable file. Upstream
    rewrites such a file in place ("wb"), so that is done here too, with a warning: the job works
    as upstream's does, without the atomicity nemo_safe adds elsewhere."""
    try:
        os.replace(src, dst)
    except PermissionError:
        if os.path.islink(dst) or not os.path.isfile(dst) or not os.access(dst, os.W_OK):
            raise
        log.warning(
            "nemo_safe: %s belongs to another user in a folder that forbids replacing it (sticky bit); "
            "rewriting it in place as upstream does (not atomic: readers may see it partly written)",
            dst,
        )
        shutil.copyfile(src, dst)
        os.unlink(src)


def _raise(exc: OSError) -> None:
    raise exc


def _check_complete(staging: str, expected: Iterable[str]) -> None:
    """Raise FileNotFoundError when ``staging`` or any ``expected`` path in it is gone (another
    process removed it): publishing the rest and returning would hide the loss."""
    if not os.path.isdir(staging):
        raise FileNotFoundError(
            errno.ENOENT, "the extraction folder vanished before its files were published (removed by another "
            "process?); nothing was published", staging,
        )  # fmt: skip
    missing = [p for p in expected if not os.path.lexists(os.path.join(staging, p))]
    if missing:
        raise FileNotFoundError(
            errno.ENOENT, f"{len(missing)} archive member(s) vanished from the extraction folder before they were "
            f"published (removed by another process?), e.g. {missing[:3]}; nothing was published",
            os.path.join(staging, missing[0]),
        )  # fmt: skip


#: Destinations already reported as reached through a symlink leading out of them (one warning each).
_warned_outside: set[str] = set()


def _check_inside(path: str, root: str) -> None:
    """Write below ``path`` only where it is a directory. Checked archive members never lead out of the
    destination ``root`` (a real path), so a symlink in ``path`` that does was already there before this
    extraction (the user put the data in another folder): it is written through, as upstream extracts, with
    one warning (where it leads to another filesystem the renames fail with EXDEV, and the caller extracts
    as upstream does instead)."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root and root not in _warned_outside:
        _warned_outside.add(root)
        log.warning("nemo_safe: %s leads to %s, outside the extraction destination %s (a symlink that was "
                    "there before): extracting through it, as upstream does", path, real, root)  # fmt: skip
    if not os.path.isdir(real):
        raise NotADirectoryError(errno.ENOTDIR, "the archive has a directory where the destination has a file", path)


def _owner_writable(path: str) -> int:
    """Let the owner write to a staging directory extraction made read-only (moving entries out of
    it, or it to another parent, needs that even where upstream's in-place extraction does not);
    returns its mode before."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if not mode & stat.S_IWUSR:
        os.chmod(path, mode | stat.S_IWUSR)
    return mode


def _move_new_dir(src: str, dst: str) -> bool:
    """Rename the directory ``src`` to ``dst`` if ``dst`` does not exist, keeping its mode; False if
    it does (also when another process created it just now), so the caller merges into it instead."""
    if os.path.lexists(dst):
        return False
    mode = _owner_writable(src)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    if not mode & stat.S_IWUSR:
        os.chmod(dst, mode)
    return True


def merge_tree(staging: str, dest: str, expected: Iterable[str] = ()) -> None:
    """Move what an extraction left in ``staging`` to the same places under ``dest``.

    A directory ``dest`` lacks is renamed into place whole: it appears complete, with the mode,
    owner and times extraction gave it (as upstream's in-place extraction leaves them). Into an
    existing directory, which keeps its mode, each entry is renamed (atomic). A symlink leading out
    of ``dest`` that was there before is written through, as upstream does; where it leads to another
    filesystem the rename raises ``OSError(EXDEV)``. Raises FileNotFoundError when ``staging`` lost any
    ``expected`` path or anything while moving, instead of returning with a partial tree published."""
    _check_complete(staging, expected)
    root = os.path.realpath(dest)
    try:
        for top, dirs, files in os.walk(staging, onerror=_raise):
            target = os.path.normpath(os.path.join(dest, os.path.relpath(top, staging)))
            _check_inside(target, root)
            if dirs or files:
                _owner_writable(top)
            for name in list(dirs):
                if os.path.islink(os.path.join(top, name)):
                    dirs.remove(name)
                    files.append(name)
                elif _move_new_dir(os.path.join(top, name), os.path.join(target, name)):
                    dirs.remove(name)
            for name in files:
                replace_file(os.path.join(top, name), os.path.join(target, name))
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            errno.ENOENT, f"files vanished from the extraction folder while they were published into {dest} "
            f"(removed by another process?); what was moved before stays: {exc}", staging,
        ) from exc  # fmt: skip
