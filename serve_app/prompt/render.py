"""Render a Conversation with the model's chat template and tokenize it: the one path every API (and every
token count) goes through, so the router hashes, `count_tokens` reports and the engine prefills the same ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
)
from serve_app.errors import InvalidRequest, ServiceError
from serve_app.parsers import REASONING_PARSERS
from serve_app.prompt.messages import to_template_messages, to_template_tools
from serve_app.prompt.policy import (
    ReplayPolicy,
    closed_empty_block,
    decide_policy,
    prompt_starts_in_reasoning,
    reasoning_fields,
    unwritten_markers,
)
from serve_app.prompt.preamble import strip_preamble

log = logging.getLogger(__name__)

_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "Probe tool.",
                                                  "parameters": {"type": "object", "properties": {}}}}]
# A call to it as a template message (Kimi's id shape, which every template takes) and its result.
_PROBE_CALL = {"id": "functions.probe:0", "type": "function", "function": {"name": "probe", "arguments": {}}}

# apply_chat_template's own parameters: a client's chat_template_kwargs must not override them.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    starts_in_reasoning: bool  # the rendered prompt ends inside the reasoning start marker


def read_template(chat_template: str) -> str:
    """A template override is inline Jinja (it contains `{`) or a path to a file."""
    if "{" in chat_template:
        return chat_template
    path = Path(chat_template)
    if not path.is_file():
        raise FileNotFoundError(f"chat template {chat_template!r} is neither a file nor an inline template")
    return path.read_text()


def load_tokenizer(path_or_id: str, chat_template: str | None = None):
    """transformers AutoTokenizer for a HF id, a model directory or a .gguf file; `chat_template` overrides."""
    from transformers import AutoTokenizer

    p = Path(path_or_id)
    if p.suffix == ".gguf" and p.is_file():
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        tok = AutoTokenizer.from_pretrained(path_or_id)
    if chat_template:
        tok.chat_template = read_template(chat_template)
    return tok


# Memoised prompt pieces (per renderer, per process), short ones too: a tokenizer call costs ~50 us however short
# the piece, and a tool loop is several pieces per turn, all but the newest turn's repeated from the turn before (100
# turns of ~1 KB tool output: 1,005 pieces, 50 ms of tokenizing per render when only pieces of 2,048+ characters
# were memoised; load/probe_render_turns.py). Bounded by the pieces' length plus an allowance per entry (the dict
# entry, the key's and the ids' objects: ~250 bytes), so many short pieces count for what they hold. The ids are
# kept as 4-byte arrays: a list of ints costs ~36 bytes a token.
_MEMO_MAX_CHARS = 32 * 1024 * 1024
_MEMO_ENTRY_CHARS = 256
# In the render pool a piece this long is tokenized with the GIL released (the loop streams meanwhile); a shorter
# one keeps it: releasing costs the pool thread a fresh wait for the GIL beside a busy loop (PromptRenderer.render).
_RELEASE_GIL_CHARS = 2048


# Rendering on the event loop (see PromptRenderer.render): conversations up to this size run their template there
# (a template over them costs well under a millisecond). An inline step slower than _INLINE_MAX_S is a strike;
# after _INLINE_STRIKES of them (a template slower than its input's size predicts) the renderer uses the pool only.
_INLINE_TEMPLATE_MAX_CHARS = 256 * 1024
_INLINE_MAX_S = 0.02  # of the loop thread's CPU time (wall time would count the host preempting the process)
_INLINE_STRIKES = 3  # slow inline steps before inlining stops (one could be a garbage collection)


def conversation_chars(conv: Conversation, limit: int) -> int:
    """The characters a template reads from `conv` (text, arguments, tool schemas), counted until past `limit`;
    images and documents count as past it (their size is not the text's)."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if total > limit:
            return
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                total += len(k) + 4
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                total += 2
                walk(v)
        else:
            total += 8

    for tool in conv.tools:
        total += len(tool.name) + len(tool.description)
        walk(tool.parameters)
    for msg in conv.messages:
        for part in msg.parts:
            if total > limit:
                return total
            if isinstance(part, (ImagePart, DocumentPart)):
                return limit + 1
            if isinstance(part, ToolCallPart):
                total += len(part.name) + len(part.arguments)
            elif isinstance(part, ToolResultPart):
                if isinstance(part.content, str):
                    total += len(part.content)
                else:
                    total += conversation_chars(Conversation(messages=[Message("user", part.content)]), limit)
            else:
                total += len(getattr(part, "text", "") or "")
    return total


def _format_default(parser: str | None) -> bool:
    """Whether the reasoning format starts in reasoning when the prompt shows no marker (DeepSeek-R1 style)."""
    if not parser:
        return False
    fmt = REASONING_PARSERS.get(parser)
    return bool(getattr(fmt, "starts_in_reasoning", False))


def _whitespace_around(text: str, inner: str) -> tuple[str, str]:
    """The whitespace right before and right after `inner` in `text` (what a template framed it with)."""
    head, tail = text.split(inner, 1)
    return head[len(head.rstrip()):], tail[: len(tail) - len(tail.lstrip())]


def _template_message(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return f"the chat template rejected the request: {text}"


class PromptRenderer:
    """Renders and tokenizes for one model; shared by all requests. The policy is fixed at construction (probed
    once from the template); the piece memo is guarded by the encode lock."""

    def __init__(self, tokenizer, model, *, strip_preamble: bool = True, render_timeout_s: float = 30.0,
                 render_threads: int = 1, inline_chars: int = 4096):
        self.tokenizer = tokenizer
        self.model = model
        self.strip_preamble = strip_preamble
        self.render_timeout_s = render_timeout_s
        self.render_threads = render_threads  # renders at once; tokenizing itself is serialised by the encode lock
        self.inline_chars = inline_chars  # prompt characters not in the memo that may be tokenized on the loop
        self._inline_off = inline_chars <= 0
        self._inline_strikes = 0
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one renders chat
            template = template.get("default") or next(iter(template.values()))
        if not template:
            raise ValueError(f"model {model.id!r}: the tokenizer has no chat template and none is configured")
        self.template: str = template
        self.reasoning_enabled = bool(model.reasoning_parser)
        probe = self._probe_generation_tail(model, thinking=True)
        self.policy: ReplayPolicy = self._probe_system_messages(self._probe_alternation(
            self._probe_empty_replay(self._decide_policy(model, probe), model)))
        # Fast tokenizers are not safe to call from several threads at once ("Already borrowed").
        self._encode_lock = threading.Lock()
        self.turn_starts = self._probe_turn_starts()
        self._cut_before = [t for t in self._special_cuts() if t in self.template]  # only those templates write
        if not self._pieces_concatenate():
            # A tokenizer that adds something at the start of every call (SentencePiece's "▁" prefix) would
            # change the prompt if it were encoded in pieces: encode it whole.
            self.turn_starts, self._cut_before = (), []
        self._backend = self._probe_backend()
        self._memo: OrderedDict[str, array] = OrderedDict()
        self._memo_chars = 0
        self._format_starts_in_reasoning = _format_default(model.reasoning_parser)
        fmt = REASONING_PARSERS.get(model.reasoning_parser) if model.reasoning_parser else None
        self._answer_tags: tuple[str, ...] = tuple(fmt.answer or ()) if fmt is not None else ()
        self._pool = self._new_pool()
        self.policy = self._probe_affixes(self._probe_tool_reasoning(self.policy), model)
        self.replay_exact = self._probe_replay()
        # Markers the template builds from pieces (Kimi K3's <|open|> + tag + <|sep|>) are in a render, not its text
        if unwritten := unwritten_markers(template + self._marker_sample(), model.reasoning_parser, model.tool_parser):
            log.warning("model %s: its chat template never writes %s; the parsers may be another family's than the "
                        "template (with `family:`, set `family_template: true` unless the checkpoint's own template "
                        "is that family's)", model.id, ", ".join(unwritten))
        if self.replay_exact is False and self.policy.mode != "drop":
            log.warning("model %s: an answer with reasoning does not render back as it was generated (replay mode "
                        "%s); later turns will miss the prefix cache from that answer on", model.id, self.policy.mode)

    # -- template kwargs --------------------------------------------------------------------------------------

    def template_kwargs(self, opts: GenerationOptions) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self.model.default_chat_template_kwargs)
        if self.reasoning_enabled:
            self._set_thinking(kwargs, opts.thinking is not False)
            # Keep earlier thinking in the prompt: the history must render as it was generated.
            kwargs["truncate_history_thinking"] = False
        elif opts.thinking is False:
            self._set_thinking(kwargs, False)
        if opts.reasoning_effort is not None:
            values = self.model.effort_values
            effort = values.get(opts.reasoning_effort) if values else opts.reasoning_effort
            if effort is not None:
                kwargs[self.model.effort_kwarg] = effort
        for key, value in opts.chat_template_kwargs.items():  # explicit per-request kwargs win
            if key not in _RESERVED_KWARGS:
                kwargs[key] = value
        return kwargs

    def _set_thinking(self, kwargs: dict[str, Any], on: bool) -> None:
        """`enable_thinking` (most templates), and the template's own switch with its own values (Kimi K3's
        `thinking`, MiniMax-M3's `thinking_mode`: "enabled" / "disabled")."""
        kwargs["enable_thinking"] = on
        kwargs[self.model.thinking_kwarg] = self.model.thinking_values[0 if on else 1]

    def _probe_render(self, messages: list[dict[str, Any]], thinking: bool, add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> str:
        kwargs = {**self.model.default_chat_template_kwargs, "truncate_history_thinking": False}
        self._set_thinking(kwargs, thinking)
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def _decide_policy(self, model, generation_tail: str) -> ReplayPolicy:
        """decide_policy with only the reasoning keys a probe render shows: the template's text may read a key of
        something else (Ministral 3 reads `block['thinking']` of content blocks, no message field), and reasoning
        handed to such a key would vanish from the prompt."""
        fields = reasoning_fields(self.template)
        if fields:
            shapes = ([{"role": "assistant", "content": "a"}],
                      [{"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}],
                      [{"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                       {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "ok"}])
            fields = tuple(key for key in fields if any(self._shows(key, shape) for shape in shapes))
        return decide_policy(self.template, model.reasoning_parser, generation_tail, fields)

    def _shows(self, key: str, shape: list[dict[str, Any]]) -> bool:
        """Whether reasoning under `key` of the shape's first (assistant) message changes the render at all
        (rendered as is, or mangled: either way the template reads it)."""
        user = {"role": "user", "content": "x"}
        try:
            text = self._probe_render([user, {**shape[0], key: "Probe reasoning."}, *shape[1:]], True, False)
            return text != self._probe_render([user, *shape], True, False)
        except Exception:  # noqa: BLE001 - a shape the template cannot render shows nothing
            return False

    def _probe_generation_tail(self, model, thinking: bool) -> str:
        """The generation prompt's tail for a one-message chat, to see whether the template opens thinking."""
        if not model.reasoning_parser:
            return ""
        try:
            text = self._probe_render([{"role": "user", "content": "x"}], thinking, True)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe simply has no opener
            return ""
        return text[-64:]

    def _probe_empty_replay(self, policy: ReplayPolicy, model) -> ReplayPolicy:
        """With thinking off, find the representation of an answer that renders back exactly as
        generation prompt + answer (tried on the template itself, once per model)."""
        block = closed_empty_block(self._probe_generation_tail(model, thinking=False), policy.markers)
        if not block:
            return policy
        answer = "Probe answer."
        try:
            prompt = self._probe_render([{"role": "user", "content": "x"}], False, True)
        except Exception:  # noqa: BLE001
            return policy
        candidates: list[str] = ["none"] + (["field"] if policy.fields else []) + ["inline"]
        user = Message("user", [TextPart("x")])
        # An answer before the next query, and (with tools) a turn inside a tool loop: templates that keep only the
        # current loop's thinking (Qwen3) render the two differently, and the loop is where agents spend turns.
        shapes = [[user, Message("assistant", [TextPart(answer)]), Message("user", [TextPart("y")])]]
        if model.tool_parser:
            shapes.append([user, Message("assistant", [TextPart(answer), ToolCallPart("call_0", "probe", "{}")]),
                           Message("user", [ToolResultPart("call_0", "ok", name="probe")])])
        best, best_score = None, 0
        for how in candidates:
            trial = replace(policy, empty_block=block, empty_replay=how)  # type: ignore[arg-type]
            score = 0
            for weight, shape in zip((1, 2), shapes):
                msgs = to_template_messages(Conversation(messages=shape), trial, thinking_off=True)
                try:
                    text = self._probe_render(msgs, False, False)
                except Exception:  # noqa: BLE001
                    continue
                if text.startswith(prompt + answer):
                    score += weight
            if score > best_score:
                best, best_score = trial, score
        return best or replace(policy, empty_block=block)

    def _probe_alternation(self, policy: ReplayPolicy) -> ReplayPolicy:
        """Does the template take two user turns in a row, and user text right after tool results? Codex opens with
        two user messages, and Anthropic clients send text beside tool results. A template whose user and assistant
        turns must alternate (Mistral's raise otherwise) gets that text joined to the user turn before it. Such a
        template may also refuse an answer that was only the end token; it gets an empty text block instead."""
        run = [Message("user", [TextPart("Probe user.")]), Message("user", [TextPart("Probe user two.")])]
        call_id = _PROBE_CALL["id"]
        after_tool = [Message("user", [TextPart("Probe user.")]),
                      Message("assistant", [ToolCallPart(call_id, "probe", "{}")]),
                      Message("user", [ToolResultPart(call_id, "Probe result.", name="probe"),
                                       TextPart("Probe user two.")])]

        def renders(pol: ReplayPolicy, shape: list[Message]) -> bool:
            """Every user text and result in the render, in order."""
            try:
                text = self._probe_render(to_template_messages(Conversation(messages=shape), pol), True, True)
            except Exception:  # noqa: BLE001 - a template that raises on the shape does not take it
                return False
            at = [text.find(p.content if isinstance(p, ToolResultPart) else p.text)
                  for m in shape if m.role == "user" for p in m.parts]
            return min(at) >= 0 and at == sorted(at)

        # The model's answer may be its end token alone: an assistant turn with neither text nor calls.
        empty = [Message("user", [TextPart("Probe user.")]), Message("assistant", []),
                 Message("user", [TextPart("Probe user two.")])]
        out = policy
        for shape, flag in ((run, "merge_user_runs"), (after_tool, "user_text_into_tool_result"),
                            (empty, "empty_turn_as_blocks")):
            trial = replace(out, **{flag: True})
            if not renders(out, shape) and renders(trial, shape):
                out = trial
        return out

    def _probe_system_messages(self, policy: ReplayPolicy) -> ReplayPolicy:
        """Does the template render every system message where it stands? Codex sends its instructions and a
        developer message first and more developer messages later in a session; Chat clients may send several
        system messages. A template that raises on them or drops them gets them as ReplayPolicy says. Probed with a
        tool, as agents send: DeepSeek-V4 drops developer messages before the last user turn only without tools."""
        def said(role: str, text: str) -> Message:
            return Message(role, [TextPart(text)])

        lead = [said("system", "Probe system one."), said("developer", "Probe system two."),
                said("user", "Probe user.")]
        later = [said("system", "Probe system one."), said("user", "Probe user."), said("assistant", "Probe answer."),
                 said("developer", "Probe system two."), said("user", "Probe user two.")]

        def kept(pol: ReplayPolicy, shape: list[Message]) -> bool:
            """Every message's text rendered, and the later system message after the answer before it (not
            hoisted to the top, which would change the prompt's prefix)."""
            for role in ("developer", "system"):  # the second system message as a developer one, and not
                msgs = [said(role, m.parts[0].text) if m.role == "developer" else m for m in shape]
                try:
                    text = self._probe_render(to_template_messages(Conversation(messages=msgs), pol), True, True,
                                              tools=_PROBE_TOOLS)
                except Exception:  # noqa: BLE001 - a template that raises on the shape does not take it
                    return False
                at = {m.parts[0].text: text.find(m.parts[0].text) for m in msgs}
                if min(at.values()) < 0 or at.get("Probe answer.", -1) > at["Probe system two."]:
                    return False
            return True

        # Codex may open with a developer message. A template that knows the role may still fail on it where it
        # stands (DeepSeek-V3.2's encoder drops developer messages before the last user turn, then fails): it gets
        # developer messages as system messages.
        opening = [said("developer", "Probe system two."), said("user", "Probe user.")]
        out = policy
        if policy.developer_role and not kept(policy, opening) and kept(replace(policy, developer_role=False), opening):
            out = replace(out, developer_role=False)
        if not kept(out, lead):
            out = replace(out, merge_leading_system=True)
        if not kept(out, later):
            out = replace(out, later_system_as_user=True)
        if out is not policy and not (kept(out, lead) and kept(out, later)):
            log.warning("model %s: its chat template does not render every system message, not even joined or "
                        "as user messages", self.model.id)
        return out

    def _probe_tool_reasoning(self, policy: ReplayPolicy) -> ReplayPolicy:
        """Drop mode: does a tool-call turn's inlined reasoning render as one think block? Not where the template
        writes its own (empty) block in front of the content."""
        if policy.mode != "drop" or not policy.markers:
            return policy
        start, end = policy.markers
        conv = Conversation(messages=[Message("user", [TextPart("Probe user.")]), Message("assistant", [
            ReasoningPart("Probe reasoning."), ToolCallPart("functions.probe:0", "probe", "{}")])])
        try:
            text = self._probe_render(to_template_messages(conv, policy), True, False)
        except Exception:  # noqa: BLE001 - no tool calls in this template: nothing to decide
            return policy
        user, at = text.find("Probe user."), text.find("Probe reasoning.")
        if 0 <= user < at and start + end in text[user:at]:
            return replace(policy, inline_tool_reasoning=False)
        return policy

    def _probe_affixes(self, policy: ReplayPolicy, model) -> ReplayPolicy:
        """Field mode: render a probe turn (reasoning, text, and a call when there is a tool parser) as the model
        would generate it, parse it with the model's parsers and see what the template added around the
        reasoning and the text; kept only if the parsed turn then renders back byte for byte."""
        if policy.mode != "field" or not model.reasoning_parser:
            return policy
        try:
            from serve_app.parsers import fold_complete, parse_complete
        except ImportError:
            return policy
        reasoning, answer = "Probe reasoning.", "Probe answer."
        user = [Message("user", [TextPart("x")])]
        call = [ToolCallPart("functions.probe:0", "probe", "{}")] if model.tool_parser else []
        found: dict[str, tuple[str, str]] = {}
        lead = ""

        def emitted(pol: ReplayPolicy, parts: list) -> tuple[str, bool] | None:
            prompt = self._probe_render(to_template_messages(Conversation(messages=user), pol), True, True)
            conv = Conversation(messages=[*user, Message("assistant", parts)])
            text = self._probe_render(to_template_messages(conv, pol), True, False)
            if not text.startswith(prompt):
                return None
            starts = prompt_starts_in_reasoning(prompt, pol.markers, self.turn_starts,
                                                self._format_starts_in_reasoning, self._answer_tags)
            return text[len(prompt):], starts

        def parsed(text: str, starts: bool) -> list:
            return fold_complete(parse_complete(text, model.reasoning_parser, model.tool_parser,
                                                starts_in_reasoning=starts))

        try:
            for key, calls in (("answer", []), ("calls", call)) if call else (("answer", []),):
                got = emitted(policy, [ReasoningPart(reasoning), TextPart(answer), *calls])
                if got is None:
                    return policy
                parts = parsed(*got)
                for p in parts:
                    if isinstance(p, ReasoningPart) and reasoning in p.text:
                        found["reasoning"] = _whitespace_around(p.text, reasoning)
                    elif isinstance(p, TextPart) and answer in p.text:
                        found[key] = _whitespace_around(p.text, answer)
                if (len(parts) > 1 and isinstance(parts[0], TextPart) and not parts[0].text.strip()
                        and isinstance(parts[1], ReasoningPart)):
                    lead = parts[0].text
            trial = replace(policy, reasoning_affixes=found.get("reasoning", ("", "")),
                            answer_affixes=found.get("answer", ("", "")), text_affixes=found.get("calls", ("", "")),
                            lead_text=lead)
            if trial == policy:
                return policy
            for key, calls in (("answer", []), ("calls", call)) if call else (("answer", []),):
                got = emitted(trial, [ReasoningPart(reasoning), TextPart(answer), *calls])
                r_head, r_tail = trial.reasoning_affixes
                t_head, t_tail = trial.text_affixes if calls else trial.answer_affixes
                # What the parser gave back for that text, replayed: must render the same text again.
                again = emitted(trial, ([TextPart(lead)] if lead else []) + [
                    ReasoningPart(r_head + reasoning + r_tail), TextPart(t_head + answer + t_tail), *calls])
                if got is None or again is None or again[0] != got[0]:
                    return policy
        except Exception:  # noqa: BLE001 - a template or parser that cannot take the probe keeps the plain policy
            return policy
        return trial

    def _marker_sample(self) -> str:
        """Renders of a turn with reasoning (in the fields templates read it from, never inline: this asks what the
        template writes, not what the replay policy adds) and of one with a call; those the template cannot
        render are left out."""
        out = []
        for turn in ({"content": "a", "reasoning_content": "r", "reasoning": "r"},
                     {"content": "", "tool_calls": [_PROBE_CALL]}):
            try:
                out.append(self._probe_render([{"role": "user", "content": "x"}, {"role": "assistant", **turn}],
                                              True, False))
            except Exception:  # noqa: BLE001 - the template's own text still counts
                pass
        return "".join(out)

    def _probe_replay(self) -> bool | None:
        """Whether a thinking answer replays byte for byte under the chosen policy (None: nothing to check).
        A diagnostic for operators adding a model: the decision itself never depends on it."""
        if not self.policy.markers:
            return None
        start, end = self.policy.markers
        try:
            prompt = self._probe_render([{"role": "user", "content": "x"}], True, True)
            opened = prompt.endswith(self.policy.opener) and self.policy.opener.startswith(start)
            reasoning = ("" if opened else "\n") + "Probe reasoning.\n"
            answer = "\n\nProbe answer."
            wrap = self._answer_tags[:2] if len(self._answer_tags) >= 2 else ("", "")  # an answer channel's tags
            generated = ("" if opened else start) + reasoning + end + wrap[0] + answer + wrap[1]
            conv = Conversation(messages=[Message("user", [TextPart("x")]),
                                          Message("assistant", [ReasoningPart(reasoning), TextPart(answer)]),
                                          Message("user", [TextPart("y")])])
            text = self._probe_render(to_template_messages(conv, self.policy), True, False)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe is reported as not exact
            return False
        return text.startswith(prompt + generated)

    # -- rendering ---------------------------------------------------------------------------------------------

    def prepare(self, conv: Conversation) -> Conversation:
        return strip_preamble(conv) if self.strip_preamble else conv

    def template_messages(self, conv: Conversation, *, thinking_off: bool = False) -> list[dict[str, Any]]:
        return to_template_messages(self.prepare(conv), self.policy, thinking_off=thinking_off)

    def render_text(self, conv: Conversation, opts: GenerationOptions, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        kwargs = self.template_kwargs(opts)
        messages = self.template_messages(conv, thinking_off=kwargs.get("enable_thinking") is False)
        tools = to_template_tools(conv.tools)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, chat_template=self.template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **kwargs)
        except ServiceError:
            raise
        except Exception as e:  # jinja2 TemplateError (raise_exception), and type errors inside the template
            raise InvalidRequest(_template_message(e), param="messages") from None

    def _probe_turn_starts(self) -> tuple[str, ...]:
        """The generation prompt strings (thinking on and off): where the model's own tokens begin."""
        user = [{"role": "user", "content": "x"}]
        out: set[str] = set()
        for thinking in ((True, False) if self.reasoning_enabled else (True,)):
            try:
                bare = self._probe_render(user, thinking, False)
                full = self._probe_render(user, thinking, True)
            except Exception:  # noqa: BLE001 - no generation prompt to find
                continue
            if full.startswith(bare) and len(full) > len(bare):
                out.add(full[len(bare):])
        if not out:
            out = self._probe_turn_ends()
        return tuple(sorted(out, key=len, reverse=True))

    def _probe_turn_ends(self) -> set[str]:
        """A template without a generation prompt ends the prompt with the last turn's own closing markup (Mistral's
        "[/INST]", "[/TOOL_RESULTS]"; DeepSeek-V4 always writes "<｜Assistant｜><think>" after a user turn), and the
        model's tokens follow it: those strings mark where they begin.
        Tokenized across that seam, a tokenizer that does not know the markup as tokens could merge the prompt's
        last characters with the model's first and lose the cache from there."""
        last = "Probe turn."  # the text the prompt's last turn ends with
        shapes = ([{"role": "user", "content": last}],
                  [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                   {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": last}])
        out: set[str] = set()
        for thinking in ((True, False) if self.reasoning_enabled else (True,)):
            for shape in shapes:
                try:
                    text = self._probe_render(shape, thinking, True)
                except Exception:  # noqa: BLE001 - a shape the template cannot render marks nothing
                    continue
                at = text.rfind(last)
                tail = text[at + len(last):] if at >= 0 else ""
                if tail.strip():
                    out.add(tail)
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize a rendered prompt in pieces that end where a generation prompt ends.

        Turn N's prompt was tokenized ending right after its generation prompt and the model's tokens followed;
        tokenized as one string, turn N+1 could merge across that seam (a trailing "\n\n" + "<tool_call>"
        becomes different tokens) and lose the cache from there on. Cutting at the same seams gives back the
        ids the engine saw; the text is unchanged. Pieces are also cut in front of special tokens (which the
        tokenizer splits out first anyway, so the ids are the same) to memoise long repeated pieces: the
        system prompt and earlier turns are tokenized once, not on every turn.
        """
        return self._encode_pieces(self._pieces(text))

    def _pieces(self, text: str) -> list[str]:
        """The pieces encode_prompt tokenizes `text` in (see there)."""
        cuts: set[int] = set()
        for start in self.turn_starts:
            at = text.find(start)
            while at >= 0:
                cuts.add(at + len(start))
                at = text.find(start, at + 1)
        for special in self._cut_before:
            at = text.find(special)
            while at >= 0:
                cuts.add(at)
                at = text.find(special, at + 1)
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def _encode_pieces_locked(self, pieces: list[str], release_gil: bool) -> list[int]:
        """`release_gil`: off the event loop, where a long piece should let the loop run while it is tokenized."""
        ids: list[int] = []
        for piece in pieces:
            ids.extend(self._encode_piece(piece, release_gil))
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        with self._encode_lock:
            return self._encode_pieces_locked(pieces, release_gil=True)

    def _uncached_chars(self, pieces: list[str]) -> int:
        """Characters of `pieces` the memo does not hold: what tokenizing them would cost."""
        memo = self._memo
        return sum(len(p) for p in pieces if p not in memo)

    def _encode_text(self, text: str, release_gil: bool = False) -> list[int]:
        if self._backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if release_gil and len(text) >= _RELEASE_GIL_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL
        return self._backend.encode(text, add_special_tokens=False).ids

    def _probe_backend(self):
        """The fast tokenizer's own backend when it gives transformers' ids for the probes. transformers' encode
        goes through the backend's batch encode, which releases the GIL (on the event loop, a chance for another
        thread to take it and hold the loop up) and adds Python work on every piece; the backend's single encode
        does neither."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is None or not callable(getattr(backend, "encode", None)):
            return None
        try:
            probes = ["Probe text.\n", " two  spaces\tand a tab", "ünïcödé, 漢字 and 👋", *self._cut_before,
                      *self.turn_starts, self._probe_render([{"role": "user", "content": "x"}], True, True)]
            for text in probes:
                if list(backend.encode(text, add_special_tokens=False).ids) != list(
                        self.tokenizer.encode(text, add_special_tokens=False)):
                    return None
        except Exception:  # noqa: BLE001 - any doubt: transformers' own path
            return None
        return backend

    def _encode_piece(self, piece: str, release_gil: bool = False) -> array:
        memo = self._memo
        hit = memo.get(piece)
        if hit is not None:
            memo.move_to_end(piece)
            return hit
        out = array("I", self._encode_text(piece, release_gil))
        memo[piece] = out
        self._memo_chars += len(piece) + _MEMO_ENTRY_CHARS
        while self._memo_chars > _MEMO_MAX_CHARS and memo:
            old, _ = memo.popitem(last=False)
            self._memo_chars -= len(old) + _MEMO_ENTRY_CHARS
        return out

    def _pieces_concatenate(self) -> bool:
        """Encoding two pieces gives the ids of encoding their concatenation (at a newline and in front of a
        special token)."""
        def enc(text: str) -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        a, b = "Probe text.\n", "Next line"
        if enc(a) + enc(b) != enc(a + b):
            return False
        return all(enc("Probe text") + enc(t + "user") == enc("Probe text" + t + "user") for t in self._cut_before)

    def _special_cuts(self) -> tuple[str, ...]:
        """Special tokens that can start a piece without changing the ids: matched verbatim (not normalised) and
        not eating whitespace on their left."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return tuple(sorted({a.content for a in added.values()
                             if getattr(a, "special", False) and not getattr(a, "lstrip", False)
                             and not getattr(a, "normalized", True) and a.content}))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        with self._encode_lock:
            return self._encode_locked(text, add_special_tokens)

    def _encode_locked(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # The token-id views `/v1/tokenize` and `/v1/detokenize` give: callers never reach into the tokenizer.
    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        return list(self.tokenizer.build_inputs_with_special_tokens(ids))

    def render_sync(self, conv: Conversation, opts: GenerationOptions, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> RenderedPrompt:
        # A prefill (opts.continue_final) renders the same way for generation and for every token count.
        continue_final_message = continue_final_message or opts.continue_final
        text = self.render_text(conv, opts, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message)
        # The template writes BOS and other special tokens itself; adding them again would double them.
        ids = self.encode_prompt(text)
        return self._rendered(text, ids, add_generation_prompt, continue_final_message)

    def _rendered(self, text: str, ids: list[int], add_generation_prompt: bool,
                  continue_final_message: bool) -> RenderedPrompt:
        starts = (self.reasoning_enabled and add_generation_prompt and not continue_final_message
                  and prompt_starts_in_reasoning(text, self.policy.markers, self.turn_starts,
                                                 self._format_starts_in_reasoning, self._answer_tags))
        return RenderedPrompt(text=text, token_ids=ids, starts_in_reasoning=starts)

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=self.render_threads, thread_name_prefix="render")

    async def render(self, conv: Conversation, opts: GenerationOptions, *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> RenderedPrompt:
        """Render on the event loop when that is cheap, else in the render pool.

        A thread beside a busy event loop waits for the GIL far longer than its work takes: the loop drops and
        retakes the GIL around every poll, which wakes the waiting thread only to lose the race again, so its
        wait never times out into a forced switch (docs/serving-path.md "The render thread's wait"). At 128
        requests arriving at once that queue was most of the ingress's part of TTFT, for renders of ~0.2 ms
        each. So a template over a conversation of bounded size runs here, and its tokens are encoded here when
        the part of the prompt the memo does not hold is at most `inline_chars` (~1.5 ms at 4,096); anything
        larger, or a render while a pool thread holds the tokenizer, goes to the pool as before. An inline step
        slower than _INLINE_MAX_S is a strike; _INLINE_STRIKES of them turn inlining off for good.
        """
        kw = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if self._inline_off or conversation_chars(conv, _INLINE_TEMPLATE_MAX_CHARS) > _INLINE_TEMPLATE_MAX_CHARS:
            return await self.run(self.render_sync, conv, opts, **kw)
        continue_final_message = continue_final_message or opts.continue_final
        started = time.thread_time()
        try:
            text = self.render_text(conv, opts, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)
        finally:
            self._check_inline(started, "template")
        pieces = self._pieces(text)
        if self._uncached_chars(pieces) <= self.inline_chars and self._encode_lock.acquire(blocking=False):
            started = time.thread_time()
            try:
                ids = self._encode_pieces_locked(pieces, release_gil=False)
            finally:
                self._encode_lock.release()
                self._check_inline(started, "tokenizing")
        else:
            ids = await self.run(self._encode_pieces, pieces)
        return self._rendered(text, ids, add_generation_prompt, continue_final_message)

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """`/v1/tokenize` of a plain prompt: on the loop up to `inline_chars` (the pool's wait, as for `render`),
        else in the pool."""
        if not self._inline_off and len(text) <= self.inline_chars and self._encode_lock.acquire(blocking=False):
            try:
                return self._encode_locked(text, add_special_tokens)
            finally:
                self._encode_lock.release()
        return await self.run(self.encode, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str:
        """`/v1/detokenize`: on the loop up to a quarter of `inline_chars` tokens (about as many characters), else
        in the pool."""
        if not self._inline_off and len(ids) <= self.inline_chars // 4:
            return self.decode(ids)
        return await self.run(self.decode, ids)

    def _check_inline(self, started: float, step: str) -> None:
        took = time.thread_time() - started
        if took <= _INLINE_MAX_S or self._inline_off:
            return
        self._inline_strikes += 1
        log.warning("model %s: %s a prompt on the event loop took %.0f ms of CPU (%d of %d)", self.model.id, step,
                    took * 1e3, self._inline_strikes, _INLINE_STRIKES)
        if self._inline_strikes >= _INLINE_STRIKES:
            self._inline_off = True
            log.warning("model %s: its prompts render in the render pool from now on", self.model.id)

    async def run(self, fn, *args, **kw):
        """Run `fn` in the render pool under the render timeout (the renders `render` does not run inline)."""
        loop = asyncio.get_running_loop()
        pool = self._pool
        fut = loop.run_in_executor(pool, lambda: fn(*args, **kw))
        try:
            return await asyncio.wait_for(fut, self.render_timeout_s)
        except asyncio.TimeoutError:
            # The stuck thread cannot be killed; give later requests fresh threads instead of queueing behind it.
            self._pool = self._new_pool()
            pool.shutdown(wait=False)  # work queued there still runs (its threads are not all stuck)
            raise ServiceError("timeout", f"rendering the prompt took longer than {self.render_timeout_s:g} s",
                               code="render_timeout") from None
