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


def _serve(mocker, body=BODY, **kwargs):
    return mocker.patch(
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


def test_download_url_short_body_raises_and_publishes_nothing(tmpdir, mocker):
    _serve(mocker, BODY[:100_000], length=len(BODY))
    with pytest.raises(urllib.error.ContentTooShortError):
        try:
            utils.download_url(URL, tmpdir)
        finally:  # checked whether or not it raised: before atomic downloads, the truncated file stayed
            _assert_only(tmpdir)


def test_download_url_read_error_propagates_and_publishes_nothing(tmpdir, mocker):
    _serve(mocker, fail_after=100_000, fail=ConnectionResetError(104, "Connection reset by peer"))
    with pytest.raises(ConnectionResetError):
        try:
            utils.download_url(URL, tmpdir)
        finally:
            _assert_only(tmpdir)


def test_download_url_wrong_md5_raises_and_publishes_nothing(tmpdir, mocker):
    _serve(mocker)
    with pytest.raises(RuntimeError, match="File not found or corrupted."):
        try:
            utils.download_url(URL, tmpdir, md5=hashlib.md5(b"other bytes").hexdigest())
        finally:
            _assert_only(tmpdir)


def test_download_url_never_shows_a_partial_file(tmpdir, mocker):
    look, seen = _partial_seen(tmpdir / "blob.bin", len(BODY))
    _serve(mocker, on_read=look)
    utils.download_url(URL, tmpdir, md5=hashlib.md5(BODY).hexdigest())
    assert seen == [], f"the final path held a partial file while downloading (sizes {seen})"
    assert (tmpdir / "blob.bin").read_binary() == BODY


def test_download_url_complete_file_is_published(tmpdir, mocker):
    _serve(mocker)
    utils.download_url(URL, tmpdir, filename="data.bin", md5=hashlib.md5(BODY).hexdigest())
    assert (tmpdir / "data.bin").read_binary() == BODY
    _assert_only(tmpdir, "data.bin")


def test_decompress_never_shows_a_partial_file(tmpdir, mocker):
    archive = tmpdir / "blob.bin.gz"
    archive.write_binary(gzip.compress(BODY))
    look, seen = _partial_seen(tmpdir / "blob.bin", len(BODY))

    def opener(path, mode):
        f = gzip.open(path, mode)
        read = f.read
        f.read = lambda *args: (look(), read(*args))[1]
        return f

    mocker.patch.dict(utils._COMPRESSED_FILE_OPENERS, {".gz": opener})
    utils.extract_archive(str(archive), remove_finished=True)
    assert seen == [], f"the final path held a partial file while decompressing (sizes {seen})"
    assert (tmpdir / "blob.bin").read_binary() == BODY
    _assert_only(tmpdir, "blob.bin")


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


def _extract_watched(tmpdir, mocker, archive, module):
    """Extract ``archive`` while ``module.copyfileobj`` (how tarfile and zipfile write a member) looks at the
    final path of the big member before and after each copy; returns the partial sizes it saw."""
    dest = tmpdir / "dest"
    look, seen = _partial_seen(dest / "a.bin", len(BODY))
    copy = module.copyfileobj
    mocker.patch.object(module, "copyfileobj", lambda *args, **kwargs: (look(), copy(*args, **kwargs), look())[1])
    utils.extract_archive(str(archive), str(dest))
    for member, data in MEMBERS.items():
        assert (dest / member).read_binary() == data
    _assert_only(dest, "a.bin", os.path.join("sub", "b.txt"))
    return seen


def test_extract_tar_never_shows_a_partial_file(tmpdir, mocker):
    _tar(tmpdir / "archive.tar.gz", MEMBERS)
    seen = _extract_watched(tmpdir, mocker, tmpdir / "archive.tar.gz", tarfile)
    assert seen == [], f"a member was visible partly written while extracting (sizes {seen})"


def test_extract_zip_never_shows_a_partial_file(tmpdir, mocker):
    _zip(tmpdir / "archive.zip", MEMBERS)
    seen = _extract_watched(tmpdir, mocker, tmpdir / "archive.zip", shutil)
    assert seen == [], f"a member was visible partly written while extracting (sizes {seen})"


def test_extract_archive_into_existing_destination(tmpdir):
    archive = tmpdir / "archive.tar.gz"
    _tar(archive, MEMBERS)
    dest = tmpdir / "dest"
    (dest / "sub").ensure(dir=True)
    (dest / "existing.txt").write_binary(b"already here\n")
    (dest / "sub" / "b.txt").write_binary(b"old version\n")

    utils.extract_archive(str(archive), str(dest))

    for member, data in MEMBERS.items():
        assert (dest / member).read_binary() == data
    assert (dest / "existing.txt").read_binary() == b"already here\n"
    _assert_only(dest, "a.bin", "existing.txt", os.path.join("sub", "b.txt"))


def test_failed_extraction_publishes_nothing(tmpdir):
    archive = tmpdir / "archive.tar.gz"
    _tar(archive, MEMBERS)
    archive.write_binary(archive.read_binary()[:-200])  # the last member's data is cut off
    dest = tmpdir / "dest"
    with pytest.raises((tarfile.TarError, EOFError, OSError)):
        try:
            utils.extract_archive(str(archive), str(dest))
        finally:
            _assert_only(dest)


def test_extract_archive_without_a_folder_extracts_into_the_working_directory(tmpdir):
    with tarfile.open(tmpdir / "a.tar", "w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with tmpdir.as_cwd():
        utils.extract_archive("a.tar")
    assert (tmpdir / "a.txt").read_binary() == b"abc"


def test_download_url_with_a_long_file_name(tmpdir, mocker):
    name = "x" * 240 + ".bin"
    _serve(mocker)
    utils.download_url(URL, tmpdir, filename=name)
    _assert_only(tmpdir, name)


def test_download_url_computes_the_md5_while_downloading(tmpdir, mocker):
    # The md5 is computed from the bytes as they arrive: the downloaded file is not read back.
    calculate_md5 = mocker.spy(utils, "calculate_md5")
    _serve(mocker)
    utils.download_url(URL, tmpdir, md5=hashlib.md5(BODY).hexdigest())
    assert calculate_md5.call_count == 0
    assert (tmpdir / "blob.bin").read_binary() == BODY


@pytest.mark.parametrize("published", [True, False])
def test_replace_onto_a_file_open_elsewhere_on_windows(tmpdir, mocker, published):
    # Windows refuses to replace a file another process has open: the new content is written over it in place, as
    # torchvision always wrote it (a file that failed its md5 must not stay).
    tmp, final = tmpdir / "tmp", tmpdir / "final"
    tmp.write_binary(b"ours")
    if published:
        final.write_binary(b"theirs")
    windows = mocker.patch.object(utils, "os", wraps=os)
    windows.name = "nt"
    windows.replace.side_effect = PermissionError(13, "Access is denied")
    utils._replace(str(tmp), str(final))
    assert final.read_binary() == b"ours"
    windows.name = "posix"
    with pytest.raises(PermissionError):
        utils._replace(str(tmp), str(final))


def test_extraction_in_progress_lists_nothing_else_in_the_destination(tmpdir, mocker):
    # What a killed extraction leaves must not be listed among the destination's classes (ImageFolder).
    _tar(tmpdir / "archive.tar.gz", MEMBERS)
    dest, listed = tmpdir / "dest", set()
    dest.mkdir()
    copy = tarfile.copyfileobj
    mocker.patch.object(tarfile, "copyfileobj", lambda *a, **kw: (listed.update(os.listdir(dest)), copy(*a, **kw))[1])
    utils.extract_archive(str(tmpdir / "archive.tar.gz"), str(dest))
    assert listed <= {"a.bin", "sub"}
    _assert_only(dest, "a.bin", os.path.join("sub", "b.txt"))


@pytest.mark.parametrize("refused", ["mkdir", "rename"])
def test_extraction_stages_inside_the_destination_where_next_to_it_fails(tmpdir, mocker, refused):
    # A read-only parent (mkdir), another filesystem or mount (rename: EXDEV): the files still arrive.
    _tar(tmpdir / "archive.tar.gz", MEMBERS)
    fake = mocker.patch.object(utils, "os", wraps=os)
    getattr(fake, refused).side_effect = OSError(18, "Invalid cross-device link")
    utils.extract_archive(str(tmpdir / "archive.tar.gz"), str(tmpdir / "dest"))
    _assert_only(tmpdir / "dest", "a.bin", os.path.join("sub", "b.txt"))
    assert sorted(os.listdir(tmpdir)) == ["archive.tar.gz", "dest"]
