"""OpenAI Chat Completions request wire model. Permissive about unknown fields, strict about types."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, model_validator

from serve_app.protocols.base import OpenModel


class FunctionCall(OpenModel):
    name: str
    arguments: str = "{}"


class ToolCall(OpenModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(OpenModel):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None
    refusal: str | None = None


class ChatMessage(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        # The API requires content on every message but an assistant's (which may carry only tool calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: field required for a {self.role} message")
        return self


class FunctionDef(OpenModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenModel):
    type: str = "function"  # only function tools are served; the converter names any other type in its 400
    function: FunctionDef | None = None


class AllowedTools(OpenModel):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class ToolChoiceObject(OpenModel):
    """`{"type":"function","function":{"name":...}}` or `{"type":"allowed_tools","allowed_tools":{...}}`; any other
    type (`custom`) is the converter's 400, which says why."""

    type: str
    function: dict[str, Any] | None = None
    allowed_tools: AllowedTools | None = None


class StreamOptions(OpenModel):
    include_usage: bool = False


class AgentHintsIn(OpenModel):
    priority: int | None = None
    osl: int | None = Field(default=None, ge=1)
    speculative_prefill: bool = False
    latency_sensitivity: float | None = None


class NvExt(OpenModel):
    agent_hints: AgentHintsIn | None = None
    forced_script: str | None = None
    tool_dispatch: bool = False  # this client reads the `event: tool_call_dispatch` side channel
    # Each tool call sent whole once complete, never one the parser abandons (None: `ingress.chat_tool_calls`).
    hold_tool_calls: bool | None = None


class ChatCompletionRequest(OpenModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id (a string on the wire) -> bias in [-100, 100]
    n: int = Field(default=1, ge=1, le=1)
    stop: Union[str, list[str], None] = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceObject, None] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Qwen's cloud API (DashScope) takes the thinking switch at the top level; OpenClaw sends it there for Qwen
    # models with `qwenThinkingFormat: "top-level"`. chat_template_kwargs.enable_thinking wins where both are set.
    enable_thinking: bool | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None  # `user`'s successor in OpenAI's API
    nvext: NvExt | None = None
    # vLLM's sampling extensions, accepted so benchmarks can ask both servers for exactly N tokens.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's extension: continue the final assistant message instead of starting a new one (a prefill).
    continue_final_message: bool = False
