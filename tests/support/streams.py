"""Streamed requests of the three APIs as the fault tests send and read them: request bodies, SSE parsing, and
what a stream failed by a lost engine must look like."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import psutil

APIS = ("anthropic", "chat", "responses")


def stream_body(api: str, model: str, script: str, max_tokens: int, prompt: str = "go") -> tuple[str, dict]:
    """(path, body) of a streamed request whose answer is the forced `script`."""
    forced = {"forced_script": script}
    if api == "anthropic":
        return "/v1/messages", {"model": model, "max_tokens": max_tokens, "stream": True, "nvext": forced,
                                "messages": [{"role": "user", "content": prompt}]}
    if api == "responses":
        return "/v1/responses", {"model": model, "max_output_tokens": max_tokens, "stream": True, "input": prompt,
                                 "store": False, "nvext": forced}
    return "/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "stream": True, "nvext": forced,
                                    "messages": [{"role": "user", "content": prompt}]}


def is_delta(line: str) -> bool:
    """A frame with model output (not Chat's opening role chunk, whose content is empty: it goes out when the
    replica accepts, before any token)."""
    return line.startswith("data:") and ('"text_delta"' in line or "output_text.delta" in line
                                         or re.search(r'"content":"[^"]', line) is not None)


def disconnect_storm(url: str, model: str, requests: int, max_connections: int) -> tuple[list[int], int]:
    """`requests` long streams at once, the three APIs in turn, each closed by the client at its first model output.
    Returns each request's status (-1: its stream ended without output) and how many were cut mid-stream."""
    dropped = 0

    async def one(i: int, client: httpx.AsyncClient) -> int:
        nonlocal dropped
        path, body = stream_body(APIS[i % 3], model, "word " * 1500, 1800)
        async with client.stream("POST", f"{url}{path}", json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code
            async for line in resp.aiter_lines():
                if is_delta(line):
                    dropped += 1
                    return 200  # leaving the block closes the connection mid-stream
        return -1

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return list(await asyncio.gather(*(one(i, client) for i in range(requests))))

    statuses = asyncio.run(storm())
    return statuses, dropped


def sse_data(lines: list[str]) -> list:
    """The JSON payloads of an SSE stream's `data:` lines, in order ("[DONE]" kept as the string)."""
    return [data for _, data in sse_events(lines)]


def sse_events(lines: list[str]) -> list[tuple[str | None, object]]:
    """(event name or None, payload) for each SSE event."""
    out, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            raw = line[5:].strip()
            out.append((name, raw if raw == "[DONE]" else json.loads(raw)))
            name = None
    return out


def assert_engine_error(api: str, lines: list[str]) -> None:
    """The stream ended with its API's error event for a failed engine, after output and without a normal end."""
    events = sse_events(lines)
    assert events, (api, lines)
    if api == "anthropic":
        # Anthropic's in-stream error event, last, after the 200 and message_start; no message_stop.
        name, data = events[-1]
        assert name == "error", events[-3:]
        assert set(data) == {"type", "error"} and data["type"] == "error", data
        assert data["error"]["type"] == "api_error" and data["error"]["message"], data
        assert not any(n == "message_stop" for n, _ in events), events[-3:]
        assert events[0][0] == "message_start", events[:2]
    elif api == "chat":
        # An `{"error": {...}}` frame in OpenAI's envelope, then [DONE]; no chunk ever finished.
        assert events[-1] == (None, "[DONE]"), events[-3:]
        name, data = events[-2]
        assert name is None and set(data) == {"error"}, events[-3:]
        assert set(data["error"]) == {"message", "type", "param", "code"}, data
        assert data["error"]["type"] == "server_error" and data["error"]["message"], data
        chunks = [d for n, d in events[:-2] if n is None]
        assert chunks and all(d["object"] == "chat.completion.chunk" for d in chunks), events[:3]
        assert not any(c["finish_reason"] for d in chunks for c in d["choices"]), events[-4:]
    else:
        data = [d for _, d in events]
        assert data[-1]["type"] == "response.failed", data[-2:]
        response = data[-1]["response"]
        assert response["status"] == "failed" and response["error"]["code"] == "server_error", response
        assert response["error"]["message"], response
    assert any(is_delta(line) for line in lines), (api, lines[:6])  # it failed mid-answer, not before


def still_running(procs, within_s: float) -> list:
    """The processes still running (not exited, not a zombie) once `within_s` has passed or all have ended."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def leave_a_non_streamed_answer(url: str, model: str, unfinished) -> int:
    """Start a ~1,900-token forced Chat answer that is not streamed, leave (close the connection with nothing read)
    once the engine runs it, and return how many requests the engine still runs 20 s later (`unfinished()`: the
    ingress's count); 0 when the route saw the client leave and aborted it."""
    body = {"model": model, "max_tokens": 2000, "messages": [{"role": "user", "content": "Tell a long story."}],
            "nvext": {"forced_script": "word " * 1900}}

    async def start_and_leave() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            call = asyncio.ensure_future(client.post(f"{url}/v1/chat/completions", json=body))
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(unfinished):
                assert not call.done() and time.monotonic() < deadline, call
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            call.cancel()

    asyncio.run(start_and_leave())
    deadline = time.monotonic() + 20
    while unfinished() and time.monotonic() < deadline:
        time.sleep(0.5)
    return unfinished()
