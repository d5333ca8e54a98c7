"""PromptRenderer.render on the event loop: which renders run inline, that they give exactly what the pool
gives, and what sends a render (or only its tokenizing) to the pool instead.

Real SmolLM2 tokenizer with the project-written templates in tests/templates."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from serve_app.conversation import (Conversation, GenerationOptions, ImagePart, Message, ReasoningPart, TextPart,
                                    ToolCallPart, ToolResultPart, ToolSpec)
from serve_app.prompt import PromptRenderer, load_tokenizer
from serve_app.prompt import render as render_mod
from serve_app.prompt.render import conversation_chars
from serve_app.settings import ModelConfig
from tests.unit.test_prompt_render import TEMPLATES, smollm2_path

LS = ToolSpec("ls", "list files", {"type": "object", "properties": {"path": {"type": "string"}}})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_path())


def make(tok, inline_chars: int = 4096, template: str = "qwen3_like.jinja") -> PromptRenderer:
    import copy

    t = copy.copy(tok)
    t.chat_template = (TEMPLATES / template).read_text()
    return PromptRenderer(t, ModelConfig(id="m", reasoning_parser="qwen3", tool_parser="hermes"),
                          inline_chars=inline_chars)


def words(rng: random.Random, n: int) -> str:
    vocab = ["files", "naïve", "x=1;", "\n", "  ", "漢字", "👋", "<tool_call>", "{\"a\": [1, 2]}", "path/to", "\\n"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def conversation(rng: random.Random, turns: int, size: int) -> Conversation:
    msgs = [Message("system", [TextPart(words(rng, size))]), Message("user", [TextPart(words(rng, size))])]
    for i in range(turns):
        call = ToolCallPart(f"call_{i}", "ls", '{"path": "%s"}' % rng.choice(["/", "a b", "ü"]))
        msgs += [Message("assistant", [ReasoningPart(words(rng, 5)), TextPart(words(rng, 5)), call]),
                 Message("user", [ToolResultPart(f"call_{i}", words(rng, size), name="ls")])]
    return Conversation(messages=msgs, tools=[LS])


class Where:
    """Records which thread ran the renderer's template and its tokenizing."""

    def __init__(self, r: PromptRenderer):
        self.template: list[int] = []
        self.tokenize: list[int] = []
        real_text, real_encode = r.render_text, r._encode_pieces_locked

        def text(*a, **k):
            self.template.append(threading.get_ident())
            return real_text(*a, **k)

        def encode(*a, **k):
            self.tokenize.append(threading.get_ident())
            return real_encode(*a, **k)

        r.render_text = text  # type: ignore[method-assign]
        r._encode_pieces_locked = encode  # type: ignore[method-assign]


def render_on_loop(r: PromptRenderer, conv: Conversation, **kw):
    async def main():
        return await r.render(conv, GenerationOptions(), **kw), threading.get_ident()

    return asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_an_inline_render_equals_the_pools_and_render_sync(tok, seed):
    rng = random.Random(seed)
    conv = conversation(rng, turns=rng.randint(0, 3), size=rng.randint(1, 40))
    inline, pooled = make(tok), make(tok, inline_chars=0)
    for kw in ({}, {"add_generation_prompt": False}):
        want = inline.render_sync(conv, GenerationOptions(), **kw)
        assert render_on_loop(inline, conv, **kw)[0] == want
        assert render_on_loop(pooled, conv, **kw)[0] == want
        assert render_on_loop(inline, conv, **kw)[0] == want  # again, with the memo warm


def test_a_small_render_runs_on_the_loop_thread(tok):
    r = make(tok)
    where = Where(r)
    conv = conversation(random.Random(1), turns=1, size=10)
    _, loop_thread = render_on_loop(r, conv)
    assert where.template == [loop_thread] and where.tokenize == [loop_thread]


def test_tokenizing_more_than_inline_chars_goes_to_the_pool_until_the_memo_holds_it(tok):
    r = make(tok, inline_chars=1024)
    where = Where(r)
    long_system = Message("system", [TextPart(words(random.Random(2), 1500))])  # one piece >= the memo's minimum
    conv = Conversation(messages=[long_system, Message("user", [TextPart("hi")])])
    first, loop_thread = render_on_loop(r, conv)
    assert where.template == [loop_thread] and where.tokenize[0] != loop_thread
    second, loop_thread = render_on_loop(r, conv)  # the long piece is memoised now: little left to tokenize
    assert where.tokenize[1] == loop_thread
    assert first == second == r.render_sync(conv, GenerationOptions())


def test_a_conversation_past_the_template_bound_or_with_an_image_renders_in_the_pool(tok, monkeypatch):
    r = make(tok)
    where = Where(r)
    monkeypatch.setattr(render_mod, "_INLINE_TEMPLATE_MAX_CHARS", 100)
    big = conversation(random.Random(3), turns=0, size=60)
    _, loop_thread = render_on_loop(r, big)
    assert where.template and where.template[-1] != loop_thread
    monkeypatch.undo()
    image = Conversation(messages=[Message("user", [TextPart("what is this"), ImagePart(url="http://x/y.png")])])
    assert conversation_chars(image, 10**9) > 10**9
    n = len(where.template)
    try:
        render_on_loop(r, image)
    except Exception:  # noqa: BLE001 - this template may not take images; where it ran is the point
        pass
    assert len(where.template) == n + 1 and where.template[-1] != loop_thread


def test_tokenizing_never_waits_on_the_loop_for_a_lock_a_pool_thread_holds(tok):
    r = make(tok)
    where = Where(r)
    conv = conversation(random.Random(4), turns=1, size=5)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        r._encode_lock.acquire()  # as a pool thread tokenizing a long prompt would
        task = asyncio.create_task(r.render(conv, GenerationOptions()))
        await asyncio.sleep(0.1)
        assert not task.done() and ticks >= 5  # the loop kept running while the render waited
        r._encode_lock.release()
        out = await task
        t.cancel()
        return out, threading.get_ident()

    out, loop_thread = asyncio.run(main())
    assert where.template == [loop_thread] and where.tokenize and where.tokenize[0] != loop_thread
    assert out == r.render_sync(conv, GenerationOptions())


def test_slow_inline_templates_send_later_renders_to_the_pool(tok, monkeypatch, caplog):
    r = make(tok)
    # Tokenizing counts strikes too: the bound sits far above what tokenizing this small prompt costs (a 2 ms bound
    # was once reached by a tokenize on a busy CI host) and far below the template's cost here.
    monkeypatch.setattr(render_mod, "_INLINE_MAX_S", 0.02)
    real = r.render_text
    threads: list[int] = []

    def slow(*a, **k):
        threads.append(threading.get_ident())
        end = time.thread_time() + 0.08  # CPU, as the strike is counted
        while time.thread_time() < end:
            pass
        return real(*a, **k)

    r.render_text = slow  # type: ignore[method-assign]
    conv = conversation(random.Random(5), turns=0, size=3)
    loops = [render_on_loop(r, conv)[1] for _ in range(render_mod._INLINE_STRIKES + 1)]
    assert threads[:-1] == loops[:-1]  # the strikes ran inline
    assert threads[-1] != loops[-1]  # then the pool
    assert "render in the render pool from now on" in caplog.text


def test_conversation_chars_counts_what_a_template_reads():
    conv = Conversation(messages=[Message("user", [TextPart("abc")]),
                                  Message("assistant", [ToolCallPart("c", "ls", '{"p": 1}')]),
                                  Message("user", [ToolResultPart("c", [TextPart("12345")])])],
                        tools=[ToolSpec("ls", "desc", {"type": "object"})])
    n = conversation_chars(conv, 10**6)
    assert n >= 3 + 2 + 8 + 5 + 2 + 4 + len("type") + len("object")
    assert conversation_chars(conv, 4) > 4  # counting stops once past the limit, still past it


def test_the_backend_encode_gives_transformers_ids(tok):
    r = make(tok)
    assert r._backend is not None  # SmolLM2's fast tokenizer passes the probe
    rng = random.Random(6)
    for _ in range(50):
        text = words(rng, rng.randint(0, 60))
        assert r._encode_text(text) == tok.encode(text, add_special_tokens=False)
    long = words(rng, 2000)  # past the length the pool tokenizes with the GIL released
    assert r._encode_text(long, release_gil=True) == r._encode_text(long) == tok.encode(long, add_special_tokens=False)


def test_the_pool_releases_the_gil_while_it_tokenizes_a_long_piece(tok):
    r = make(tok, inline_chars=0)
    calls: list[str] = []
    backend = r._backend

    class Spy:
        def encode(self, *a, **k):
            calls.append("encode")
            return backend.encode(*a, **k)

        def encode_batch(self, *a, **k):
            calls.append("encode_batch")  # the binding that releases the GIL
            return backend.encode_batch(*a, **k)

    r._backend = Spy()
    conv = Conversation(messages=[Message("system", [TextPart(words(random.Random(7), 1500))]),
                                  Message("user", [TextPart("hi")])])
    out, _ = render_on_loop(r, conv)
    assert "encode_batch" in calls
    r._backend = backend
    assert out == r.render_sync(conv, GenerationOptions())


def test_tokenize_and_detokenize_of_a_short_text_run_on_the_loop_and_equal_the_pools(tok):
    """`/v1/tokenize` of a plain prompt and `/v1/detokenize`: the same waits as a render, the same bounds."""
    inline, pooled = make(tok, inline_chars=256), make(tok, inline_chars=0)
    seen: list[int] = []
    for r in (inline, pooled):
        real_enc, real_dec = r.tokenizer.encode, r.tokenizer.decode
        r.tokenizer.encode = lambda *a, _f=real_enc, **k: seen.append(threading.get_ident()) or _f(*a, **k)
        r.tokenizer.decode = lambda *a, _f=real_dec, **k: seen.append(threading.get_ident()) or _f(*a, **k)
    short, long = words(random.Random(3), 20)[:200], words(random.Random(4), 200)

    async def both(r, text):
        ids = await r.tokenize(text, add_special_tokens=True)
        return ids, await r.detokenize(ids), threading.get_ident()

    for text in (short, long):
        seen.clear()
        ids, back, loop_thread = asyncio.run(both(inline, text))
        assert ids == tok.encode(text, add_special_tokens=True) and back == tok.decode(ids)
        on_loop = len(text) <= 256
        assert (seen[0] == loop_thread) is on_loop and (seen[1] == loop_thread) is (len(ids) <= 64), (text, ids)
        seen.clear()
        assert asyncio.run(both(pooled, text))[:2] == (ids, back)
        assert loop_thread not in seen
