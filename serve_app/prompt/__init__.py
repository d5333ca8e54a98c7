"""The prompt pipeline (docs/architecture.md, step 3): strip the per-session preamble, decide how earlier
reasoning is replayed, render the model's chat template and tokenize — the only place a prompt is built."""

from serve_app.prompt.policy import ReplayPolicy, decide_policy, reasoning_markers
from serve_app.prompt.preamble import strip_preamble
from serve_app.prompt.render import PromptRenderer, RenderedPrompt, load_tokenizer

__all__ = ["PromptRenderer", "RenderedPrompt", "ReplayPolicy", "decide_policy", "load_tokenizer",
           "reasoning_markers", "strip_preamble"]
