# ruff: noqa: UP007, UP035  (torchvision's typing idiom: Optional, Union, typing.Callable)
"""What the upstream pull requests put into ``torchvision/datasets/utils.py``, verbatim.

``ci/make_patches.py`` copies these definitions by name into torchvision 0.29.1's
``utils.py``: the atomic publication (patch 0001 of ``patches/torchvision/``; patch 0002's
lock is :mod:`nemo_safe.download_lock`). The overlay
(:mod:`nemo_safe.patches.torchvision_downloads`) runs the same ``_urlretrieve``,
``_decompress`` and ``_atomic_extractor`` with ``torchvision.datasets.utils``'s globals,
as they run there upstream, except that the helpers they call by name, ``_atomic_path``,
``_temp_sibling`` and ``_publish_tree``, are the overlay's richer versions (temporaries
named after their writer and swept when it is dead, the single-flight leadership check
before publishing, staging folders checked complete). The helpers here are the simple
upstream ones.

Written in torchvision's idiom (``Optional`` / ``Union``, no logging); the names the
functions find in ``torchvision.datasets.utils`` are imported for type checkers only.
"""

import contextlib
import functools
import hashlib
import os
import pathlib
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Optional, Union

if TYPE_CHECKING:  # found in torchvision.datasets.utils, where these functions run
    from torchvision.datasets.utils import _COMPRESSED_FILE_OPENERS, USER_AGENT, _detect_file_type, tqdm


def _temp_sibling(path: Union[str, pathlib.Path]) -> str:
    directory, name = os.path.split(os.path.abspath(path))  # the same directory: os.replace() is atomic
    return os.path.join(directory, f".{name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.partial")


def _replace(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except PermissionError:  # on Windows, while another process has dst open: write over it in place, as before
        if os.name != "nt":
            raise
        shutil.copyfile(src, dst)


@contextlib.contextmanager
def _atomic_path(path: Union[str, pathlib.Path]) -> Iterator[str]:
    tmp = _temp_sibling(path)  # moved to ``path`` once the block succeeds: no process sees a partial file
    try:
        yield tmp
        _replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _urlretrieve(
    url: str, filename: Union[str, pathlib.Path], chunk_size: int = 1024 * 32, md5: Optional[str] = None
) -> None:
    with _atomic_path(filename) as tmp:
        digest = hashlib.md5(usedforsecurity=False)  # checked as it arrives: the file is read only once
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": USER_AGENT})) as response:
            size = response.length
            with open(tmp, "wb") as fh, tqdm(total=size, unit="B", unit_scale=True) as pbar:
                while chunk := response.read(chunk_size):
                    fh.write(chunk)
                    digest.update(chunk)
                    pbar.update(len(chunk))
                received = fh.tell()
        if size is not None and received < size:
            message = f"retrieval incomplete: got only {received} out of {size} bytes"
            raise urllib.error.ContentTooShortError(message, None)
        if md5 is not None and digest.hexdigest() != md5:
            raise RuntimeError("File not found or corrupted.")


def _decompress(
    from_path: Union[str, pathlib.Path],
    to_path: Optional[Union[str, pathlib.Path]] = None,
    remove_finished: bool = False,
) -> pathlib.Path:
    r"""Decompress a file.

    The compression is automatically detected from the file name.

    Args:
        from_path (str): Path to the file to be decompressed.
        to_path (str): Path to the decompressed file. If omitted, ``from_path`` without compression extension is used.
        remove_finished (bool): If ``True``, remove the file after the extraction.

    Returns:
        (str): Path to the decompressed file.
    """
    suffix, archive_type, compression = _detect_file_type(from_path)
    if not compression:
        raise RuntimeError(f"Couldn't detect a compression from suffix {suffix}.")

    if to_path is None:
        to_path = pathlib.Path(os.fspath(from_path).replace(suffix, archive_type if archive_type is not None else ""))

    # We don't need to check for a missing key here, since this was already done in _detect_file_type()
    compressed_file_opener = _COMPRESSED_FILE_OPENERS[compression]

    with _atomic_path(to_path) as tmp, compressed_file_opener(from_path, "rb") as rfh, open(tmp, "wb") as wfh:
        wfh.write(rfh.read())

    if remove_finished:
        os.remove(from_path)

    return pathlib.Path(to_path)


def _publish_tree(staging: str, to_path: Union[str, pathlib.Path]) -> None:
    for root, dirs, files in os.walk(staging):  # each file to the same place under to_path, by os.replace()
        target = os.path.join(to_path, os.path.relpath(root, staging))
        os.makedirs(target, exist_ok=True)
        os.chmod(root, 0o700)  # an archive's read-only directory must let its files be moved out
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            _replace(os.path.join(root, name), os.path.join(target, name))


def _atomic_extractor(extractor: Callable[..., None]) -> Callable[..., None]:
    # Extract into a temporary folder next to to_path (never one of its classes), else inside it; then move the files.
    @functools.wraps(extractor)
    def extract(
        from_path: Union[str, pathlib.Path], to_path: Union[str, pathlib.Path], compression: Optional[str]
    ) -> None:
        to_path = os.path.abspath(to_path or os.curdir)  # extract_archive("a.tar") extracts into the working directory
        os.makedirs(to_path, exist_ok=True)
        staging, inside = _temp_sibling(to_path), _temp_sibling(os.path.join(to_path, os.path.basename(from_path)))
        try:
            os.mkdir(staging)
            os.rename(staging, inside)
            os.rename(inside, staging)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            staging = inside
            os.makedirs(staging, exist_ok=True)
        try:
            extractor(from_path, staging, compression)
            _publish_tree(staging, to_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    return extract
