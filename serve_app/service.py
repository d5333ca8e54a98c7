"""GenerationService: the one pipeline every API adapter drives (ARCHITECTURE steps 3-6).

An adapter turns its wire request into `(Conversation, GenerationOptions)` and then:

    prepared = await service.prepare(conv, opts, model_id)       # render + tokenize + limits (may raise ServiceError)
    async for ev in service.stream(prepared): ...                # parser events, then Usage, then Finish
    n = await service.count_tokens(conv, opts, model_id)         # == prepared.num_prompt_tokens for the same request

`stream` yields the IR's semantic events: ReasoningDelta / TextDelta / ToolCallStart / ToolCallArgsDelta /
ToolCallEnd as the parser produces them, then exactly one `Usage` and one `Finish` last. An engine failure after
the stream began ends it with `Finish(reason="error", error=...)` (never an exception), so each adapter can emit
its protocol's error event. Closing the iterator (client disconnect) aborts the engine request.

The non-streaming form is the same stream folded (`conversation.fold_events`), so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_app.conversation import Conversation, GenerationOptions
from serve_app.settings import ModelConfig


@dataclass(slots=True)
class PreparedRequest:
    request_id: str
    model_id: str  # the id the client asked for (echoed back)
    model: ModelConfig
    conversation: Conversation
    options: GenerationOptions
    prompt_token_ids: list[int]
    max_tokens: int  # clamped to what fits in the context
    starts_in_reasoning: bool = False
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style function schemas for the parser

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
