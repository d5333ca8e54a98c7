"""How long a burst of renders waits beside a busy event loop: in the render pool vs on the loop itself.

The service's own PromptRenderer (SmolLM2's tokenizer, as in bench_capacity's tiny model, and the service's
template) renders N small prompts
submitted at once, while a task on the same loop does bursts of Python work and yields (`await asyncio.sleep(0)`)
between them, as a loop streaming many responses does. `pool`: `render_inline_chars` 0, every render in the
one-thread render pool; `inline`: the default, small renders on the loop. Per mode: the time from submitting the
burst to its renders' completions (p50 and last), the process's CPU meanwhile, and the busy task's bursts per
second meanwhile (the loop kept running either way: the pool's renders wait for the GIL, not for the loop).

    .venv/bin/python load/probe_render_wait.py --json load/results/render_wait.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import provenance  # noqa: E402
from load.busy_loop import BusyLoop  # noqa: E402
from serve_app.conversation import Conversation, GenerationOptions, Message, TextPart  # noqa: E402


def make_renderer(inline_chars: int):
    from load.tiny_model import ensure_tiny_model
    from serve_app.prompt import PromptRenderer, load_tokenizer
    from serve_app.settings import ModelConfig

    template = Path(__file__).resolve().parent.parent / "serve_app" / "templates" / "smollm2_tools.jinja"
    tok = load_tokenizer(ensure_tiny_model(), str(template))
    return PromptRenderer(tok, ModelConfig(id="probe"), inline_chars=inline_chars)


def conversation(i: int) -> Conversation:
    return Conversation(messages=[Message("system", [TextPart("You are a helpful assistant. " * 8)]),
                                  Message("user", [TextPart(f"Request {i}: write a story about a dragon.")])])


async def burst(renderer, n: int, burst_iterations: int, budget_s: float) -> dict:
    async with BusyLoop(burst_iterations) as busy:
        done: list[float] = []
        t0 = time.perf_counter()
        cpu0 = time.process_time()

        async def one(i: int) -> None:
            await renderer.render(conversation(i), GenerationOptions())
            done.append(time.perf_counter() - t0)

        waiting = [asyncio.create_task(one(i)) for i in range(n)]
        finished, pending = await asyncio.wait(waiting, timeout=budget_s)
        for p in pending:
            p.cancel()
        rate = busy.rate()
    return {"renders": n, "finished": len(done),
            "p50_ms": round(statistics.median(done) * 1e3, 1) if done else None,
            "last_ms": round(max(done) * 1e3, 1) if len(done) == n else None,
            "gave_up_after_s": budget_s if pending else None,
            "loop_bursts_per_s": rate,
            "process_cpu_ms": round((time.process_time() - cpu0) * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--renders", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst-iterations", type=int, default=20000, help="Python loop iterations per busy burst")
    ap.add_argument("--budget-s", type=float, default=30.0, help="give up on a burst's renders after this long")
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = {"pool": make_renderer(0), "inline": make_renderer(4096)}
    for r in modes.values():  # warm: the first render imports and compiles
        asyncio.run(r.render(conversation(0), GenerationOptions()))
    out: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, r in modes.items():
            row = asyncio.run(burst(r, args.renders, args.burst_iterations, args.budget_s))
            out[mode].append(row)
            print(mode, row, flush=True)
    if args.json:
        doc = {**provenance.header("load/probe_render_wait.py", sys.argv[1:]), "renders": args.renders,
               "burst_iterations": args.burst_iterations, "modes": out}
        provenance.write(args.json, doc)


if __name__ == "__main__":
    main()
