"""MNIST, FashionMNIST, KMNIST, EMNIST, QMNIST: one download per dataset folder, and repair.

In torchvision 0.29.1 every process that builds ``MNIST(root, download=True)`` downloads
and extracts into the same files at once (the FSDP tutorial does exactly that),
and ``_check_exists()`` only tests that the raw files exist, so an empty or
truncated one left by a killed process crashes every later load. EMNIST even
``rmtree``s ``raw/gzip`` while other processes still extract from it.

Here ``download`` is decorated as the upstream pull request decorates it
(:mod:`nemo_safe.patches.torchvision_mnist_upstream`: ``_download_once``, the same
code) with upstream's ``_DownloadLock`` (:mod:`nemo_safe.download_lock`) in the form of its
overlay subclass :class:`~nemo_safe.single_flight.SingleFlight`, in ``root/<Class>/``. One
process downloads and extracts (whichever gets there first: no head start for rank 0), the
others wait and load. ``_check_exists`` also runs :func:`_is_complete_idx` on each raw
file (its size against its IDX header), so an invalid raw file is rebuilt by
``download=True`` instead of crashing at load.
Whether every rank builds the dataset, whether the root is shared or node-local,
and whether any rank is known at all does not matter for correctness.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nemo_safe.errors import LeaderDeposed
from nemo_safe.patches import torchvision_mnist_upstream
from nemo_safe.patches.upstream_code import run_in
from nemo_safe.patching import Replacements
from nemo_safe.single_flight import SingleFlight, lock_folder_usable
from nemo_safe.version_gate import Fact, SourceGate, defines_function, init_downloads_then_checks

if TYPE_CHECKING:  # found in torchvision.datasets.mnist, where _is_complete_idx runs
    import torch
    from torchvision.datasets.mnist import SN3_PASCALVINCENT_TYPEMAP, get_int

log = logging.getLogger(__name__)

MODULE = "torchvision.datasets.mnist"
#: Classes whose own ``download`` / ``_check_exists`` are replaced; FashionMNIST and KMNIST inherit MNIST's.
CLASSES = ("MNIST", "EMNIST", "QMNIST")
METHODS = ("download", "_check_exists")
#: The upstream function the overlay runs (from :mod:`nemo_safe.patches.torchvision_mnist_upstream`).
SHARED = ("_download_once",)

KNOWN_MNIST = {
    "9246d36e12ff12a6e2b2cc754fd713987e934fe95a9a3d0b57fb9cbb4afb9d0c": "torchvision 0.29.1",
}

#: ``.dataset``: the dataset whose ``download()`` runs in this thread (what :func:`download_lock` waits for).
_downloading = threading.local()


#: Raw files already reported as incomplete (one warning per file and process).
_warned: set[str] = set()


def _own_methods(module: ModuleType) -> bool:
    """MNIST, EMNIST and QMNIST define their own ``download`` and ``_check_exists`` (the ones wrapped)."""
    return all(method in getattr(module, cls).__dict__ for cls in CLASSES for method in METHODS)


def _raw_file_names(module: ModuleType) -> bool:
    """What :func:`raw_files` reads: MNIST's ``raw_folder`` and ``resources``, EMNIST's and QMNIST's files."""
    mnist = module.MNIST
    return isinstance(mnist.__dict__.get("raw_folder"), property) and all(
        isinstance(getattr(module, cls).__dict__.get(name), property)
        for cls in ("EMNIST", "QMNIST")
        for name in ("images_file", "labels_file")
    )


def _idx_reader(module: ModuleType) -> bool:
    """What :func:`_is_complete_idx` calls in this module."""
    typemap = getattr(module, "SN3_PASCALVINCENT_TYPEMAP", None)
    return isinstance(typemap, dict) and callable(getattr(module, "get_int", None)) and hasattr(module, "torch")


def _init_downloads_then_checks(module: ModuleType) -> bool:
    return init_downloads_then_checks(module.MNIST, "download", "_check_exists")


#: What torchvision pull request 2 of ``patches/torchvision`` adds to ``mnist.py`` (copied from
#: :mod:`nemo_safe.patches.torchvision_mnist_upstream`): a release that defines it downloads once itself.
UPSTREAM_ONCE = torchvision_mnist_upstream._download_once.__name__

#: What the patch relies on: it wraps each class's own ``download`` (run by one process at a time, as upstream's
#: ``@_download_once`` does) and ``_check_exists`` (plus the IDX size check), never replacing their bodies.
FACTS = (
    Fact("MNIST, EMNIST and QMNIST define download and _check_exists", _own_methods),
    Fact("MNIST.raw_folder, EMNIST's and QMNIST's images_file and labels_file are properties", _raw_file_names),
    Fact("the module globals SN3_PASCALVINCENT_TYPEMAP, get_int and torch", _idx_reader),
    Fact("MNIST.__init__ calls self.download(), then self._check_exists()", _init_downloads_then_checks),
)

GATE = SourceGate(
    MODULE,
    lambda module: [getattr(module, cls).__dict__[method] for cls in CLASSES for method in METHODS],
    KNOWN_MNIST,
    library="torchvision",
    unpatched="every process downloads, raw files are not validated",
    consequence="MNIST-family downloads stay as upstream has them (every process downloads)",
    facts=FACTS,
    by_facts=True,
    fixed=Fact(f"torchvision/datasets/mnist.py defines {UPSTREAM_ONCE}: one download per root across processes",
               defines_function(UPSTREAM_ONCE)),
)  # fmt: skip
source_digest, recognise = GATE.digest, GATE.recognise


def raw_files(dataset: Any) -> list[str]:
    """The raw files this dataset object loads."""
    if hasattr(type(dataset), "images_file"):  # EMNIST, QMNIST
        return [dataset.images_file, dataset.labels_file]
    return [
        os.path.join(dataset.raw_folder, os.path.splitext(os.path.basename(url))[0]) for url, _ in dataset.resources
    ]


def shared_functions(mnist: ModuleType) -> dict[str, Callable[..., Any]]:
    """The upstream functions of :data:`SHARED`, running in ``mnist`` (their ``_DownloadLock`` is the overlay's),
    and :func:`_is_complete_idx`, which reads the IDX header with ``mnist``'s own helpers."""
    shared = run_in(torchvision_mnist_upstream, mnist, SHARED, {"_DownloadLock": download_lock})
    return {**shared, **run_in(sys.modules[__name__], mnist, ("_is_complete_idx",), {})}


def _is_complete_idx(path: str) -> bool:
    """Whether the raw file's size matches its IDX header, so that download=True replaces a raw file that an
    interrupted download of an earlier run cut short (run with ``torchvision.datasets.mnist``'s globals:
    ``get_int``, ``SN3_PASCALVINCENT_TYPEMAP``, ``torch``). Not in the upstream pull request: with its atomic
    files, torchvision no longer writes a truncated raw file."""
    try:
        with open(path, "rb") as f:
            header = f.read(4)
            dims = [get_int(f.read(4)) for _ in range(header[3])]
            size = os.fstat(f.fileno()).st_size
    except (OSError, IndexError, ValueError):
        return False
    dtype = SN3_PASCALVINCENT_TYPEMAP.get(header[2])
    return dtype is not None and size == 4 + 4 * len(dims) + torch.Size(dims).numel() * dtype.itemsize


class _AsUpstream:
    """Where no lock can live (a read-only root, a file where the lock folder goes): the block runs, as upstream."""

    @contextlib.contextmanager
    def hold(self, done: Callable[[], bool]) -> Iterator[bool]:
        yield True


def download_lock(folder: str) -> SingleFlight | _AsUpstream:
    """Upstream's ``_DownloadLock(folder)``: a :class:`SingleFlight` (its subclass) named after the dataset whose
    ``download()`` runs in this thread; the block runs in the process that leads, the others return once the
    dataset's ``_check_exists()`` holds or raise the leader's error (:class:`~nemo_safe.errors.LeaderFailed`)."""
    dataset = _downloading.dataset
    folder = os.path.abspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)  # upstream's download creates the raw folder below it anyway
    except OSError:
        pass
    if not lock_folder_usable(folder):
        return _AsUpstream()  # and upstream's own error where it cannot write either
    return SingleFlight(folder, flight_name(dataset), what=f"{type(dataset).__name__} download into {folder}")


def flight_name(dataset: Any) -> str:
    """One flight per set of files a ``download()`` fetches: QMNIST fetches only its subset's two files
    (``what="test10k"`` and ``"test50k"`` share the test subset), so ``what="train"`` must neither wait for
    nor fail with ``what="test"``. MNIST, FashionMNIST and KMNIST fetch every split, EMNIST one archive of
    every split (and removes its ``raw/gzip`` afterwards): one flight per folder."""
    subsets, chosen = getattr(type(dataset), "subsets", None), getattr(dataset, "what", None)
    if isinstance(subsets, dict) and chosen in subsets:
        return f"download-{subsets[chosen]}"
    return "download"


def validating_check_exists(
    original: Callable[[Any], bool], complete: Callable[[str], bool], idx_loaders: tuple[Any, ...] = ()
) -> Callable[[Any], bool]:
    """``_check_exists`` that also wants each raw file to be a complete IDX file (upstream's
    ``_is_complete_idx``, ``complete`` here), warning once per file that is not. Only for datasets that load
    their raw files with one of ``idx_loaders`` (the family's own ``_load_data``): a user's subclass with
    other raw files (``.npz``, images) keeps upstream's check."""

    def _check_exists(self: Any) -> bool:
        if not original(self):
            return False
        if idx_loaders and getattr(type(self), "_load_data", None) not in idx_loaders:
            return True
        for path in raw_files(self):
            if not complete(path):
                if path not in _warned:
                    _warned.add(path)
                    try:
                        size: object = os.stat(path).st_size
                    except OSError:
                        size = "no"
                    log.warning("nemo_safe: %s (%s bytes) is not a complete IDX file (its size does not match its "
                                "header); download=True rebuilds it", path, size)  # fmt: skip
                return False
        return True

    _check_exists.__wrapped__ = original  # type: ignore[attr-defined]
    return _check_exists


def single_flight_download(original: Callable[[Any], None], once: Callable[..., Any]) -> Callable[[Any], None]:
    """``download`` as upstream's ``@_download_once`` decorates it (``once``, with the overlay's
    :func:`download_lock` as its ``_DownloadLock``); a leader taken over while stalled waits for the new one
    and returns once the data is complete (or leads again), as :meth:`SingleFlight.run` does."""
    decorated = once(original)

    def download(self: Any) -> None:
        previous = getattr(_downloading, "dataset", None)
        _downloading.dataset = self
        try:
            while True:
                try:
                    return decorated(self)
                except LeaderDeposed:
                    continue
        finally:
            _downloading.dataset = previous

    download.__wrapped__ = original  # type: ignore[attr-defined]
    download.__doc__ = original.__doc__
    return download


def apply(module: ModuleType) -> Replacements | None:
    verdict = GATE.verdict(module)
    GATE.note(module, verdict)
    if not verdict.patches:
        return None
    changes = Replacements(f"{verdict}: one download per dataset folder, raw files validated")
    shared = shared_functions(module)
    for cls_name in CLASSES:
        cls = getattr(module, cls_name)
        changes.expect(module, cls_name)  # a reload of the module defines new classes
        download, check = cls.__dict__["download"], cls.__dict__["_check_exists"]  # its own, not inherited ones
        changes.set(cls, "download", single_flight_download(download, shared["_download_once"]), original=download)
        loaders = tuple(getattr(module, name).__dict__.get("_load_data") for name in CLASSES)
        validating = validating_check_exists(check, shared["_is_complete_idx"], tuple(f for f in loaders if f))
        changes.set(cls, "_check_exists", validating, original=check)
    return changes


describe = GATE.describe
