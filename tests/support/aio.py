"""Small helpers for tests that run sockets and event loops in-process."""

from __future__ import annotations

import asyncio
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(cond, timeout: float = 20.0) -> None:
    """Poll `cond` on the running loop until it holds; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)
