"""Which filesystem holds a path (ext4, nfs4, lustre, gpfs, fuse.bindfs, ...).

Read from /proc/self/mountinfo so that users can see whether their barrier
directory is on a shared filesystem before a long job.
"""

from __future__ import annotations

import os


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return field.encode().decode("unicode_escape") if "\\" in field else field


def filesystem_type(path: str) -> str:
    """The type of the mount containing ``path``, or ``unknown`` off Linux."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 5 or not rfields:
                    continue
                mount_point = _unescape(fields[4])
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, rfields[0]
    except OSError:
        pass
    return best_type
