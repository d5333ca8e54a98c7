"""Network helpers for tests that start servers of their own."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now: the OS picks it, so a server left running by something else on this
    machine (another test run, a developer's `serve run`) cannot make the suite's server fail to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
