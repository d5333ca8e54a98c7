"""How long the engines of one process take to start: config.yaml's engines (two: the same weights at two context
lengths) started the way `python -m serve_app run config.yaml` starts them (engine/vllm_engine.start_engines:
engines that set the same environment at the same time), against one after another (how they started before, and
how a process of vLLM's own server starts its engine), alternating in one run. Wall seconds from the first start
call to the last engine up; each round stops its engines before the next.

    python -m load.bench_engine_start --json load/results/engine_start.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

from load import provenance

ROOT = Path(__file__).resolve().parent.parent


def engines(config: Path) -> list:
    """One VLLMEngine per engine key of the config's first app, as LocalEngineClient.start builds them."""
    from serve_app.engine.provision import ensure_model
    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    settings = AppSettings.model_validate(yaml.safe_load(config.read_text())["applications"][0]["args"])
    out: dict = {}
    for m in settings.models:
        if engine_key(m) not in out:
            out[engine_key(m)] = VLLMEngine(m, ensure_model(m.model_source, settings.model_cache_dir),
                                            kv_events=False)
    return list(out.values())


def timed_start(config: Path, together: bool) -> float:
    from serve_app.engine.vllm_engine import start_engines

    group = engines(config)
    began = time.monotonic()
    try:
        if together:
            start_engines(group)
        else:
            for engine in group:
                engine.start(cache_envs=False)
        return time.monotonic() - began
    finally:
        for engine in group:
            engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--rounds", type=int, default=3, help="starts of each kind, alternating")
    ap.add_argument("--json", help="write the result here")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    doc = provenance.header("load.bench_engine_start", argv)
    engines(a.config)  # converts the default model once, outside the timings
    import vllm.v1.engine.async_llm  # noqa: F401 - and imports vLLM here once, which the first start would time
    seconds: dict[str, list[float]] = {"together": [], "one_after_another": []}
    for i in range(a.rounds):
        for kind in (("together", "one_after_another") if i % 2 == 0 else ("one_after_another", "together")):
            seconds[kind].append(round(timed_start(a.config, kind == "together"), 2))
            print(kind, seconds[kind][-1], flush=True)
    medians = {k: round(statistics.median(v), 2) for k, v in seconds.items()}
    doc.update({"settings": {"config": str(a.config.relative_to(ROOT)) if a.config.is_relative_to(ROOT)
                             else str(a.config), "rounds": a.rounds, "engines": len(engines(a.config))},
                "seconds": seconds, "median_s": medians,
                "together_over_one_after_another": round(medians["together"] / medians["one_after_another"], 3)})
    print(medians, doc["together_over_one_after_another"], flush=True)
    if a.json:
        provenance.write(a.json, doc)


if __name__ == "__main__":
    main()
