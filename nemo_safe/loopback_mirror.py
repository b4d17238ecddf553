"""A real HTTP mirror on 127.0.0.1 for ``nemo-safe demo``, the benchmarks and the tests.

Serves files from memory, counts requests, complete responses and body bytes
per file, and can throttle (so that concurrent downloads overlap for sure),
break a response off after some bytes, or serve wrong bytes. torchvision's
redirect probe opens a GET and drops it: those broken pipes are expected and
counted as aborted, not complete.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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


@dataclass
class Faults:
    """Misbehaviour, by file name."""

    #: Close the connection after this many body bytes (Content-Length still announces the full size).
    drop_after: dict[str, int] = field(default_factory=dict)
    #: Serve these files with their last byte flipped (a wrong md5, the right size).
    corrupt: set[str] = field(default_factory=set)


class LoopbackMirror:
    """``with LoopbackMirror(files, rate=...) as mirror:`` then point a dataset's mirrors at ``mirror.url``."""

    def __init__(
        self,
        files: Mapping[str, bytes],
        *,
        rate: float | None = None,
        link_rate: float | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.files = dict(files)
        #: Bytes per second per response; None = as fast as the loopback goes.
        self.rate = rate
        #: Bytes per second shared by all responses (one uplink, as a site's internet connection); None = unlimited.
        self.link_rate = link_rate
        self._link_free_at = 0.0
        self.faults = faults or Faults()
        self._lock = threading.Lock()
        self._stats: dict[str, FileStats] = {name: FileStats() for name in self.files}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
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
            return {
                name: FileStats(s.requests, s.complete, s.body_bytes, s.probes, s.probe_bytes)
                for name, s in self._stats.items()
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {name: FileStats() for name in self.files}

    def total_body_bytes(self) -> int:
        return sum(s.body_bytes for s in self.stats().values())

    def _use_link(self, nbytes: int) -> None:
        """Wait for this chunk's turn on the shared link."""
        if not self.link_rate:
            return
        with self._lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + nbytes / self.link_rate
            until = self._link_free_at
        time.sleep(max(0.0, until - time.monotonic()))

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
                mirror._count(name, **({"probes": 1} if probe else {"requests": 1}))
                body = mirror.files[name]
                if name in mirror.faults.corrupt:
                    body = body[:-1] + bytes([body[-1] ^ 0xFF])
                limit = mirror.faults.drop_after.get(name, len(body))
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
                        mirror._use_link(len(piece))
                        self.wfile.write(piece)
                        sent += len(piece)
                        mirror._count(name, **({"probe_bytes": len(piece)} if probe else {"body_bytes": len(piece)}))
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return  # torchvision's redirect probe, or a killed client
                if sent == len(body) and not probe:
                    mirror._count(name, complete=1)
                self.close_connection = True

        return Handler
