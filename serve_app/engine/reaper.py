"""Engine processes die with the replica that started them.

vLLM runs its EngineCore in a child process that waits on a socket and never notices its parent is gone. When Ray
kills an Engine replica (a crash, `ray stop --force`, an actor kill) no Python shutdown code runs, so the child
would keep its memory and threads forever. A small watcher process waits (no polling) for the replica's process to
exit and then stops the children that `start()` created; it exits by itself when those children exit first. Linux
only (pidfds); elsewhere it does nothing.

Starting an engine takes seconds on a CPU and minutes on a GPU (weights, compilation), and vLLM starts EngineCore
at the beginning of it: a replica killed meanwhile would leave a half-started engine holding its memory (on a GPU,
the next start then finds none free). So `Guard()`, made before the engine is created, starts the watcher at once;
until `Guard.arm` names the engine's children it notes every new child of the replica's process (`PENDING_POLL_S`)
and, if the replica dies first, stops those; armed, it watches exactly the named ones.
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
PENDING_POLL_S = 0.1  # how often a watcher not yet armed looks for new children of the replica


def children() -> set[int]:
    """The pids of this process's direct children now."""
    return {p.pid for p in psutil.Process().children(recursive=False)}


class Guard:
    """The watcher for an engine about to start: `Guard()` before creating it, `arm(new children)` after (also
    when creating it failed). Does nothing where pidfds are missing."""

    def __init__(self, existing: Iterable[int] = ()):
        self.proc: subprocess.Popen | None = None
        if hasattr(os, "pidfd_open"):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serve_app.engine.reaper", "--pending", str(os.getpid()),
                 *map(str, sorted(set(existing)))],
                # Its own session: a signal sent to the replica's process group must not take the watcher with it.
                stdin=subprocess.PIPE, text=True, start_new_session=True)

    def arm(self, child_pids: Iterable[int]) -> subprocess.Popen | None:
        """Hand the watcher the engine's children (it then watches exactly those); with none it exits."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        pids = sorted(set(child_pids) - {proc.pid})  # the watcher is a new child of the replica too
        try:
            proc.stdin.write(" ".join(map(str, pids)) + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            return None
        return proc if pids else None


def watch_pending(parent: int, existing: set[int]) -> None:
    """Until the parent names its engine's children on stdin, note every new child of `parent` (by pidfd, so a
    reused pid is never signalled); if `parent` exits first, stop those. Then `watch` the named ones."""
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        return  # gone before anything started
    existing = existing | {os.getpid()}  # this watcher is one of the parent's children
    seen: dict[int, int] = {}  # pidfd -> pid
    poller = select.poll()
    poller.register(parent_fd, select.POLLIN)
    poller.register(sys.stdin.fileno(), select.POLLIN)
    line = None
    while True:
        ready = {fd for fd, _ in poller.poll(int(PENDING_POLL_S * 1000))}
        _note_children(parent, existing, seen)
        if parent_fd in ready:
            break
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            break
    # The parent died while its engine was starting: its end of stdin closes as it exits, which may show before
    # its pidfd does (an end of file, not a line: `arm` always ends its line)
    if line is None or not line.endswith("\n"):
        if seen:
            _stop(seen)
        return
    for fd in seen:
        os.close(fd)
    os.close(parent_fd)
    pids = [int(p) for p in line.split()]
    if pids:
        watch(parent, pids)


def _note_children(parent: int, existing: set[int], seen: dict[int, int]) -> None:
    try:
        kids = psutil.Process(parent).children(recursive=False)
    except psutil.NoSuchProcess:
        return
    known = set(seen.values())
    for kid in kids:
        if kid.pid in existing or kid.pid in known:
            continue
        try:
            seen[os.pidfd_open(kid.pid)] = kid.pid
        except ProcessLookupError:
            pass


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
    assert sys.argv[1] == "--pending", sys.argv
    watch_pending(int(sys.argv[2]), {int(a) for a in sys.argv[3:]})
