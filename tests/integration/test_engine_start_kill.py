"""A process killed while its vLLM engine is still starting leaves no engine process behind (engine/reaper.py's
Guard): vLLM starts EngineCore early in start-up, which on a GPU then loads and compiles for minutes, and an orphaned
EngineCore keeps its memory (on a GPU, the next start finds none free). The real engine, SmolLM2 on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

STARTER = textwrap.dedent(
    """
    import sys, time
    from serve_app.settings import ModelConfig
    from serve_app.engine.provision import ensure_model
    from serve_app.engine.vllm_engine import VLLMEngine
    m = ModelConfig(id="smollm2-135m-instruct", max_model_len=2048, max_output_tokens=64,
                    engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, engine_kwargs={"enforce_eager": True})
    path = ensure_model(m.model_source, None)
    print("starting", flush=True)
    VLLMEngine(m, path, kv_events=False).start()
    open(sys.argv[1], "w").close()  # started (vLLM logs to stdout, so not there)
    time.sleep(600)
    """
)


def _cmdline(k: psutil.Process) -> str | None:
    """A child's command line; None once it has exited: start-up runs short-lived children, and one that ends
    while the children are listed is a zombie until its parent reaps it (or already gone)."""
    try:
        return " ".join(k.cmdline())
    except psutil.NoSuchProcess:  # psutil.ZombieProcess is one too
        return None


def _alive(k: psutil.Process) -> bool:
    try:
        return k.is_running() and k.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_process_killed_while_its_engine_starts_leaves_no_engine_process(tmp_path):
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", STARTER, str(started)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    kids: list[psutil.Process] = []
    try:
        assert proc.stdout.readline().strip() == "starting"
        deadline = time.monotonic() + 120
        engine = []
        while time.monotonic() < deadline and not engine:
            kids = psutil.Process(proc.pid).children(recursive=True)
            engine = [k for k in kids if (cmd := _cmdline(k)) is not None and "serve_app.engine.reaper" not in cmd]
            time.sleep(0.02)
        assert engine, "vLLM started no engine process"
        time.sleep(3 * 0.1 + 0.2)  # the watcher looks for new children every 0.1 s
        assert proc.poll() is None and not started.exists(), "the engine started before the kill: nothing was tested"
        proc.kill()  # SIGKILL mid-start: no Python shutdown code runs
        proc.wait()
        end = time.monotonic() + 30
        alive = kids
        while alive and time.monotonic() < end:
            alive = [k for k in kids if _alive(k)]
            time.sleep(0.1)
        assert not alive, f"outlived the process that started them: {[(_cmdline(k) or '')[:80] for k in alive]}"
    finally:
        for k in [*kids, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if k is not None:
                try:
                    k.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
        proc.wait()
