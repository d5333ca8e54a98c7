"""Agent-shaped load at high concurrency on the frontend-bound tiny model, with the serving path's CPU per token.

Starts this app on load/tiny_model.py (dummy weights, so the serving path is what is loaded) with forced scripts
on, runs load/locustfile.py headless with `--scripted` (Claude-Code-, Codex- and chat-shaped sessions: thinking,
tool calls, growing histories), and reads every server process's CPU from /proc, by role, as
load/bench_capacity.py does. The result file records the command, commit and host, Locust's summary (failures,
TTFT, ITL, cached fraction) and CPU seconds per 1,000 streamed output tokens.

    python -m load.locust_capacity --users 64 --run-time 180 --json load/results/locust_capacity.json
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from load import provenance
from load.bench_capacity import (ROOT, CpuMeter, add_engine_placement_arg, add_front_arg, add_launcher_arg, free_port,
                                 start_server, stop, wait_healthy, with_front)

PY = sys.executable


def config(port: int, model_path: str, engine_placement: str = "deployment", front: str = "haproxy",
           ingress_set: dict | None = None) -> dict:
    served = yaml.safe_load((ROOT / "config.yaml").read_text())
    model = {
        "id": "tiny",
        "source": model_path,
        # The ids the locustfile's sessions ask for by default.
        "aliases": ["claude-sonnet-4-6", "gpt-5.5", "smollm2"],
        "max_model_len": 8192,
        "max_output_tokens": 2048,
        "reasoning_parser": "qwen3",
        "tool_parser": "hermes",
        "chat_template": "serve_app/templates/smollm2_tools.jinja",
        "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "2"},
        "engine_kwargs": {"enforce_eager": True, "load_format": "dummy"},
    }
    return with_front({
        **{k: served[k] for k in ("controller_options", "proxy_location") if k in served},
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "route_prefix": "/", "import_path": "serve_app.app:build_app",
                          "args": {"models": [model], "testing": {"forced_scripts": True},
                                   "engine_placement": engine_placement,
                                   "ingress": {"api_keys": ["sk-load-test"], "strip_preamble": True,
                                               **(ingress_set or {})}}}],
    }, front)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--run-time", type=int, default=180, help="seconds")
    ap.add_argument("--max-turns", type=int, default=4)
    add_engine_placement_arg(ap)
    add_front_arg(ap)
    add_launcher_arg(ap)
    ap.add_argument("--ingress-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an ingress setting for this run (YAML value), e.g. render_inline_chars=0; repeatable")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    ingress_set = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.ingress_set)}

    from load.tiny_model import ensure_tiny_model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    cfg = Path(tempfile.mkdtemp()) / "locust_capacity.yaml"
    cfg.write_text(yaml.safe_dump(config(port, ensure_tiny_model(), a.engine_placement, a.front, ingress_set)))
    log = open(tempfile.mkstemp(prefix="locust_capacity_", suffix=".log")[1], "w")
    server = start_server(cfg, a.launcher, log)
    summary_path = Path(tempfile.mkdtemp()) / "summary.json"
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server, headers={"authorization": "Bearer sk-load-test"})
        meter = CpuMeter(server.pid, "ours")
        before = meter.snapshot()
        t0 = time.monotonic()
        locust = subprocess.run(
            [str(Path(PY).parent / "locust"), "-f", str(ROOT / "load" / "locustfile.py"), "--headless", "--host", url,
             "--users", str(a.users), "--spawn-rate", str(max(1, a.users // 10)), "--run-time", f"{a.run_time}s",
             "--stop-timeout", "120", "--scripted", "--max-turns", str(a.max_turns), "--max-tokens", "128",
             "--system-tokens", "1500", "--summary-json", str(summary_path), "--only-summary"],
            cwd=ROOT, capture_output=True, text=True, timeout=a.run_time + 600)
        wall = time.monotonic() - t0
        cpu = CpuMeter.delta(before, meter.snapshot())
        summary = json.loads(summary_path.read_text())
        tokens = summary["output_tokens"]["total"]
        per_1k = {k: round(1000 * v / max(tokens, 1), 4) for k, v in sorted(cpu.items())}
        serving = sum(v for k, v in per_1k.items() if k in ("proxy", "ingress", "router", "engine_replica"))
        out = {
            **provenance.header("load.locust_capacity", sys.argv[1:]),
            "model": "tiny-random-smollm2 (dummy weights) with forced agent scripts (qwen3 thinking, hermes tools)",
            "engine_placement": a.engine_placement,
            "front": a.front,
            "launcher": a.launcher,
            "ingress_set": ingress_set,
            "users": a.users,
            "run_time_s": a.run_time,
            "wall_s": round(wall, 1),
            "locust_exit_code": locust.returncode,
            "summary": summary,
            "output_tokens_per_s": round(tokens / wall, 1),
            "cpu_s_per_1k_tokens": per_1k,
            "serving_path_cpu_s_per_1k_tokens": round(serving, 4),
        }
        print(json.dumps(out, indent=2))
        if locust.returncode not in (0, 1):
            print(locust.stderr[-3000:], file=sys.stderr)
        if a.json:
            provenance.write(a.json, out)
    finally:
        stop([server])


if __name__ == "__main__":
    main()
