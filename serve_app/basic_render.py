"""Temporary minimal renderer used until serve_app.prompt lands (the lead removes this file then)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from serve_app.conversation import ReasoningPart, TextPart, ToolCallPart, ToolResultPart


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    starts_in_reasoning: bool = False


def load_tokenizer(path, chat_template=None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat_template:
        tok.chat_template = open(chat_template).read() if chat_template.endswith(".jinja") else chat_template
    return tok


class PromptRenderer:
    def __init__(self, tokenizer, model, *, strip_preamble=True, render_timeout_s=30.0):
        self.tokenizer = tokenizer
        self.model = model

    def render_sync(self, conv, opts):
        msgs = []
        for m in conv.messages:
            text = "".join(p.text for p in m.parts if isinstance(p, TextPart))
            d = {"role": "system" if m.role == "developer" else m.role, "content": text}
            calls = [p for p in m.parts if isinstance(p, ToolCallPart)]
            if calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            r = [p.text for p in m.parts if isinstance(p, ReasoningPart)]
            if r:
                d["reasoning_content"] = "".join(r)
            for p in m.parts:
                if isinstance(p, ToolResultPart):
                    d = {"role": "tool", "tool_call_id": p.tool_call_id, "content": p.content if isinstance(p.content, str) else ""}
            msgs.append(d)
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}} for t in conv.tools] or None
        text = self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        return RenderedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    async def render(self, conv, opts):
        return await asyncio.to_thread(self.render_sync, conv, opts)
