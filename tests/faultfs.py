"""A passthrough FUSE filesystem (over mfusepy) with the faults of real cluster filesystems.

    python tests/faultfs.py ROOT MOUNTPOINT [--no-link] [--estale-every N] [--eio-seconds S]

* ``--no-link``: ``link(2)`` fails with EPERM, as on gcsfuse, s3fs, blobfuse and FAT.
* ``--estale-every N``: every N-th ``read`` of a file under a ``.nemo_safe`` folder (or
  listing of one) fails with ESTALE, as on NFSv3 when another client renamed a new
  file over it between the reader's open and read.
* ``--eio-seconds S``: from the first such read or listing on, they fail with EIO for
  S seconds (a server failover seen by one client).
* ``--rename-delay S``: every rename takes S seconds more (a slow metadata server: a move of
  many files that lasts).

Runs in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``).
"""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time
from typing import Any

import mfusepy
from mfusepy import FuseOSError, Operations

LOCK_FOLDER = "/.nemo_safe/"


class FaultFS(Operations):
    use_ns = True

    def __init__(
        self, root: str, no_link: bool, estale_every: int, eio_seconds: float, rename_delay: float = 0.0
    ) -> None:
        self.root = os.path.realpath(root)
        self.rename_delay = rename_delay
        self.no_link = no_link
        self.estale_every = estale_every
        self.eio_seconds = eio_seconds
        self._eio_until: float | None = None
        self._reads = 0
        self._lock = threading.Lock()

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _fault_for_read(self, path: str) -> int | None:
        if LOCK_FOLDER.rstrip("/") not in path:
            return None
        with self._lock:
            self._reads += 1
            now = time.monotonic()
            if self.eio_seconds:
                if self._eio_until is None:
                    self._eio_until = now + self.eio_seconds
                if now < self._eio_until:
                    return errno.EIO
            if self.estale_every and self._reads % self.estale_every == 0:
                return errno.ESTALE
        return None

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as exc:
            raise FuseOSError(exc.errno) from None

    # -- metadata ---------------------------------------------------------------------

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise FuseOSError(errno.EACCES)
        return 0

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = self._call(os.lstat, self._full(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        attrs = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            attrs[k] = attrs.pop(k + "_ns")
        return attrs

    def chmod(self, path: str, mode: int) -> int:
        return self._call(os.chmod, self._full(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> int:
        return self._call(os.lchown, self._full(path), uid, gid)

    def readdir(self, path: str, fh: int) -> list[str]:
        fault = self._fault_for_read(path)
        if fault is not None:
            raise FuseOSError(fault)
        return [".", "..", *self._call(os.listdir, self._full(path))]

    def readlink(self, path: str) -> str:
        return self._call(os.readlink, self._full(path))

    def mkdir(self, path: str, mode: int) -> int:
        return self._call(os.mkdir, self._full(path), mode)

    def rmdir(self, path: str) -> int:
        return self._call(os.rmdir, self._full(path))

    def unlink(self, path: str) -> int:
        return self._call(os.unlink, self._full(path))

    def symlink(self, target: str, source: str) -> int:
        return self._call(os.symlink, source, self._full(target))

    def rename(self, old: str, new: str) -> int:
        time.sleep(self.rename_delay)
        return self._call(os.replace, self._full(old), self._full(new))

    def link(self, target: str, source: str) -> int:
        if self.no_link:
            raise FuseOSError(errno.EPERM)
        return self._call(os.link, self._full(source), self._full(target))

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        return self._call(lambda: os.utime(self._full(path), ns=times) if times else os.utime(self._full(path)))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                "f_frsize", "f_namemax")  # fmt: skip
        return {k: getattr(sv, k) for k in keys}

    # -- file contents ----------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        return self._call(os.open, self._full(path), flags)

    def create(self, path: str, mode: int, flags: int) -> int:
        return self._call(os.open, self._full(path), flags | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        fault = self._fault_for_read(path)
        if fault is not None:
            raise FuseOSError(fault)
        return self._call(os.pread, fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return self._call(os.pwrite, fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        return self._call(os.truncate, self._full(path) if fh is None else fh, length)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        return self._call(os.close, fh)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        return self._call(os.fdatasync if datasync else os.fsync, fh)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("mountpoint")
    p.add_argument("--no-link", action="store_true")
    p.add_argument("--estale-every", type=int, default=0)
    p.add_argument("--eio-seconds", type=float, default=0.0)
    p.add_argument("--rename-delay", type=float, default=0.0)
    args = p.parse_args()
    ops = FaultFS(args.root, args.no_link, args.estale_every, args.eio_seconds, args.rename_delay)
    # direct_io: every read reaches this process (no page cache hides a fault); no attribute cache either.
    mfusepy.FUSE(ops, args.mountpoint, foreground=True, nothreads=False, direct_io=True, attr_timeout=0,
                 entry_timeout=0, negative_timeout=0)  # fmt: skip


if __name__ == "__main__":
    main()
