"""Chat Completions request → Conversation + GenerationOptions."""

from __future__ import annotations

from typing import Any

from serve_app.conversation import (
    Conversation,
    GenerationOptions,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from serve_app.errors import InvalidRequest
from serve_app.ingress import output_format
from serve_app.ingress.common import agent_hints, parse_model, thinking_switch
from serve_app.protocols.chat import ChatCompletionRequest, ChatMessage


def _content_parts(msg: ChatMessage, where: str) -> list[Part]:
    if msg.content is None:
        return []
    if isinstance(msg.content, str):
        return [TextPart(msg.content)] if msg.content else []
    parts: list[Part] = []
    for i, p in enumerate(msg.content):
        if p.type in ("text", "input_text", "output_text"):
            parts.append(TextPart(p.text or ""))
        elif p.type == "refusal" and msg.role == "assistant":
            # An earlier answer's refusal part (assistant history): it is what the model said.
            parts.append(TextPart(p.refusal or ""))
        elif p.type == "image_url":
            url = p.image_url.get("url") if isinstance(p.image_url, dict) else p.image_url
            parts.append(ImagePart(url=url))
        else:
            raise InvalidRequest(f"{where}.content.{i}.type: unsupported content part type {p.type!r}",
                                 param=f"{where}.content.{i}.type")
    return parts


def _message(msg: ChatMessage, i: int) -> Message:
    where = f"messages.{i}"
    if msg.role == "tool":
        if not msg.tool_call_id:
            raise InvalidRequest(f"{where}.tool_call_id: field required for role tool", param=f"{where}.tool_call_id")
        content = msg.content if isinstance(msg.content, str) else _content_parts(msg, where)
        return Message("tool", [ToolResultPart(tool_call_id=msg.tool_call_id, content=content or "", name=msg.name)])
    parts: list[Part] = []
    if msg.role == "assistant":
        reasoning = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
        if reasoning:
            parts.append(ReasoningPart(reasoning))
    parts.extend(_content_parts(msg, where))
    for call in msg.tool_calls or []:
        if msg.role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls: only assistant messages carry tool calls", param=f"{where}.tool_calls")
        parts.append(ToolCallPart(id=call.id, name=call.function.name, arguments=call.function.arguments))
    return Message(msg.role, parts)


def _check_tool_pairing(messages: list[ChatMessage]) -> None:
    """The API's rule, in its own words: a `tool` message answers a call of the assistant message with `tool_calls`
    it follows (only other tool messages may come between)."""
    calls: set[str] | None = None  # the open assistant turn's call ids; None when no such turn is open
    for i, msg in enumerate(messages):
        if msg.role == "tool":
            if calls is None:
                raise InvalidRequest("Invalid parameter: messages with role 'tool' must be a response to a "
                                     "preceeding message with 'tool_calls'.", param=f"messages.[{i}].role")
            if msg.tool_call_id not in calls:
                raise InvalidRequest(f"Invalid parameter: 'tool_call_id' of '{msg.tool_call_id}' not found in "
                                     "'tool_calls' of previous message.", param=f"messages.[{i}].tool_call_id")
        elif msg.role == "assistant" and msg.tool_calls:
            calls = {c.id for c in msg.tool_calls}
        else:
            calls = None


# Chat custom (freeform) tools are not served: their calls come back in a `custom` shape the Chat chunk types do not
# carry. The Responses API serves them (given to the model as a function with one string parameter).
_NO_CUSTOM = ("custom tools are not supported on Chat Completions by this server; the Responses API "
              "(/v1/responses) serves them, or give the tool as a function tool")


def _function_only(kind: Any, where: str) -> None:
    """A tool entry at `where` must be a function tool: custom ones get the reason, other types the value 400."""
    if kind == "custom":
        raise InvalidRequest(f"{where}.type: {_NO_CUSTOM}", param=f"{where}.type")
    if kind != "function":
        raise InvalidRequest(f"{where}.type: Invalid value: {kind!r}. Supported values are: 'function'.",
                             param=f"{where}.type", code="invalid_value")


def _tools(req: ChatCompletionRequest) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(req.tools or []):
        where = f"tools.{i}"
        _function_only(t.type, where)
        if t.function is None:
            raise InvalidRequest(f"{where}.function: field required", param=f"{where}.function")
        specs.append(ToolSpec(name=t.function.name, description=t.function.description or "",
                              parameters=t.function.parameters or {"type": "object", "properties": {}}))
    return specs


def _allowed_names(entries: list[dict[str, Any]], names: set[str]) -> tuple[str, ...]:
    """The tool names an `allowed_tools` choice lists, each one a given tool (else the 400 names the entry)."""
    allowed: list[str] = []
    for i, entry in enumerate(entries):
        where = f"tool_choice.allowed_tools.tools.{i}"
        _function_only(entry.get("type") if isinstance(entry, dict) else None, where)
        fn = entry.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.function.name: field required", param=f"{where}.function.name")
        if name not in names:
            raise InvalidRequest(f"{where}.function.name: no tool named {name!r} in tools",
                                 param=f"{where}.function.name")
        allowed.append(name)
    return tuple(dict.fromkeys(allowed))


def _tool_choice(req: ChatCompletionRequest, tools: list[ToolSpec]) -> ToolChoice:
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
    tc = req.tool_choice
    if tc is None or tc == "auto":
        return ToolChoice("auto", parallel=parallel)
    if tc == "none":
        return ToolChoice("none", parallel=parallel)
    if tc == "required":
        return ToolChoice("required", parallel=parallel)
    if tc.type == "allowed_tools":
        if tc.allowed_tools is None:
            raise InvalidRequest("tool_choice.allowed_tools: field required", param="tool_choice.allowed_tools")
        # every tool stays in the prompt (the cached prefix does not change); the grammar allows only these calls
        allowed = _allowed_names(tc.allowed_tools.tools, {t.name for t in tools})
        return ToolChoice(tc.allowed_tools.mode, parallel=parallel, allowed=allowed)
    if tc.type == "custom":
        raise InvalidRequest(f"tool_choice.type: {_NO_CUSTOM}", param="tool_choice.type")
    if tc.type != "function":
        raise InvalidRequest(f"tool_choice.type: Invalid value: {tc.type!r}. Supported values are: 'function', "
                             "'allowed_tools'.", param="tool_choice.type", code="invalid_value")
    name = (tc.function or {}).get("name")
    if not name:
        raise InvalidRequest("tool_choice.function.name: field required", param="tool_choice.function.name")
    return ToolChoice("tool", name=name, parallel=parallel)


# Fields of the current SDK's create() that ask for output this server cannot produce: answering without them
# would look like success and be something else. Every other field is accepted (docs/anthropic.md lists the ones
# without effect and why).
def _unserved(req: ChatCompletionRequest) -> tuple[str, str] | None:
    extra = req.model_extra or {}
    if extra.get("functions") or extra.get("function_call"):
        name = "functions" if extra.get("functions") else "function_call"
        return name, "the deprecated function-calling fields are not supported by this server; send `tools`"
    if extra.get("audio") or "audio" in (extra.get("modalities") or []):
        return ("audio" if extra.get("audio") else "modalities"), "this server generates text only"
    if extra.get("web_search_options") is not None:
        return "web_search_options", "this server has no web search; give the model a search tool in `tools`"
    if extra.get("logprobs"):
        return "logprobs", "log probabilities are not returned by this server"
    return None


def chat_request_to_conversation(body: dict[str, Any]) -> tuple[ChatCompletionRequest, Conversation, GenerationOptions]:
    req = parse_model(ChatCompletionRequest, body)
    unserved = _unserved(req)
    if unserved is not None:
        raise InvalidRequest(f"{unserved[0]}: {unserved[1]}", param=unserved[0])
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise InvalidRequest("continue_final_message: the last message must be an assistant message to continue",
                             param="continue_final_message")
    for token, bias in (req.logit_bias or {}).items():
        if not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias: the bias of token {token} must be between -100 and 100",
                                 param="logit_bias")
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    _check_tool_pairing(req.messages)
    tools = _tools(req)
    conv = Conversation(messages=messages, tools=tools, tool_choice=_tool_choice(req, tools))
    kwargs = dict(req.chat_template_kwargs or {})
    effort_on = None if req.reasoning_effort is None else req.reasoning_effort not in ("none", "minimal")
    thinking = thinking_switch(kwargs, req.enable_thinking, effort_on)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    nvext = req.nvext
    opts = GenerationOptions(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias or None,
        stop=stop,
        thinking=thinking,
        reasoning_effort=req.reasoning_effort,
        chat_template_kwargs=kwargs,
        session_key=req.prompt_cache_key or req.user,
        user_key=req.safety_identifier or req.user,
        hints=agent_hints(nvext.agent_hints if nvext else None),
        forced_script=nvext.forced_script if nvext else None,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        output_format=output_format.from_chat(req.response_format),
        continue_final=req.continue_final_message,
    )
    return req, conv, opts
