"""Sources over a faulty S3 endpoint (tests/s3proxy.py in front of the loopback server): with
20% of requests answered 503 or dropped, Parquet, Arrow and JSONL give exactly the records they
give without faults (retried, nothing lost or repeated); an endpoint that always fails is a
``SourceError`` naming the URL after a bounded number of retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

import resumable as rs
from resumable.sources import blocks, remote
from tests.s3proxy import FaultProxy
from tests.s3server import S3Server
from tests.sources import _file

RECORDS = [{"id": i, "text": f"document {i} " + "y" * (i % 17)} for i in range(300)]
KINDS = ("parquet", "arrow", "jsonl")
FAULTS = 0.2


@pytest.fixture(scope="module")
def urls(s3_server: S3Server) -> dict[str, tuple[str, str]]:
    """Per kind: the local file of ``RECORDS`` and the URL of its uploaded copy."""
    files = {}
    for kind in KINDS:
        path = _file(kind, RECORDS)
        files[kind] = (path, s3_server.upload(path, f"faults/data.{kind}"))
    return files


@pytest.fixture
def proxy(s3_server: S3Server, request: pytest.FixtureRequest) -> Iterator[FaultProxy]:
    started = FaultProxy(s3_server.endpoint, fraction=getattr(request, "param", FAULTS), seed=12)
    yield started
    started.stop()


def source(kind: str, url: str, options: dict[str, Any] | None, cache_dir: Path) -> rs.Node[Any]:
    """A source over ``url`` with small blocks (many ranged reads) and a cold chunk cache."""
    read = {"jsonl": rs.jsonl, "parquet": rs.parquet, "arrow": rs.arrow}[kind]
    return read(url, storage_options=options, cache_dir=str(cache_dir), block_bytes=1024, cache_bytes=4096)


@pytest.mark.parametrize("kind", KINDS)
def test_faults_are_retried_and_nothing_is_lost_or_repeated(
    s3_server: S3Server,
    urls: dict[str, tuple[str, str]],
    proxy: FaultProxy,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "REQUEST_BLOCKS", 1)  # one request per 1 kB block: many chances to fail
    _, url = urls[kind]
    options = proxy.options(s3_server.options)
    pipe = source(kind, url, options, tmp_path)  # the JSONL index too is built through the proxy
    assert list(pipe) == RECORDS
    assert proxy.faults > 0 and proxy.requests > proxy.faults
    assert pipe.stats["retries"] > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("proxy", [1.0], indirect=True)
def test_an_endpoint_that_always_fails_is_a_source_error_naming_the_url(
    s3_server: S3Server,
    urls: dict[str, tuple[str, str]],
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two attempts show the retry as well as six, without six rounds of backoff.
    monkeypatch.setattr(remote, "RETRY_ATTEMPTS", 2)
    _, url = urls["jsonl"]  # every kind reaches its objects through Remote: one kind suffices
    kind = "jsonl"
    with pytest.raises(rs.SourceError) as raised:
        source(kind, url, proxy.options(s3_server.options), tmp_path)
    assert url in str(raised.value)
    assert proxy.requests > 1  # retried, then gave up


@pytest.mark.parametrize(
    "error, transient",
    [
        (
            OSError(
                "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data"
            ),
            True,
        ),
        (OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject operation: No response body."), True),
        (
            OSError(
                "AWS Error SLOW_DOWN (HTTP status 503) during GetObject operation: Please reduce your request rate."
            ),
            True,
        ),
        (OSError("AWS Error UNKNOWN (HTTP status 429) during HeadObject operation"), True),
        (OSError("AWS Error UNKNOWN (HTTP status 408) during GetObject operation"), True),
        (ConnectionResetError("Connection reset by peer"), True),
        (TimeoutError("timed out"), True),
        (OSError("AWS Error ACCESS_DENIED during HeadObject operation: No response body."), False),
        (OSError("AWS Error UNKNOWN (HTTP status 403) during GetObject operation"), False),
        (OSError("AWS Error NO_SUCH_KEY during GetObject operation"), False),
        (OSError("AWS Error UNKNOWN (HTTP status 400) during HeadObject operation: InvalidAccessKeyId"), False),
        (FileNotFoundError("Path does not exist 'bucket/key'"), False),
        (PermissionError("denied"), False),
        (ValueError("not an I/O error"), False),
    ],
)
def test_transient_failures_are_told_from_permanent_ones(error: BaseException, transient: bool) -> None:
    assert remote.is_transient(error) is transient


def test_call_retries_transient_failures_counts_them_and_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.0)
    target = remote.Remote(filesystem=None)  # type: ignore[arg-type]
    answers: list[Any] = [ConnectionResetError("reset"), OSError("HTTP status 503"), b"data"]

    def flaky() -> bytes:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return bytes(answer)

    assert target.call("reading s3://b/k", flaky) == b"data"
    assert target.retries == 2

    def always_failing() -> bytes:
        raise OSError("HTTP status 500")

    with pytest.raises(rs.SourceError, match="reading s3://b/k: OSError: HTTP status 500"):
        target.call("reading s3://b/k", always_failing)
    assert target.retries == 2 + remote.RETRY_ATTEMPTS - 1

    def denied() -> bytes:
        raise OSError("AWS Error ACCESS_DENIED during GetObject operation")

    with pytest.raises(rs.SourceError, match="ACCESS_DENIED"):
        target.call("reading s3://b/k", denied)
    assert target.retries == 2 + remote.RETRY_ATTEMPTS - 1  # not retried
