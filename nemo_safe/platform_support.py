"""Whether this platform has what nemo_safe's guarantees are built on.

The patches publish files by exclusive create + rename and never follow a symlink
planted where a lock or state file belongs (``os.O_NOFOLLOW``); the download lock
is taken with ``os.link`` where the filesystem has hard links (exclusive create
otherwise). Windows has no ``O_NOFOLLOW`` (and its ``os.kill(pid, 0)`` terminates the process instead of
probing it). Where one is missing, ``import nemo_safe`` patches no library and logs
one warning: NeMo and torchvision then run exactly as upstream.
"""

from __future__ import annotations

import os

#: ``os`` attributes the patches rely on.
REQUIRED = ("O_NOFOLLOW", "link")


def missing() -> list[str]:
    """The required ``os`` attributes this platform lacks, as ``os.<name>``; empty when supported."""
    return [f"os.{name}" for name in REQUIRED if not hasattr(os, name)]


def supported() -> bool:
    return not missing()


def unsupported_message() -> str:
    return (
        f"nemo_safe: this platform has no {' and no '.join(missing())}, which nemo_safe's atomic files and "
        "download locks rely on; no library is patched, so NeMo's exp_manager and torchvision's downloads "
        "run exactly as upstream (with their start-up races). Set NEMO_SAFE_DISABLE=1 to silence this."
    )
