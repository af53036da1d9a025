"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the test S3 server (tests/s3server.py).

Each request is forwarded to the server, except a seeded random ``fraction`` of them, which are
answered ``503 SlowDown`` (S3's throttling answer) or dropped (the connection closed without an
answer), alternately. Faults are bounded: never more than ``max_in_a_row`` in a row, fewer than
the client's retry attempts, so every read succeeds after its retries; ``fraction=1`` fails
every request (no bound) to test that retries end. Requests and faults are counted.
"""

from __future__ import annotations

import http.client
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
RANGED_SLOW_DOWN = b""
"""The body of a 503 to a ranged GET: empty. pyarrow 26 writes an error's body into the buffer
of the range asked for, and when the body is longer than the range (an 8-byte Parquet footer
read) fails with a non-retried ``INTERNAL_FAILURE`` (``Failed to flush response stream``)
instead of retrying: a known limit of pyarrow's S3 client, not what these tests are about."""
HOP_HEADERS = ("connection", "keep-alive", "transfer-encoding", "content-length")
"""Headers of the server's answer that the proxy sets itself."""


class FaultProxy:
    """A threaded proxy to ``upstream`` (``http://host:port``) failing ``fraction`` of requests."""

    def __init__(self, upstream: str, fraction: float, seed: int = 0, max_in_a_row: int = 3) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.fraction = fraction
        self.max_in_a_row = max_in_a_row
        self.requests = 0
        self.faults = 0
        self._in_a_row = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"

    def options(self, server_options: dict[str, Any]) -> dict[str, Any]:
        """``server_options`` (the S3 server's ``storage_options``) pointed at this proxy."""
        return {**server_options, "endpoint_url": self.endpoint}

    def fault(self) -> str | None:
        """Count a request and decide its fate: None (forward it), ``"503"`` or ``"drop"``."""
        with self._lock:
            self.requests += 1
            bounded = self.fraction < 1 and self._in_a_row >= self.max_in_a_row
            if bounded or self._random.random() >= self.fraction:
                self._in_a_row = 0
                return None
            self._in_a_row += 1
            self.faults += 1
            return "503" if self.faults % 2 else "drop"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            """Quiet: one line per request otherwise."""

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            fate = proxy.fault()
            if fate == "drop":
                self.close_connection = True
                return
            if fate == "503":  # see RANGED_SLOW_DOWN
                ranged = self.command == "GET" and "Range" in self.headers
                head = self.command == "HEAD"  # no body: one would be read as the next answer on the connection
                headers = [("Content-Type", "application/xml")] + ([("Content-Length", "0")] if head else [])
                self._answer(503, headers, RANGED_SLOW_DOWN if ranged else SLOW_DOWN, head=head)
                return
            connection = http.client.HTTPConnection(proxy.upstream, timeout=30)
            try:
                connection.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                answer = connection.getresponse()
                data = answer.read()
                headers = [(k, v) for k, v in answer.getheaders() if k.lower() not in HOP_HEADERS]
                if self.command == "HEAD":
                    headers.append(("Content-Length", answer.getheader("Content-Length") or "0"))
                self._answer(answer.status, headers, data, head=self.command == "HEAD")
            finally:
                connection.close()

        def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes, head: bool = False) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler
