"""The model-family catalog: per family its real chat template (vendored, with source and license), parsers,
thinking behaviour, stop tokens and template kwargs — data in `catalog.yaml`, validated here.

A model config names `family:` and gets `reasoning_parser`, `tool_parser` and `default_chat_template_kwargs` from
the entry (its own fields override); `family_template: true` also renders with the vendored template instead of
the tokenizer's. `python -m serve_app families [--json]` prints the catalog.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from serve_app.parsers.answer import understood_kwargs

CATALOG = Path(__file__).resolve().parent / "catalog.yaml"
TEMPLATES = CATALOG.parent / "templates"

ThinkingReplay = Literal["keeps_all", "last_turn", "drops"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TemplateSource(_Strict):
    repo: str  # the GitHub repository the file was taken from
    commit: str  # a commit id; for a template written here, the release tag of the encoder it reproduces
    path: str
    blob: str  # git blob id of the vendored file
    model: str  # the Hugging Face model whose template it is
    license: str  # the model's license, which covers its template
    upstream: str | None = None  # the project the repository mirrors
    # The model ships its format as code, not a template: the template is this project's reproduction of the
    # encoder at `path` in that release (and `blob` is the template's own), tested against the encoder itself.
    written_here: bool = False


class Family(_Strict):
    name: str
    description: str
    models: list[str]
    template: str  # file name under templates/
    source: TemplateSource
    note: str | None = None
    reasoning_parser: str | None
    tool_parser: str | None
    thinking_in_prompt: bool
    thinking_can_be_disabled: bool
    thinking_replay: ThinkingReplay
    stop_tokens: list[str]
    chat_template_kwargs: dict[str, str]  # kwarg → what it does
    thinking_kwarg: str = "enable_thinking"  # the kwarg that switches the template's thinking
    thinking_values: tuple[Any, Any] = (True, False)  # what thinking_kwarg is set to for thinking on, off
    effort_kwarg: str = "reasoning_effort"  # the kwarg a request's reasoning effort goes to
    effort_values: dict[str, str] = Field(default_factory=dict)  # effort → the template's value ({}: as is)
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # What one assistant turn of the template can carry (the round-trip test asserts each false one).
    parallel_calls: bool = True  # several calls in one turn
    no_argument_calls: bool = True  # a call with an empty arguments object
    text_reasoning_and_calls: bool = True  # reasoning, text and calls together in one turn
    text_with_calls: bool = True  # a call turn's text renders as text (gpt-oss writes it to the analysis channel)
    reasoning_with_calls: bool = True  # a turn with calls renders its reasoning
    reasoning_with_answers: bool = True  # a turn without calls renders its reasoning (Gemma 4: only call turns do)
    text_before_calls: bool = True  # a call turn's text renders in front of its calls (Gemma 4 writes it after them)
    # Thinking off: the empty think block the generation prompt closes renders back with the turn (Gemma 4 drops it)
    empty_thought_replayed: bool = True
    declares_tools: bool = True  # the template writes the request's tool schemas into the prompt
    # argument values keep their JSON types in the render (MiniMax-M3 writes them as untyped elements: only the
    # tool's schema types them back, what it does not describe comes back as text)
    typed_values: bool = True
    limits: list[str] = Field(default_factory=list)  # further limits, in words

    @property
    def template_path(self) -> Path:
        return TEMPLATES / self.template

    def template_text(self) -> str:
        return self.template_path.read_text(encoding="utf-8")

    def turn_ends(self, eos_token: str | None) -> list[str]:
        """What ends an assistant turn in a render: the stop tokens, and the tokenizer's end-of-sequence token
        where the template writes `eos_token` instead of a literal (Mistral's). A checkpoint served with another
        tokenizer, as the tests serve SmolLM2's, ends its turns with that one's."""
        if eos_token and eos_token not in self.stop_tokens and "eos_token" in self.template_text():
            return [*self.stop_tokens, eos_token]
        return list(self.stop_tokens)

    def summary(self) -> dict[str, Any]:
        """What `families --json` prints: the entry, and the request kwargs its parsers read (not the template)."""
        return self.model_dump(mode="json") | {"template_path": str(self.template_path),
                                               "parser_kwargs": understood_kwargs(self.reasoning_parser)}


@lru_cache(maxsize=1)
def load_catalog() -> dict[str, Family]:
    data = yaml.safe_load(CATALOG.read_text(encoding="utf-8"))
    return {name: Family(name=name, **entry) for name, entry in data["families"].items()}


def get_family(name: str) -> Family:
    catalog = load_catalog()
    if name not in catalog:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(catalog))}")
    return catalog[name]


def apply_family(model: dict[str, Any]) -> dict[str, Any]:
    """A model config dict with its family's fields filled in where the config does not set them. The family's
    default template kwargs sit under the model's own (a key the model sets wins)."""
    name = model.get("family")
    if not name:
        return model
    fam = get_family(name)
    out = dict(model)
    for key in ("reasoning_parser", "tool_parser", "thinking_kwarg", "thinking_values", "effort_kwarg",
                "effort_values"):
        if key not in out:
            out[key] = getattr(fam, key)
    out["default_chat_template_kwargs"] = {**fam.default_chat_template_kwargs,
                                           **(out.get("default_chat_template_kwargs") or {})}
    if out.get("family_template") and out.get("chat_template") is None:
        out["chat_template"] = str(fam.template_path)
    return out
