"""``download_url`` and ``extract_archive`` must publish a file under its final name only when it is complete and right.

torchvision 0.29.1's ``_urlretrieve`` opens the final path with ``open(fpath, "wb")`` and streams the response into
it; ``download_url`` checks the md5 only afterwards. So:

* a download that breaks off (the server announced a Content-Length and closed the connection early) leaves a
  truncated file at the final path. ``http.client`` reports the early end as an empty read, not as an error, so with
  ``md5=None`` ``download_url`` even returns normally, and the next ``download=True`` finds the file, calls it
  present and uses it;
* a download with the wrong md5 raises "File not found or corrupted." but leaves the wrong bytes at the final path,
  where the next caller without an md5 (or any process listing the folder) takes them.

A correct implementation writes into a temporary sibling and renames it into place only after all announced bytes
arrived and the md5 (when given) matched. The exception types are an implementation detail; what the user sees is
the folder, so the tests assert that something derived from ``RuntimeError`` is raised and then look at the disk:
no file under the final name, and no temporary left behind either.

The server is a ``ThreadingHTTPServer`` on 127.0.0.1 serving bytes from memory; nothing leaves the machine.
"""

import hashlib
import io
import os
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from torchvision.datasets.utils import download_url, extract_archive

PAYLOAD_SIZE = 1024 * 1024
DROP_AFTER = 300 * 1024
CHUNK = 64 * 1024


def _payload(size=PAYLOAD_SIZE, seed=b"torchvision"):
    """Deterministic, incompressible bytes."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(seed + counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:size])


def _md5(data):
    return hashlib.md5(data).hexdigest()


class _Server:
    """Serves ``files[name] = (body, drop_after)``: announces ``len(body)`` as Content-Length and closes the
    connection after ``drop_after`` body bytes (``None``: the whole body)."""

    def __init__(self):
        self.files = {}
        self.requests = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                # download_url's redirect probe is a GET with a "Method: HEAD" header that it closes right after
                # the headers; it gets the same response as the real GET (and its broken pipe is ignored below).
                server.requests.append((name, self.headers.get("Method") == "HEAD"))
                if name not in server.files:
                    self.send_error(404)
                    return
                body, drop_after = server.files[name]
                limit = len(body) if drop_after is None else drop_after
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for start in range(0, limit, CHUNK):
                        self.wfile.write(body[start : min(start + CHUNK, limit)])
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def serve(self, name, body, drop_after=None):
        self.files[name] = (body, drop_after)
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{name}"

    def start(self):
        self._thread.start()

    def stop(self):
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


@pytest.fixture
def server():
    s = _Server()
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _temporaries(folder):
    return sorted(
        os.path.relpath(os.path.join(top, name), folder)
        for top, dirs, files in os.walk(folder)
        for name in dirs + files
        if name.startswith(".tmp.")
    )


def _assert_nothing_published(root, name="blob.bin"):
    path = root / name
    assert not path.exists(), (
        f"{name} was left at its final path ({path.stat().st_size} bytes) although the download failed; "
        f"the next download=True would take it for the dataset file"
    )
    assert _temporaries(root) == [], f"temporary files left behind: {_temporaries(root)}"


def test_download_url_broken_off_leaves_no_file(server, tmp_path):
    payload = _payload()
    url = server.serve("blob.bin", payload, drop_after=DROP_AFTER)

    with pytest.raises(RuntimeError):
        try:
            download_url(url, tmp_path, filename="blob.bin", md5=None)
        finally:
            # Checked whether or not download_url raised: before atomic downloads, 0.29.1 returned normally here.
            _assert_nothing_published(tmp_path)

    assert ("blob.bin", False) in server.requests


def test_download_url_wrong_md5_leaves_no_file(server, tmp_path):
    payload = _payload()
    served = payload[:-1] + bytes([payload[-1] ^ 0xFF])  # right size, wrong md5
    url = server.serve("blob.bin", served)

    with pytest.raises(RuntimeError):
        try:
            download_url(url, tmp_path, filename="blob.bin", md5=_md5(payload))
        finally:
            _assert_nothing_published(tmp_path)

    assert ("blob.bin", False) in server.requests


def test_download_url_complete_file_is_published(server, tmp_path):
    payload = _payload()
    url = server.serve("blob.bin", payload)

    download_url(url, tmp_path, filename="blob.bin", md5=_md5(payload))

    assert (tmp_path / "blob.bin").read_bytes() == payload
    assert _temporaries(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["blob.bin"]


def test_extract_archive_into_existing_destination(tmp_path):
    members = {
        "a.bin": _payload(200 * 1024, seed=b"a"),
        "sub/b.txt": b"second member\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "archive.tar.gz"
    archive.write_bytes(buffer.getvalue())

    destination = tmp_path / "extracted"
    destination.mkdir()
    (destination / "existing.txt").write_bytes(b"already here\n")

    extract_archive(str(archive), str(destination))

    for name, data in members.items():
        assert (destination / name).read_bytes() == data
    assert (destination / "existing.txt").read_bytes() == b"already here\n"
    assert _temporaries(destination) == []
    assert sorted(
        os.path.relpath(os.path.join(top, name), destination)
        for top, _, files in os.walk(destination)
        for name in files
    ) == ["a.bin", "existing.txt", os.path.join("sub", "b.txt")]
