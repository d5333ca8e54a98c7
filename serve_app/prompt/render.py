"""Render a Conversation with the model's chat template and tokenize it: the one path every API (and every
token count) goes through, so the router hashes, `count_tokens` reports and the engine prefills the same ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.conversation import Conversation, GenerationOptions
from serve_app.errors import InvalidRequest, ServiceError
from serve_app.prompt.messages import to_template_messages, to_template_tools
from serve_app.prompt.policy import ReplayPolicy, decide_policy, ends_in_reasoning
from serve_app.prompt.preamble import strip_preamble

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


class _TemplateRejected(Exception):
    pass


def _template_message(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return f"the chat template rejected the request: {text}"


class PromptRenderer:
    """Renders and tokenizes for one model. Immutable after construction; safe to share across tasks."""

    def __init__(self, tokenizer, model, *, strip_preamble: bool = True, render_timeout_s: float = 30.0):
        self.tokenizer = tokenizer
        self.model = model
        self.strip_preamble = strip_preamble
        self.render_timeout_s = render_timeout_s
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one renders chat
            template = template.get("default") or next(iter(template.values()))
        if not template:
            raise ValueError(f"model {model.id!r}: the tokenizer has no chat template and none is configured")
        self.template: str = template
        self.reasoning_enabled = bool(model.reasoning_parser)
        probe = self._probe_generation_tail(model)
        self.policy: ReplayPolicy = decide_policy(template, model.reasoning_parser, probe)
        # Fast tokenizers are not safe to call from several threads at once ("Already borrowed").
        self._encode_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="render")

    # -- template kwargs --------------------------------------------------------------------------------------

    def template_kwargs(self, opts: GenerationOptions) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self.model.default_chat_template_kwargs)
        if self.reasoning_enabled:
            thinking = opts.thinking is not False
            kwargs["enable_thinking"] = thinking
            if thinking:
                # Keep earlier thinking in the prompt: the history must render as it was generated.
                kwargs["truncate_history_thinking"] = False
        elif opts.thinking is False:
            kwargs["enable_thinking"] = False
        if opts.reasoning_effort is not None:
            kwargs["reasoning_effort"] = opts.reasoning_effort
        for key, value in opts.chat_template_kwargs.items():  # explicit per-request kwargs win
            if key not in _RESERVED_KWARGS:
                kwargs[key] = value
        return kwargs

    def _probe_generation_tail(self, model) -> str:
        """The generation prompt's tail for a one-message chat, to see whether the template opens thinking."""
        if not model.reasoning_parser:
            return ""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                chat_template=self.template,
                **{**model.default_chat_template_kwargs, "enable_thinking": True, "truncate_history_thinking": False})
        except Exception:  # noqa: BLE001 - a template that cannot render the probe simply has no opener
            return ""
        return text[-64:]

    # -- rendering ---------------------------------------------------------------------------------------------

    def prepare(self, conv: Conversation) -> Conversation:
        return strip_preamble(conv) if self.strip_preamble else conv

    def template_messages(self, conv: Conversation) -> list[dict[str, Any]]:
        return to_template_messages(self.prepare(conv), self.policy)

    def render_text(self, conv: Conversation, opts: GenerationOptions, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        messages = self.template_messages(conv)
        tools = to_template_tools(conv.tools)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, chat_template=self.template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **self.template_kwargs(opts))
        except ServiceError:
            raise
        except Exception as e:  # jinja2 TemplateError (raise_exception), and type errors inside the template
            raise InvalidRequest(_template_message(e), param="messages") from None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        with self._encode_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_sync(self, conv: Conversation, opts: GenerationOptions, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> RenderedPrompt:
        text = self.render_text(conv, opts, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message)
        # The template writes BOS and other special tokens itself; adding them again would double them.
        ids = self.encode(text)
        starts = (self.reasoning_enabled and add_generation_prompt and not continue_final_message
                  and ends_in_reasoning(text, self.policy.markers))
        return RenderedPrompt(text=text, token_ids=ids, starts_in_reasoning=starts)

    async def render(self, conv: Conversation, opts: GenerationOptions, **kw) -> RenderedPrompt:
        return await self.run(self.render_sync, conv, opts, **kw)

    async def run(self, fn, *args, **kw):
        """Run `fn` in the render pool under the render timeout; the event loop never blocks on a template."""
        loop = asyncio.get_running_loop()
        pool = self._pool
        fut = loop.run_in_executor(pool, lambda: fn(*args, **kw))
        try:
            return await asyncio.wait_for(fut, self.render_timeout_s)
        except asyncio.TimeoutError:
            # The stuck thread cannot be killed; give later requests fresh threads instead of queueing behind it.
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="render")
            pool.shutdown(wait=False, cancel_futures=True)
            raise ServiceError("timeout", f"rendering the prompt took longer than {self.render_timeout_s:g} s",
                               code="render_timeout") from None
