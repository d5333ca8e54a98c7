"""A CPU engine's KV cache size (VLLM_CPU_KVCACHE_SPACE) is an engine argument, not this process's environment
(serve_app/engine/vllm_engine.py): vLLM's CPU platform would read the variable from the environment while building
each engine's config, so engines of one process with different sizes would have to take turns with it."""

from __future__ import annotations

import pytest

from serve_app.engine import vllm_engine
from serve_app.engine.vllm_engine import KV_SPACE_ENV, VLLMEngine, build_engine_args, kv_cache_gib
from serve_app.settings import ModelConfig


@pytest.fixture
def fresh(monkeypatch):
    """The process's own value not read yet, as in a new process."""
    monkeypatch.setattr(vllm_engine, "_process_kv_space", [])
    monkeypatch.setattr(vllm_engine, "_on_cpu_platform", lambda: True)
    return monkeypatch


def test_an_engines_own_size_wins_and_the_processs_is_the_default_and_leaves_the_environment(fresh):
    import os

    fresh.setenv(KV_SPACE_ENV, "4")
    own = ModelConfig(id="a", engine_env={KV_SPACE_ENV: "2"})
    plain = ModelConfig(id="b")
    assert kv_cache_gib(own) == "2"
    assert KV_SPACE_ENV not in os.environ  # vLLM's platform finds nothing to override the engine argument with
    assert kv_cache_gib(plain) == "4"  # the process's value, read before it left
    fresh.setenv(KV_SPACE_ENV, "9")  # set again later: removed again, the first value stays the default
    assert kv_cache_gib(plain) == "4" and KV_SPACE_ENV not in os.environ


def test_no_size_anywhere_leaves_vllms_default(fresh):
    fresh.delenv(KV_SPACE_ENV, raising=False)
    assert kv_cache_gib(ModelConfig(id="a")) is None


def test_the_size_becomes_kv_cache_memory_bytes_unless_the_engine_arguments_set_it(tmp_path):
    model = ModelConfig(id="m", engine_env={KV_SPACE_ENV: "3"})
    assert build_engine_args(model, str(tmp_path), kv_cache_gib="3").kv_cache_memory_bytes == 3 << 30
    assert build_engine_args(model, str(tmp_path)).kv_cache_memory_bytes is None
    pinned = ModelConfig(id="m", engine_kwargs={"kv_cache_memory_bytes": 123 << 20})
    assert build_engine_args(pinned, str(tmp_path), kv_cache_gib="3").kv_cache_memory_bytes == 123 << 20


def test_engines_that_differ_only_in_kv_cache_size_set_the_same_environment(fresh):
    """So config.yaml's two engines (1 and 2 GiB) start together (start_engines groups by environment)."""
    small = VLLMEngine(ModelConfig(id="a", engine_env={KV_SPACE_ENV: "1"}), "/m", kv_events=False)
    large = VLLMEngine(ModelConfig(id="b", engine_env={KV_SPACE_ENV: "2"}), "/m", kv_events=False)
    other = VLLMEngine(ModelConfig(id="c", engine_env={KV_SPACE_ENV: "2", "CUDA_VISIBLE_DEVICES": "1"}), "/m",
                       kv_events=False)
    assert small.environment() == large.environment()
    assert KV_SPACE_ENV not in small.environment()
    assert other.environment() != large.environment()
