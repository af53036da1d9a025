"""An S3 server on loopback for the tests: ``moto`` in server mode on 127.0.0.1 (a free port),
one bucket, and helpers to upload the local files ``tests/sources.py`` writes.

The server runs in a thread of the test process, so a test can switch its authentication on
(``require_auth``) to see denied requests. Ranged GETs read only their range (``_ranged_reads``):
moto copies the whole object for each one, which would make a read of 1 MiB of a 300 MB object
cost what a read of the object costs. Credentials and the endpoint are passed to sources as
``storage_options`` (``S3Server.options``) or set in the environment by a fixture through
``monkeypatch``, never left in ``os.environ``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

import boto3
from moto import settings as moto_settings
from moto.s3.models import FakeKey
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer

BUCKET = "resumable-tests"
REGION = "us-east-1"
KEY_ID = "testing"
SECRET = "testing"


_ranged = threading.local()
"""Set while the server thread answers a GET with a Range header."""


class _LazyValue:
    """An object's bytes, read on slicing: what a ranged GET slices ``key.value`` into."""

    def __init__(self, key: FakeKey) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return bytes(self.key._value_buffer.read(max(0, stop - start)))

    def __bytes__(self) -> bytes:
        return self[:]


@contextlib.contextmanager
def _ranged_reads() -> Iterator[None]:
    """Within the block, a ranged GET reads only its range from the object's buffer."""
    value, key_response = FakeKey.value, S3Response.key_response

    def lazy_value(key: FakeKey) -> Any:
        return _LazyValue(key) if getattr(_ranged, "active", False) else value.fget(key)  # type: ignore[attr-defined]

    def ranged_key_response(self: S3Response, request: Any, full_url: str, headers: Any) -> Any:
        _ranged.active = request.method == "GET" and bool(request.headers.get("range"))
        try:
            status, response_headers, content = key_response(self, request, full_url, headers)
        finally:
            _ranged.active = False
        return status, response_headers, bytes(content) if isinstance(content, _LazyValue) else content

    FakeKey.value = property(lazy_value, value.fset)  # type: ignore[method-assign, assignment]
    S3Response.key_response = ranged_key_response  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeKey.value, S3Response.key_response = value, key_response  # type: ignore[method-assign]


class S3Server:
    """A moto S3 server on 127.0.0.1 holding ``BUCKET``."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_ranged_reads())
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
        )
        self.client.create_bucket(Bucket=BUCKET)

    @property
    def options(self) -> dict[str, Any]:
        """``storage_options`` (fsspec names) that reach this server."""
        return {"key": KEY_ID, "secret": SECRET, "endpoint_url": self.endpoint, "region": REGION}

    def upload(self, path: str, key: str) -> str:
        """Upload the local file at ``path`` as ``key``; returns its ``s3://`` URL."""
        self.client.upload_file(path, BUCKET, key)
        return f"s3://{BUCKET}/{key}"

    @contextlib.contextmanager
    def require_auth(self) -> Iterator[None]:
        """Within the block, every request is authenticated against the server's (empty) IAM
        users, so any key is refused (``InvalidAccessKeyId``): bad credentials."""
        saved = moto_settings.INITIAL_NO_AUTH_ACTION_COUNT
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            yield
        finally:
            moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = saved

    def stop(self) -> None:
        self._server.stop()
        self._patches.close()
