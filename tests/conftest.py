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
    "ci", max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
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


LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)
"""What torchrun or a cluster's launcher sets: a shell inside one would make every test a rank."""
PROXY_AND_AWS_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "AWS_PROFILE", "AWS_CONFIG_FILE")
"""What would send the loopback S3 server's requests elsewhere, or to a missing profile."""


@pytest.fixture(scope="session", autouse=True)
def environment_of_a_plain_process() -> Iterator[None]:
    """The tests run as one process outside any launcher and reach 127.0.0.1 directly, whatever
    the shell they are started from holds; restored after."""
    names = LAUNCHER_VARIABLES + PROXY_AND_AWS_VARIABLES + ("NO_PROXY", "no_proxy")
    saved = {name: os.environ.get(name) for name in names}
    for name in LAUNCHER_VARIABLES + PROXY_AND_AWS_VARIABLES:
        os.environ.pop(name, None)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
