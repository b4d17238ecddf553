"""The tests' loopback mirror: :class:`~nemo_safe_tools.loopback_mirror.LoopbackMirror` plus faults and HTTPS.

A response can be broken off after some bytes (a clean close, or a TCP reset), or serve wrong bytes.
Given an ``ssl.SSLContext`` the mirror speaks HTTPS and plain HTTP on the same port (it peeks at the
first byte of each connection: 0x16 starts a TLS handshake), as torchvision's ``download_url`` expects
when it retries a failed ``https://`` URL with ``http://`` in its place; faults can be limited to one
of the two.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nemo_safe_tools.loopback_mirror import LoopbackMirror


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


class FaultyMirror(LoopbackMirror):
    """``LoopbackMirror`` with ``faults``; with ``tls`` (a server-side ``ssl.SSLContext``),
    ``mirror.https_url`` serves the same files over HTTPS on the same port."""

    def __init__(
        self,
        files: Mapping[str, bytes],
        *,
        rate: float | None = None,
        faults: Faults | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.faults = faults or Faults()
        self._tls = tls
        super().__init__(files, rate=rate)

    @property
    def https_url(self) -> str:
        """The same files over HTTPS, on the same port as :attr:`url` (needs ``tls``)."""
        if self._tls is None:
            raise ValueError("this FaultyMirror was started without a TLS context")
        return f"https://127.0.0.1:{self._server.server_address[1]}/"

    def _make_server(self) -> ThreadingHTTPServer:
        server = _Server(("127.0.0.1", 0), self._handler())
        server.tls = self._tls
        return server

    def _faults(self, scheme: str) -> Faults:
        return self.faults if scheme in self.faults.schemes else Faults()

    def _response(self, name: str, scheme: str) -> tuple[bytes, int]:
        body, _ = super()._response(name, scheme)
        faults = self._faults(scheme)
        if name in faults.corrupt:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        breaks = (faults.drop_after, faults.reset_after, faults.bad_tls_record_after)
        return body, min(len(body), *(fault.get(name, len(body)) for fault in breaks))

    def _after_body(self, handler: BaseHTTPRequestHandler, name: str, scheme: str) -> bool:
        faults = self._faults(scheme)
        bad_record = name in faults.bad_tls_record_after
        if not bad_record and name not in faults.reset_after:
            return False
        _reset(handler, bad_record)
        return True


def _reset(handler: BaseHTTPRequestHandler, bad_record: bool) -> None:
    """Abort the connection: a zero linger time makes close() send a TCP reset, no FIN (and, over
    TLS, no close_notify). With ``bad_record``, over TLS, first a TLS application-data record whose
    authentication tag cannot match."""
    time.sleep(RESET_DELAY)
    handler.close_connection = True
    connection = handler.connection
    if bad_record and isinstance(connection, ssl.SSLSocket):
        raw = socket.socket(fileno=os.dup(connection.fileno()))
        try:
            raw.sendall(b"\x17\x03\x03\x00\x20" + os.urandom(32))
        finally:
            raw.close()
        time.sleep(RESET_DELAY)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.rfile.close()  # the makefile reference would defer the close
    connection.close()
