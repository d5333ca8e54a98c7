"""`sliding_window` on a model (settings.py): what it asks of vLLM (engine/vllm_engine.py) and how it is checked.

The window reaches vLLM as model-config overrides; that vLLM applies them is shown end to end by
`tests/integration/test_chat_e2e.py` (the 32K engine answers short prompts exactly as the 8K one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.engine import provision
from serve_app.engine.vllm_engine import build_engine_args, check_window_applied, sliding_window_overrides
from serve_app.service import engine_key
from serve_app.settings import AppSettings, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "smollm2-135m-instruct"


def _model(**kw) -> ModelConfig:
    return ModelConfig.model_validate({"id": "m", "source": SOURCE, "max_model_len": 32768, "max_output_tokens": 128,
                                       **kw})


def test_every_layer_gets_the_window_and_the_context_is_raised_to_max_model_len():
    path = provision.ensure_model(SOURCE)
    over = sliding_window_overrides(path, 4096, 32768)
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(path).num_hidden_layers
    assert over["layer_types"] == ["sliding_attention"] * layers and layers > 1
    assert over["sliding_window"] == 4096
    assert over["max_position_embeddings"] == 32768  # the model declares 8192; vLLM would refuse 32K


def test_engine_args_carry_the_window_and_explicit_overrides_win():
    path = provision.ensure_model(SOURCE)
    args = build_engine_args(_model(sliding_window=4096), path)
    assert args.hf_overrides["sliding_window"] == 4096 and args.max_model_len == 32768
    assert "rope_parameters" not in args.hf_overrides  # the native rope: no stretch
    mine = build_engine_args(_model(sliding_window=4096, hf_overrides={"max_position_embeddings": 65536}), path)
    assert mine.hf_overrides["max_position_embeddings"] == 65536 and mine.hf_overrides["sliding_window"] == 4096
    assert not getattr(build_engine_args(_model(max_model_len=8192), path), "hf_overrides", None)


def test_a_windowed_engine_keeps_every_prefix_block_not_only_its_last_window():
    """vLLM's default retains a sliding-window prompt's blocks only at its last window, which loses the shared system
    prompt of a session whose first request ran past it (tests/integration/test_chat_e2e.py shows the reuse)."""
    path = provision.ensure_model(SOURCE)
    assert build_engine_args(_model(sliding_window=4096), path).prefix_cache_retention_interval is None
    mine = build_engine_args(_model(sliding_window=4096, engine_kwargs={"prefix_cache_retention_interval": 1024}), path)
    assert mine.prefix_cache_retention_interval == 1024
    from vllm.engine.arg_utils import AsyncEngineArgs

    full = build_engine_args(_model(max_model_len=8192), path)
    assert full.prefix_cache_retention_interval == AsyncEngineArgs.prefix_cache_retention_interval  # vLLM's own


def test_a_window_not_below_the_context_is_refused():
    with pytest.raises(ValidationError, match="sliding_window"):
        _model(sliding_window=32768)
    with pytest.raises(ValidationError):
        _model(sliding_window=0)


def test_the_window_is_part_of_the_engine_identity():
    """Two models differing only in the window cannot share one engine deployment."""
    assert engine_key(_model(sliding_window=4096)) != engine_key(_model())
    assert engine_key(_model(sliding_window=4096)) != engine_key(_model(sliding_window=2048))


def test_the_default_configs_long_context_engines_use_a_window_not_a_rope_stretch():
    for cfg in ("config.yaml", "tests/configs/test.yaml"):
        long = AppSettings.from_yaml(ROOT / cfg).find_model("claude-sonnet-4-6")
        assert long.max_model_len >= 32768 and long.sliding_window, cfg
        assert "rope_parameters" not in long.hf_overrides, cfg


def _vllm_model_config(path: str, hf_overrides: dict | None, max_model_len: int):
    from vllm.config import ModelConfig as VllmModelConfig

    return VllmModelConfig(model=path, tokenizer=path, max_model_len=max_model_len, hf_overrides=hf_overrides or {},
                           enforce_eager=True)


def test_vllm_takes_the_window_from_the_overrides_and_the_start_up_check_passes():
    path = provision.ensure_model(SOURCE)
    args = build_engine_args(_model(sliding_window=4096), path)
    cfg = _vllm_model_config(path, args.hf_overrides, 32768)
    assert cfg.get_sliding_window() == 4096 and cfg.max_model_len == 32768
    check_window_applied(4096, cfg)


def test_the_start_up_check_refuses_an_engine_whose_window_was_not_applied():
    path = provision.ensure_model(SOURCE)
    cfg = _vllm_model_config(path, None, 8192)  # what a model whose implementation ignores the overrides gets
    assert cfg.get_sliding_window() is None
    with pytest.raises(RuntimeError, match="sliding_window 4096 was not applied"):
        check_window_applied(4096, cfg)
    check_window_applied(None, cfg)  # no window asked: nothing to check
