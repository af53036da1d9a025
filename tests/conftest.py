"""Hypothesis profiles: `ci` (the default, and what CI runs) is sized for a 2-core machine, where
the whole suite must run in well under 15 minutes; `dev` (HYPOTHESIS_PROFILE=dev) explores
twelve times more examples per property."""

import os
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, settings

# Every header a node keeps between states is checked against a fresh one, in this process and
# in the worker processes the tests start (which inherit the environment).
os.environ["RESUMABLE_VERIFY_HEADERS"] = "1"

settings.register_profile("dev", max_examples=150, deadline=None)
settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 for the session (tests/s3server.py), stopped after; skipped
    where moto is not installed (it comes with the ``test`` extra)."""
    s3server = pytest.importorskip("tests.s3server")
    server = s3server.S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def cache_dir_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Line indices of remote objects and the chunk cache go to a directory of this test session,
    not to ~/.cache/resumable: runs do not see each other's cached blocks."""
    saved = os.environ.get("RESUMABLE_CACHE_DIR")
    os.environ["RESUMABLE_CACHE_DIR"] = str(tmp_path_factory.mktemp("resumable-cache"))
    yield
    if saved is None:
        del os.environ["RESUMABLE_CACHE_DIR"]
    else:
        os.environ["RESUMABLE_CACHE_DIR"] = saved
