"""What rendering a long agent conversation costs the serving path per turn, against another checkout in one run.

A Codex-shaped tool loop through the Responses API's own adapter: each turn stores a record (a user message, a
function call, its ~`--turn-kb` KB output, a short answer) continuing the one before, then the next request
(`previous_response_id`) is parsed with its whole history read back and rendered by the default model's renderer
(the embedded SmolLM2, its tools template), as the ingress does for every such request and the front door's
Router again. The renderer's memo is warm from the turns before, as in a live session. Per turn bucket: the median
time of one render (template and tokenization), for this checkout and for `--baseline-tree` (another checkout's
serve_app, run in a subprocess of its own). Both must give the same token ids at every turn (checked: a memo that
changed a prompt would fail here, not only be faster).

    .venv/bin/python load/probe_render_turns.py --baseline-tree /tmp/before --json load/results/render_turns.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = ((1, 25), (26, 50), (51, 100), (101, 150), (151, 200))


def turn_items(n: int, turn_kb: int) -> list[dict]:
    output = "".join(f"{n:03d}:{i:04d} src/module_{i % 37}.py: def handler_{i}(request, context) -> None\n"
                     for i in range(turn_kb * 1024 // 60))
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Step {n}: go on."}]},
            {"type": "function_call", "call_id": f"call_{n}", "name": "shell",
             "arguments": json.dumps({"command": ["rg", "-n", f"handler_{n}", "src"]})},
            {"type": "function_call_output", "call_id": f"call_{n}", "output": output},
            {"type": "message", "role": "assistant", "id": f"msg_{n}",
             "content": [{"type": "output_text", "text": f"Found the handlers of step {n}.", "annotations": []}]}]


def measure(turns: int, turn_kb: int, reps: int) -> list[dict]:
    """Runs in the checkout on sys.path[0]: per turn, the median render time and a digest of the ids."""
    from starlette.requests import Request

    from serve_app.engine.provision import ensure_model
    from serve_app.ingress.context import IngressContext
    from serve_app.ingress.responses.api import RESPONSES
    from serve_app.ingress.responses.store import ResponseStoreCore, StoreClient
    from serve_app.service import GenerationService
    from serve_app.settings import AppSettings

    settings = AppSettings.model_validate({"models": [{
        "id": "m", "source": "smollm2-135m-instruct", "max_model_len": 8192, "tool_parser": "hermes",
        "chat_template": "serve_app/templates/smollm2_tools.jinja"}]})
    service = GenerationService(settings, engines=None,
                                model_paths={"smollm2-135m-instruct": ensure_model("smollm2-135m-instruct")})
    store = ResponseStoreCore(max_items=turns + 1, ttl_s=1e9, max_bytes=1 << 40)
    ctx = IngressContext(settings=settings, service=service, secret=b"probe", response_store=StoreClient(store))
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}]
    request = Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": []})

    async def run() -> list[dict]:
        renderer, _ = await service.renderer_for("m")
        out = []
        for n in range(turns):
            store.put(f"resp_{n}", {"response": {"id": f"resp_{n}"}, "items": turn_items(n, turn_kb)},
                      parent=f"resp_{n - 1}" if n else None)
            body = {"model": "m", "instructions": "You are a coding agent.", "tools": tools,
                    "input": [{"type": "message", "role": "user", "content": "next"}],
                    "previous_response_id": f"resp_{n}"}
            call = await RESPONSES.parse(body, request, ctx)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                rendered = renderer.render_sync(call.conversation, call.options)
                times.append((time.perf_counter() - t0) * 1000)
            ids = hashlib.sha256(json.dumps(list(rendered.token_ids)).encode()).hexdigest()[:16]
            out.append({"turn": n + 1, "render_ms": statistics.median(times), "tokens": len(rendered.token_ids),
                        "ids": ids})
        return out

    return asyncio.run(run())


def in_tree(tree: str, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", tree, "--turns", str(args.turns),
           "--turn-kb", str(args.turn_kb), "--reps", str(args.reps)]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def buckets(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for lo, hi in BUCKETS:
        sel = [r for r in rows if lo <= r["turn"] <= hi]
        if sel:
            out[f"{lo}-{hi}"] = {"render_ms": round(statistics.median(r["render_ms"] for r in sel), 2),
                                 "tokens": sel[-1]["tokens"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=150)
    ap.add_argument("--turn-kb", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="renders per turn (the median is kept)")
    ap.add_argument("--baseline-tree", default=None, help="another checkout to measure in the same run")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.worker:
        sys.path.insert(0, a.worker)
        print(json.dumps(measure(a.turns, a.turn_kb, a.reps)))
        return

    sys.path.insert(0, str(ROOT))
    from load import provenance

    trees = {"this": str(ROOT), **({"baseline": a.baseline_tree} if a.baseline_tree else {})}
    rows = {name: in_tree(tree, a) for name, tree in trees.items()}
    if "baseline" in rows:
        differ = [r["turn"] for r, b in zip(rows["this"], rows["baseline"]) if r["ids"] != b["ids"]]
        if differ:
            raise SystemExit(f"the two checkouts rendered different token ids at turns {differ[:10]}")
    result = {
        **provenance.header("load/probe_render_turns.py", sys.argv[1:]),
        **({"baseline_tree": {"path": str(Path(a.baseline_tree).resolve()),
                              "at": provenance.git_commit(a.baseline_tree)}} if a.baseline_tree else {}),
        "workload": {"turns": a.turns, "turn_kb": a.turn_kb, "reps": a.reps},
        "buckets": {name: buckets(r) for name, r in rows.items()},
        "turns": rows,
    }
    if "baseline" in rows:
        result["ratio"] = {k: round(v["render_ms"] / result["buckets"]["baseline"][k]["render_ms"], 3)
                           for k, v in result["buckets"]["this"].items()}
    print(json.dumps({k: result[k] for k in ("buckets", "ratio") if k in result}, indent=1))
    if a.json:
        provenance.write(a.json, result, indent=1)


if __name__ == "__main__":
    main()
