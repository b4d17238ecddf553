"""torchvision dataset downloads and extractions publish every file atomically.

torchvision 0.29.1 streams a download straight into its final path
(``_urlretrieve`` opens it "wb", truncating it for every other process that
reads or writes it), and ``_decompress`` opens the final raw file "wb" before
decompressing into memory; the tar/zip extractors write in place too. So a
second process, or a killed one, leaves empty or truncated files behind.

The functions that do it here are the ones the upstream pull request puts into
``torchvision/datasets/utils.py`` (:mod:`nemo_safe.patches.torchvision_upstream`:
``_urlretrieve``, ``_decompress``, ``_atomic_extractor``), run with that module's
globals as they would run there. Only the helpers they call by name are the
overlay's: :func:`atomic_path` and :func:`temp_sibling` name the temporary after its
writer (``.tmp.<name>~<host>@<pid namespace>~<pid>~<random>``) and sweep the
temporaries of dead writers in that directory first, and publish only while this
process still leads its single flight (a deposed leader publishes nothing);
:func:`publish_tree` checks the staging folder still holds every member before
moving it into place. Tar members are checked before they are extracted (nothing
outside the destination, as Python 3.14's tarfile data filter).

A download is published only when all announced bytes arrived
(``urllib.error.ContentTooShortError`` otherwise, an ``OSError``) and, when the
caller gave an md5, the md5 matches (``RuntimeError("File not found or corrupted.")``
otherwise, as upstream's ``download_url``); errors while reading the body keep their
own type.

Patched are the names the helpers look up at call time in
``torchvision.datasets.utils`` (``_urlretrieve``, ``_decompress``, the entries
of ``_ARCHIVE_EXTRACTORS``) plus every ``download_url`` binding: dataset
modules import ``download_url`` by name, and it is the one place that knows
the md5 before the file is published.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import os
import sys
import tarfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from nemo_safe.archive_members import checked_tar_members, zip_names
from nemo_safe.atomic_files import merge_tree, seal, sibling_temp, unlink_if_exists
from nemo_safe.patches import torchvision_upstream
from nemo_safe.patches.upstream_code import run_in
from nemo_safe.patching import Replacements
from nemo_safe.single_flight import check_still_leading
from nemo_safe.version_gate import Fact, SourceGate, called_name, calls_in_order, defines_function, function_tree
from nemo_safe.warn_once import warn_once

log = logging.getLogger(__name__)

MODULE = "torchvision.datasets.utils"
PACKAGE = "torchvision.datasets"
CHECKED = ("_urlretrieve", "_decompress", "download_url", "extract_archive", "_extract_tar", "_extract_zip")
#: The upstream functions the overlay runs (from :mod:`nemo_safe.patches.torchvision_upstream`).
SHARED = ("_urlretrieve", "_decompress", "_atomic_extractor")

#: sha256 over the sources of CHECKED, for the releases this patch was verified against.
KNOWN_UTILS = {
    "b154c4821097b883741abdea9ca7ddfa261513ab9905bea0442c29c921b7f6f3": "torchvision 0.29.1",
}
#: The functions whose bodies the overlay replaces with its own (``_urlretrieve``, ``_decompress``, the tar
#: extractor; the zip extractor is wrapped but listed): they must be a verified release's up to formatting,
#: comments and annotations (:data:`KNOWN_SHAPES`), so that they return and raise what this release's do.
REPLACED = ("_urlretrieve", "_decompress", "_extract_tar", "_extract_zip")
KNOWN_SHAPES = {
    "b6ae41c05a8d103d018caa2e371798bb0e8b36e2755d9a1008eec7caecc7cfd9": "torchvision 0.29.1",
}


def _download_url_parameters(utils: ModuleType) -> bool:
    names = list(inspect.signature(inspect.unwrap(utils.download_url)).parameters)
    return names == ["url", "root", "filename", "md5", "max_redirect_hops"]


def _calls_by_global_name(function: str, *callees: str) -> Callable[[ModuleType], bool]:
    def holds(utils: ModuleType) -> bool:
        names = {called_name(call) for call in calls_in_order(function_tree(getattr(utils, function)))}
        return set(callees) <= names

    return holds


def _extractors_by_suffix(utils: ModuleType) -> bool:
    extractors = getattr(utils, "_ARCHIVE_EXTRACTORS", None)
    return isinstance(extractors, dict) and {".tar", ".zip"} <= set(extractors)


#: What the patch relies on around the functions it replaces (true from torchvision 0.18 on, whose download_url
#: differs from 0.29.1's only by its print calls, which keep running: download_url is wrapped, not replaced).
FACTS = (
    Fact("download_url(url, root, filename, md5, max_redirect_hops)", _download_url_parameters),
    Fact("download_url calls the module globals _urlretrieve and check_integrity",
         _calls_by_global_name("download_url", "_urlretrieve", "check_integrity")),
    Fact("extract_archive calls the module global _decompress",
         _calls_by_global_name("extract_archive", "_decompress")),
    Fact("_ARCHIVE_EXTRACTORS maps .tar and .zip to extractors", _extractors_by_suffix),
)  # fmt: skip

#: What torchvision pull request 1 of ``patches/torchvision`` adds to ``utils.py`` (copied from
#: :mod:`nemo_safe.patches.torchvision_upstream`): a release that defines it publishes atomically itself.
UPSTREAM_ATOMIC = torchvision_upstream._atomic_path.__name__

_expected = threading.local()
_ORIGINAL_DECOMPRESS: list[Callable[..., Any]] = []
#: Staging folder -> the members its checked extraction created (read by :func:`publish_tree`).
_extracted: dict[str, list[str]] = {}


GATE = SourceGate(
    MODULE,
    lambda module: [getattr(module, name) for name in CHECKED],
    KNOWN_UTILS,
    library="torchvision",
    unpatched="downloads stay non-atomic",
    consequence="its downloads stay as upstream has them (not atomic)",
    facts=FACTS,
    shapes=KNOWN_SHAPES,
    shape_parts=lambda module: [getattr(module, name) for name in REPLACED],
    fixed=Fact(f"torchvision/datasets/utils.py defines {UPSTREAM_ATOMIC}: it publishes files atomically itself",
               defines_function(UPSTREAM_ATOMIC)),
)  # fmt: skip
source_digest, recognise = GATE.digest, GATE.recognise


@contextlib.contextmanager
def expecting_md5(path: str, md5: str | None) -> Iterator[None]:
    """Tell the download of ``path`` in this thread which md5 it must have before it is published."""
    table: dict[str, str | None] = getattr(_expected, "table", None) or {}
    _expected.table = table
    previous = table.get(path)
    table[path] = md5
    try:
        yield
    finally:
        if previous is None:
            table.pop(path, None)
        else:
            table[path] = previous


def _md5_for(path: str) -> str | None:
    return (getattr(_expected, "table", None) or {}).get(path)


# -- the helpers the upstream functions call by name, in the overlay's versions -----------------------------------


def temp_sibling(path: str | os.PathLike[str]) -> str:
    """Upstream's ``_temp_sibling``: here named after its writer, after sweeping dead writers' temporaries
    in that directory (:func:`~nemo_safe.atomic_files.sibling_temp`)."""
    return sibling_temp(os.path.abspath(os.fspath(path)))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Upstream's ``_atomic_path``: a temporary sibling (:func:`temp_sibling`) made durable and renamed to
    ``path`` when the block succeeds, removed otherwise. A single-flight leader taken over while stalled
    writes nothing more and publishes nothing (:func:`~nemo_safe.single_flight.check_still_leading`)."""
    check_still_leading()
    final = os.path.abspath(os.fspath(path))
    tmp = temp_sibling(final)
    try:
        yield tmp
        check_still_leading()
        seal(tmp, final)
    finally:
        unlink_if_exists(tmp)


def publish_tree(staging: str, dest: str | os.PathLike[str]) -> None:
    """Upstream's ``_publish_tree``: :func:`~nemo_safe.atomic_files.merge_tree` (new directories renamed
    whole with the archive's modes, no writing through a symlink leading out, and raising when the staging
    folder lost any member its extraction created), by a process that still leads its single flight."""
    members = _extracted.pop(staging, ())
    check_still_leading()
    merge_tree(staging, os.path.abspath(os.fspath(dest)), members)


def shared_functions(utils: ModuleType) -> dict[str, Callable[..., Any]]:
    """The upstream functions of :data:`SHARED`, running in ``utils`` with the overlay's helpers."""
    helpers = {"_temp_sibling": temp_sibling, "_atomic_path": atomic_path, "_publish_tree": publish_tree}
    return run_in(torchvision_upstream, utils, SHARED, helpers)


def with_expected_md5(urlretrieve: Callable[..., None]) -> Callable[..., None]:
    """What replaces ``utils._urlretrieve``: upstream 0.29.1's ``download_url`` does not pass the md5 to it,
    so the md5 comes from the :func:`md5_aware` wrapper around ``download_url`` in this thread."""

    @functools.wraps(urlretrieve)
    def _urlretrieve(url: str, filename: str | os.PathLike[str], chunk_size: int = 1024 * 32) -> None:
        urlretrieve(url, filename, chunk_size, md5=_md5_for(os.path.abspath(os.fspath(filename))))

    return _urlretrieve


def leader_removes(decompress: Callable[..., Any]) -> Callable[..., Any]:
    """``_decompress`` whose ``remove_finished`` removes the compressed file only while this process
    still leads its single flight."""

    @functools.wraps(decompress)
    def _decompress(from_path: Any, to_path: Any = None, remove_finished: bool = False) -> Any:
        out = decompress(from_path, to_path, remove_finished=False)
        if remove_finished:
            check_still_leading()
            os.remove(from_path)
        return out

    _decompress.__nemo_safe__ = True  # type: ignore[attr-defined]  (a reload's bindings recognise it)
    return _decompress


def extract_tar_checked(from_path: Any, to_path: Any, compression: str | None) -> None:
    """``_extract_tar`` of torchvision 0.29.1 (verified source) with each member checked before it
    is extracted (:func:`~nemo_safe.archive_members.checked_tar_members`: one pass over the
    archive, as upstream's); records the paths it created for :func:`publish_tree`."""
    names: list[str] = []
    with tarfile.open(from_path, f"r:{compression[1:]}" if compression else "r") as tar:
        tar.extractall(to_path, members=checked_tar_members(tar, os.fspath(from_path), names))
    _extracted[os.fspath(to_path)] = names


def extract_zip_listed(original: Callable[..., None]) -> Callable[..., None]:
    """Upstream's zip extractor, recording the paths it creates (from the central directory) for
    :func:`publish_tree`."""

    @functools.wraps(original)
    def extract(from_path: Any, to_path: Any, compression: str | None) -> None:
        with zipfile.ZipFile(from_path) as archive:
            names = zip_names(archive)
        original(from_path, to_path, compression)
        _extracted[os.fspath(to_path)] = names

    return extract


def in_place_across_filesystems(atomic: Callable[..., None], upstream: Callable[..., None]) -> Callable[..., None]:
    """The atomic extractor, except where the destination holds a symlink (the user's: checked members never
    make one) leading to another filesystem, e.g. ``root/cifar-10-batches-py`` on a scratch disk. Staging on
    the root's disk and renaming across cannot work there (EXDEV), and the root's disk may be the small one
    the user moved the data away from; so the archive is extracted in place by ``upstream``'s extractor, as
    without nemo_safe, with one warning. Checked up front for the destination's own entries; a deeper link
    is met when the first rename fails, and the extraction is then redone in place (never a failure after
    the work)."""

    @functools.wraps(atomic)
    def extract(from_path: Any, to_path: Any, compression: str | None) -> None:
        dest = os.fspath(to_path or os.curdir)
        if not _links_to_another_filesystem(dest):
            try:
                return atomic(from_path, to_path, compression)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
        warn_once(log, f"across:{os.path.abspath(dest)}", "nemo_safe: a symlink in %s leads to another filesystem; "
                  "extracting %s in place, as upstream does (its files not atomic)", dest, from_path)  # fmt: skip
        upstream(from_path, dest, compression)

    return extract


def _links_to_another_filesystem(dest: str) -> bool:
    """Whether an entry of ``dest`` is a symlink to another filesystem (one listing, a stat per symlink)."""
    try:
        device = os.stat(dest).st_dev
        with os.scandir(dest) as entries:
            for entry in entries:
                if entry.is_symlink():
                    try:
                        if os.stat(entry.path).st_dev != device:
                            return True
                    except OSError:
                        continue  # dangling: the extraction meets it as upstream's would
    except OSError:
        pass  # no destination yet: the extractor creates it
    return False


def md5_aware(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``download_url`` so that the download it starts knows the md5 before publishing."""

    @functools.wraps(original)
    def download_url(
        url: str,
        root: str | os.PathLike[str],
        filename: str | os.PathLike[str] | None = None,
        md5: str | None = None,
        max_redirect_hops: int = 3,
    ) -> None:
        name = filename or os.path.basename(url)
        path = os.path.abspath(os.path.join(os.path.expanduser(root), name))
        with expecting_md5(path, md5):
            return original(url, root, filename, md5, max_redirect_hops)

    download_url.__nemo_safe__ = True  # type: ignore[attr-defined]
    return download_url


def apply_utils(utils: ModuleType) -> Replacements | None:
    verdict = GATE.verdict(utils)
    GATE.note(utils, verdict)
    if not verdict.patches:
        return None
    _ORIGINAL_DECOMPRESS[:] = [utils._decompress]
    changes = Replacements(f"{verdict}: atomic downloads and extraction")
    changes.expect(utils, "_ARCHIVE_EXTRACTORS")
    shared = shared_functions(utils)
    changes.set(utils, "_urlretrieve", with_expected_md5(shared["_urlretrieve"]))
    changes.set(utils, "_decompress", leader_removes(shared["_decompress"]))
    changes.set(utils, "download_url", md5_aware(utils.download_url))
    checked = {".tar": lambda _: extract_tar_checked, ".zip": extract_zip_listed}
    for suffix, extractor in list(utils._ARCHIVE_EXTRACTORS.items()):
        if suffix not in checked:
            continue  # an archive type of another release: extracted as upstream does
        atomic = shared["_atomic_extractor"](checked[suffix](extractor))
        changes.set_item(utils._ARCHIVE_EXTRACTORS, suffix, in_place_across_filesystems(atomic, extractor))
    return changes


def _bound_from(utils: ModuleType, attr: str, value: object) -> bool:
    """Whether ``value`` is ``utils.<attr>`` as an earlier execution of ``utils`` defined it (a reload)."""
    try:
        function = inspect.unwrap(value) if callable(value) else value
    except ValueError:
        return False
    return getattr(function, "__name__", None) == attr and getattr(function, "__globals__", None) is vars(utils)


def _ours(attr: str, value: object) -> bool:
    """Whether ``value`` is this patch's replacement of ``utils.<attr>`` from an earlier application
    (before a reload of ``utils`` made new ones)."""
    return getattr(value, "__nemo_safe__", False) is True and getattr(value, "__name__", None) == attr


def apply_bindings(package: ModuleType) -> Replacements | None:
    """Rebind ``download_url`` and ``_decompress`` in every dataset module that imported them
    by name (``from .utils import download_url``; pcam imports ``_decompress``)."""
    utils = sys.modules.get(MODULE)
    if not getattr(getattr(utils, "download_url", None), "__nemo_safe__", False):
        return None
    replacements = {
        "download_url": (utils.download_url.__wrapped__, utils.download_url),
        "_decompress": (_ORIGINAL_DECOMPRESS[0], utils._decompress),
    }
    changes = Replacements()
    changes.expect(utils, "download_url")  # rebound to this wrapper: a reload of utils makes a new one
    rebound = 0
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith(PACKAGE + ".") or module is None or module is utils:
            continue
        found = False
        for attr, (original, patched) in replacements.items():
            # A module imported after the utils patch bound the patched function already;
            # record it too, so that undo restores the original there as well.
            bound = getattr(module, attr, None)
            if bound is original or bound is patched or _bound_from(utils, attr, bound) or _ours(attr, bound):
                changes.set(module, attr, patched, original=original)
                found = True
        rebound += found
    changes.description = (
        f"{rebound} dataset modules that imported download_url or _decompress by name call the atomic ones"
    )
    return changes


describe_utils = GATE.describe


def describe_bindings(package: ModuleType) -> str:
    if not getattr(getattr(sys.modules.get(MODULE), "download_url", None), "__nemo_safe__", False):
        return "torchvision-atomic-downloads is not in place: dataset modules call upstream's download_url"
    return "not applied: dataset modules keep the download_url and _decompress they imported"
