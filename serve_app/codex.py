"""Codex CLI integration: the model catalog (Codex's `ModelInfo` shape) and the config.toml provider block.

Codex shapes its whole behaviour from the catalog entry its model slug resolves to (context window, tool-output
truncation, reasoning summaries, parallel tool calls, apply_patch as a freeform tool). A served id that matches no
entry gets Codex's fallback metadata ("Model metadata for … not found"): bytes truncation, no parallel calls, no
reasoning summaries. So each served id gets its own full entry here, derived from its ModelConfig:

- `GET /v1/models` carries these entries as the `models` array (what Codex's `/models` refresh decodes);
- `python -m serve_app codex-config --base-url URL` writes them to a catalog file for `model_catalog_json` and
  prints the provider block (plain `env_key` providers never call `/models`, so the file is what binds them).
  It asks the running service (`ask_service`) which models it serves and whether it wants a key, because the
  service may run another config than the one beside the command; the config is the fallback when it is down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve_app.settings import ModelConfig

PROVIDER_ID = "serve_app"
ENV_KEY = "SERVE_APP_API_KEY"

# Codex's own base prompt is ~10K tokens; served open models get a compact one (the model template still adds
# Codex's tool and environment context as developer messages).
BASE_INSTRUCTIONS = (
    "You are Codex, a coding agent running in the user's terminal. You and the user share one workspace. "
    "Use the tools you are given to inspect files and run commands; prefer `rg` for searching. Make the change "
    "the user asks for, verify it, and finish with a short summary of what you did."
)

_EFFORTS = [
    {"effort": "low", "description": "Fast responses with lighter reasoning"},
    {"effort": "medium", "description": "Balances speed and reasoning depth for everyday tasks"},
    {"effort": "high", "description": "Greater reasoning depth for complex problems"},
]


def tool_output_token_limit(model: ModelConfig) -> int:
    """Token budget for one tool output echoed back to the model: small contexts get proportionally less."""
    return max(1000, min(10_000, model.max_model_len // 8))


def codex_model_info(slug: str, model: ModelConfig, priority: int = 0) -> dict[str, Any]:
    """One Codex `ModelInfo` entry (codex-rs/protocol/src/openai_models.rs) for a served id."""
    reasoning = model.reasoning_parser is not None
    window = model.max_model_len
    return {
        "slug": slug,
        "display_name": model.display_name or slug,
        "description": f"{model.model_source} served by serve_app",
        "default_reasoning_level": "medium" if reasoning else None,
        "supported_reasoning_levels": list(_EFFORTS) if reasoning else [],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": priority,
        "upgrade": None,
        "base_instructions": BASE_INSTRUCTIONS,
        "model_messages": None,
        "supports_reasoning_summaries": reasoning,
        "supports_reasoning_summary_parameter": reasoning,
        "default_reasoning_summary": "auto" if reasoning else "none",
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": "freeform",
        "web_search_tool_type": "text",
        "truncation_policy": {"mode": "tokens", "limit": tool_output_token_limit(model)},
        "supports_parallel_tool_calls": True,
        "context_window": window,
        "max_context_window": window,
        "auto_compact_token_limit": int(window * 0.8),
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
        "prefer_websockets": False,
        "supports_search_tool": False,
        "use_responses_lite": False,
        "service_tiers": [],
        "additional_speed_tiers": [],
        "default_service_tier": None,
    }


def codex_models_payload(models: list[ModelConfig]) -> list[dict[str, Any]]:
    """The `models` array of GET /v1/models: one entry per served id (aliases included, so every slug binds)."""
    out: list[dict[str, Any]] = []
    for m in models:
        for slug in m.all_ids:
            out.append(codex_model_info(slug, m, priority=len(out)))
    return out


def catalog_json(entries: list[dict[str, Any]]) -> str:
    return json.dumps({"models": entries}, indent=2) + "\n"


@dataclass
class ServiceAnswer:
    """What the running service says about itself (`ask_service`)."""

    reachable: bool
    key_required: bool | None = None  # None: not known (unreachable, or an unexpected answer)
    entries: list[dict[str, Any]] | None = None  # its Codex catalog (`models` of GET /v1/models), when it gave one
    detail: str = ""


def ask_service(base_url: str, api_key: str | None = None, *, timeout_s: float = 5.0,
                transport: httpx.BaseTransport | None = None) -> ServiceAnswer:
    """GET /v1/models without a key: 200 means the service takes requests without one (none configured, or an
    open `{tenant: default}` entry), 401 that it requires one. With a 401 and `api_key`, asks again with the key
    for the catalog. The service is the authority: the config file beside this command may not be what it runs."""
    base = base_url.rstrip("/")
    url = (base if base.endswith("/v1") else base + "/v1") + "/models"
    try:
        with httpx.Client(timeout=timeout_s, transport=transport) as client:
            r = client.get(url)
            if r.status_code == 401:
                entries = None
                if api_key:
                    keyed = client.get(url, headers={"authorization": f"Bearer {api_key}"})
                    entries = _entries(keyed)
                return ServiceAnswer(True, key_required=True, entries=entries)
            if r.status_code == 200:
                return ServiceAnswer(True, key_required=False, entries=_entries(r))
            return ServiceAnswer(True, detail=f"GET {url} answered {r.status_code}")
    except httpx.HTTPError as e:
        return ServiceAnswer(False, detail=f"GET {url}: {type(e).__name__}: {e}")


def _entries(r: httpx.Response) -> list[dict[str, Any]] | None:
    if r.status_code != 200:
        return None
    try:
        models = r.json().get("models")
    except (ValueError, AttributeError):
        return None
    return models if isinstance(models, list) and models and all(isinstance(m, dict) and "slug" in m
                                                                  for m in models) else None


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid TOML basic string


def provider_toml(base_url: str, model: str, catalog_path: str | None, *, provider_id: str = PROVIDER_ID,
                  env_key: str | None = ENV_KEY, name: str = "serve_app") -> str:
    """The config.toml lines: top-level model/provider/catalog keys, then the provider table."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    lines = [
        f"model = {_toml_str(model)}",
        f"model_provider = {_toml_str(provider_id)}",
    ]
    if catalog_path:
        lines.append(f"model_catalog_json = {_toml_str(catalog_path)}")
    lines += [
        "",
        f"[model_providers.{provider_id}]",
        f"name = {_toml_str(name)}",
        f"base_url = {_toml_str(base)}",
        'wire_api = "responses"',
    ]
    if env_key:
        lines.append(f"env_key = {_toml_str(env_key)}")
    lines += ["request_max_retries = 4", "stream_max_retries = 5", "stream_idle_timeout_ms = 300000"]
    return "\n".join(lines) + "\n"


def write_codex_config(entries: list[dict[str, Any]], base_url: str, catalog_out: str | Path, *,
                       model: str | None = None, env_key: str | None = ENV_KEY) -> str:
    """Write the catalog file (Codex entries, `codex_models_payload`) and return the provider block that points at
    it; the default model is the first entry's."""
    path = Path(catalog_out).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(catalog_json(entries))
    chosen = model or entries[0]["slug"]
    return provider_toml(base_url, chosen, str(path), env_key=env_key)
