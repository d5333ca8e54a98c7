"""What every result file in load/results/ records, and how it is written.

A figure in the README is kept only if its result file says which command wrote it, at which commit, on which host
and when (README "Performance"); every script in load/ takes those four fields from `header()` and writes
its file with `write()`, so they read the same everywhere (load/plots.py captions figures from them).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def git_commit(root: str | Path = ROOT) -> str:
    """HEAD of the checkout at `root` (this one by default), with `+dirty` when tracked files differ from it.
    Result files the run itself (or the run before it) rewrote do not make the measured code dirty."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!load/results"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# CPU features that change which kernels (and dtype: engine/vllm_engine.keeps_float32) a CPU engine runs; VM model
# names ("Intel(R) Xeon(R) Processor") do not say.
CPU_FEATURES = ("avx512f", "avx512_bf16", "amx_bf16")


def host() -> dict:
    cpu, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                if cpu and flags:
                    break
    except OSError:
        pass
    return {"hostname": platform.node(), "cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "cpu_features": [f for f in CPU_FEATURES if f in flags],
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version()}


def header(script: str, argv: list[str]) -> dict:
    """The four fields a result file starts with. `script`: how the README runs it, a module for `python -m`
    (`load.bench_idle`), a file (`load/bench_parsers.py`) or a program on the PATH (`locust`); `argv`: its
    arguments."""
    if script.endswith(".py"):
        run = ["python", script]
    elif "." in script:
        run = ["python", "-m", script]
    else:
        run = [script]
    return {"command": " ".join([*run, *argv]), "commit": git_commit(), "host": host(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write(path: str | Path, doc: dict, indent: int = 2) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
