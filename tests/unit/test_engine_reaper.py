"""The reaper stops an engine's child processes once the process that started them is killed, and only then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from serve_app.engine import reaper

if not hasattr(os, "pidfd_open"):  # the reaper waits on pidfds; CI runs on Linux, where it must be tested
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise RuntimeError("CI requires os.pidfd_open (Linux) for the engine reaper tests")
    pytest.skip("pidfds are Linux-only", allow_module_level=True)

# A stand-in for an Engine replica: starts a long-lived child the way vLLM starts EngineCore, guards it, reports.
REPLICA = textwrap.dedent(
    """
    import subprocess, sys, time
    from serve_app.engine import reaper
    before = reaper.children()
    guard = reaper.Guard(before)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = guard.arm(reaper.children() - before)
    print(child.pid, watcher.pid, flush=True)
    time.sleep(600)
    """
)


def _wait_gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def replica():
    proc = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True)
    child, watcher = map(int, proc.stdout.readline().split())
    yield proc, child, watcher
    for pid in (proc.pid, child, watcher):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_killed_replica_takes_its_engine_process_with_it(replica):
    proc, child, watcher = replica
    assert not _wait_gone(child, 0.5), "the child must live while its replica does"
    proc.kill()  # SIGKILL: no Python shutdown code runs, as when Ray kills an actor
    proc.wait()
    assert _wait_gone(child, 30), "the engine process outlived its replica"
    assert _wait_gone(watcher, 30), "the watcher must exit once its work is done"


def test_watcher_exits_when_the_children_exit_first(replica):
    proc, child, watcher = replica
    os.kill(child, signal.SIGTERM)  # a clean engine shutdown
    assert _wait_gone(watcher, 30)
    assert proc.poll() is None, "the replica itself is untouched"


def test_a_child_that_exits_first_leaves_the_others_guarded():
    # vLLM's engine has more than one child (EngineCore, its resource tracker): one may exit before the replica.
    import threading

    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    errors = []

    def run():
        try:
            reaper.watch(parent.pid, [quick.pid, slow.pid])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    watcher = threading.Thread(target=run)
    watcher.start()
    try:
        quick.wait(timeout=30)
        time.sleep(0.5)
        assert watcher.is_alive() and not errors, errors  # still watching `slow` for its parent
        parent.kill()
        watcher.join(timeout=30)
        assert not errors, errors
        assert slow.wait(timeout=30) == -signal.SIGTERM
    finally:
        for p in (parent, slow):
            p.kill()
            p.wait()


def test_child_ignoring_sigterm_is_killed(monkeypatch):
    monkeypatch.setattr(reaper, "TERM_GRACE_S", 0.2)
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    stubborn.stdout.readline()  # SIG_IGN is in place
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait()  # a parent that has already exited: the watcher stops the children at once
    # Its pid is reaped, so pidfd_open fails: the watcher treats a missing parent as a dead one.
    reaper.watch(parent.pid, [stubborn.pid])
    assert stubborn.wait(timeout=30) == -signal.SIGKILL


# A replica whose engine is still starting: the watcher runs before the engine's children exist.
STARTING = textwrap.dedent(
    """
    import subprocess, sys, time
    from serve_app.engine import reaper
    before = reaper.children()
    guard = reaper.Guard(before)
    time.sleep(0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, guard.proc.pid, flush=True)
    if sys.argv[1] == "arm":
        print(guard.arm(reaper.children() - before).pid, flush=True)
    time.sleep(600)
    """
)


def _starting(mode: str):
    proc = subprocess.Popen([sys.executable, "-c", STARTING, mode], stdout=subprocess.PIPE, text=True)
    child, watcher = map(int, proc.stdout.readline().split())
    return proc, child, watcher


def _cleanup(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_replica_killed_while_its_engine_starts_takes_the_started_children_with_it():
    proc, child, watcher = _starting("pending")
    try:
        time.sleep(3 * reaper.PENDING_POLL_S + 0.2)  # the watcher has seen the new child
        assert not _wait_gone(child, 0.3) and not _wait_gone(watcher, 0.1)
        proc.kill()  # before `arm`: the engine was still starting
        proc.wait()
        assert _wait_gone(child, 30), "a half-started engine outlived its replica"
        assert _wait_gone(watcher, 30)
    finally:
        _cleanup(proc.pid, child, watcher)
        proc.wait()


def test_an_armed_guard_watches_exactly_the_engines_children():
    proc, child, watcher = _starting("arm")
    try:
        assert int(proc.stdout.readline()) == watcher  # the same watcher, now armed
        assert not _wait_gone(watcher, 1.0), "armed, it waits for the replica"
        os.kill(child, signal.SIGTERM)  # the engine stops cleanly: nothing left to guard
        assert _wait_gone(watcher, 30)
        assert proc.poll() is None and psutil.Process(proc.pid).is_running()  # the watcher never signals itself
    finally:
        _cleanup(proc.pid, child, watcher)
        proc.wait()


def test_arming_with_no_children_ends_the_watcher():
    before = reaper.children()
    guard = reaper.Guard(before)
    watcher = guard.proc
    assert guard.arm(reaper.children() - before) is None  # only the watcher itself is new: nothing to guard
    assert watcher.wait(timeout=30) == 0
