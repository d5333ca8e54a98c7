"""A frontend-bound model for capacity benchmarks: SmolLM2's tokenizer beside a 2-layer, 128-wide Llama config.

vLLM loads it with `load_format: dummy` (random weights, nothing read from disk), so a decode step costs almost
nothing and what a benchmark measures is the serving path around the engine, as on a GPU. Its output is random
text: it is for capacity, never for behaviour.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_ID = "tiny-random-smollm2"

# Llama with SmolLM2's vocabulary; everything else as small as vLLM's CPU kernels accept (head size 32).
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")


def ensure_tiny_model(cache_dir: str | Path | None = None) -> str:
    """The tiny model's folder (made once beside the converted default model); returns its path."""
    from serve_app.engine.provision import default_cache_dir, ensure_model

    smollm2 = Path(ensure_model("smollm2-135m-instruct", cache_dir))
    out = (Path(cache_dir) if cache_dir else default_cache_dir()) / TINY_ID
    base = json.loads((smollm2 / "config.json").read_text())
    config = {**CONFIG, "vocab_size": base["vocab_size"], "bos_token_id": base.get("bos_token_id"),
              "eos_token_id": base.get("eos_token_id")}
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == config:
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy2(smollm2 / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


if __name__ == "__main__":
    print(ensure_tiny_model())
