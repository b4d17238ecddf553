# ruff: noqa: UP007, UP035  (torchvision's typing idiom: Optional, Union, typing.Callable)
"""What the upstream pull requests put into ``torchvision/datasets/utils.py``, verbatim.

``ci/make_patches.py`` copies these definitions by name into torchvision 0.29.1's
``utils.py``: the atomic publication (patch 0001 of ``patches/torchvision/``) and
``_download_lock`` (patch 0002; the overlay runs :class:`~nemo_safe.single_flight.SingleFlight`
in its place, see :mod:`nemo_safe.patches.torchvision_mnist`). The overlay
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
import os
import pathlib
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Optional, Union

if TYPE_CHECKING:  # found in torchvision.datasets.utils, where these functions run
    from torchvision.datasets.utils import _COMPRESSED_FILE_OPENERS, USER_AGENT, _detect_file_type, check_md5, tqdm


def _temp_sibling(path: Union[str, pathlib.Path]) -> str:
    # A hidden name next to ``path`` (same directory, so that os.replace() is atomic), unique per process and call.
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.partial")


@contextlib.contextmanager
def _atomic_path(path: Union[str, pathlib.Path]) -> Iterator[str]:
    """Yield a temporary path to write ``path``'s content to, moved to ``path`` only if the block succeeds.

    Other processes see either no file or the complete one under ``path``, never a partial one. The temporary
    is removed on any error; a killed process leaves it behind (hidden, next to ``path``).
    """
    tmp = _temp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _urlretrieve(
    url: str, filename: Union[str, pathlib.Path], chunk_size: int = 1024 * 32, md5: Optional[str] = None
) -> None:
    with _atomic_path(filename) as tmp:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": USER_AGENT})) as response:
            size = response.length
            with open(tmp, "wb") as fh, tqdm(total=size, unit="B", unit_scale=True) as pbar:
                while chunk := response.read(chunk_size):
                    fh.write(chunk)
                    pbar.update(len(chunk))
                received = fh.tell()
        if size is not None and received < size:
            message = f"retrieval incomplete: got only {received} out of {size} bytes"
            raise urllib.error.ContentTooShortError(message, None)
        if md5 is not None and not check_md5(tmp, md5):
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
    # Move each extracted file to the same place under to_path with os.replace(), creating directories as needed.
    for root, dirs, files in os.walk(staging):
        target = os.path.join(to_path, os.path.relpath(root, staging))
        os.makedirs(target, exist_ok=True)
        os.chmod(root, 0o700)  # an archive's read-only directory must let its files be moved out
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            os.replace(os.path.join(root, name), os.path.join(target, name))


def _atomic_extractor(extractor: Callable[..., None]) -> Callable[..., None]:
    # Extract into a temporary folder inside to_path and move the files into place only once all are extracted.
    @functools.wraps(extractor)
    def extract(
        from_path: Union[str, pathlib.Path], to_path: Union[str, pathlib.Path], compression: Optional[str]
    ) -> None:
        to_path = to_path or os.curdir  # extract_archive("archive.tar") extracts into the working directory
        os.makedirs(to_path, exist_ok=True)
        staging = _temp_sibling(os.path.join(to_path, os.path.basename(from_path)))
        os.mkdir(staging)
        try:
            extractor(from_path, staging, compression)
            _publish_tree(staging, to_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    return extract


#: How long a process waits for another process's download into the same folder before it gives up (seconds).
_DOWNLOAD_LOCK_TIMEOUT = 30 * 60


def _read_lock(lock: str) -> str:
    try:
        with open(lock) as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def _remove_lock(lock: str, content: str) -> None:
    # Only while it still holds ``content``: another process may have taken it over since.
    if _read_lock(lock) == content:
        with contextlib.suppress(OSError):  # removed by another process; on Windows, open in one
            os.remove(lock)


def _folder_state(folder: str) -> list[tuple[str, int]]:
    # The names and sizes of the files under ``folder``: a download in progress grows its temporary file.
    state = []
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # renamed or removed while we looked
                state.append((os.path.join(root, name), os.path.getsize(os.path.join(root, name))))
    return sorted(state)


@contextlib.contextmanager
def _download_lock(folder: str, stale: float = 60.0) -> Iterator[None]:
    """Run the block holding the download lock of ``folder``: processes downloading into it at once take turns.

    The processes that saw a holder fail raise its error instead of retrying in turn. A lock whose holder was
    killed is taken over once nothing changed under ``folder`` for ``stale`` seconds.
    """
    os.makedirs(folder, exist_ok=True)
    lock, token = os.path.join(folder, ".download.lock"), os.urandom(8).hex() + "\n"
    seen, changed, delay = None, time.monotonic(), 0.01
    deadline = changed + _DOWNLOAD_LOCK_TIMEOUT
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            content = _read_lock(lock)
        holder, _, error = content.partition("\n")
        if error and seen is not None and seen[0] == holder + "\n":
            raise RuntimeError(f"The process downloading into {folder} failed: {error}")
        state = (content, _folder_state(folder))
        if error or (state == seen and time.monotonic() - changed > stale):
            _remove_lock(lock, content)  # an earlier run's failure, or a holder that was killed: take over
            continue
        if state != seen:
            seen, changed = state, time.monotonic()
            deadline = changed + _DOWNLOAD_LOCK_TIMEOUT
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"No progress downloading into {folder} for {_DOWNLOAD_LOCK_TIMEOUT} s; is {lock} stale?"
            )
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    try:
        yield
    except Exception as e:
        if _read_lock(lock) == token:  # tell the processes waiting for this lock why it failed
            with open(lock, "a") as fh:
                fh.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        _remove_lock(lock, token)  # unless it now records a failure, or another process took it over
