"""Codex catalog entries and the `codex-config` command."""

from __future__ import annotations

import json
import tomllib

from serve_app.__main__ import main
from serve_app.codex import codex_models_payload, provider_toml
from serve_app.settings import AppSettings

SETTINGS = AppSettings.model_validate({"models": [
    {"id": "small", "aliases": ["small-alias"], "max_model_len": 8192},
    {"id": "thinker", "max_model_len": 32768, "reasoning_parser": "qwen3", "tool_parser": "hermes"},
]})

REQUIRED = {"slug", "display_name", "supported_reasoning_levels", "shell_type", "visibility", "supported_in_api",
            "priority", "base_instructions", "supports_reasoning_summaries", "support_verbosity",
            "truncation_policy", "supports_parallel_tool_calls", "context_window", "experimental_supported_tools",
            "apply_patch_tool_type", "input_modalities"}


def test_one_full_entry_per_served_id():
    entries = codex_models_payload(SETTINGS.models)
    assert [e["slug"] for e in entries] == ["small", "small-alias", "thinker"]
    for e in entries:
        assert REQUIRED <= e.keys()
        assert e["truncation_policy"]["mode"] == "tokens" and e["truncation_policy"]["limit"] > 0
        assert e["supports_parallel_tool_calls"] is True and e["apply_patch_tool_type"] == "freeform"
        assert e["auto_compact_token_limit"] < e["context_window"]
    small, _, thinker = entries
    assert small["context_window"] == 8192 and thinker["context_window"] == 32768
    # reasoning summaries and efforts only where the model has a reasoning parser
    assert thinker["supports_reasoning_summaries"] is True and thinker["supported_reasoning_levels"]
    assert small["supports_reasoning_summaries"] is False and small["supported_reasoning_levels"] == []
    assert len({e["priority"] for e in entries}) == 3
    json.dumps(entries)


def test_provider_block_is_valid_toml():
    cfg = tomllib.loads(provider_toml("http://h:8000/", "thinker", "/x/cat.json"))
    assert cfg["model"] == "thinker" and cfg["model_provider"] == "serve_app"
    assert cfg["model_catalog_json"] == "/x/cat.json"
    p = cfg["model_providers"]["serve_app"]
    assert p["base_url"] == "http://h:8000/v1" and p["wire_api"] == "responses" and p["env_key"] == "SERVE_APP_API_KEY"
    assert tomllib.loads(provider_toml("http://h/v1", "m", None))["model_providers"]["serve_app"]["base_url"] == "http://h/v1"


def test_cli_writes_catalog_and_prints_block(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"applications": [{"args": SETTINGS.model_dump()}]}))
    out = tmp_path / "catalog.json"
    assert main(["codex-config", "--base-url", "http://h:1", "--config", str(cfg), "--catalog-out", str(out),
                 "--model", "thinker"]) == 0
    block = tomllib.loads(capsys.readouterr().out)
    assert block["model"] == "thinker" and block["model_catalog_json"] == str(out.resolve())
    assert [m["slug"] for m in json.loads(out.read_text())["models"]] == ["small", "small-alias", "thinker"]
    assert main(["codex-config", "--base-url", "http://h:1", "--config", str(cfg), "--catalog-out", str(out),
                 "--model", "unknown"]) == 2


def test_cli_names_an_env_key_only_when_the_service_has_api_keys(tmp_path, capsys):
    """Codex stops with "Missing environment variable" for a provider whose env_key is unset: the README's line
    must work verbatim against a service without keys, and still name the variable where keys are required."""
    out = tmp_path / "catalog.json"

    def provider(settings: dict, *extra: str) -> dict:
        cfg = tmp_path / "serve.yaml"
        cfg.write_text(json.dumps({"applications": [{"args": settings}]}))
        assert main(["codex-config", "--base-url", "http://h:1", "--config", str(cfg), "--catalog-out", str(out),
                     *extra]) == 0
        return tomllib.loads(capsys.readouterr().out)["model_providers"]["serve_app"]

    open_service = SETTINGS.model_dump()
    keyed = {**open_service, "ingress": {**open_service["ingress"], "api_keys": ["k"]}}
    assert "env_key" not in provider(open_service)
    assert provider(keyed)["env_key"] == "SERVE_APP_API_KEY"
    assert provider(open_service, "--env-key", "MY_KEY")["env_key"] == "MY_KEY"
    assert "env_key" not in provider(keyed, "--no-env-key")
