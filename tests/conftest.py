"""Hypothesis profiles: `dev` explores more, `ci` is sized for a 2-core machine."""

import os
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=150, deadline=None)
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 for the session (tests/s3server.py), stopped after; skipped
    where moto is not installed (it comes with the ``test`` extra)."""
    s3server = pytest.importorskip("tests.s3server")
    server = s3server.S3Server()
    yield server
    server.stop()
