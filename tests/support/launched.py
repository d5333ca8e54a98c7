"""The README's first command as a subprocess, on config.yaml as shipped plus the test hooks: another port, the
suite's forced scripts (so the engine says exactly what a test expects) and a Responses file of the test's.
Used by the launcher's tests (test_serve_app_run on Ray, test_single_process without it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import yaml

from serve_app.engine.vllm_engine import free_port
from tests.conftest import load_test_config
from tests.support.apps import healthy

ROOT = Path(__file__).resolve().parents[2]


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def titles(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline()) or p.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def shipped_config_with_hooks(tmp: Path, edit: Callable[[dict], None] | None = None) -> tuple[Path, int]:
    """config.yaml with the test hooks, written under `tmp`; returns its path and port. `edit(args)` changes the
    application's args first (a test's own models or tenants)."""
    port = free_port()
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["ingress"]["listen"]["port"] = port
    args["ingress"]["response_store_path"] = str(tmp / "responses.sqlite3")
    args["testing"] = load_test_config()["applications"][0]["args"]["testing"]  # forced scripts and CLI rules
    if edit is not None:
        edit(args)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def start(tmp: Path, *extra: str, edit: Callable[[dict], None] | None = None
          ) -> tuple[subprocess.Popen, str, Path]:
    """`python -m serve_app run <config> *extra` started in its own session on config.yaml with the test hooks (and
    `edit`, shipped_config_with_hooks); returns (process, URL, log) at once."""
    path, port = shipped_config_with_hooks(tmp, edit)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED")}
    log_path = tmp / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serve_app", "run", str(path), *extra], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of `proc`'s process tree (its session and any child that left it)."""
    if proc.poll() is not None:
        return
    try:
        procs = tree(proc.pid)
    except psutil.NoSuchProcess:
        procs = []
    os.killpg(proc.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def launch(tmp: Path, *extra: str, timeout_s: float = 600, edit: Callable[[dict], None] | None = None
           ) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`start`, yielded once healthy as (process, URL, log); whatever is left of its process tree is killed
    afterwards."""
    proc, url, log_path = start(tmp, *extra, edit=edit)
    try:
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            assert proc.poll() is None, f"exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        yield proc, url, log_path
    finally:
        kill_tree(proc)


def interrupted_cleanly(proc: subprocess.Popen, url: str, log: Path, interrupt, timeout_s: float) -> None:
    """Call `interrupt()` (a SIGINT to the launcher, or to its group as a terminal sends it), then check that the
    launcher exits with 0 within `timeout_s`, its URL no longer answers, and every process of its tree is gone
    within a minute."""
    import pytest

    procs = tree(proc.pid)
    interrupt()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout_s:g} s after SIGINT: {log.read_text()[-3000:]}")
    assert rc == 0, log.read_text()[-3000:]
    assert not healthy(url)
    deadline = time.monotonic() + 60
    while left := titles([p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
        assert time.monotonic() < deadline, f"still running after the launcher exited: {left}"
        time.sleep(1)
