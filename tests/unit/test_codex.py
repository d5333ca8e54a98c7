"""Codex catalog entries and the `codex-config` command."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
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
                 "--model", "thinker", "--offline"]) == 0
    block = tomllib.loads(capsys.readouterr().out)
    assert block["model"] == "thinker" and block["model_catalog_json"] == str(out.resolve())
    assert [m["slug"] for m in json.loads(out.read_text())["models"]] == ["small", "small-alias", "thinker"]
    assert main(["codex-config", "--base-url", "http://h:1", "--config", str(cfg), "--catalog-out", str(out),
                 "--model", "unknown", "--offline"]) == 2


def test_offline_cli_names_an_env_key_only_when_the_config_requires_a_key(tmp_path, capsys):
    """Codex stops with "Missing environment variable" for a provider whose env_key is unset: without the service
    to ask (`--offline`, or it is down), the config's ingress.api_keys decide."""
    out = tmp_path / "catalog.json"

    def provider(settings: dict, *extra: str) -> dict:
        cfg = tmp_path / "serve.yaml"
        cfg.write_text(json.dumps({"applications": [{"args": settings}]}))
        assert main(["codex-config", "--base-url", "http://h:1", "--config", str(cfg), "--catalog-out", str(out),
                     "--offline", *extra]) == 0
        return tomllib.loads(capsys.readouterr().out)["model_providers"]["serve_app"]

    open_service = SETTINGS.model_dump()
    keyed = {**open_service, "ingress": {**open_service["ingress"], "api_keys": ["k"]}}
    open_entry = {**open_service, "ingress": {**open_service["ingress"], "api_keys": ["k", {"tenant": "default"}]}}
    assert "env_key" not in provider(open_service)
    assert provider(keyed)["env_key"] == "SERVE_APP_API_KEY"
    assert "env_key" not in provider(open_entry)  # a request without a key is served as `default`
    assert provider(open_service, "--env-key", "MY_KEY")["env_key"] == "MY_KEY"
    assert "env_key" not in provider(keyed, "--no-env-key")


# -- asking the running service -------------------------------------------------------------------------------------

@contextlib.contextmanager
def running_service(settings: dict):
    """The real models routes (GET /v1/models with its key check) on a local uvicorn, as the ingress serves them."""
    import uvicorn
    from fastapi import FastAPI

    from serve_app.ingress import models_routes
    from serve_app.ingress.context import IngressContext

    cfg = AppSettings.model_validate(settings)
    app = FastAPI()
    app.state.ctx = IngressContext(settings=cfg, service=None, secret=b"s")
    app.include_router(models_routes.router)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


SERVED = {"models": [{"id": "served-a", "aliases": ["org/served-a"], "max_model_len": 16384}]}


def _cli(tmp_path, capsys, base_url: str, config: dict, *extra: str) -> tuple[dict, list[str], str]:
    """(the provider table, the catalog's slugs, stderr) of `codex-config` with `config` beside the command."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"applications": [{"args": config}]}))
    out = tmp_path / "catalog.json"
    assert main(["codex-config", "--base-url", base_url, "--config", str(cfg), "--catalog-out", str(out), *extra]) == 0
    captured = capsys.readouterr()
    block = tomllib.loads(captured.out)
    return block["model_providers"]["serve_app"], [m["slug"] for m in json.loads(out.read_text())["models"]], \
        captured.err


def test_the_readme_line_against_a_service_without_keys_names_no_env_key(tmp_path, capsys, monkeypatch):
    """The README's `codex-config --base-url URL`, verbatim: the running service answers GET /v1/models without a
    key, so the provider names no env_key, and the catalog is what the service serves, even when the config beside
    the command says otherwise (here: keys, and other models)."""
    monkeypatch.delenv("SERVE_APP_API_KEY", raising=False)
    keyed_config = {**SETTINGS.model_dump(), "ingress": {"api_keys": ["k"]}}
    with running_service(SERVED) as url:
        provider, slugs, err = _cli(tmp_path, capsys, url, keyed_config)
    assert "env_key" not in provider and provider["base_url"] == url + "/v1"
    assert slugs == ["served-a", "org/served-a"]
    assert "does not require a key" in err


def test_a_service_that_wants_a_key_gets_an_env_key(tmp_path, capsys, monkeypatch):
    open_config = SETTINGS.model_dump()
    keyed = {**SERVED, "ingress": {"api_keys": ["sk-1"]}}
    monkeypatch.delenv("SERVE_APP_API_KEY", raising=False)
    with running_service(keyed) as url:
        provider, slugs, err = _cli(tmp_path, capsys, url, open_config)
        assert provider["env_key"] == "SERVE_APP_API_KEY" and "requires a key" in err
        # Without the key the service lists nothing: the models come from the config, and the command says so.
        assert slugs == ["small", "small-alias", "thinker"] and "set $SERVE_APP_API_KEY" in err
        monkeypatch.setenv("SERVE_APP_API_KEY", "sk-1")
        provider, slugs, _ = _cli(tmp_path, capsys, url, open_config)
        assert provider["env_key"] == "SERVE_APP_API_KEY" and slugs == ["served-a", "org/served-a"]
    # An open `{tenant: default}` entry serves requests without a key: no env_key.
    with running_service({**SERVED, "ingress": {"api_keys": ["sk-1", {"tenant": "default"}]}}) as url:
        monkeypatch.delenv("SERVE_APP_API_KEY")
        provider, slugs, _ = _cli(tmp_path, capsys, url, open_config)
        assert "env_key" not in provider and slugs == ["served-a", "org/served-a"]


def test_a_service_that_cannot_be_asked_falls_back_to_the_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SERVE_APP_API_KEY", raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    keyed_config = {**SETTINGS.model_dump(), "ingress": {"api_keys": ["k"]}}
    provider, slugs, err = _cli(tmp_path, capsys, url, keyed_config)
    assert provider["env_key"] == "SERVE_APP_API_KEY" and slugs == ["small", "small-alias", "thinker"]
    assert "could not ask the service" in err
