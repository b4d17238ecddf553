"""MNIST, FashionMNIST, KMNIST, EMNIST, QMNIST: one download per dataset folder, and repair.

In torchvision 0.29.1 every process that builds ``MNIST(root, download=True)`` downloads
and extracts into the same files at once (the FSDP tutorial does exactly that),
and ``_check_exists()`` only tests that the raw files exist, so an empty or
truncated one left by a killed process crashes every later load. EMNIST even
``rmtree``s ``raw/gzip`` while other processes still extract from it.

Here ``download`` goes through :class:`~nemo_safe.single_flight.SingleFlight`
in ``root/<Class>/``: one process downloads and extracts (rank 0 preferred when
a rank is known), the others wait and load. ``_check_exists`` also validates
the IDX header against the file size, so an invalid raw file is rebuilt by
``download=True`` instead of crashing at load. Whether every rank builds the
dataset, whether the root is shared or node-local, and whether any rank is
known at all does not matter for correctness.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nemo_safe import cluster_identity, idx_files
from nemo_safe.errors import NemoSafeError
from nemo_safe.patching import Patch, Replacements
from nemo_safe.single_flight import SingleFlight

log = logging.getLogger(__name__)

MODULE = "torchvision.datasets.mnist"
#: Classes whose own ``download`` / ``_check_exists`` are replaced; FashionMNIST and KMNIST inherit MNIST's.
CLASSES = ("MNIST", "EMNIST", "QMNIST")
METHODS = ("download", "_check_exists")

KNOWN_MNIST = {
    "9246d36e12ff12a6e2b2cc754fd713987e934fe95a9a3d0b57fb9cbb4afb9d0c": "torchvision 0.29.1",
}

_warned: set[str] = set()


def source_digest(module: ModuleType) -> str:
    h = hashlib.sha256()
    for cls in CLASSES:
        for method in METHODS:
            h.update(inspect.getsource(getattr(module, cls).__dict__[method]).encode())
    return h.hexdigest()


def recognise(module: ModuleType) -> str | None:
    try:
        return KNOWN_MNIST.get(source_digest(module))
    except (AttributeError, KeyError, OSError, TypeError):
        return None


def raw_files(dataset: Any) -> list[str]:
    """The raw files this dataset object loads."""
    if hasattr(type(dataset), "images_file"):  # EMNIST, QMNIST
        return [dataset.images_file, dataset.labels_file]
    return [
        os.path.join(dataset.raw_folder, os.path.splitext(os.path.basename(url))[0]) for url, _ in dataset.resources
    ]


def preferred_leader() -> bool | None:
    """True on the process that should download (rank 0, or local rank 0 for node-local roots),
    False on the others, None when no rank is known (then every process has an equal chance)."""
    try:
        ident = cluster_identity.detect()
    except NemoSafeError:
        return None  # inconsistent launcher variables: correctness never depended on the preference
    if ident.launcher != "none":
        return ident.rank == 0 or ident.local_rank == 0
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return None


def validating_check_exists(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def _check_exists(self: Any) -> bool:
        if not original(self):
            return False
        for path in raw_files(self):
            problem = idx_files.problem(path)
            if problem is not None:
                if path not in _warned:
                    _warned.add(path)
                    log.warning("nemo_safe: %s is invalid (%s); download=True rebuilds it", path, problem)
                return False
        return True

    _check_exists.__wrapped__ = original  # type: ignore[attr-defined]
    return _check_exists


def single_flight_download(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def download(self: Any) -> None:
        if self._check_exists():
            return
        folder = os.path.dirname(os.path.abspath(self.raw_folder))
        flight = SingleFlight(
            folder, "download", what=f"{type(self).__name__} download into {folder}", preferred=preferred_leader()
        )
        flight.run(lambda: original(self), done=self._check_exists)

    download.__wrapped__ = original  # type: ignore[attr-defined]
    download.__doc__ = original.__doc__
    return download


def _apply(module: ModuleType) -> Replacements | None:
    known = recognise(module)
    if known is None:
        log.warning(
            "nemo_safe: torchvision.datasets.mnist is a version nemo_safe was not verified against; MNIST "
            "downloads are left unchanged (every process downloads). Known: %s",
            ", ".join(KNOWN_MNIST.values()),
        )
        return None
    changes = Replacements(f"one download per dataset folder, raw files validated ({known})")
    for cls_name in CLASSES:
        cls = getattr(module, cls_name)
        changes.expect(module, cls_name)  # a reload of the module defines new classes
        for method, wrap in (("download", single_flight_download), ("_check_exists", validating_check_exists)):
            original = cls.__dict__[method]  # the class's own, not an inherited one
            changes.set(cls, method, wrap(original), original=original)
    return changes


def _describe(module: ModuleType) -> str:
    """The unpatched module (see :class:`~nemo_safe.patching.Patch`)."""
    known = recognise(module)
    version = f"recognised as {known}" if known else "unknown torchvision version"
    return f"{version}: every process downloads, raw files are not validated"


PATCH = Patch(module=MODULE, name="torchvision-mnist-single-flight", apply=_apply, describe=_describe)
