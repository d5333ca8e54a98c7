"""Locust load test with users that behave like coding agents, not like chat.

User classes (weights in parentheses):
- `ClaudeCodeSession` (3): Anthropic Messages, streamed. A large system prompt that is the same for every session,
  preceded by a per-session `x-anthropic-billing-header` block (as Claude Code sends it), ~10 tools, thinking on,
  `X-Claude-Code-Session-Id`. Each turn appends the assistant's blocks (thinking with its signature, text,
  tool_use) and, when the model called tools, a `tool_result` per call; otherwise a follow-up user message. So the
  context grows turn by turn and every turn's prompt starts with the previous one's.
- `CodexSession` (2): Responses API, streamed, `store: false`, long `instructions`, function tools,
  `prompt_cache_key` = the conversation id; each turn re-sends the whole history with the returned output items
  (reasoning with encrypted content, function_call) and `function_call_output` items.
- `PlainChat` (1): Chat Completions, one-shot questions, streamed with `include_usage`.

Custom metrics appear in Locust's stats (and CSV/HTML) as extra rows, so they aggregate across worker processes:
  `TTFT <api>` (ms to the first reasoning/text/tool-call delta), `ITL <api>` (ms between deltas),
  `TOKS <api>` (output tokens/s of one request, shown in the ms column), `CACHED% <api>` (cached/prompt tokens
  x100, from the API's usage), `SESSION <class>` (one row per finished session, its duration).
Errors are Locust failures whose message starts with the type: `http_<status>`, `<error type from the envelope>`,
`stream_error`, `protocol`, `timeout`, `connection`. At the end a JSON summary is written (`--summary-json`).

Options (besides Locust's own): `--cc-model`, `--codex-model`, `--chat-model`, `--max-turns`, `--max-tokens`,
`--system-tokens` (size of the stable system prompt, in words), `--scripted` (send `nvext.forced_script` so a
test server with `testing.forced_scripts` makes the model think and call tools deterministically),
`--summary-json PATH`. The command for a headless run is in docs/load.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
import uuid
from collections import Counter
from typing import Any

import httpx
from locust import User, between, events, task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_wire import LoadError, Timing, billing_line, fold_anthropic, iter_sse, stable_text  # noqa: E402
from provenance import header, write  # noqa: E402

API_KEY = "sk-load-test"
OUTPUT_TOKENS: Counter = Counter()  # by API, from each response's usage (this process's users only)
TIMEOUT = httpx.Timeout(600.0, connect=10.0)

TOOLS = [
    ("Bash", "Run a shell command in the workspace.", {"command": {"type": "string"}, "timeout": {"type": "integer"}}),
    ("Read", "Read a file.", {"file_path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}}),
    ("Edit", "Replace text in a file.", {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                         "new_string": {"type": "string"}}),
    ("Write", "Write a file.", {"file_path": {"type": "string"}, "content": {"type": "string"}}),
    ("Grep", "Search file contents.", {"pattern": {"type": "string"}, "path": {"type": "string"}}),
    ("Glob", "Find files by pattern.", {"pattern": {"type": "string"}}),
    ("LS", "List a directory.", {"path": {"type": "string"}}),
    ("TodoWrite", "Update the todo list.", {"todos": {"type": "array", "items": {"type": "string"}}}),
    ("WebFetch", "Fetch a URL.", {"url": {"type": "string"}, "prompt": {"type": "string"}}),
    ("Task", "Start a sub-agent.", {"description": {"type": "string"}, "prompt": {"type": "string"}}),
]
TASKS = [
    "Find why the unit tests in tests/test_parser.py fail and fix the bug.",
    "Add a --verbose flag to the CLI and document it in the README.",
    "Refactor the config loader so that unknown keys are rejected with a clear error.",
    "The build is slow. Look at the Makefile and speed up the test target.",
    "Write a function that merges two sorted lists and add tests for it.",
]
FOLLOW_UPS = ["Continue.", "Now run the tests again.", "Good. Also update the changelog.", "Explain what you changed."]


class AgentUser(User):
    """Base: an httpx client, per-request reporting to Locust, and the custom metric rows."""

    abstract = True
    wait_time = between(0.5, 2.0)
    api = "?"

    def on_start(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self.http = httpx.Client(base_url=self.host, timeout=TIMEOUT,
                                 headers={"authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY})

    def on_stop(self):
        self.http.close()

    def fire(self, request_type: str, name: str, ms: float, length: int = 0, exc: Exception | None = None):
        self.environment.events.request.fire(request_type=request_type, name=name, response_time=ms,
                                             response_length=length, exception=exc, context={})

    def stream(self, path: str, body: dict, headers: dict | None = None) -> tuple[Timing, list[tuple[str | None, Any]]]:
        """POST a streamed request; return its timing and parsed events, reporting it to Locust either way."""
        timing = Timing()
        got: list[tuple[str | None, Any]] = []
        length = 0
        name = f"{path} [{self.api}]"
        try:
            with self.http.stream("POST", path, json=body, headers=headers or {}) as resp:
                if resp.status_code != 200:
                    raw = resp.read()
                    length = len(raw)
                    raise LoadError(*_http_error(resp.status_code, raw))
                for ev, data in iter_sse(resp):
                    length += len(data)
                    if data == "[DONE]":
                        got.append((ev, None))
                        continue
                    obj = json.loads(data)
                    got.append((ev, obj))
                    if self.is_delta(ev, obj):
                        timing.delta()
                    err = self.stream_error(ev, obj)
                    if err:
                        raise LoadError("stream_error", err)
        except LoadError as e:
            self.fire("POST", name, _ms(timing.start), length, e)
            raise
        except httpx.TimeoutException as e:
            err = LoadError("timeout", repr(e))
            self.fire("POST", name, _ms(timing.start), length, err)
            raise err from None
        except (httpx.HTTPError, OSError) as e:
            err = LoadError("connection", repr(e))
            self.fire("POST", name, _ms(timing.start), length, err)
            raise err from None
        except json.JSONDecodeError as e:
            err = LoadError("protocol", f"bad SSE JSON: {e}")
            self.fire("POST", name, _ms(timing.start), length, err)
            raise err from None
        self.fire("POST", name, _ms(timing.start), length)
        return timing, got

    def record(self, timing: Timing, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        OUTPUT_TOKENS[self.api] += output_tokens
        if timing.first is not None:
            self.fire("TTFT", self.api, (timing.first - timing.start) * 1000)
            for gap in timing.gaps:
                self.fire("ITL", self.api, gap * 1000)
            if output_tokens > 0 and timing.last > timing.first:
                self.fire("TOKS", self.api, output_tokens / (timing.last - timing.first))
        if prompt_tokens > 0:
            self.fire("CACHED%", self.api, 100.0 * cached_tokens / prompt_tokens)

    def protocol_error(self, path: str, detail: str) -> None:
        self.fire("CHECK", f"{path} [{self.api}]", 0, 0, LoadError("protocol", detail))

    def is_delta(self, ev: str | None, obj: Any) -> bool:
        raise NotImplementedError

    def stream_error(self, ev: str | None, obj: Any) -> str | None:
        raise NotImplementedError


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _http_error(status: int, raw: bytes) -> tuple[str, str]:
    try:
        body = json.loads(raw)
        err = body.get("error", {})
        kind = err.get("type") or err.get("code") or f"http_{status}"
        return f"http_{status}", f"{kind} {err.get('message', '')}"
    except (ValueError, AttributeError):
        return f"http_{status}", raw[:200].decode("utf-8", "replace")


def _script(think: str, text: str, call: tuple[str, dict] | None) -> str:
    """A forced script in the test models' format: qwen3 `<think>` reasoning, hermes tool calls."""
    out = f"<think>\n{think}\n</think>\n\n{text}"
    if call:
        out += "\n<tool_call>\n" + json.dumps({"name": call[0], "arguments": call[1]}) + "\n</tool_call>"
    return out


SCRIPTED_CALLS = [
    ("Bash", {"command": "pytest -q tests/test_parser.py"}),
    ("Read", {"file_path": "src/parser.py", "offset": 1, "limit": 200}),
    ("Grep", {"pattern": "def parse", "path": "src"}),
    ("Edit", {"file_path": "src/parser.py", "old_string": "i + 1", "new_string": "i"}),
]


class ClaudeCodeSession(AgentUser):
    weight = 3
    api = "anthropic"

    def on_start(self):
        super().on_start()
        self.system_body = stable_text(self.opts.system_tokens, "claude-code-system")
        self.tools = [{"name": n, "description": d,
                       "input_schema": {"type": "object", "properties": p, "required": [next(iter(p))]}}
                      for n, d, p in TOOLS]
        self.tools[-1]["cache_control"] = {"type": "ephemeral"}

    def is_delta(self, ev, obj):
        return ev == "content_block_delta" and obj["delta"]["type"] in ("text_delta", "thinking_delta", "input_json_delta")

    def stream_error(self, ev, obj):
        if ev == "error" or obj.get("type") == "error":
            err = obj.get("error", {})
            return f"{err.get('type')} {err.get('message')}"
        return None

    @task
    def session(self):
        session = str(uuid.uuid4())
        system = [
            {"type": "text", "text": billing_line(session)},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": self.system_body, "cache_control": {"type": "ephemeral"}},
        ]
        messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": random.choice(TASKS)}]}]
        headers = {"anthropic-version": "2023-06-01", "x-app": "cli", "X-Claude-Code-Session-Id": session,
                   "anthropic-beta": "interleaved-thinking-2025-05-14"}
        started = time.perf_counter()
        turns = self.opts.max_turns
        for turn in range(turns):
            body: dict[str, Any] = {
                "model": self.opts.cc_model, "max_tokens": self.opts.max_tokens, "stream": True,
                "system": system, "tools": self.tools, "messages": messages,
                "thinking": {"type": "adaptive"},  # what Claude Code sends to 4.6-generation models
                "metadata": {"user_id": json.dumps({"session_id": session})},
            }
            call = SCRIPTED_CALLS[turn % len(SCRIPTED_CALLS)] if turn < turns - 1 else None
            if self.opts.scripted:
                body["nvext"] = {"forced_script": _script(f"Turn {turn}: decide the next step.", "On it.", call)}
                body["max_tokens"] = max(self.opts.max_tokens, 400)
            try:
                timing, got = self.stream("/v1/messages", body, headers)
            except LoadError:
                return
            blocks, stop, usage = self._fold(got)
            if stop is None:
                self.protocol_error("/v1/messages", "stream ended without message_delta/message_stop")
                return
            prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
            self.record(timing, prompt, usage.get("cache_read_input_tokens", 0), usage.get("output_tokens", 0))
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if self.opts.scripted and call and (not uses or uses[0]["name"] != call[0] or uses[0]["input"] != call[1]):
                self.protocol_error("/v1/messages", f"expected tool_use {call[0]}, got {uses}")
                return
            messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
            if uses:
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": u["id"],
                     "content": stable_text(120, f"{session}-{turn}-{u['id']}")} for u in uses]})
            else:
                messages.append({"role": "user", "content": [{"type": "text", "text": random.choice(FOLLOW_UPS)}]})
        self.fire("SESSION", self.api, _ms(started))

    _fold = staticmethod(fold_anthropic)


class CodexSession(AgentUser):
    weight = 2
    api = "responses"

    def on_start(self):
        super().on_start()
        self.instructions = "You are Codex, a coding agent.\n" + stable_text(self.opts.system_tokens, "codex-instructions")
        self.tools = [{"type": "function", "name": n, "description": d, "strict": False,
                       "parameters": {"type": "object", "properties": p}} for n, d, p in TOOLS[:6]]

    def is_delta(self, ev, obj):
        t = obj.get("type", ev)
        return t in ("response.output_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_summary_text.delta", "response.function_call_arguments.delta")

    def stream_error(self, ev, obj):
        t = obj.get("type", ev)
        if t in ("response.failed", "error"):
            err = (obj.get("response") or {}).get("error") or obj.get("error") or obj
            return f"{err.get('code') or err.get('type')} {err.get('message')}"
        return None

    @task
    def session(self):
        conv = str(uuid.uuid4())
        items: list[dict] = [{"type": "message", "role": "developer",
                              "content": [{"type": "input_text", "text": "<permissions>workspace-write</permissions>"}]},
                             {"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": random.choice(TASKS)}]}]
        headers = {"originator": "codex_cli_rs", "session_id": conv, "accept": "text/event-stream"}
        started = time.perf_counter()
        turns = self.opts.max_turns
        for turn in range(turns):
            body: dict[str, Any] = {
                "model": self.opts.codex_model, "instructions": self.instructions, "input": items,
                "tools": self.tools, "tool_choice": "auto", "parallel_tool_calls": False,
                "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
                "include": ["reasoning.encrypted_content"], "prompt_cache_key": conv,
                "max_output_tokens": self.opts.max_tokens,
            }
            call = SCRIPTED_CALLS[turn % len(SCRIPTED_CALLS)] if turn < turns - 1 else None
            if self.opts.scripted:
                body["nvext"] = {"forced_script": _script(f"Step {turn}.", "Working on it.", call)}
                body["max_output_tokens"] = max(self.opts.max_tokens, 400)
            try:
                timing, got = self.stream("/v1/responses", body, headers)
            except LoadError:
                return
            done = [o for _, o in got if o and o.get("type") == "response.completed"]
            if not done:
                self.protocol_error("/v1/responses", "stream ended without response.completed")
                return
            response = done[0]["response"]
            usage = response.get("usage") or {}
            self.record(timing, usage.get("input_tokens", 0),
                        (usage.get("input_tokens_details") or {}).get("cached_tokens", 0), usage.get("output_tokens", 0))
            output = [_echo_item(o) for o in response.get("output", [])]
            calls = [o for o in output if o["type"] == "function_call"]
            if self.opts.scripted and call and (not calls or calls[0]["name"] != call[0]
                                                or json.loads(calls[0]["arguments"]) != call[1]):
                self.protocol_error("/v1/responses", f"expected function_call {call[0]}, got {calls}")
                return
            items.extend(output)
            if calls:
                items.extend({"type": "function_call_output", "call_id": c["call_id"],
                              "output": stable_text(120, f"{conv}-{turn}-{c['call_id']}")} for c in calls)
            else:
                items.append({"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": random.choice(FOLLOW_UPS)}]})
        self.fire("SESSION", self.api, _ms(started))


def _echo_item(item: dict) -> dict:
    """An output item as Codex sends it back next turn (no ids; reasoning with its encrypted content)."""
    if item["type"] == "function_call":
        return {"type": "function_call", "name": item["name"], "arguments": item["arguments"], "call_id": item["call_id"]}
    if item["type"] == "reasoning":
        return {"type": "reasoning", "summary": item.get("summary", []),
                "encrypted_content": item.get("encrypted_content")}
    if item["type"] == "message":
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": c.get("text", "")} for c in item.get("content", [])]}
    return {k: v for k, v in item.items() if k not in ("id", "status")}


class PlainChat(AgentUser):
    weight = 1
    api = "chat"

    def is_delta(self, ev, obj):
        if not obj or not obj.get("choices"):
            return False
        d = obj["choices"][0].get("delta") or {}
        return bool(d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"))

    def stream_error(self, ev, obj):
        if obj and "error" in obj:
            return f"{obj['error'].get('type')} {obj['error'].get('message')}"
        return None

    @task
    def ask(self):
        body: dict[str, Any] = {
            "model": self.opts.chat_model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": self.opts.max_tokens,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": random.choice(TASKS)}],
        }
        if self.opts.scripted:
            body["nvext"] = {"forced_script": "Here is a short answer to that question."}
        try:
            timing, got = self.stream("/v1/chat/completions", body)
        except LoadError:
            return
        if not got or got[-1][1] is not None:
            self.protocol_error("/v1/chat/completions", "stream did not end with [DONE]")
            return
        usage = next((o["usage"] for _, o in reversed(got) if o and o.get("usage")), {})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.record(timing, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0))


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--cc-model", default="claude-sonnet-4-6", help="model id for Claude-Code-like sessions")
    parser.add_argument("--codex-model", default="gpt-5.5", help="model id for Codex-like sessions")
    parser.add_argument("--chat-model", default="smollm2", help="model id for plain chat")
    parser.add_argument("--max-turns", type=int, default=4, help="turns per agent session")
    parser.add_argument("--max-tokens", type=int, default=128, help="max output tokens per request")
    parser.add_argument("--system-tokens", type=int, default=1500, help="words in the stable system prompt")
    parser.add_argument("--scripted", action="store_true", help="send nvext.forced_script (test configs only)")
    parser.add_argument("--summary-json", default="", help="write a JSON summary here at the end")


def summary(stats) -> dict:
    """Sessions, RPS, TTFT/ITL percentiles, tokens/s, cached fraction and errors by type from Locust's stats."""
    out: dict[str, Any] = {"apis": {}, "errors_by_type": {}}
    total = stats.total
    reqs = [e for e in stats.entries.values() if e.method == "POST"]
    out["requests"] = sum(e.num_requests for e in reqs)
    out["failures"] = sum(e.num_failures for e in stats.entries.values())
    duration = max(1e-9, (total.last_request_timestamp or 0) - (total.start_time or 0))
    out["duration_s"] = round(duration, 1)
    out["rps"] = round(out["requests"] / duration, 3)
    for e in stats.entries.values():
        kind = e.method
        if kind in ("TTFT", "ITL", "TOKS", "CACHED%", "SESSION") and e.num_requests:
            api = out["apis"].setdefault(e.name, {})
            key = {"TTFT": "ttft_ms", "ITL": "itl_ms", "TOKS": "output_tokens_per_s", "CACHED%": "cached_pct",
                   "SESSION": "session_ms"}[kind]
            api[key] = {"n": e.num_requests, "mean": round(e.avg_response_time, 1),
                        "p50": e.get_response_time_percentile(0.5), "p95": e.get_response_time_percentile(0.95)}
            if kind == "SESSION":
                api["sessions"] = e.num_requests
    errors: Counter = Counter()
    for err in stats.errors.values():
        # Locust keeps repr(exception): "LoadError('http_529: overloaded_error ...')".
        m = re.match(r"(?:LoadError\(['\"])?([\w%]+):", str(err.error))
        errors[m.group(1) if m else str(err.error)[:60]] += err.occurrences
    out["errors_by_type"] = dict(errors)
    out["output_tokens"] = {**OUTPUT_TOKENS, "total": sum(OUTPUT_TOKENS.values())}  # single-process runs only
    return out


@events.quitting.add_listener
def _write_summary(environment, **_):
    from locust.runners import WorkerRunner

    path = getattr(environment.parsed_options, "summary_json", "") if environment.parsed_options else ""
    if path and environment.stats is not None and not isinstance(environment.runner, WorkerRunner):
        write(path, {**header("locust", sys.argv[1:]), **summary(environment.stats)})
