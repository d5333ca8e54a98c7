"""PromptRenderer: preamble stripping, the reasoning replay policy per template, template kwargs,
starts_in_reasoning, template errors as 400s, and the worker-thread render with its timeout.

Real SmolLM2 tokenizer (the embedded default model) with the project-written templates in tests/templates."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from serve_app.conversation import (
    Conversation,
    DocumentPart,
    GenerationOptions,
    ImagePart,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from serve_app.errors import InvalidRequest, ServiceError
from serve_app.prompt import PromptRenderer, load_tokenizer, strip_preamble
from serve_app.prompt.policy import decide_policy
from serve_app.settings import ModelConfig

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
HEADER = "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=cli;"


def smollm2_path() -> str:
    """The converted default model if it is cached, else the GGUF straight from its package (slower)."""
    from serve_app.engine.provision import default_tokenizer_source

    return default_tokenizer_source()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_path())


def renderer(tok, template: str | None, reasoning: str | None = "qwen3", tools: str | None = "hermes",
             strip: bool = True, inline_chars: int = 4096, **model_kw) -> PromptRenderer:
    import copy

    t = copy.copy(tok)  # the template override must not leak into other tests
    if template is not None:
        t.chat_template = (TEMPLATES / template).read_text()
    model = ModelConfig(id="m", reasoning_parser=reasoning, tool_parser=tools, **model_kw)
    return PromptRenderer(t, model, strip_preamble=strip, inline_chars=inline_chars)


def conv(*messages: Message, tools=()) -> Conversation:
    return Conversation(messages=list(messages), tools=list(tools))


USER = Message("user", [TextPart("list the files")])
LS = ToolSpec("ls", "list files", {"type": "object", "properties": {"path": {"type": "string"}}})


# -- preamble -------------------------------------------------------------------------------------------------------

def test_strip_drops_the_header_block_and_keeps_the_rest_byte_for_byte():
    system = Message("system", [TextPart(HEADER), TextPart("You are Claude Code.\n"), TextPart("  Rules:\t1 ")])
    out = strip_preamble(conv(system, USER))
    assert out.messages[0].parts == [TextPart("You are Claude Code.\n"), TextPart("  Rules:\t1 ")]
    assert out.messages[1] is USER
    assert system.parts[0].text == HEADER  # the request's own conversation is not modified


@pytest.mark.parametrize("header", [HEADER, HEADER + " cch=00000;", HEADER + " cch=eb6c6; cc_is_subagent=true;"])
def test_strip_drops_only_the_first_line_of_a_joined_system_string(header):
    out = strip_preamble(conv(Message("system", [TextPart(header + "\nYou are X.\n\nx-anthropic-billing-header: y")])))
    assert out.messages[0].parts == [TextPart("You are X.\n\nx-anthropic-billing-header: y")]


def test_strip_leaves_everything_else_alone():
    mid = conv(Message("system", [TextPart("You are X. " + HEADER)]), USER)
    assert strip_preamble(mid) is mid
    in_user = conv(Message("user", [TextPart(HEADER)]))
    assert strip_preamble(in_user) is in_user
    second = conv(Message("system", [TextPart("A")]), USER, Message("system", [TextPart(HEADER)]))
    assert strip_preamble(second) is second


def test_a_header_only_system_message_disappears():
    out = strip_preamble(conv(Message("system", [TextPart(HEADER)]), USER))
    assert out.messages == [USER]


def test_stripping_makes_sessions_share_the_prefix_and_off_keeps_the_line(tok):
    def session(tag: str) -> Conversation:
        return conv(Message("system", [TextPart(f"{HEADER[:-5]}{tag};"), TextPart("You are Claude Code.")]), USER)

    on = renderer(tok, "qwen3_like.jinja")
    a, b = on.render_sync(session("aaa"), GenerationOptions()), on.render_sync(session("bbb"), GenerationOptions())
    assert a.token_ids == b.token_ids and "billing" not in a.text
    off = renderer(tok, "qwen3_like.jinja", strip=False)
    a, b = off.render_sync(session("aaa"), GenerationOptions()), off.render_sync(session("bbb"), GenerationOptions())
    assert a.token_ids != b.token_ids and "x-anthropic-billing-header" in a.text


# -- policy per template --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template,reasoning,mode,opener", [
    ("qwen3_like.jinja", "qwen3", "field", "<think>\n"),
    ("xml_tools.jinja", "qwen3", "field", "<think>\n"),
    ("content_only.jinja", "qwen3", "inline", "<think>"),
    ("r1_like.jinja", "deepseek_r1", "drop", "<think>\n"),
    ("content_only.jinja", None, "drop", ""),
    ("content_only.jinja", "mistral", "inline", "[THINK]"),
])
def test_policy_is_decided_from_the_template(tok, template, reasoning, mode, opener):
    r = renderer(tok, template, reasoning)
    assert (r.policy.mode, r.policy.opener) == (mode, opener)


@pytest.mark.parametrize("template,fields", [
    ("{{ message.reasoning_content }}", ("reasoning_content",)),
    ("{% if m['reasoning'] %}{{ m.reasoning }}{% endif %}", ("reasoning",)),
    ("{{ message.get('reasoning_content') }}", ("reasoning_content",)),
    ("{% if message.thinking is defined %}{{ message.thinking }}{% endif %}", ("thinking",)),
    ("{{ enable_thinking }}{{ message.content }}", ()),
])
def test_the_reasoning_keys_a_template_reads_are_the_ones_filled(template, fields):
    policy = decide_policy(template, "qwen3")
    assert policy.fields == fields
    assert policy.mode == ("field" if fields else "inline")


def test_string_arguments_are_detected_where_the_template_prints_them_verbatim():
    assert decide_policy("{% if f.arguments is string %}{{ f.arguments }}{% endif %}", None).arguments_as_string
    assert decide_policy("{{ fn['arguments'] is string }}", None).arguments_as_string
    assert not decide_policy("{{ tc.function.arguments | tojson }}", None).arguments_as_string
    # Gemma 4: a dict is written in the template's own notation; the string branch only wraps text in braces
    assert not decide_policy("{% if f['arguments'] is mapping %}{{ f.arguments | dictsort }}"
                             "{% elif f['arguments'] is string %}{{ '{' + f['arguments'] + '}' }}{% endif %}",
                             None).arguments_as_string


# -- reasoning replay -----------------------------------------------------------------------------------------------

def answer(reasoning: str, text: str, *calls: ToolCallPart) -> Message:
    return Message("assistant", [ReasoningPart(reasoning), TextPart(text), *calls])


def history(*assistant: Message) -> Conversation:
    msgs: list[Message] = [USER]
    for a in assistant:
        msgs += [a, Message("user", [TextPart("next")])]
    return conv(*msgs, tools=[LS])


def test_field_mode_hands_reasoning_to_the_template(tok):
    r = renderer(tok, "qwen3_like.jinja")
    msgs = r.template_messages(history(answer("\nplan\n", "\n\nDone.")))
    # Without the whitespace the template writes around each field itself (probed: it would be written twice).
    assert r.policy.reasoning_affixes == ("", "\n") and r.policy.answer_affixes == ("\n\n", "")
    assert msgs[1] == {"role": "assistant", "content": "Done.", "reasoning_content": "\nplan"}
    text = r.render_sync(history(answer("\nplan\n", "\n\nDone.")), GenerationOptions()).text
    assert "<|im_start|>assistant\n<think>\nplan\n</think>\n\nDone.<|im_end|>" in text


def test_inline_mode_puts_reasoning_back_between_the_markers_exactly(tok):
    r = renderer(tok, "content_only.jinja")
    text = r.render_sync(history(answer("\nplan\n", "\n\nDone.")), GenerationOptions()).text
    assert "<|im_start|>assistant\n<think>\nplan\n</think>\n\nDone.<|im_end|>" in text


def test_drop_mode_drops_reasoning_of_answers_and_keeps_it_with_tool_calls(tok):
    r = renderer(tok, "r1_like.jinja", "deepseek_r1")
    call = ToolCallPart("c1", "ls", '{"path": "."}')
    c = conv(USER, answer("plan\n", "\n\nDone."), Message("user", [TextPart("now ls")]),
             answer("use ls\n", "", call), Message("tool", [ToolResultPart("c1", "a.py")]), tools=[LS])
    text = r.render_sync(c, GenerationOptions()).text
    assert "plan" not in text
    assert '<|im_start|>assistant\n<think>\nuse ls\n</think><tool_call>\n{"name": "ls", "arguments": {"path": "."}}' in text


def test_without_a_reasoning_parser_reasoning_is_never_rendered(tok):
    r = renderer(tok, "content_only.jinja", reasoning=None)
    text = r.render_sync(history(answer("secret plan", "Done.")), GenerationOptions()).text
    assert "secret plan" not in text and "<|im_start|>assistant\nDone.<|im_end|>" in text


def test_interleaved_reasoning_stays_with_its_tool_call_in_order(tok):
    c0, c1 = ToolCallPart("c0", "ls", '{"path": "a"}'), ToolCallPart("c1", "ls", '{"path": "b"}')
    turn = Message("assistant", [ReasoningPart("think0"), c0, ReasoningPart("think1"), c1])
    for template, reasoning in [("qwen3_like.jinja", "qwen3"), ("content_only.jinja", "qwen3"),
                                ("r1_like.jinja", "deepseek_r1")]:
        r = renderer(tok, template, reasoning)
        msgs = [m for m in r.template_messages(conv(USER, turn, tools=[LS])) if m["role"] == "assistant"]
        assert [m["tool_calls"][0]["id"] for m in msgs] == ["c0", "c1"]
        text = r.render_sync(conv(USER, turn, tools=[LS]), GenerationOptions()).text
        positions = [text.find(s) for s in ("think0", '"path": "a"', "think1", '"path": "b"')]
        assert -1 not in positions and positions == sorted(positions), (template, text)


def test_tool_results_become_tool_messages_named_after_their_call(tok):
    r = renderer(tok, "qwen3_like.jinja")
    c = conv(USER, Message("assistant", [ToolCallPart("c1", "ls", '{"path": "."}')]),
             Message("user", [ToolResultPart("c1", [TextPart("a.py"), TextPart("b.py")]), TextPart("and?")]))
    msgs = r.template_messages(c)
    assert msgs[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py", "name": "ls"},
                        {"role": "user", "content": "and?"}]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"path": "."}'  # verbatim: template prints strings


def test_dict_templates_get_parsed_arguments_and_malformed_json_becomes_empty(tok):
    r = renderer(tok, "xml_tools.jinja")
    c = conv(USER, Message("assistant", [ToolCallPart("c1", "ls", '{"path": "src", "depth": 2}'),
                                         ToolCallPart("c2", "ls", '{"path": ')]), tools=[LS])
    calls = r.template_messages(c)[1]["tool_calls"]
    assert [k["function"]["arguments"] for k in calls] == [{"path": "src", "depth": 2}, {}]
    assert "<function=ls>\n<parameter=path>\nsrc\n</parameter>\n<parameter=depth>\n2\n</parameter>" in \
        r.render_sync(c, GenerationOptions()).text


def test_images_are_refused_with_a_400_naming_the_part(tok):
    r = renderer(tok, "qwen3_like.jinja")
    with pytest.raises(InvalidRequest) as e:
        r.render_sync(conv(Message("user", [TextPart("see"), ImagePart(data="AAAA")])), GenerationOptions())
    assert e.value.status == 400 and e.value.param == "messages.0.content.1"


def test_text_documents_render_with_their_provenance_and_plain_ones_as_before(tok):
    r = renderer(tok, "qwen3_like.jinja")
    doc = DocumentPart(media_type="text/plain", text="Sunny.", title="Paris weather", source="https://example.com")
    msgs = r.template_messages(conv(Message("user", [doc, TextPart("Weather?")])))
    assert msgs[0]["content"] == "Title: Paris weather\nSource: https://example.com\nSunny.\nWeather?"
    plain = r.template_messages(conv(Message("user", [DocumentPart(media_type="text/plain", text="Sunny.")])))
    assert plain[0]["content"] == "Sunny."  # unchanged for documents without a title, source or context
    ids = [len(r.render_sync(conv(Message("user", parts)), GenerationOptions()).token_ids)
           for parts in ([TextPart("Weather?")], [doc, TextPart("Weather?")])]
    assert ids[1] > ids[0]


@pytest.mark.parametrize("template,reasoning", [("qwen3_like.jinja", "qwen3"), ("content_only.jinja", "qwen3"),
                                                ("r1_like.jinja", "deepseek_r1"), (None, None)])
@pytest.mark.parametrize("thinking", [None, False])
def test_a_prefill_continues_the_final_assistant_text(tok, template, reasoning, thinking):
    r = renderer(tok, template, reasoning)
    prefill = "The best answer is ("
    c = conv(USER, Message("assistant", [TextPart(prefill)]))
    out = r.render_sync(c, GenerationOptions(thinking=thinking, continue_final=True))
    assert out.text.endswith(prefill), out.text[-80:]  # no end of turn, no new generation prompt
    assert out.starts_in_reasoning is False  # the continuation is answer text
    assert out.token_ids == r.encode_prompt(out.text)
    # The same conversation without the prefill flag is a new turn after that message (what used to happen).
    new_turn = r.render_sync(c, GenerationOptions(thinking=thinking)).text
    assert new_turn.startswith(out.text) and len(new_turn) > len(out.text)
    # And the prompt up to the prefill is the one a plain request renders (the prefix cache holds).
    plain = r.render_sync(conv(USER), GenerationOptions(thinking=thinking)).text
    assert out.text.startswith(plain[:plain.rfind("<|im_start|>assistant")])


# -- template kwargs and starts_in_reasoning ------------------------------------------------------------------------

def test_thinking_kwargs_follow_the_parser_and_the_client(tok):
    r = renderer(tok, "qwen3_like.jinja", default_chat_template_kwargs={"custom": 1})
    assert r.template_kwargs(GenerationOptions()) == {"custom": 1, "enable_thinking": True,
                                                       "truncate_history_thinking": False}
    assert r.template_kwargs(GenerationOptions(thinking=False)) == {"custom": 1, "enable_thinking": False,
                                                                     "truncate_history_thinking": False}
    explicit = GenerationOptions(chat_template_kwargs={"enable_thinking": False, "custom": 2, "tools": "x",
                                                       "add_generation_prompt": False})
    assert r.template_kwargs(explicit) == {"custom": 2, "enable_thinking": False, "truncate_history_thinking": False}
    assert renderer(tok, "content_only.jinja", reasoning=None).template_kwargs(GenerationOptions()) == {}


def test_truncate_history_thinking_false_keeps_earlier_reasoning(tok):
    r = renderer(tok, "qwen3_like.jinja")
    c = history(answer("\nold plan\n", "\n\nDone."))
    assert "old plan" in r.render_sync(c, GenerationOptions()).text
    # A client asking for the template's own default gets Qwen3's truncation back.
    assert "old plan" not in r.render_sync(c, GenerationOptions(
        chat_template_kwargs={"truncate_history_thinking": True})).text


@pytest.mark.parametrize("template,reasoning,opts,expected", [
    ("qwen3_like.jinja", "qwen3", GenerationOptions(), True),
    ("qwen3_like.jinja", "qwen3", GenerationOptions(thinking=False), False),
    ("qwen3_like.jinja", "qwen3", GenerationOptions(chat_template_kwargs={"enable_thinking": False}), False),
    ("qwen3_like.jinja", None, GenerationOptions(), False),
    ("content_only.jinja", "qwen3", GenerationOptions(), False),
    ("r1_like.jinja", "deepseek_r1", GenerationOptions(), True),
    # No marker in the generation prompt: the format decides (an R1 model starts thinking unannounced).
    ("content_only.jinja", "deepseek_r1", GenerationOptions(), True),
    # The generation prompt closed an empty block: not in reasoning, whatever the format's default.
    ("qwen3_like.jinja", "deepseek_r1", GenerationOptions(thinking=False), False),
])
def test_starts_in_reasoning(tok, template, reasoning, opts, expected):
    out = renderer(tok, template, reasoning).render_sync(conv(USER), opts)
    assert out.starts_in_reasoning is expected
    assert out.text.endswith("<think>\n") is (template != "content_only.jinja" and opts.thinking is not False
                                              and not opts.chat_template_kwargs)


def test_token_ids_are_the_rendered_text_without_added_specials(tok):
    r = renderer(tok, "qwen3_like.jinja")
    out = r.render_sync(history(answer("a", "b")), GenerationOptions())
    assert out.token_ids == tok.encode(out.text, add_special_tokens=False)
    assert tok.decode(out.token_ids) == out.text


# -- errors, threads, loading ---------------------------------------------------------------------------------------

def test_a_template_rejection_is_a_400_that_says_what_was_rejected(tok):
    import copy

    t = copy.copy(tok)
    t.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}"
                       "{{ raise_exception('tool messages are not supported by this model') }}{% endif %}"
                       "{{ m.content }}{% endfor %}")
    r = PromptRenderer(t, ModelConfig(id="m"))
    c = conv(USER, Message("assistant", [ToolCallPart("c", "ls", "{}")]), Message("tool", [ToolResultPart("c", "x")]))
    with pytest.raises(InvalidRequest) as e:
        r.render_sync(c, GenerationOptions())
    assert e.value.status == 400
    assert "tool messages are not supported by this model" in e.value.message


def test_a_type_error_inside_the_template_is_a_400_too(tok):
    import copy

    t = copy.copy(tok)
    t.chat_template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    with pytest.raises(InvalidRequest, match="chat template rejected"):
        PromptRenderer(t, ModelConfig(id="m")).render_sync(conv(USER), GenerationOptions())


def test_with_inlining_off_render_runs_off_the_event_loop_and_equals_render_sync(tok):
    r = renderer(tok, "qwen3_like.jinja", inline_chars=0)
    c = history(answer("x", "y"))

    async def main():
        loop_thread = threading.get_ident()
        seen: list[int] = []
        real = r.render_sync

        def spy(*a, **k):
            seen.append(threading.get_ident())
            return real(*a, **k)

        r.render_sync = spy  # type: ignore[method-assign]
        try:
            out = await r.render(c, GenerationOptions())
        finally:
            del r.render_sync
        return out, seen, loop_thread

    out, seen, loop_thread = asyncio.run(main())
    assert out == r.render_sync(c, GenerationOptions())
    assert seen and seen[0] != loop_thread


def test_a_stuck_render_times_out_without_blocking_later_renders(tok):
    r = renderer(tok, "qwen3_like.jinja", inline_chars=0)
    r.render_timeout_s = 0.2
    release = threading.Event()
    real = r.render_text

    def stuck(*a, **k):
        release.wait()
        return real(*a, **k)

    async def main():
        r.render_text = stuck  # type: ignore[method-assign]
        with pytest.raises(ServiceError) as e:
            await r.render(conv(USER), GenerationOptions())
        del r.render_text
        # Both pool threads could be stuck; the fresh pool still serves.
        r.render_text = stuck  # type: ignore[method-assign]
        with pytest.raises(ServiceError):
            await r.render(conv(USER), GenerationOptions())
        del r.render_text
        out = await r.render(conv(USER), GenerationOptions())
        release.set()
        return e.value, out

    err, out = asyncio.run(main())
    assert err.kind == "timeout" and err.status == 504
    assert out.token_ids


def test_render_threads_bound_the_renders_running_at_once(tok):
    model = ModelConfig(id="m", reasoning_parser="qwen3", tool_parser="hermes")
    r = PromptRenderer(tok, model, render_threads=2, inline_chars=0)
    lock, running, peak = threading.Lock(), [0], [0]
    real = r.render_text

    def counted(*a, **k):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            time.sleep(0.05)  # long enough for every queued render to try to start meanwhile
            return real(*a, **k)
        finally:
            with lock:
                running[0] -= 1

    async def main():
        r.render_text = counted  # type: ignore[method-assign]
        return await asyncio.gather(*(r.render(conv(USER), GenerationOptions()) for _ in range(6)))

    outs = asyncio.run(main())
    assert peak[0] == 2
    assert len({tuple(o.token_ids) for o in outs}) == 1


def test_load_tokenizer_takes_an_inline_template_or_a_path():
    path = smollm2_path()
    inline = load_tokenizer(path, "{{ messages[0].content }}!")
    assert inline.chat_template == "{{ messages[0].content }}!"
    from_file = load_tokenizer(path, str(TEMPLATES / "r1_like.jinja"))
    assert from_file.chat_template == (TEMPLATES / "r1_like.jinja").read_text()
    with pytest.raises(FileNotFoundError):
        load_tokenizer(path, "no/such/template.jinja")


# -- thinking off: the empty think block and the tokenization seam ---------------------------------------------------

def test_with_thinking_off_an_answer_gets_the_prompts_empty_think_block_back(tok):
    r = renderer(tok, "qwen3_like.jinja")
    assert (r.policy.empty_block, r.policy.empty_replay) == ("<think>\n\n</think>\n\n", "field")
    assert renderer(tok, "content_only.jinja").policy.empty_replay == "none"
    off = GenerationOptions(thinking=False)
    first = r.render_sync(conv(USER, tools=[LS]), off)
    assert first.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    c = conv(USER, Message("assistant", [TextPart("Done.")]), Message("user", [TextPart("next")]), tools=[LS])
    assert r.render_sync(c, off).text.startswith(first.text + "Done.<|im_end|>")
    # With thinking on, an answer without reasoning is not given an invented block.
    assert "<think>" not in r.template_messages(c)[1].get("reasoning_content", "")


def test_prompt_ids_are_cut_where_the_generation_prompt_ends(tok):
    r = renderer(tok, "qwen3_like.jinja")
    prompt = r.render_sync(conv(USER, tools=[LS]), GenerationOptions(thinking=False))
    generated = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    whole = tok.encode(prompt.text + generated, add_special_tokens=False)
    seamed = prompt.token_ids + tok.encode(generated, add_special_tokens=False)
    assert whole != seamed  # one-string tokenization merges across the seam ("\n\n" + "<")...
    assert r.encode_prompt(prompt.text + generated) == seamed  # ...the renderer's does not
    assert tok.decode(seamed) == prompt.text + generated


def test_cutting_in_front_of_special_tokens_leaves_the_ids_unchanged(tok):
    r = renderer(tok, "qwen3_like.jinja")
    r.turn_starts = ()  # only the special-token cuts
    assert "<|im_start|>" in r._cut_before and "<|im_end|>" in r._cut_before
    long = "word " * 600
    text = (f"<|im_start|>system\n{long}\n\n<|im_end|>\n<|im_start|>user\n  spaced  <|im_end|>  \n\n"
            f"<|im_start|>assistant\n{long}<|im_end|>\n<|im_start|>user\n\t<|im_end|><|im_start|>assistant\n")
    first = r.encode_prompt(text)
    assert first == tok.encode(text, add_special_tokens=False)
    assert r._memo  # the long pieces were memoised...
    assert r.encode_prompt(text) == first  # ...and give the same ids again


def test_the_piece_memo_is_bounded(tok, monkeypatch):
    import serve_app.prompt.render as render_mod

    entry = render_mod._MEMO_ENTRY_CHARS
    monkeypatch.setattr(render_mod, "_MEMO_MAX_CHARS", 4 * (entry + 40))
    r = renderer(tok, "qwen3_like.jinja")
    for i in range(20):
        r.encode_prompt(f"<|im_start|>user\npiece number {i:04d} with some words<|im_end|>")
    assert 0 < r._memo_chars <= 4 * (entry + 40)
    assert sum(len(k) + entry for k in r._memo) == r._memo_chars
    assert "<|im_start|>user\npiece number 0019 with some words" in r._memo  # the newest stay, the oldest went
    assert "<|im_start|>user\npiece number 0000 with some words" not in r._memo


def test_a_turn_tokenizes_only_its_own_pieces(tok):
    """Every piece is memoised, however short: the next turn of a tool loop resends the conversation, and only the
    pieces it adds reach the tokenizer. The ids are the pieces' own, memo or not."""
    r = renderer(tok, "qwen3_like.jinja")
    calls = []
    encode = r._encode_text
    r._encode_text = lambda text, release_gil=False: calls.append(text) or encode(text, release_gil)
    messages = [Message("system", [TextPart("You are a coding agent.")])]
    for turn in range(6):
        messages += [Message("user", [TextPart(f"Tool output {turn}: " + "a line of output\n" * 8)]),
                     Message("assistant", [TextPart(f"Read output {turn}.")])]
    before = r.render_sync(Conversation(messages=messages[:-2]), GenerationOptions(thinking=False))
    calls.clear()
    after = r.render_sync(Conversation(messages=messages), GenerationOptions(thinking=False))
    assert after.text.startswith(before.text[: before.text.rfind("<|im_start|>assistant")])
    assert after.token_ids == [i for piece in r._pieces(after.text) for i in tok.encode(piece, add_special_tokens=False)]
    pieces = r._pieces(after.text)
    new = [p for p in pieces if p not in set(r._pieces(before.text))]
    assert calls == new and 0 < len(new) < len(pieces) // 5, (calls, len(pieces))


@pytest.mark.parametrize("template,reasoning,exact", [
    ("qwen3_like.jinja", "qwen3", True),
    ("xml_tools.jinja", "qwen3", True),
    ("content_only.jinja", "qwen3", True),
    ("r1_like.jinja", "deepseek_r1", False),  # drops earlier thinking by design
    ("content_only.jinja", None, None),
])
def test_the_replay_self_check_reports_whether_thinking_answers_round_trip(tok, template, reasoning, exact):
    assert renderer(tok, template, reasoning).replay_exact is exact


def test_a_template_that_mangles_reasoning_is_reported(tok, caplog):
    import copy

    t = copy.copy(tok)  # reads reasoning_content but trims it: replay cannot be exact
    t.chat_template = ((TEMPLATES / "qwen3_like.jinja").read_text()
                       .replace("rc.strip('\\n')", "rc.strip()[:5]"))
    with caplog.at_level("WARNING", logger="serve_app.prompt.render"):
        r = PromptRenderer(t, ModelConfig(id="mangler", reasoning_parser="qwen3"))
    assert r.replay_exact is False
    assert any("mangler" in rec.getMessage() for rec in caplog.records)


class _PrefixingTokenizer:
    """The SmolLM2 tokenizer, but every encode call starts with an extra token, as a SentencePiece tokenizer's
    "▁" prefix does: encoding pieces separately would change the prompt."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text, add_special_tokens=False):
        return [self._inner.convert_tokens_to_ids("Ġ")] + list(self._inner.encode(text, add_special_tokens=False))


def test_a_tokenizer_that_prefixes_every_call_is_encoded_whole(tok):
    import copy

    t = copy.copy(tok)
    t.chat_template = (TEMPLATES / "qwen3_like.jinja").read_text()
    r = PromptRenderer(_PrefixingTokenizer(t), ModelConfig(id="m", reasoning_parser="qwen3"))
    assert r.turn_starts == () and r._cut_before == []
    out = r.render_sync(history(answer("x", "y")), GenerationOptions())
    assert out.token_ids == r.tokenizer.encode(out.text)
