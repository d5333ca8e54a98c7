"""Cold prefill time of the default config's 32K engine against prompt length, and what it predicts for a prompt
of a given size (Claude Code's first request by default: load/results/first_turn_cpu.json).

Why: the first Claude Code turn on two CPU cores is bounded by one cold prefill of Claude Code's whole first
prompt. This measures it on vLLM directly (the engine the config builds, `build_engine_args`, no serving path),
with random token ids so nothing is cached, fits time = a*n + b*n^2 (the linear layers and the attention) and
extrapolates to the target length. `--chunk` tries another `max_num_batched_tokens`, `--dtype` another dtype,
`--sliding-window` another attention window (0: full attention). Where the target length is one of the sizes,
its measured time is recorded beside the prediction (the quadratic fit does not describe a windowed model).

    python -m load.bench_prefill --json load/results/prefill_cpu.json
    python -m load.bench_prefill --sizes 8192,16384,31752 --json load/results/prefill_cpu_window.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SIZES = (2048, 4096, 8192)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of t = a*n + b*n^2 (no constant: an empty prompt costs nothing)."""
    s11 = sum(n * n for n, _ in points)
    s12 = sum(n ** 3 for n, _ in points)
    s22 = sum(n ** 4 for n, _ in points)
    y1 = sum(n * t for n, t in points)
    y2 = sum(n * n * t for n, t in points)
    det = s11 * s22 - s12 * s12
    return (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det


def target_tokens() -> int | None:
    try:
        first = json.loads((ROOT / "load" / "results" / "first_turn_cpu.json").read_text())
        return max(r["prompt_tokens"] for r in first["results"]["requests"])
    except (OSError, KeyError, ValueError):
        return None


async def measure(model_id: str, sizes: list[int], chunk: int | None, dtype: str | None = None,
                  window: int | None = None) -> tuple[int, list[tuple[int, float]]]:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_app.engine import provision
    from serve_app.engine.vllm_engine import build_engine_args, cpu_thread_env
    from serve_app.settings import AppSettings

    args = yaml.safe_load((ROOT / "config.yaml").read_text())["applications"][0]["args"]
    model = next(m for m in AppSettings.model_validate(args).models if m.id == model_id)
    extra = {**({"max_num_batched_tokens": chunk} if chunk else {}), **({"dtype": dtype} if dtype else {})}
    update: dict = {"engine_kwargs": {**model.engine_kwargs, **extra}}
    if window is not None:  # 0: full attention at the same context
        update["sliding_window"] = window or None
        if not window:
            update["hf_overrides"] = {**model.hf_overrides, "max_position_embeddings": model.max_model_len}
    model = model.model_copy(update=update)
    os.environ.update({**cpu_thread_env(os.sched_getaffinity(0), dict(os.environ)), **model.engine_env})
    engine = AsyncLLM.from_engine_args(build_engine_args(model, provision.ensure_model(model.model_source)))
    batched = engine.vllm_config.scheduler_config.max_num_batched_tokens
    rng = random.Random(0)
    points = []
    try:
        for n in sizes:
            ids = [rng.randrange(100, 40000) for _ in range(n)]  # random: no block of it is cached
            t0 = time.perf_counter()
            async for _ in engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), f"prefill-{n}"):
                pass
            points.append((n, time.perf_counter() - t0))
            print(f"{n} tokens: {points[-1][1]:.1f} s", flush=True)
    finally:
        engine.shutdown()
    return batched, points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct-32k", help="a model id of config.yaml")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--chunk", type=int, help="max_num_batched_tokens (default: the config's, vLLM's default)")
    ap.add_argument("--dtype", help="engine dtype (default: the config's choice for this host)")
    ap.add_argument("--sliding-window", type=int, help="attention window (default: the config's; 0: full attention)")
    ap.add_argument("--target", type=int, help="prompt length to predict (default: Claude Code's first request)")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args()
    from load import provenance

    batched, points = asyncio.run(measure(a.model, [int(x) for x in a.sizes.split(",")], a.chunk, a.dtype,
                                          a.sliding_window))
    lin, quad = fit(points) if len(points) > 1 else (float("nan"), float("nan"))  # one size: measured only
    target = a.target or target_tokens()
    out = {
        **provenance.header("load.bench_prefill", sys.argv[1:]),
        "model": a.model,
        "max_num_batched_tokens": batched,
        "dtype": a.dtype or "the config's default for this host",
        "sliding_window": "the config's" if a.sliding_window is None else (a.sliding_window or "none (full attention)"),
        "cold_prefill_s": {str(n): round(t, 2) for n, t in points},
        "fit": {"linear_s_per_token": lin, "quadratic_s_per_token2": quad} if len(points) > 1 else None,
        "target_tokens": target,
        "predicted_cold_prefill_s": round(lin * target + quad * target ** 2, 1) if target and len(points) > 1 else None,
        "predicted_attention_share": (round(quad * target / (lin + quad * target), 3) if target and len(points) > 1
                                      else None),
        "measured_at_target_s": dict(points).get(target) and round(dict(points)[target], 1),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        provenance.write(a.json, out)


if __name__ == "__main__":
    main()
