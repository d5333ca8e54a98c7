"""Wire helpers of the load test that do not need Locust (so unit tests can import them without gevent's
monkey-patching): the stable prompt text, Claude Code's attribution line, SSE parsing, the Anthropic fold."""

from __future__ import annotations

import hashlib
import json
import random
import time
from typing import AsyncIterator, Iterator

import httpx

# Words for the stable system prompt and tool outputs; a fixed seed keeps the prompt identical in every process.
_WORDS = ("repository function module test build error file change commit branch review refactor interface "
          "parameter return value exception handler request response stream token cache config deploy "
          "replica router engine schema validate parse encode decode compile runtime memory thread").split()


def stable_text(n_words: int, seed: str) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(0, n_words, 16):
        lines.append(f"{i // 16 + 1}. " + " ".join(rng.choice(_WORDS) for _ in range(16)) + ".")
    return "\n".join(lines)


def billing_line(session: str) -> str:
    """Claude Code's attribution line: stable within a conversation, different across conversations."""
    return f"x-anthropic-billing-header: cc_version=2.1.197.{hashlib.sha256(session.encode()).hexdigest()[:3]}; cc_entrypoint=cli;"


class _SseEvents:
    """Lines in, (event name, data) per complete SSE event out; comments and keep-alives are skipped."""

    def __init__(self):
        self.name: str | None = None
        self.data: list[str] = []

    def line(self, line: str) -> tuple[str | None, str] | None:
        if line == "":
            event = (self.name, "\n".join(self.data)) if self.data else None
            self.name, self.data = None, []
            return event
        if line.startswith("event:"):
            self.name = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
        return None

    def end(self) -> tuple[str | None, str] | None:
        return (self.name, "\n".join(self.data)) if self.data else None


def iter_sse(resp: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name, data) per SSE event; comments and keep-alives are skipped."""
    events = _SseEvents()
    for line in resp.iter_lines():
        event = events.line(line)
        if event is not None:
            yield event
    event = events.end()
    if event is not None:
        yield event


async def aiter_sse(resp: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """`iter_sse` over an httpx.AsyncClient stream."""
    events = _SseEvents()
    async for line in resp.aiter_lines():
        event = events.line(line)
        if event is not None:
            yield event
    event = events.end()
    if event is not None:
        yield event


class LoadError(Exception):
    """A failed request; `str()` starts with the error type so Locust groups failures by it."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}"[:300])
        self.kind = kind


class Timing:
    """TTFT and inter-token gaps of one streamed request."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def delta(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now


def fold_anthropic(got) -> tuple[list[dict], str | None, dict]:
    """Rebuild the assistant content blocks exactly as the SDK's accumulator would."""
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    usage: dict = {}
    stop = None
    for ev, obj in got:
        if ev == "message_start":
            usage.update(obj["message"].get("usage", {}))
        elif ev == "content_block_start":
            blocks[obj["index"]] = dict(obj["content_block"])
        elif ev == "content_block_delta":
            b, d = blocks[obj["index"]], obj["delta"]
            if d["type"] == "text_delta":
                b["text"] = b.get("text", "") + d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] = b.get("thinking", "") + d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[obj["index"]] = partial.get(obj["index"], "") + d["partial_json"]
        elif ev == "content_block_stop":
            i = obj["index"]
            if blocks[i]["type"] == "tool_use":
                blocks[i]["input"] = json.loads(partial.get(i) or "{}")
        elif ev == "message_delta":
            stop = obj["delta"].get("stop_reason")
            usage.update({k: v for k, v in (obj.get("usage") or {}).items() if v is not None})
    return [blocks[i] for i in sorted(blocks)], stop, usage
