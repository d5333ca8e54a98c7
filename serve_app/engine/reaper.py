"""Engine processes die with the replica that started them.

vLLM runs its EngineCore in a child process that waits on a socket and never notices its parent is gone. When Ray
kills an Engine replica (a crash, `ray stop --force`, an actor kill) no Python shutdown code runs, so the child
would keep its memory and threads forever. `guard()` starts a small watcher process that waits (no polling) for
the replica's process to exit and then stops the children that `start()` created; it exits by itself when those
children exit first. Linux only (pidfds); elsewhere it does nothing.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Iterable

import psutil

log = logging.getLogger(__name__)

TERM_GRACE_S = 5.0  # SIGTERM lets EngineCore stop its own workers; SIGKILL after this


def children() -> set[int]:
    """The pids of this process's direct children now."""
    return {p.pid for p in psutil.Process().children(recursive=False)}


def guard(child_pids: Iterable[int]) -> subprocess.Popen | None:
    """Start the watcher for `child_pids` on behalf of this process; None where pidfds are missing."""
    pids = sorted(set(child_pids))
    if not pids or not hasattr(os, "pidfd_open"):
        return None
    # Its own session: a signal sent to the replica's process group must not take the watcher with it.
    return subprocess.Popen(
        [sys.executable, "-m", "serve_app.engine.reaper", str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def watch(parent: int, pids: list[int]) -> None:
    """Block until `parent` exits (then stop `pids`) or until every pid in `pids` has exited."""
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        parent_fd = None
    # pidfds name the exact processes, so a pid reused after an exit is never signalled.
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    poller = select.poll()
    for fd in ([parent_fd] if parent_fd is not None else []) + list(fds):
        poller.register(fd, select.POLLIN)
    while fds and parent_fd is not None:
        ready = {fd for fd, _ in poller.poll()}
        if parent_fd in ready:
            break
        for fd in ready & fds.keys():  # a child exited first: stop watching it, keep watching the rest
            poller.unregister(fd)
            del fds[fd]
            os.close(fd)
    if fds:
        _stop(fds)


def _stop(fds: dict[int, int]) -> None:
    for fd, pid in fds.items():
        _signal(fd, signal.SIGTERM)
        log.warning("engine process %d outlived its replica; stopping it", pid)
    alive = dict(fds)
    poller = select.poll()
    for fd in alive:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + TERM_GRACE_S
    while alive:
        ready = poller.poll(max(0, int((deadline - time.monotonic()) * 1000)))
        if not ready:
            break
        for fd, _ in ready:
            poller.unregister(fd)
            alive.pop(fd, None)
    for fd in alive:
        _signal(fd, signal.SIGKILL)


def _signal(fd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="reaper: %(message)s")
    watch(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
