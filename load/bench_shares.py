"""Weighted fair shares under saturation, side by side in one run: two tenants of one tier, `a` and `b`, each keep
the same number of long streams open, so both always have requests waiting inside vLLM. Run three times on the same
server config: `b` given share 2 (`tenants.b.share`, serve_app/engine/fair_share.py); equal shares (both 1, the
default); and first come, first served (`ingress.fair_share: false`, what vLLM's own queue does). The figure is each
tenant's output tokens over the measured window (requests that finished in it) and `b`'s over `a`'s: the operator
asked for 2, equal shares and arrival order give what the clients' own pace gives.

The frontend-bound tiny model (load/tiny_model.py, random weights) on `python -m serve_app run --single-process`,
config.yaml's topology, with `max_num_seqs` small so that requests wait inside vLLM, where the shares act.

    python -m load.bench_shares --json load/results/shares.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from load import provenance
from load.bench_capacity import free_port
from load.bench_tiers import config, serve_and_load, stream
from load.tiny_model import ensure_tiny_model

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b"}
SHARES = {"weighted": {"a": 1, "b": 2}, "equal": {"a": 1, "b": 1}, "fcfs": {"a": 1, "b": 1}}
FAIR_SHARE = {"weighted": True, "equal": True, "fcfs": False}


async def load(url: str, a: argparse.Namespace) -> dict:
    """Each tenant keeps `streams` requests of `tokens` output tokens open; after `warmup_s`, the tokens of the
    requests that finish within `measure_s`, per tenant."""
    done = asyncio.Event()
    window: list[float] = []
    tokens = {t: 0 for t in KEYS}
    finished = {t: 0 for t in KEYS}
    limits = httpx.Limits(max_connections=2 * a.streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(tenant: str) -> None:
            while not done.is_set():
                n = await stream(client, KEYS[tenant], a.tokens)
                if len(window) == 1:  # finished inside the measured window
                    tokens[tenant] += n
                    finished[tenant] += 1

        workers = [asyncio.create_task(worker(t)) for t in KEYS for _ in range(a.streams)]
        await asyncio.sleep(a.warmup_s)  # both queues fill
        window.append(time.monotonic())
        await asyncio.sleep(a.measure_s)
        window.append(time.monotonic())
        done.set()
        await asyncio.gather(*workers)
    span = window[1] - window[0]
    return {"measured_s": round(span, 2), "finished": finished, "tokens": tokens,
            "tokens_per_s": {t: round(n / span, 1) for t, n in tokens.items()}}


def run_variant(name: str, a: argparse.Namespace, model_path: str) -> dict:
    tenants = {t: {"share": s} for t, s in SHARES[name].items()}
    port = free_port()
    cfg = config(port, model_path, tenants, a.max_num_seqs, FAIR_SHARE[name], keys=KEYS)
    seen, _, _ = serve_and_load(f"shares-{name}", cfg, port, KEYS["a"], lambda url: load(url, a))
    if not seen["tokens"]["a"] or not seen["tokens"]["b"]:
        raise RuntimeError(f"{name}: a tenant finished nothing in the window: {seen}")
    out = {"shares": SHARES[name], "fair_share": FAIR_SHARE[name], **seen,
           "b_over_a": round(seen["tokens"]["b"] / seen["tokens"]["a"], 3)}
    print(name, out, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-seqs", type=int, default=2, help="the engine's running requests at most")
    ap.add_argument("--streams", type=int, default=8, help="streams each tenant keeps open")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request (ignore_eos)")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="load before the measured window")
    ap.add_argument("--measure-s", type=float, default=60.0)
    ap.add_argument("--json", help="write the result here")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    doc = provenance.header("load.bench_shares", argv)
    model_path = ensure_tiny_model()
    variants = {name: run_variant(name, a, model_path) for name in SHARES}
    doc.update({"settings": {k: v for k, v in vars(a).items() if k != "json"}, "variants": variants,
                "b_over_a": {name: v["b_over_a"] for name, v in variants.items()}})
    print(doc["b_over_a"], flush=True)
    if a.json:
        provenance.write(a.json, doc)


if __name__ == "__main__":
    main()
