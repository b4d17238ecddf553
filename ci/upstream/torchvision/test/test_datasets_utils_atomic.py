"""Downloaded, decompressed and extracted files appear under their final name only when complete.

``urllib.request.urlopen`` is mocked (no network); ``read()`` of the fake response, the decompressor and the
archive copies look at the final path while the file is being written, so "no reader ever sees a partial file"
is checked deterministically, in one process.
"""

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import urllib.error
import zipfile
from unittest import mock

import pytest
from torchvision.datasets import utils

BODY = bytes(range(256)) * 1024  # 256 KiB: eight reads of _urlretrieve's 32 KiB chunks
URL = "http://example.com/data/blob.bin"


class _Response(io.BytesIO):
    """What ``urlopen`` returns: announces ``length`` bytes, serves ``body``, then ``b""`` (a server that closed
    early) or raises ``fail`` once ``fail_after`` bytes are read. ``on_read`` runs before every read."""

    def __init__(self, url, body, length=None, fail_after=None, fail=None, on_read=None):
        super().__init__(body)
        self.url = url
        self.length = len(body) if length is None else length
        self._fail_after, self._fail, self._on_read = fail_after, fail, on_read

    def read(self, size=-1):
        if self._on_read is not None:
            self._on_read()
        if self._fail_after is not None and self.tell() >= self._fail_after:
            raise self._fail
        return super().read(size)


def _serve(body=BODY, **kwargs):
    return mock.patch(
        "urllib.request.urlopen", side_effect=lambda request, *a, **kw: _Response(request.full_url, body, **kwargs)
    )


def _partial_seen(path, size):
    """A callback recording whether ``path`` exists with fewer than ``size`` bytes when it is called."""
    seen = []

    def look():
        if os.path.exists(path) and os.path.getsize(path) < size:
            seen.append(os.path.getsize(path))

    return look, seen


def _assert_only(folder, *names):
    left = sorted(os.path.relpath(os.path.join(top, n), folder) for top, _, files in os.walk(folder) for n in files)
    assert left == sorted(names), f"expected exactly {sorted(names)} in {folder}, found {left}"


def test_download_url_short_body_raises_and_publishes_nothing(tmp_path):
    with _serve(BODY[:100_000], length=len(BODY)), pytest.raises(urllib.error.ContentTooShortError):
        try:
            utils.download_url(URL, tmp_path)
        finally:  # checked whether or not it raised: before atomic downloads, the truncated file stayed
            _assert_only(tmp_path)


def test_download_url_read_error_propagates_and_publishes_nothing(tmp_path):
    with _serve(fail_after=100_000, fail=ConnectionResetError(104, "Connection reset by peer")):
        with pytest.raises(ConnectionResetError):
            try:
                utils.download_url(URL, tmp_path)
            finally:
                _assert_only(tmp_path)


def test_download_url_wrong_md5_raises_and_publishes_nothing(tmp_path):
    with _serve(), pytest.raises(RuntimeError, match="File not found or corrupted."):
        try:
            utils.download_url(URL, tmp_path, md5=hashlib.md5(b"other bytes").hexdigest())
        finally:
            _assert_only(tmp_path)


def test_download_url_never_shows_a_partial_file(tmp_path):
    look, seen = _partial_seen(tmp_path / "blob.bin", len(BODY))
    with _serve(on_read=look):
        utils.download_url(URL, tmp_path, md5=hashlib.md5(BODY).hexdigest())
    assert seen == [], f"the final path held a partial file while downloading (sizes {seen})"
    assert (tmp_path / "blob.bin").read_bytes() == BODY


def test_download_url_complete_file_is_published(tmp_path):
    with _serve():
        utils.download_url(URL, tmp_path, filename="data.bin", md5=hashlib.md5(BODY).hexdigest())
    assert (tmp_path / "data.bin").read_bytes() == BODY
    _assert_only(tmp_path, "data.bin")


def test_decompress_never_shows_a_partial_file(tmp_path, monkeypatch):
    archive = tmp_path / "blob.bin.gz"
    archive.write_bytes(gzip.compress(BODY))
    look, seen = _partial_seen(tmp_path / "blob.bin", len(BODY))

    def opener(path, mode):
        f = gzip.open(path, mode)
        read = f.read
        f.read = lambda *args: (look(), read(*args))[1]
        return f

    monkeypatch.setitem(utils._COMPRESSED_FILE_OPENERS, ".gz", opener)
    utils.extract_archive(str(archive), remove_finished=True)
    assert seen == [], f"the final path held a partial file while decompressing (sizes {seen})"
    assert (tmp_path / "blob.bin").read_bytes() == BODY
    _assert_only(tmp_path, "blob.bin")


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


MEMBERS = {"a.bin": BODY, "sub/b.txt": b"second member\n"}


def _extract_watched(tmp_path, monkeypatch, archive, module):
    """Extract ``archive`` while ``module.copyfileobj`` (how tarfile and zipfile write a member) looks at the
    final path of the big member before and after each copy; returns the partial sizes it saw."""
    dest = tmp_path / "dest"
    look, seen = _partial_seen(dest / "a.bin", len(BODY))
    copy = module.copyfileobj
    monkeypatch.setattr(module, "copyfileobj", lambda *args, **kwargs: (look(), copy(*args, **kwargs), look())[1])
    utils.extract_archive(str(archive), str(dest))
    for member, data in MEMBERS.items():
        assert (dest / member).read_bytes() == data
    _assert_only(dest, "a.bin", os.path.join("sub", "b.txt"))
    return seen


def test_extract_tar_never_shows_a_partial_file(tmp_path, monkeypatch):
    _tar(tmp_path / "archive.tar.gz", MEMBERS)
    seen = _extract_watched(tmp_path, monkeypatch, tmp_path / "archive.tar.gz", tarfile)
    assert seen == [], f"a member was visible partly written while extracting (sizes {seen})"


def test_extract_zip_never_shows_a_partial_file(tmp_path, monkeypatch):
    _zip(tmp_path / "archive.zip", MEMBERS)
    seen = _extract_watched(tmp_path, monkeypatch, tmp_path / "archive.zip", shutil)
    assert seen == [], f"a member was visible partly written while extracting (sizes {seen})"


def test_extract_archive_into_existing_destination(tmp_path):
    archive = tmp_path / "archive.tar.gz"
    _tar(archive, MEMBERS)
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "existing.txt").write_bytes(b"already here\n")
    (dest / "sub" / "b.txt").write_bytes(b"old version\n")

    utils.extract_archive(str(archive), str(dest))

    for member, data in MEMBERS.items():
        assert (dest / member).read_bytes() == data
    assert (dest / "existing.txt").read_bytes() == b"already here\n"
    _assert_only(dest, "a.bin", "existing.txt", os.path.join("sub", "b.txt"))


def test_failed_extraction_publishes_nothing(tmp_path):
    archive = tmp_path / "archive.tar.gz"
    _tar(archive, MEMBERS)
    archive.write_bytes(archive.read_bytes()[:-200])  # the last member's data is cut off
    dest = tmp_path / "dest"
    with pytest.raises((tarfile.TarError, EOFError, OSError)):
        try:
            utils.extract_archive(str(archive), str(dest))
        finally:
            _assert_only(dest)


def test_extract_archive_without_a_folder_extracts_into_the_working_directory(tmp_path, monkeypatch):
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    monkeypatch.chdir(tmp_path)
    utils.extract_archive("a.tar")
    assert (tmp_path / "a.txt").read_bytes() == b"abc"


def test_download_url_with_a_long_file_name(tmp_path):
    name = "x" * 240 + ".bin"
    with _serve():
        utils.download_url(URL, tmp_path, filename=name)
    _assert_only(tmp_path, name)
