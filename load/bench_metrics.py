"""Per-token cost of recording the service's metrics, against the serving path's CPU budget (docs/serving-path.md).

The per-token metric calls are `instrument_stream`'s: a clock read and an inter-token observation per content
event. This times a stream of N text deltas through `instrument_stream` minus the same stream passed through bare,
in CPU time of the recording thread, for each way the metrics can be recorded:
  local   the process-local prometheus_client registry (what a process outside Ray records into)
  ray     ray.util.metrics, inside a Ray actor (what a Serve replica records into: one registry, exported by
          the node's metrics agent)
  before  the previous module (`--before`, read from git), which recorded each observation into both
and also one bare `observe_inter_token` call per backend. Needs a local Ray (started here, one CPU).

    python load/bench_metrics.py --save load/results/metrics_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# docs/serving-path.md, this app alone at concurrency 32 with both structural levers (CPU s per 1K tokens).
BUDGET_US_PER_TOKEN = {"ingress": 67.0, "serving_path": 120.0}


def load_before(rev: str):
    """The metrics module as it was at `rev`, under another name (it registers its own local registry)."""
    text = subprocess.run(["git", "show", f"{rev}:serve_app/metrics.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("serve_app_metrics_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, f"{rev}:serve_app/metrics.py", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


def measure(module, tokens: int, repeat: int) -> dict:
    """CPU µs per token of instrument_stream over a bare pass-through, and of one inter-token observation."""
    from serve_app.conversation import Finish, TextDelta, Usage

    deltas = [TextDelta(text="x")] * tokens
    tail = [Usage(prompt_tokens=1000, completion_tokens=tokens, cached_tokens=500), Finish(reason="stop")]

    async def source():
        for ev in deltas:
            yield ev
        for ev in tail:
            yield ev

    async def drain(events):
        async for _ in events:
            pass

    def cpu(fn, clock=time.thread_time) -> float:
        best = float("inf")
        for _ in range(repeat):
            t = clock()
            fn()
            best = min(best, clock() - t)
        return best

    loop = asyncio.new_event_loop()
    try:
        api = "bench"
        module.observe_inter_token(api, 0.01)  # label children and backends exist before timing
        bare = cpu(lambda: loop.run_until_complete(drain(source())))
        instrumented = cpu(lambda: loop.run_until_complete(drain(module.instrument_stream(api, source()))))
        calls = cpu(lambda: [module.observe_inter_token(api, 0.01) for _ in range(tokens)])
        # The whole process too: work a backend hands to its own threads would show here, not above.
        bare_p = cpu(lambda: loop.run_until_complete(drain(source())), time.process_time)
        instrumented_p = cpu(lambda: loop.run_until_complete(drain(module.instrument_stream(api, source()))),
                             time.process_time)
    finally:
        loop.close()
    return {"stream_us_per_token": 1e6 * (instrumented - bare) / tokens,
            "stream_us_per_token_process_cpu": 1e6 * (instrumented_p - bare_p) / tokens,
            "observe_inter_token_us": 1e6 * calls / tokens,
            "bare_stream_us_per_token": 1e6 * bare / tokens}


def _in_actor(before_rev: str | None, tokens: int, repeat: int) -> dict:
    from serve_app import metrics

    out = {"ray": {"backend_is_ray": metrics.in_ray_worker(), **measure(metrics, tokens, repeat)}}
    if before_rev:
        out["before"] = measure(load_before(before_rev), tokens, repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", default="1c60a81", help="git revision of the two-copy module ('' to skip)")
    ap.add_argument("--save", metavar="PATH")
    a = ap.parse_args()

    import ray

    from load import provenance
    from serve_app import metrics

    rows = {"local": {"backend_is_ray": metrics.in_ray_worker(), **measure(metrics, a.tokens, a.repeat)}}
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        remote = ray.remote(num_cpus=1)(_in_actor)
        rows.update(ray.get(remote.remote(a.before or None, a.tokens, a.repeat)))
    finally:
        ray.shutdown()
    assert rows["ray"]["backend_is_ray"] and not rows["local"]["backend_is_ray"]
    for row in rows.values():
        row["share_of_budget"] = {k: row["stream_us_per_token"] / v for k, v in BUDGET_US_PER_TOKEN.items()}
    meta = {**provenance.header("load/bench_metrics.py", sys.argv[1:]), "ray": ray.__version__,
            "tokens": a.tokens, "repeat": a.repeat, "cpu_time": "thread CPU time (and process CPU time), best of repeat",
            "budget_us_per_token": BUDGET_US_PER_TOKEN,
            "budget_source": "docs/serving-path.md: this app alone, c=32, delta channel + direct ingress"}
    result = {"meta": meta, "rows": rows}
    print(json.dumps(result, indent=2))
    if a.save:
        provenance.write(a.save, result)


if __name__ == "__main__":
    main()
