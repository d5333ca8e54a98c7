"""Drop the per-session attribution line harnesses put at the top of the system prompt.

Claude Code (and OpenClaw on its Claude-identity path) send `x-anthropic-billing-header: cc_version=…;
cc_entrypoint=…;` (optionally `cch=…;`) as the first system block. It differs per session (and, in old
versions, per request), so left in place it sits at token 0 and defeats the prefix cache for the whole prompt
(harness-contracts A4). Only that one line is removed, only from the first system message, and everything else
is kept byte for byte.
"""

from __future__ import annotations

from serve_app.conversation import Conversation, Message, TextPart

BILLING_PREFIX = "x-anthropic-billing-header:"


def _strip_line(text: str) -> str | None:
    """The text without a leading billing-header line, or None when it does not start with one."""
    if not text.startswith(BILLING_PREFIX):
        return None
    newline = text.find("\n")
    return "" if newline < 0 else text[newline + 1:]


def strip_preamble(conv: Conversation) -> Conversation:
    """Return `conv` without the attribution line (a shallow copy; `conv` itself is never modified)."""
    for i, msg in enumerate(conv.messages):
        if msg.role not in ("system", "developer"):
            continue
        # Only the first system message, and only its first part, can carry the line.
        if not msg.parts or not isinstance(msg.parts[0], TextPart):
            return conv
        rest = _strip_line(msg.parts[0].text)
        if rest is None:
            return conv
        parts = ([TextPart(rest)] if rest else []) + list(msg.parts[1:])
        messages = list(conv.messages)
        if parts:
            messages[i] = Message(msg.role, parts)
        else:
            del messages[i]
        return Conversation(messages=messages, tools=conv.tools, tool_choice=conv.tool_choice)
    return conv
