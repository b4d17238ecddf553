"""A real HTTP mirror on 127.0.0.1 for ``nemo-safe demo`` (and, extended, the benchmarks and the tests).

Serves files from memory, counts requests, complete responses and body bytes
per file, and can throttle each response (so that concurrent downloads overlap
for sure). torchvision's redirect probe opens a GET and drops it: those broken
pipes are expected and counted as aborted, not complete. The tests' mirror
(``tests/faulty_mirror.py``) adds faults (responses broken off, wrong bytes) and
HTTPS through the hooks ``_make_server``, ``_response``, ``_after_body``;
``benchmarks/download_time.py`` shares one throttled link among all responses
through ``_pace``.
"""

from __future__ import annotations

import dataclasses
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHUNK = 64 * 1024


@dataclass
class FileStats:
    """Per file. ``probes`` are torchvision's redirect probes (a GET with a ``Method: HEAD``
    header that is dropped after the headers); their bytes are counted apart."""

    requests: int = 0
    complete: int = 0
    body_bytes: int = 0
    probes: int = 0
    probe_bytes: int = 0
    #: Of ``requests``, those that came over TLS (``https://``).
    https_requests: int = 0


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class LoopbackMirror:
    """``with LoopbackMirror(files, rate=...) as mirror:`` then point a dataset's mirrors at ``mirror.url``."""

    def __init__(self, files: Mapping[str, bytes], *, rate: float | None = None) -> None:
        self.files = dict(files)
        #: Bytes per second per response; None = as fast as the loopback goes.
        self.rate = rate
        self._lock = threading.Lock()
        self._stats: dict[str, FileStats] = {name: FileStats() for name in self.files}
        self._server = self._make_server()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="loopback-mirror")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def __enter__(self) -> LoopbackMirror:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def stats(self) -> dict[str, FileStats]:
        with self._lock:
            return {name: dataclasses.replace(s) for name, s in self._stats.items()}

    def total_body_bytes(self) -> int:
        return sum(s.body_bytes for s in self.stats().values())

    def _make_server(self) -> ThreadingHTTPServer:
        return _Server(("127.0.0.1", 0), self._handler())

    def _response(self, name: str, scheme: str) -> tuple[bytes, int]:
        """The body to announce for ``name`` (its Content-Length) and how many of its bytes to send."""
        body = self.files[name]
        return body, len(body)

    def _after_body(self, handler: BaseHTTPRequestHandler, name: str, scheme: str) -> bool:
        """Called once the bytes of :meth:`_response` are sent; True: the connection was aborted."""
        return False

    def _pace(self, nbytes: int) -> None:
        """Called before each chunk of a body is sent (after the per-response throttle)."""

    def _count(self, name: str, **delta: int) -> None:
        with self._lock:
            s = self._stats[name]
            for key, value in delta.items():
                setattr(s, key, getattr(s, key) + value)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                if name not in mirror.files:
                    self.send_error(404)
                    return
                probe = self.headers.get("Method") == "HEAD"
                scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
                if probe:
                    mirror._count(name, probes=1)
                else:
                    mirror._count(name, requests=1, https_requests=int(scheme == "https"))
                body, limit = mirror._response(name, scheme)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                sent = 0
                started = time.monotonic()
                try:
                    while sent < limit:
                        if mirror.rate:
                            ahead = sent / mirror.rate - (time.monotonic() - started)
                            if ahead > 0:
                                time.sleep(ahead)
                        piece = body[sent : min(sent + CHUNK, limit)]
                        mirror._pace(len(piece))
                        self.wfile.write(piece)
                        sent += len(piece)
                        mirror._count(name, **({"probe_bytes": len(piece)} if probe else {"body_bytes": len(piece)}))
                    self.wfile.flush()
                    if mirror._after_body(self, name, scheme):
                        return
                except (BrokenPipeError, ConnectionResetError):
                    return  # torchvision's redirect probe, or a killed client
                if sent == len(body) and not probe:
                    mirror._count(name, complete=1)
                self.close_connection = True

        return Handler
