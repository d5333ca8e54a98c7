"""The ingress replica's own HTTP listener (`ingress.listen`): clients reach the replica's port directly, with no
proxy process (Serve's HAProxy or Python proxy) between them and the app (docs/serving-path.md "No proxy").

Every ingress replica on a host binds the same port with SO_REUSEPORT, so the kernel spreads new connections
among them, and a replica being replaced keeps its open streams while its successor already accepts. The Serve
config then runs no proxy at all (`proxy_location: Disabled`), which also leaves Serve's direct-ingress server
unstarted: this listener is the replica's only HTTP server. Plain uvicorn on the replica's event loop; nothing
here knows about Ray."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other processes of this user may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"ingress.listen cannot bind {host}:{port} ({e.strerror}); another server holds it without "
            "SO_REUSEPORT — with ingress.listen the Serve config must say `proxy_location: Disabled`, so that "
            "no Serve proxy or HAProxy takes the port") from e
    return sock


class _Counted:
    """`app` counting the HTTP requests it is serving: what the replica reports to Serve's autoscaler, which
    sees none of them (ingress/autoscaling.py)."""

    __slots__ = ("app", "open")

    def __init__(self, app):
        self.app, self.open = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.open += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.open -= 1


class Listener:
    """One uvicorn server for `app` on a shared port, started on the running event loop."""

    def __init__(self, app, host: str, port: int, keep_alive_s: float, drain_s: float):
        self.sock = reuseport_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self._app = _Counted(app)
        self.server = uvicorn.Server(uvicorn.Config(
            self._app, lifespan="off", access_log=False, log_config=None, log_level="warning",
            timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=drain_s))
        # Signal handling belongs to the process's owner (Ray, or single_process.py), not to one server in it:
        # uvicorn's `serve` would take SIGINT/SIGTERM over in the main thread and re-raise them when it stops.
        self.server.capture_signals = contextlib.nullcontext
        self.task: asyncio.Task | None = None

    @property
    def open_requests(self) -> int:
        """HTTP requests this listener is serving now (streams until their last byte)."""
        return self._app.open

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("ingress listener on port %d stopped: %r", self.port, task.exception())

    async def drain(self) -> None:
        """Stop accepting (a successor on the same port takes new connections), close idle keep-alive
        connections, let open requests finish within the drain time, then cancel what is left."""
        if self.task is None or self.task.done():
            self.sock.close()
            return
        self.server.should_exit = True
        await asyncio.wait({self.task})
