"""Sampling parameters the engine replica gives vLLM (engine/vllm_engine.py): the model's defaults fill what a
request leaves unset, as vLLM's own server does; what the request sets always wins."""

from __future__ import annotations

from serve_app.engine.types import EngineRequest
from serve_app.engine.vllm_engine import VLLMEngine
from serve_app.settings import ModelConfig


def _engine(defaults: dict, forced: bool = False) -> VLLMEngine:
    e = VLLMEngine(ModelConfig(id="m"), "/nonexistent", forced_scripts=forced, kv_events=False)
    e.default_sampling = defaults  # what start() reads from vLLM's get_diff_sampling_param()
    return e


def test_unset_fields_take_the_models_defaults():
    p = _engine({"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05}).sampling_params(
        EngineRequest("r", [1, 2], max_tokens=7))
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == (0.2, 0.9, 1.05, 7)


def test_what_the_request_sets_wins():
    p = _engine({"temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.5}).sampling_params(
        EngineRequest("r", [1], max_tokens=3, temperature=1.0, top_p=1.0, presence_penalty=0.0))
    assert (p.temperature, p.top_p, p.presence_penalty) == (1.0, 1.0, 0.0)


def test_no_defaults_is_vllms_neutral_sampling():
    p = _engine({}).sampling_params(EngineRequest("r", [1], max_tokens=3))
    assert (p.temperature, p.top_p) == (1.0, 1.0)


def test_a_forced_script_is_greedy_whatever_the_defaults():
    p = _engine({"temperature": 0.7}, forced=True).sampling_params(
        EngineRequest("r", [1], max_tokens=3, forced_token_ids=[5, 6], forced_eos_id=2))
    assert p.temperature == 0.0
