"""A real HTTP mirror on 127.0.0.1 for ``nemo-safe demo``, the benchmarks and the tests.

Serves files from memory, counts requests, complete responses and body bytes
per file, and can throttle (so that concurrent downloads overlap for sure),
break a response off after some bytes (a clean close, or a TCP reset), or serve
wrong bytes. torchvision's redirect probe opens a GET and drops it: those broken
pipes are expected and counted as aborted, not complete.

Given an ``ssl.SSLContext`` it speaks HTTPS and plain HTTP on the same port (it
peeks at the first byte of each connection: 0x16 starts a TLS handshake), as
torchvision's ``download_url`` expects when it retries a failed ``https://`` URL
with ``http://`` in its place; faults can be limited to one of the two.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import struct
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
    #: Of ``requests``, those that came over TLS (``https://``).
    https_requests: int = 0


@dataclass
class Faults:
    """Misbehaviour, by file name."""

    #: Close the connection after this many body bytes (Content-Length still announces the full size).
    drop_after: dict[str, int] = field(default_factory=dict)
    #: Abort the connection with a TCP reset after this many body bytes: the client's next read
    #: raises ConnectionResetError (a connection reset by a proxy or a crashing server).
    reset_after: dict[str, int] = field(default_factory=dict)
    #: Over TLS: after this many body bytes, send a record that fails its integrity check, then reset;
    #: the client's next read raises ssl.SSLError (an OSError). Over plain HTTP: a reset.
    bad_tls_record_after: dict[str, int] = field(default_factory=dict)
    #: Serve these files with their last byte flipped (a wrong md5, the right size).
    corrupt: set[str] = field(default_factory=set)
    #: The schemes the faults apply to; the other one is served correctly.
    schemes: frozenset[str] = frozenset({"http", "https"})


#: Seconds a connection to be reset waits first, so that the client has read what was sent
#: (a reset discards data still queued on the server side).
RESET_DELAY = 0.2


class _Server(ThreadingHTTPServer):
    """One port, plain HTTP and, with ``tls``, HTTPS: decided by the first byte the client sends."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            request.settimeout(30)
            first = request.recv(1, socket.MSG_PEEK)
            if first == b"\x16":  # a TLS record of type handshake: ClientHello
                request = self.tls.wrap_socket(request, server_side=True)
            request.settimeout(None)
        except OSError:  # ssl.SSLError is one: a client that gave up or does not trust the certificate
            return
        try:
            super().finish_request(request, client_address)
        finally:
            if isinstance(request, ssl.SSLSocket):
                request.close()  # the wrapped socket; socketserver closes the (detached) original


class LoopbackMirror:
    """``with LoopbackMirror(files, rate=...) as mirror:`` then point a dataset's mirrors at ``mirror.url``.

    With ``tls`` (a server-side ``ssl.SSLContext``), ``mirror.https_url`` serves the same files over
    HTTPS on the same port."""

    def __init__(
        self,
        files: Mapping[str, bytes],
        *,
        rate: float | None = None,
        link_rate: float | None = None,
        faults: Faults | None = None,
        tls: ssl.SSLContext | None = None,
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
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._server.tls = tls
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="loopback-mirror")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    @property
    def https_url(self) -> str:
        """The same files over HTTPS, on the same port as :attr:`url` (needs ``tls``)."""
        if self._server.tls is None:
            raise ValueError("this LoopbackMirror was started without a TLS context")
        return f"https://127.0.0.1:{self._server.server_address[1]}/"

    def __enter__(self) -> LoopbackMirror:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def stats(self) -> dict[str, FileStats]:
        with self._lock:
            return {name: dataclasses.replace(s) for name, s in self._stats.items()}

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
                scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
                if probe:
                    mirror._count(name, probes=1)
                else:
                    mirror._count(name, requests=1, https_requests=int(scheme == "https"))
                body = mirror.files[name]
                faults = mirror.faults if scheme in mirror.faults.schemes else Faults()
                if name in faults.corrupt:
                    body = body[:-1] + bytes([body[-1] ^ 0xFF])
                bad_record = name in faults.bad_tls_record_after
                reset = bad_record or name in faults.reset_after
                limit = min(
                    len(body),
                    *(
                        fault.get(name, len(body))
                        for fault in (faults.drop_after, faults.reset_after, faults.bad_tls_record_after)
                    ),
                )
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
                    if reset:
                        self._reset(bad_record)
                        return
                except (BrokenPipeError, ConnectionResetError):
                    return  # torchvision's redirect probe, or a killed client
                if sent == len(body) and not probe:
                    mirror._count(name, complete=1)
                self.close_connection = True

            def _reset(self, bad_record: bool = False) -> None:
                """Abort the connection: a zero linger time makes close() send a TCP reset, no FIN
                (and, over TLS, no close_notify). With ``bad_record``, over TLS, first a TLS
                application-data record whose authentication tag cannot match."""
                time.sleep(RESET_DELAY)
                self.close_connection = True
                if bad_record and isinstance(self.connection, ssl.SSLSocket):
                    raw = socket.socket(fileno=os.dup(self.connection.fileno()))
                    try:
                        raw.sendall(b"\x17\x03\x03\x00\x20" + os.urandom(32))
                    finally:
                        raw.close()
                    time.sleep(RESET_DELAY)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()  # the makefile reference would defer the close
                self.connection.close()

        return Handler
