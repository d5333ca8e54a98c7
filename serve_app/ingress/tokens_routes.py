"""`/v1/tokenize` and `/v1/detokenize` (also at `/tokenize`, `/detokenize`) in vLLM's request/response shapes.

The chat form goes through the same converter and prompt renderer as a chat completion, so `count` equals the
`usage.prompt_tokens` the engine reports for that request (docs/architecture.md: "The ingress owns the prompt").
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from serve_app.errors import InvalidRequest
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import api_router, openai_envelope
from serve_app.ingress.streaming import read_body

router = api_router(openai_envelope)

# Chat-form fields vLLM accepts that change nothing here (no multimodal inputs on the default model).
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "return_token_strs", "media_io_kwargs",
              "mm_processor_kwargs", "add_special_tokens", "chat_template")


async def _body(request: Request, ctx: IngressContext) -> dict[str, Any]:
    body = await read_body(request, ctx)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    # vLLM makes `model` optional on these routes: the first configured model answers then.
    if body.get("model") is None and ctx.settings.models:
        body["model"] = ctx.settings.models[0].id
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("model: must be a string (a served model id)", param="model")
    return body


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key}: must be a boolean", param=key)
    return value


async def _tokenize_chat(ctx: IngressContext, body: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    if body.get("chat_template") is not None:
        raise InvalidRequest("chat_template: a request-supplied chat template is not accepted", param="chat_template")
    add_gen = _flag(body, "add_generation_prompt", True)
    cont = _flag(body, "continue_final_message", False)
    if add_gen and cont and "add_generation_prompt" in body:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                             param="continue_final_message")
    chat_body = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    req, conv, opts = chat_request_to_conversation(chat_body)
    renderer, model = await ctx.service.renderer_for(req.model)
    rendered = await renderer.render(conv, opts, add_generation_prompt=add_gen and not cont,
                                     continue_final_message=cont)
    ids = list(rendered.token_ids)
    if _flag(body, "add_special_tokens", False):
        ids = renderer.with_special_tokens(ids)
    return renderer, model, ids


async def _tokenize_prompt(ctx: IngressContext, body: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt: must be a string", param="prompt")
    add_special = _flag(body, "add_special_tokens", True)
    renderer, model = await ctx.service.renderer_for(body.get("model"))
    ids = await renderer.tokenize(prompt, add_special_tokens=add_special)
    return renderer, model, ids


@router.post("/v1/tokenize")
@router.post("/tokenize")
async def tokenize(request: Request, ctx: IngressContext = Depends(get_ctx)) -> dict[str, Any]:
    body = await _body(request, ctx)
    if "messages" in body:
        renderer, model, ids = await _tokenize_chat(ctx, body)
    elif "prompt" in body:
        renderer, model, ids = await _tokenize_prompt(ctx, body)
    else:
        raise InvalidRequest("either `prompt` or `messages` is required", param="prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = renderer.token_strings(ids)
    return out


@router.post("/v1/detokenize")
@router.post("/detokenize")
async def detokenize(request: Request, ctx: IngressContext = Depends(get_ctx)) -> dict[str, Any]:
    body = await _body(request, ctx)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("tokens: must be a list of integers", param="tokens")
    renderer, _ = await ctx.service.renderer_for(body.get("model"))
    vocab = renderer.vocab_size
    bad = next((t for t in tokens if t < 0 or t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens: {bad} is not a token id of this model (0..{vocab - 1})", param="tokens")
    text = await renderer.detokenize(tokens)
    return {"prompt": text}
