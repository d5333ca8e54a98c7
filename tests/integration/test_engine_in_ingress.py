"""`engine_placement: ingress` on the real server: the engines run inside the Ingress replica (no Engine or Router
deployment), and every API behaves as with the Engine deployment.

A second app beside the session's server (its own route prefix), with two engines in its one ingress process
(the 8K weights under two context lengths, so two engine keys): streamed calls parsed and equal to the
non-streamed answer through the real SDKs, a tool loop whose second turn reuses the first's cached prefix,
vLLM's own validation as a 400 before the stream starts, streams dropped mid-way aborted in the engine, and (last,
since it ends by replacing the replica) engine cores killed mid-stream: the stream ends with its API's error and
the replica replaces its engines in place; killed again past the app's restart limit, the replica fails Serve's
health check and Serve replaces it, engines and all.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time

import anthropic
import httpx
import openai
import psutil
import pytest

from tests.support.apps import replica_url, run_app
from tests.support.streams import (assert_engine_error, disconnect_storm, is_delta, leave_a_non_streamed_answer,
                                  still_running, stream_body)

pytestmark = pytest.mark.integration

APP = "inproc"
PLAIN = "smollm2-135m-instruct"
SHORT = "inproc-4k"  # the same weights at 4K context: a second engine in the same process
BASH = {"type": "function", "function": {"name": "Bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def call(name: str, args: dict) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


def forced(script: str) -> dict:
    return {"nvext": {"forced_script": script}}


@pytest.fixture(scope="module")
def app_url(serve_url, serve_config):
    from ray import serve

    args = copy.deepcopy(serve_config["applications"][0]["args"])
    base = next(m for m in args["models"] if m["id"] == PLAIN)
    short = {**copy.deepcopy(base), "id": SHORT, "source": base.get("source") or PLAIN, "aliases": [],
             "max_model_len": 4096, "max_output_tokens": 1024}
    args["models"] = [base, short]
    args["engine_placement"] = "ingress"
    # Serve calls a replica unhealthy after three failed checks in a row: every 2 s instead of its 10, the last
    # test's replica past its restart limit is replaced some 25 s sooner.
    args["ingress"] = {**args.get("ingress", {}), "deployment": {"num_replicas": 1, "health_check_period_s": 2}}
    args["engine_restarts"] = {"limit": 1}  # the last test kills the engines twice: replaced, then past the limit
    yield run_app(args, APP, serve_url)
    serve.delete(APP)


@pytest.fixture(scope="module")
def ingress(app_url):
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=APP)


def test_only_the_ingress_runs(app_url):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert set(deployments) <= {"Ingress", "ResponseStore", "TenantLimits"}, set(deployments)
    assert "Ingress" in deployments


def test_chat_stream_parses_calls_and_equals_the_non_streamed_answer(app_url):
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=300)
    script = "Listing first." + call("Bash", {"command": "ls -la \"a b\"\n"}) + "\n" + call("Bash", {"command": "pwd"})
    kw = dict(model=PLAIN, max_tokens=300, tools=[BASH], messages=[{"role": "user", "content": "go"}],
              extra_body=forced(script))
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.content == "Listing first."
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"command": "ls -la \"a b\"\n"},
                                                                       {"command": "pwd"}]
    assert whole.choices[0].finish_reason == "tool_calls"
    text, args, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert text == msg.content and finish == "tool_calls"
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.function.arguments) for c in msg.tool_calls]


def test_two_engines_in_one_process_each_serve_their_model(app_url):
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=300)
    for model in (PLAIN, SHORT):
        r = client.chat.completions.create(model=model, max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                                           extra_body=forced(f"I am {model}."))
        assert r.choices[0].message.content == f"I am {model}."
    with pytest.raises(openai.BadRequestError):  # the 4K engine's own context, not the 8K one's
        client.chat.completions.create(model=SHORT, max_tokens=10, messages=[{"role": "user", "content": "hi " * 5000}])


def test_tool_loop_reuses_the_cached_prefix(app_url):
    client = anthropic.Anthropic(base_url=app_url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "Bash", "description": "Run a shell command", "input_schema": BASH["function"]["parameters"]}
    kw = dict(model=PLAIN, max_tokens=200, system="You are a coding agent. " * 40, tools=[tool])
    user = [{"role": "user", "content": "go"}]
    first = client.messages.create(messages=user, extra_body=forced(call("Bash", {"command": "echo hi"})), **kw)
    use = first.content[-1]
    assert use.type == "tool_use" and use.input == {"command": "echo hi"} and first.stop_reason == "tool_use"
    history = [user[0], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi"}]}]
    second = client.messages.create(messages=history, extra_body=forced("It printed hi."), **kw)
    assert second.content[-1].text == "It printed hi." and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0


def test_a_schema_the_grammar_cannot_compile_is_a_400(app_url):
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=PLAIN, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert "objekt" in err.value.message


def test_a_client_that_leaves_a_non_streamed_answer_aborts_its_engine_request(app_url, ingress):
    """Serve's direct-ingress disconnect watcher is off (`ingress.disconnects: app`): the route watches itself. A
    ~1,900-token forced answer takes this engine most of a minute; the client leaves once it runs. Straight to
    the replica: Serve's HAProxy does not close its connection to the replica when a client leaves before the
    answer's head (a known gap of the front door, docs/serving-path.md), so only a stream is aborted through it."""
    url = replica_url(APP)
    assert leave_a_non_streamed_answer(url, PLAIN, lambda: ingress.num_unfinished.remote().result(timeout_s=30)) == 0


def test_dropped_streams_are_aborted_in_the_engine(app_url, ingress):
    statuses, dropped = disconnect_storm(app_url, PLAIN, 24, max_connections=50)
    assert statuses == [200] * 24 and dropped == 24, statuses
    deadline = time.monotonic() + 60
    while ingress.num_unfinished.remote().result(timeout_s=30) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ingress.num_unfinished.remote().result(timeout_s=30) == 0
    assert httpx.get(f"{app_url}/health", timeout=10).status_code == 200


def _kill_cores_mid_stream(app_url: str, cores: list) -> list[str]:
    """A chat stream on PLAIN, with every engine core in `cores` killed once its output has started; its lines."""
    lines: list[str] = []
    killed: list[bool] = []

    async def stream_and_kill():
        path, body = stream_body("chat", PLAIN, "word " * 1500, 1800)
        async with httpx.AsyncClient(timeout=180) as c, c.stream("POST", app_url + path, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                lines.append(line)
                if is_delta(line) and not killed:  # once output has started
                    for p in cores:
                        p.kill()
                    killed.append(True)

    asyncio.run(asyncio.wait_for(stream_and_kill(), 120))  # the stream ends; it does not hang
    assert killed
    return lines


def test_dead_engine_cores_are_replaced_in_the_replica_and_past_the_limit_serve_replaces_it(app_url):
    """Both engine cores killed mid-stream: the stream ends with its API's error, and the replica replaces its
    engines itself (engine/local_client.py), the same replica serving both models again. Killed again, past this
    app's `engine_restarts.limit` (1): the health check fails and Serve replaces the replica, engines and all."""
    import ray

    def ingress_actors():
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#Ingress")]

    def engine_cores(proc):
        return [p for p in proc.children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]

    def answered(model: str, deadline_s: float, until=lambda: True) -> httpx.Response:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                r = httpx.post(f"{app_url}/v1/chat/completions", timeout=120, json={
                    "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                    **forced("ok")})
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200 and until():
                return r
            # 503 with retry-after while an engine is replaced; 500 for a request the dead core failed first
            assert r is None or r.status_code in (500, 502, 503, 529), r.text[:300]
            assert time.monotonic() < deadline, r.text[:300] if r is not None else "no answer"
            time.sleep(2)

    (victim,) = ingress_actors()
    (replica_proc,) = [p for p in psutil.process_iter(["cmdline"])
                       if f"ServeReplica:{APP}:Ingress" in " ".join(p.info["cmdline"] or [])]
    cores = engine_cores(replica_proc)
    assert len(cores) == 2, [(p.name(), p.cmdline()) for p in replica_proc.children(recursive=True)]
    assert_engine_error("chat", _kill_cores_mid_stream(app_url, cores))
    for model in (PLAIN, SHORT):
        assert answered(model, 600).json()["choices"][0]["message"]["content"] == "ok"
    assert ingress_actors() == [victim] and replica_proc.is_running()  # the same replica, new engines
    replaced = engine_cores(replica_proc)
    assert len(replaced) == 2 and not {p.pid for p in replaced} & {p.pid for p in cores}

    # Past the limit: Serve's health check fails and the replica is replaced; its process goes, and with it
    # nothing of the old engines stays behind.
    assert_engine_error("chat", _kill_cores_mid_stream(app_url, replaced))
    r = answered(SHORT, 600, until=lambda: ingress_actors() and ingress_actors() != [victim])
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    assert not still_running([replica_proc], within_s=60), "the replaced replica's process is still running"
