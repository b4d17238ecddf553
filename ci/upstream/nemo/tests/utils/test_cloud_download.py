# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Downloads of nemo.utils.cloud.maybe_download_from_cloud and megatron_utils._download against a local HTTP server.

A download that breaks off must leave nothing at the destination (a later call would re-use a truncated file), and
processes that download the same file before torch.distributed exists must not share a temporary file (#12420).
"""

import http.server
import threading
import time

import pytest
from nemo.collections.common.tokenizers import megatron_utils
from nemo.utils.cloud import maybe_download_from_cloud

PAYLOAD = bytes(range(256)) * 256  # 64 KiB


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cut_at=None, chunk_pause=0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.cut_at, self.chunk_pause, self.requests = cut_at, chunk_pause, 0

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.requests += 1
        body = PAYLOAD if self.server.cut_at is None else PAYLOAD[: self.server.cut_at]
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAYLOAD)))
        self.end_headers()
        for start in range(0, len(body), 8192):
            self.wfile.write(body[start : start + 8192])
            self.wfile.flush()
            time.sleep(self.server.chunk_pause)
        if self.server.cut_at is not None:
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server(request):
    srv = _Server(**getattr(request, "param", {}))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.unit
@pytest.mark.parametrize("server", [{"cut_at": len(PAYLOAD) // 2}], indirect=True)
def test_broken_download_leaves_no_file_to_reuse(server, tmp_path):
    """The server breaks the response off halfway: no file may appear at the destination, or the next call (every
    other rank of the job) re-uses a truncated .nemo file."""
    with pytest.raises(ValueError, match="Not able to download"):
        maybe_download_from_cloud(server.url, "model.nemo", cache_dir=tmp_path)
    assert server.requests == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.unit
def test_download_and_reuse(server, tmp_path):
    path = maybe_download_from_cloud(server.url, "model.nemo", subfolder="sub", cache_dir=tmp_path)
    assert open(path, "rb").read() == PAYLOAD
    again = maybe_download_from_cloud(server.url, "model.nemo", subfolder="sub", cache_dir=tmp_path)
    assert str(again) == str(path) and server.requests == 1
    (tmp_path / "sub" / "model.nemo").write_bytes(b"old")
    maybe_download_from_cloud(server.url, "model.nemo", subfolder="sub", cache_dir=tmp_path, refresh_cache=True)
    assert (tmp_path / "sub" / "model.nemo").read_bytes() == PAYLOAD and server.requests == 2
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["model.nemo"]


@pytest.mark.unit
@pytest.mark.parametrize("server", [{"chunk_pause": 0.1}], indirect=True)
def test_megatron_download_twice_at_once_before_distributed(server, tmp_path, monkeypatch):
    """Two downloads of one vocab file at once, before torch.distributed is initialized (every rank builds its
    tokenizer; two threads here): both must get the whole file (#12420: both wrote path + ".tmp", and the second
    to finish found it moved away: FileNotFoundError)."""
    monkeypatch.setattr(megatron_utils, "MEGATRON_CACHE", str(tmp_path))
    path, errors = str(tmp_path / "megatron-gpt-345m_vocab"), []

    def download():
        try:
            megatron_utils._download(path, server.url + "gpt2-vocab.json")
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=download) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert open(path, "rb").read() == PAYLOAD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron-gpt-345m_vocab"]
