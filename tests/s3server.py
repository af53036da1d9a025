"""An S3 server on loopback for the tests: ``moto`` in server mode on 127.0.0.1 (a free port),
one bucket, and helpers to upload the local files ``tests/sources.py`` writes.

The server runs in a thread of the test process, so a test can switch its authentication on
(``require_auth``) to see denied requests. Credentials and the endpoint are passed to sources as
``storage_options`` (``S3Server.options``) or set in the environment by a fixture through
``monkeypatch``, never left in ``os.environ``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import boto3
from moto import settings as moto_settings
from moto.server import ThreadedMotoServer

BUCKET = "resumable-tests"
REGION = "us-east-1"
KEY_ID = "testing"
SECRET = "testing"


class S3Server:
    """A moto S3 server on 127.0.0.1 holding ``BUCKET``."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
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
