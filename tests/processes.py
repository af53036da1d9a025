"""Helpers for tests that start real process groups."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on loopback that is free now, for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
