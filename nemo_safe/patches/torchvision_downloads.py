"""torchvision dataset downloads and extractions publish every file atomically.

torchvision 0.29.1 streams a download straight into its final path
(``_urlretrieve`` opens it "wb", truncating it for every other process that
reads or writes it), and ``_decompress`` opens the final raw file "wb" before
decompressing into memory; the tar/zip extractors write in place too. So a
second process, or a killed one, leaves empty or truncated files behind.

Here every one of those files is written under a temporary name in its own
directory (``.tmp.<name>~<host>@<pid namespace>~<pid>~<random>``) and renamed
into place only when complete: all announced bytes arrived and, when the caller
gave an md5, the md5 matches. Temporaries of dead writers are swept on the next
write into that directory, never published. Archives are extracted into a
staging folder after their members were checked (nothing outside the
destination, as Python 3.14's tarfile data filter), and published only when
the folder still holds every member.

Patched are the names the helpers look up at call time in
``torchvision.datasets.utils`` (``_urlretrieve``, ``_decompress``, the entries
of ``_ARCHIVE_EXTRACTORS``) plus every ``download_url`` binding: dataset
modules import ``download_url`` by name, and it is the one place that knows
the md5 before the file is published.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import inspect
import logging
import os
import pathlib
import shutil
import sys
import tarfile
import threading
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from nemo_safe.archive_members import checked_tar_members, zip_names
from nemo_safe.atomic_files import merge_tree, owned_temp_name, seal, sibling_temp, sweep_stale_temps, unlink_if_exists
from nemo_safe.errors import ChecksumMismatch, download_incomplete
from nemo_safe.patching import Patch, Replacements
from nemo_safe.single_flight import check_still_leading

log = logging.getLogger(__name__)

MODULE = "torchvision.datasets.utils"
PACKAGE = "torchvision.datasets"
CHECKED = ("_urlretrieve", "_decompress", "download_url", "extract_archive", "_extract_tar", "_extract_zip")

#: sha256 over the sources of CHECKED, for the releases this patch was verified against.
KNOWN_UTILS = {
    "b154c4821097b883741abdea9ca7ddfa261513ab9905bea0442c29c921b7f6f3": "torchvision 0.29.1",
}

_expected = threading.local()
_ORIGINAL_DECOMPRESS: list[Callable[..., Any]] = []


def source_digest(module: ModuleType) -> str:
    h = hashlib.sha256()
    for name in CHECKED:
        h.update(inspect.getsource(getattr(module, name)).encode())
    return h.hexdigest()


def recognise(module: ModuleType) -> str | None:
    try:
        return KNOWN_UTILS.get(source_digest(module))
    except (AttributeError, OSError, TypeError):
        return None


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


def urlretrieve(
    url: str, filename: str | os.PathLike[str], chunk_size: int = 1024 * 32, md5: str | None = None
) -> None:
    """Download ``url`` to ``filename`` so that ``filename`` never holds a partial or wrong file.

    The bytes go to a temporary sibling (the writer's host and pid in its name) and are renamed
    into place only when all announced bytes arrived and, given ``md5``, the md5 matches. Other
    processes reading or downloading the same file at the same time never see a partial one.

    Errors keep upstream's types (see :class:`~nemo_safe.errors.DownloadIncomplete`): a body that
    breaks off raises ``DownloadIncomplete`` that is also the type of what broke it off (a
    ``ConnectionResetError`` stays one, so ``download_url`` still retries ``https`` over ``http``);
    a body that ends early without an error (upstream: a silently truncated file) raises a plain
    ``DownloadIncomplete``, a ``RuntimeError`` and an ``OSError``; a wrong md5 raises
    ``ChecksumMismatch``, a ``RuntimeError`` as upstream's "File not found or corrupted.".
    Errors opening the URL (``URLError``, ``HTTPError``) and writing the file are upstream's own.
    """
    utils = sys.modules[MODULE]
    check_still_leading()  # a download leader taken over while stalled fetches nothing more
    final = os.path.abspath(os.fspath(filename))
    tmp = sibling_temp(final)
    digest = hashlib.md5(usedforsecurity=False)
    received = 0
    try:
        request = urllib.request.Request(url, headers={"User-Agent": utils.USER_AGENT})
        with urllib.request.urlopen(request) as response:
            announced = response.length
            with open(tmp, "xb") as fh, utils.tqdm(total=announced, unit="B", unit_scale=True) as pbar:
                while True:
                    try:
                        chunk = response.read(chunk_size)
                    except (http.client.HTTPException, OSError) as exc:  # not fh.write's errors: those are ours
                        raise download_incomplete(
                            f"download of {url} broke off after {received} bytes ({type(exc).__name__}: {exc}); "
                            f"nothing was written to {final}. Retry, or check the server.",
                            exc,
                        ) from exc
                    if not chunk:
                        break
                    check_still_leading(look=False)
                    fh.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    pbar.update(len(chunk))
        if announced is not None and received != announced:
            raise download_incomplete(
                f"download of {url} ended after {received} of {announced} bytes; nothing was written to "
                f"{final}. Retry, or check the server or proxy."
            )
        if md5 is not None and digest.hexdigest() != md5:
            raise ChecksumMismatch(
                f"File not found or corrupted: {url} has md5 {digest.hexdigest()} ({received} bytes), expected "
                f"{md5}; nothing was written to {final}. The mirror serves other bytes than the dataset "
                "declares: try another mirror."
            )
        check_still_leading()
        seal(tmp, final)
    finally:
        unlink_if_exists(tmp)


def decompress(
    from_path: str | os.PathLike[str],
    to_path: str | os.PathLike[str] | None = None,
    remove_finished: bool = False,
) -> pathlib.Path:
    """Decompress ``from_path`` into a temporary sibling of ``to_path``, renamed into place when complete."""
    utils = sys.modules[MODULE]
    suffix, archive_type, compression = utils._detect_file_type(from_path)
    if not compression:
        raise RuntimeError(f"Couldn't detect a compression from suffix {suffix}.")

    if to_path is None:
        to_path = pathlib.Path(os.fspath(from_path).replace(suffix, archive_type if archive_type is not None else ""))

    # We don't need to check for a missing key here, since this was already done in _detect_file_type()
    compressed_file_opener = utils._COMPRESSED_FILE_OPENERS[compression]

    # Decompress into a temporary sibling, streamed, and rename it into place when complete.
    final = os.path.abspath(os.fspath(to_path))
    tmp = sibling_temp(final)
    try:
        with compressed_file_opener(from_path, "rb") as rfh, open(tmp, "xb") as wfh:
            shutil.copyfileobj(rfh, wfh, 1 << 20)
        check_still_leading()
        seal(tmp, final)
    finally:
        unlink_if_exists(tmp)

    if remove_finished:
        check_still_leading()
        os.remove(from_path)

    return pathlib.Path(to_path)


def extract_tar_checked(from_path: Any, to_path: Any, compression: str | None) -> list[str]:
    """``_extract_tar`` of torchvision 0.29.1 (verified source) with each member checked before it
    is extracted (:func:`~nemo_safe.archive_members.checked_tar_members`: one pass over the
    archive, as upstream's); returns the paths it created."""
    names: list[str] = []
    with tarfile.open(from_path, f"r:{compression[1:]}" if compression else "r") as tar:
        tar.extractall(to_path, members=checked_tar_members(tar, os.fspath(from_path), names))
    return names


def extract_zip_listed(original: Callable[..., None]) -> Callable[..., list[str]]:
    """Upstream's zip extractor, returning the paths it creates (from the central directory)."""

    def extract(from_path: Any, to_path: Any, compression: str | None) -> list[str]:
        with zipfile.ZipFile(from_path) as archive:
            names = zip_names(archive)
        original(from_path, to_path, compression)
        return names

    return extract


def atomic_extractor(extract_into: Callable[..., list[str]], original: Callable[..., None]) -> Callable[..., None]:
    """Make an archive extractor publish atomically: ``extract_into`` extracts into a temporary
    folder inside the destination and returns the paths it created; then each file (or new
    directory) is renamed into place, so no reader sees a partially written file, nothing is
    written outside the destination, and a staging folder that lost members (removed by another
    process) raises instead of publishing a partial tree."""

    @functools.wraps(original)
    def extract(from_path: Any, to_path: Any, compression: str | None) -> None:
        dest = os.path.abspath(os.fspath(to_path))
        os.makedirs(dest, exist_ok=True)
        sweep_stale_temps(dest)
        staging = os.path.join(dest, owned_temp_name(os.path.basename(os.fspath(from_path))))
        os.mkdir(staging)
        try:
            members = extract_into(from_path, staging, compression)
            check_still_leading()
            merge_tree(staging, dest, members)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    return extract


def _urlretrieve_expecting_md5(url: str, filename: str | os.PathLike[str], chunk_size: int = 1024 * 32) -> None:
    """What replaces ``utils._urlretrieve``: upstream's ``download_url`` does not pass the md5 to it,
    so the md5 comes from the :func:`md5_aware` wrapper around ``download_url`` in this thread."""
    md5 = _md5_for(os.path.abspath(os.fspath(filename)))
    urlretrieve(url, filename, chunk_size, md5=md5)


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


def _apply_utils(utils: ModuleType) -> Replacements | None:
    known = recognise(utils)
    if known is None:
        log.warning(
            "nemo_safe: torchvision.datasets.utils is a version nemo_safe was not verified against; its downloads "
            "are left unchanged (not atomic). Known: %s",
            ", ".join(KNOWN_UTILS.values()),
        )
        return None
    _ORIGINAL_DECOMPRESS[:] = [utils._decompress]
    changes = Replacements(f"atomic downloads and extraction ({known})")
    changes.expect(utils, "_ARCHIVE_EXTRACTORS")
    changes.set(utils, "_urlretrieve", _urlretrieve_expecting_md5)
    changes.set(utils, "_decompress", decompress)
    changes.set(utils, "download_url", md5_aware(utils.download_url))
    listed = {".tar": lambda _: extract_tar_checked, ".zip": extract_zip_listed}
    for suffix, extractor in list(utils._ARCHIVE_EXTRACTORS.items()):
        changes.set_item(utils._ARCHIVE_EXTRACTORS, suffix, atomic_extractor(listed[suffix](extractor), extractor))
    return changes


def _bound_from(utils: ModuleType, attr: str, value: object) -> bool:
    """Whether ``value`` is ``utils.<attr>`` as an earlier execution of ``utils`` defined it (a reload)."""
    try:
        function = inspect.unwrap(value) if callable(value) else value
    except ValueError:
        return False
    return getattr(function, "__name__", None) == attr and getattr(function, "__globals__", None) is vars(utils)


def _apply_bindings(package: ModuleType) -> Replacements | None:
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
            if bound is original or bound is patched or _bound_from(utils, attr, bound):
                changes.set(module, attr, patched, original=original)
                found = True
        rebound += found
    changes.description = (
        f"{rebound} dataset modules that imported download_url or _decompress by name call the atomic ones"
    )
    return changes


def _describe(module: ModuleType) -> str:
    """The unpatched module (see :class:`~nemo_safe.patching.Patch`): its sources are fingerprinted."""
    known = recognise(module)
    if known:
        return f"recognised as {known}: downloads stay non-atomic"
    return "unknown torchvision version: downloads stay non-atomic"


def _describe_bindings(package: ModuleType) -> str:
    if not getattr(getattr(sys.modules.get(MODULE), "download_url", None), "__nemo_safe__", False):
        return "torchvision-atomic-downloads is not in place: dataset modules call upstream's download_url"
    return "not applied: dataset modules keep the download_url and _decompress they imported"


PATCHES = (
    Patch(module=MODULE, name="torchvision-atomic-downloads", apply=_apply_utils, describe=_describe),
    Patch(module=PACKAGE, name="torchvision-download-url-bindings", apply=_apply_bindings, describe=_describe_bindings),
)
