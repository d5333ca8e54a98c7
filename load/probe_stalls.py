"""When in a round the long inter-token gaps happen, for this app through the front door, this app straight to
its ingress replica, and vLLM's server, alternating round by round in one run (tiny model, as bench_capacity).

bench_capacity's ITL p99 at 128 streams moves 1.7x-6x vLLM's between runs of the same code; this probe says
whether the long gaps sit in the admission burst (every stream of a round starts at once, so until the last
stream's first token the server is still parsing, rendering and admitting requests while it streams the first
ones) or are spread over the steady streaming after it, and which path has them.

    python -m load.probe_stalls --rounds 4 --json load/results/stalls.json

`--cpu-timeline` also samples every process of this app's tree every 100 ms, and says for each stall (a gap
shared by at least half the streams) which processes ran above their usual share of the round meanwhile, against
the same count for windows of the same length where nothing stalled. `--engine-env KEY=VALUE` sets an engine
environment variable for both servers (an empty value unsets one of this app's small-host defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter

import aiohttp
import psutil

from load import provenance
from load.bench_capacity import (SETTLE_S, add_engine_placement_arg, free_port, one_stream, pct,
                                 replica_http_port, request_log, role_of, start_ours, start_vllm, stop, wait_healthy)
from load.tiny_model import ensure_tiny_model

LONG_GAP_S = 0.1  # vLLM's ITL p99 at 128 streams on these hosts is ~40-150 ms
SAMPLE_S = 0.1
ABOVE_USUAL_CORES = 0.15  # a process counts as bursting in a window when this far above its median share
RAY_DAEMONS = ("raylet", "gcs_server", "dashboard/agent", "dashboard", "log_monitor", "runtime_env")


def fine_role(proc: psutil.Process) -> str:
    """bench_capacity's role, with Ray's daemons told apart."""
    role = role_of(proc, "ours")
    if role == "ray_daemons":
        title = " ".join(proc.cmdline())
        return next((f"ray:{k.split('/')[-1]}" for k in RAY_DAEMONS if k in title), "ray:other")
    return role


class CpuTimeline:
    """Every SAMPLE_S, the cores each role of a process tree used since the last sample (a thread of this
    process; reading /proc costs a few ms a sample)."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._roles: dict[int, str] = {}

    def _cpu(self) -> dict[int, float]:
        out = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                if p.pid not in self._roles:
                    self._roles[p.pid] = fine_role(p)
                out[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def _run(self) -> None:
        prev, prev_t = self._cpu(), time.perf_counter()
        while not self._stop.wait(SAMPLE_S):
            cur, now = self._cpu(), time.perf_counter()
            by_role: dict[str, float] = {}
            for pid, cpu in cur.items():
                if pid in prev:
                    role = self._roles[pid]
                    by_role[role] = by_role.get(role, 0.0) + (cpu - prev[pid]) / (now - prev_t)
            self.samples.append((now, by_role))
            prev, prev_t = cur, now

    def __enter__(self) -> "CpuTimeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stall_events(streams: list[dict]) -> list[tuple[float, float]]:
    """(start, end) in seconds from the round's start of each stall shared by at least half the streams: long gaps
    grouped by start time (within SAMPLE_S of the group's first)."""
    starts = sorted((t - d, t) for s in streams for t, d in s["gaps"] if d >= LONG_GAP_S)
    events, group = [], []
    for b, e in starts:
        if group and b - group[0][0] > SAMPLE_S:
            events.append(group)
            group = []
        group.append((b, e))
    if group:
        events.append(group)
    return [(g[0][0], statistics.median(e for _, e in g)) for g in events if len(g) >= len(streams) / 2]


def bursts(samples: list[tuple[float, dict[str, float]]], t0: float, a: float, b: float,
           usual: dict[str, float]) -> dict[str, float]:
    """Roles above their usual cores in the window [a, b] (seconds from t0), by how much: the samples whose period
    (the SAMPLE_S before each) overlaps it."""
    inside = [r for t, r in samples if a < t - t0 < b + SAMPLE_S]
    out = {}
    for role, base in usual.items():
        mean = sum(r.get(role, 0.0) for r in inside) / max(len(inside), 1)
        if mean - base > ABOVE_USUAL_CORES:
            out[role] = round(mean - base, 2)
    return out


def attribute(streams: list[dict], samples: list[tuple[float, dict[str, float]]], t0: float, end: float,
              seed: int) -> dict:
    """Which processes burst during each stall, and how often the same happens in windows without a stall."""
    window = [(t, r) for t, r in samples if 0 <= t - t0 <= end]
    roles = {k for _, r in window for k in r}
    usual = {k: statistics.median(r.get(k, 0.0) for _, r in window) for k in roles}
    events = stall_events(streams)
    stalled = [bursts(window, t0, a, b, usual) for a, b in events]
    rng, calm = random.Random(seed), []
    for a, b in events:  # as many windows of the same lengths where no stream stalled
        for _ in range(50):
            x = rng.uniform(0, max(end - (b - a), 0))
            if all(x + (b - a) < p or x > q for p, q in events):
                calm.append(bursts(window, t0, x, x + (b - a), usual))
                break
    outside = ("engine_core", "ingress", "engine_replica", "router")  # the token path's own processes
    return {
        "stalls": [{"start_s": round(a, 2), "length_s": round(b - a, 2), "bursting": r}
                   for (a, b), r in zip(events, stalled)],
        "stalls_with_a_bursting_process_off_the_token_path": sum(
            1 for r in stalled if any(k not in outside for k in r)),
        "calm_windows": len(calm),
        "calm_windows_with_one": sum(1 for r in calm if any(k not in outside for k in r)),
    }


def _in_round(r: dict, prompt: str, t0: float) -> dict:
    """bench_capacity.one_stream's result with its times from the round's start (perf_counter() t0)."""
    return {"prompt": prompt, "sent": r["sent"], "first": r["first"] - t0,
            "first_wall": r["sent"] + r["first"] - r["started"],
            "gaps": [(e - t0, g) for e, g in zip(r["gap_ends"], r["gaps"])]}


async def _round(url: str, c: int, tokens: int, seed: int) -> list[dict]:
    prompts = [f"[{seed}.{i}] Write a story about the number {seed * 7919 + i}." for i in range(c)]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, p, tokens) for p in prompts))
    return [_in_round(r, p, t0) for r, p in zip(results, prompts)]


def run_round(url: str, c: int, tokens: int, seed: int, timeline_root: int | None) -> tuple[list[dict], dict | None]:
    if timeline_root is None:
        return asyncio.run(_round(url, c, tokens, seed)), None
    with CpuTimeline(timeline_root) as tl:
        t0 = time.perf_counter()
        streams = asyncio.run(_round(url, c, tokens, seed))
        end = time.perf_counter() - t0
    return streams, attribute(streams, tl.samples, t0, end, seed)


def summarize(streams: list[dict]) -> dict:
    admitted = max(s["first"] for s in streams)  # the last stream's first token: the admission burst is over
    gaps = [g for s in streams for g in s["gaps"]]
    during = [d for t, d in gaps if t - d < admitted]  # gaps that began before the last first token
    after = [d for t, d in gaps if t - d >= admitted]
    long_ = [(t, d) for t, d in gaps if d >= LONG_GAP_S]
    return {
        "admission_s": round(admitted, 3),
        "ttft_p50_ms": round(1000 * pct([s["first"] for s in streams], 0.5), 1),
        "itl_p99_ms": round(1000 * pct([d for _, d in gaps], 0.99), 1),
        "itl_p99_during_admission_ms": round(1000 * pct(during, 0.99), 1),
        "itl_p99_after_admission_ms": round(1000 * pct(after, 0.99), 1),
        "gaps_during_admission": len(during),
        "gaps_after_admission": len(after),
        "long_gaps": len(long_),
        "long_gaps_during_admission": sum(1 for t, d in long_ if t - d < admitted),
        "longest_gap_ms": round(1000 * max(d for _, d in gaps), 1),
        # Long gaps by the second of the round they ended in: a stall shared by all streams is one column.
        "long_gaps_by_second": {str(k): v for k, v in sorted(Counter(int(t) for t, _ in long_).items())},
    }


def ttft_split(streams: list[dict], log: dict[str, dict]) -> dict:
    """Where each request's client TTFT went, from the request log's line for it (matched by its prompt text):
    before the app (client send -> ASGI entry: the connection, the front door, the replica's HTTP server and
    Serve's per-request wrapper), inside the app (ASGI entry -> first token at the ingress: the log's ttft_s) and
    after (that first token -> the client reading its frame)."""
    before, inside, after = [], [], []
    for s in streams:
        rec = log.get(s["prompt"])
        if not rec or rec.get("ttft_s") is None or rec.get("duration_s") is None:
            continue
        arrived = rec["ts"] - rec["duration_s"]
        before.append(arrived - s["sent"])
        inside.append(rec["ttft_s"])
        after.append(s["first_wall"] - arrived - rec["ttft_s"])
    out: dict = {"matched": len(before)}
    for name, xs in (("before_app", before), ("in_app", inside), ("after_app", after)):
        out[f"{name}_p50_ms"] = round(1000 * pct(xs, 0.5), 1)
        out[f"{name}_p90_ms"] = round(1000 * pct(xs, 0.9), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    add_engine_placement_arg(ap, default="ingress")
    ap.add_argument("--cpu-timeline", action="store_true", help="attribute each stall to the processes bursting then")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="engine environment for both servers, repeatable")
    ap.add_argument("--json")
    a = ap.parse_args()
    engine_env = dict(kv.split("=", 1) for kv in a.engine_env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = ensure_tiny_model()
    log = open(tempfile.mkstemp(prefix="probe_stalls_", suffix=".log")[1], "w")
    ports = {"ours": free_port(), "vllm": free_port()}
    # Ray's workers inherit serve run's environment, so the engine's variables reach ours through it.
    procs = [start_ours(ports["ours"], model, 1, log, engine_env, engine_placement=a.engine_placement,
                        ingress_set={"log_request_text": True}),  # to match the request log's lines to requests
             start_vllm(ports["vllm"], model, log, extra_env=engine_env)]
    try:
        wait_healthy(f"http://127.0.0.1:{ports['ours']}", procs[0])
        wait_healthy(f"http://127.0.0.1:{ports['vllm']}", procs[1])
        urls = {"ours_front_door": f"http://127.0.0.1:{ports['ours']}",
                "ours_replica": f"http://127.0.0.1:{replica_http_port(ports['ours'])}",
                "vllm": f"http://127.0.0.1:{ports['vllm']}"}
        for url in urls.values():  # warm-up
            asyncio.run(_round(url, 8, 16, seed=-1))
        rounds: dict[str, list[dict]] = {n: [] for n in urls}
        raw: dict[str, list[list[dict]]] = {n: [] for n in urls}
        names = list(urls)
        for r in range(a.rounds):
            for n in names[r % 3:] + names[:r % 3]:  # rotate the order so no path always follows another
                time.sleep(SETTLE_S)
                root = procs[0].pid if a.cpu_timeline and n.startswith("ours") else None
                streams, attributed = run_round(urls[n], a.concurrency, a.tokens, r * 10 + names.index(n), root)
                raw[n].append(streams)
                rounds[n].append(summarize(streams))
                if attributed is not None:
                    rounds[n][-1]["cpu_timeline"] = attributed
                print(f"round {r} {n}: {json.dumps(rounds[n][-1])}", flush=True)
        time.sleep(3)  # Ray forwards the replica's stdout (the request log) with a short delay
        log.flush()
        lines = {rec["text"]: rec for rec in request_log(log.name) if "text" in rec}
        for n in ("ours_front_door", "ours_replica"):
            for row, streams in zip(rounds[n], raw[n]):
                row["ttft_split"] = ttft_split(streams, lines)
        out = {**provenance.header("load.probe_stalls", sys.argv[1:]), "concurrency": a.concurrency, "tokens_per_request": a.tokens, "engine_placement": a.engine_placement,
               "engine_env": engine_env,
               "long_gap_s": LONG_GAP_S, "rounds": rounds}
        if a.json:
            provenance.write(a.json, out)
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
