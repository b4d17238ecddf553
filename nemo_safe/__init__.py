"""nemo_safe: multi-process training jobs safe from start-up filesystem races.

``import nemo_safe`` enables the library patches (lazily: a patched module is
changed when it is imported, whatever the order) unless ``NEMO_SAFE_DISABLE=1``.
It imports nothing heavy itself: no torch, lightning, nemo or torchvision.
On a platform without ``os.O_NOFOLLOW`` or ``os.link`` (Windows) it patches nothing
and logs one warning on the ``nemo_safe`` logger; every library then runs as upstream.

Public API (every name in ``__all__``; docs/api.md describes each)::

    nemo_safe.rank_zero_first(directory, world_size, name)   # context manager
    nemo_safe.Barrier, nemo_safe.StoreChannel                # the barrier itself (gather/open, wait)
    nemo_safe.detect_identity()                              # rank, world size, attempt key
    nemo_safe.SingleFlight(directory, name).run(job, done)   # one process does a job, the others wait
    nemo_safe.patch() / nemo_safe.unpatch()                  # (re)apply / undo the patches
    nemo_safe.active()                                       # names of the patches applied
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nemo_safe import log_output, patches, patching, platform_support
from nemo_safe.errors import (
    BarrierTimeout,
    ConfigurationError,
    LeaderDeposed,
    LeaderFailed,
    NemoSafeError,
    RankZeroAbsent,
    RankZeroFailed,
    RankZeroStalled,
    RemoteFailure,
    UnsafeArchivePath,
    UnsafeBarrierPath,
    WaitTimeout,
)
from nemo_safe.lazy_attributes import module_getattr

if TYPE_CHECKING:
    from nemo_safe.barrier import Barrier, rank_zero_first
    from nemo_safe.barrier_channels import StoreChannel
    from nemo_safe.cluster_identity import ClusterIdentity
    from nemo_safe.cluster_identity import detect as detect_identity
    from nemo_safe.single_flight import SingleFlight

#: Public names imported on first use, so that ``import nemo_safe`` (in every process of a job,
#: most of which never call them) stays cheap: name -> (module, attribute).
_ON_FIRST_USE = {
    "Barrier": ("nemo_safe.barrier", "Barrier"),
    "rank_zero_first": ("nemo_safe.barrier", "rank_zero_first"),
    "StoreChannel": ("nemo_safe.barrier_channels", "StoreChannel"),
    "ClusterIdentity": ("nemo_safe.cluster_identity", "ClusterIdentity"),
    "detect_identity": ("nemo_safe.cluster_identity", "detect"),
    "SingleFlight": ("nemo_safe.single_flight", "SingleFlight"),
}


__getattr__ = module_getattr(__name__, globals(), _ON_FIRST_USE)


def __dir__() -> list[str]:
    """The public names, the module's own dunders and the submodules imported so far; not the helpers and
    imports of this file (``log``, ``logging``, ``module_getattr``)."""
    names = {*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))}
    return sorted(names | {n for n, v in globals().items() if getattr(v, "__name__", "").startswith(__name__ + ".")})


__version__ = "0.1.0"

__all__ = [
    "Barrier",
    "BarrierTimeout",
    "ClusterIdentity",
    "ConfigurationError",
    "LeaderDeposed",
    "LeaderFailed",
    "NemoSafeError",
    "RankZeroAbsent",
    "RankZeroFailed",
    "RankZeroStalled",
    "RemoteFailure",
    "SingleFlight",
    "StoreChannel",
    "UnsafeArchivePath",
    "UnsafeBarrierPath",
    "WaitTimeout",
    "__version__",
    "active",
    "detect_identity",
    "patch",
    "rank_zero_first",
    "unpatch",
]


log = logging.getLogger(__name__)


def patch() -> bool:
    """Apply every registered library patch now and on later imports (idempotent).

    Returns False when ``NEMO_SAFE_DISABLE`` is set or the platform lacks what the patches
    rely on (:mod:`nemo_safe.platform_support`); nothing is patched then."""
    if not platform_support.supported():
        return False
    return patching.enable()


def unpatch() -> None:
    """Restore every patched library function and stop patching later imports."""
    patching.disable()


def active() -> list[str]:
    """Names of the library patches currently applied (empty when nothing is patched)."""
    return patching.active()


log_output.install()  # before the first line: the platform warning, NEMO_SAFE_DISABLE
for _patch in patches.ALL:
    patching.register(_patch)
if not patching.disabled_by_env() and not platform_support.supported():
    log.warning("%s", platform_support.unsupported_message())
patch()
