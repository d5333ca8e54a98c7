"""Which dtype a CPU engine runs (engine/vllm_engine.py): float32 where vLLM's bf16 would be slow or would change
a float32 checkpoint's answers; vLLM's default otherwise and on GPUs."""

from __future__ import annotations

import json

import pytest

from serve_app.engine import vllm_engine
from serve_app.engine.vllm_engine import checkpoint_dtype, keeps_float32

AMX = "flags : fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
AVX512_BF16 = "flags : fpu sse avx2 avx512f avx512_bf16"
AVX2 = "flags : fpu sse avx2 fma"


@pytest.mark.parametrize("flags, checkpoint, expected", [
    (AVX2, "bfloat16", True),  # no native bf16: bf16 runs through slow fallback kernels
    (AVX2, None, True),
    (AMX, "float32", True),  # a float32 checkpoint is not cast down (its answers changed on AMX)
    (AVX512_BF16, "float32", True),
    (AMX, "bfloat16", False),  # a bf16 checkpoint on a bf16 CPU: vLLM's default
    (AMX, None, False),
])
def test_a_cpu_engine_keeps_float32_where_bf16_is_slow_or_changes_the_model(flags, checkpoint, expected):
    assert keeps_float32(flags, checkpoint) is expected


def test_the_checkpoint_dtype_is_read_from_its_config(tmp_path):
    assert checkpoint_dtype(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"  # the newer key wins
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "float16"}}))
    assert checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(str(tmp_path)) is None


def test_the_engine_args_carry_it_unless_the_model_entry_names_a_dtype(tmp_path, monkeypatch):
    from serve_app.settings import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    monkeypatch.setattr(vllm_engine, "cpu_float32", lambda path: checkpoint_dtype(path) == "float32")
    model = ModelConfig(id="m", max_model_len=8192)
    assert vllm_engine.build_engine_args(model, str(tmp_path)).dtype == "float32"
    pinned = ModelConfig(id="m", max_model_len=8192, engine_kwargs={"dtype": "bfloat16"})
    assert vllm_engine.build_engine_args(pinned, str(tmp_path)).dtype == "bfloat16"
