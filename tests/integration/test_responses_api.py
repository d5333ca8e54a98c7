"""The Responses API through the whole path (Ray Serve proxy → Ingress ×2 → Router → vLLM engine), driven by the
real `openai` SDK. Exact outputs come from forced scripts through the real engine (`nvext.forced_script`)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import zstandard

pytestmark = pytest.mark.integration

PLAIN = "smollm2-135m-instruct"  # no reasoning parser, hermes tools
THINK = "test-qwen3"  # qwen3 reasoning parser + hermes tools
CPU_BLOCK = 128  # vLLM's KV block size on CPU: only whole blocks are cached

EXEC = {"type": "function", "name": "exec_command", "description": "Run a shell command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
READ = {"type": "function", "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
LONG_INSTRUCTIONS = "You are a careful coding agent. Always check files before editing them. " * 40


def call(name: str, args: dict) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


def forced(script: str) -> dict:
    return {"nvext": {"forced_script": script}}


@pytest.fixture(scope="module")
def client(serve_url):
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_real_model_answers(client):
    r = client.responses.create(model=PLAIN, input="What is the capital of France?", max_output_tokens=20,
                                temperature=0)
    assert r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output and r.output[0].type == "message" and r.output_text.strip()
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 20
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 20 and r.temperature == 0


def test_stream_reasoning_and_function_call(client):
    script = "<think>List the files first.</think>" + call("exec_command", {"cmd": "ls"})
    args = dict(model=THINK, input="what is here?", tools=[EXEC], reasoning={"effort": "medium", "summary": "auto"},
                extra_body=forced(script))
    created = client.responses.create(**args)
    with client.responses.stream(**args) as s:
        types = [e.type for e in s]
        streamed = s.get_final_response()
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed" and types.count("response.completed") == 1
    for t in ("response.reasoning_summary_text.delta", "response.function_call_arguments.delta",
              "response.function_call_arguments.done"):
        assert t in types
    assert "response.reasoning_text.delta" not in types  # a summary was asked for: the reasoning goes out once
    for r in (created, streamed):
        assert [o.type for o in r.output] == ["reasoning", "function_call"]
        assert r.output[0].summary[0].text == "List the files first." and not r.output[0].content
        fc = r.output[1]
        assert fc.name == "exec_command" and json.loads(fc.arguments) == {"cmd": "ls"} and fc.call_id
        assert r.reasoning.effort == "medium" and r.tools[0].name == "exec_command"
    assert streamed.usage.output_tokens == created.usage.output_tokens
    assert streamed.usage.output_tokens_details.reasoning_tokens > 0


def test_custom_tool_call_comes_back_raw(client):
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello \"world\"\n*** End Patch"
    script = call("apply_patch", {"input": patch})
    with client.responses.stream(model=PLAIN, input="add hello.txt", tools=[EXEC, PATCH],
                                 extra_body=forced(script)) as s:
        events = list(s)
        r = s.get_final_response()
    assert [o.type for o in r.output] == ["custom_tool_call"]
    assert r.output[0].name == "apply_patch" and r.output[0].input == patch
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == patch
    assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [patch]


def test_parallel_calls(client):
    script = call("read_file", {"path": "a.py"}) + "\n" + call("read_file", {"path": "b.py"})
    r = client.responses.create(model=PLAIN, input="read both", tools=[READ], parallel_tool_calls=True,
                                extra_body=forced(script))
    assert [(o.type, json.loads(o.arguments)["path"]) for o in r.output] == [
        ("function_call", "a.py"), ("function_call", "b.py")]
    assert len({o.call_id for o in r.output}) == 2 and r.parallel_tool_calls is True


def test_encrypted_reasoning_round_trip_reuses_prefix_and_rejects_tampering(client):
    script = "<think>I need the listing.</think>" + call("exec_command", {"cmd": "ls"})
    first = client.responses.create(model=THINK, instructions=LONG_INSTRUCTIONS, input="list files", tools=[EXEC],
                                    reasoning={"effort": "high"}, include=["reasoning.encrypted_content"],
                                    store=False, extra_body=forced(script))
    rs, fc = first.output
    assert rs.type == "reasoning" and rs.encrypted_content and fc.type == "function_call"
    history = [{"role": "user", "content": "list files"}, rs.model_dump(exclude_none=True),
               fc.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": fc.call_id, "output": "a.py\nb.py"}]
    second = client.responses.create(model=THINK, instructions=LONG_INSTRUCTIONS, input=history, tools=[EXEC],
                                     reasoning={"effort": "high"}, include=["reasoning.encrypted_content"],
                                     store=False, extra_body=forced("Two files."))
    assert second.output_text == "Two files."
    # turn 2's prompt starts with turn 1's prompt: its whole blocks come from the prefix cache
    assert first.usage.input_tokens > 4 * CPU_BLOCK
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // CPU_BLOCK) * CPU_BLOCK
    tampered = dict(history[1])
    blob = tampered["encrypted_content"]
    tampered["encrypted_content"] = blob[:20] + ("x" if blob[20] != "x" else "y") + blob[21:]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=THINK, input=[history[0], tampered, *history[2:]], tools=[EXEC],
                                include=["reasoning.encrypted_content"], store=False)
    assert e.value.body["param"] == "input.1.encrypted_content"


def test_previous_response_id_and_get_across_ingress_replicas(serve_url):
    """Each call on a fresh connection: the Serve proxy spreads them over both ingress replicas, and every lookup
    must find the response whichever replica stored it."""
    crossed = 0
    for i in range(8):
        with httpx.Client(base_url=serve_url, timeout=600) as c:
            a = c.post("/v1/responses", json={"model": PLAIN, "input": f"question {i}",
                                              **forced(f"answer {i}")})
        assert a.status_code == 200, a.text
        rid = a.json()["id"]
        with httpx.Client(base_url=serve_url, timeout=600) as c:
            g = c.get(f"/v1/responses/{rid}")
        assert g.status_code == 200 and g.json()["output"][0]["content"][0]["text"] == f"answer {i}"
        with httpx.Client(base_url=serve_url, timeout=600) as c:
            b = c.post("/v1/responses", json={"model": PLAIN, "input": "and then?", "previous_response_id": rid,
                                              **forced("more")})
        assert b.status_code == 200, b.text
        assert b.json()["previous_response_id"] == rid
        # the follow-up's prompt holds the first turn: it is longer by at least the first answer and question
        assert b.json()["usage"]["input_tokens"] > a.json()["usage"]["input_tokens"]
        with httpx.Client(base_url=serve_url, timeout=600) as c:  # a third turn: the chain of two stored turns
            d = c.post("/v1/responses", json={"model": PLAIN, "input": "and last?",
                                              "previous_response_id": b.json()["id"], **forced("done")})
        assert d.status_code == 200, d.text
        assert d.json()["usage"]["input_tokens"] > b.json()["usage"]["input_tokens"]
        replicas = {a.headers["x-serve-replica"], g.headers["x-serve-replica"], b.headers["x-serve-replica"]}
        crossed += len(replicas) > 1
    assert crossed > 0, "all requests landed on one ingress replica: the cross-replica path was not exercised"


def test_unknown_ids_and_zstd_body(serve_url):
    with httpx.Client(base_url=serve_url, timeout=600) as c:
        assert c.get("/v1/responses/resp_does_not_exist").status_code == 404
        r = c.post("/v1/responses", json={"model": PLAIN, "input": "x", "previous_response_id": "resp_nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        body = json.dumps({"model": PLAIN, "input": "hi", **forced("zstd ok")}).encode()
        r = c.post("/v1/responses", content=zstandard.ZstdCompressor(level=3).compress(body),
                   headers={"content-encoding": "zstd", "content-type": "application/json"})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "zstd ok"


def test_prompt_too_long_is_response_failed_when_streaming_and_a_400_when_not(client):
    events = list(client.responses.create(model=PLAIN, input="word " * 9000, stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "context_length_exceeded"  # what Codex compacts on
    words = "Your input exceeds the context window of this model."  # the Responses API's, not Chat's
    assert events[-1].response.error.message.startswith(words)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=PLAIN, input="word " * 9000)
    assert e.value.code == "context_length_exceeded" and e.value.body["message"].startswith(words)


def test_context_full_is_incomplete_and_so_is_the_message_it_cut(client):
    """About 8130 prompt tokens of the 8K engine's 8192 and max_output_tokens 200: the context fills first, and the
    API reports that as it reports max_output_tokens (docs/limits.md)."""
    events = list(client.responses.create(model=PLAIN, input="hi " * 8100, max_output_tokens=200, stream=True,
                                          extra_body=forced("story " * 300)))
    assert events[-1].type == "response.incomplete"
    r = events[-1].response
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]
    assert r.output[0].content[0].text.startswith("story story")
    assert r.usage.output_tokens == 8192 - r.usage.input_tokens < 200


def test_models_list_has_codex_entries(serve_url):
    body = httpx.get(f"{serve_url}/v1/models", timeout=60).json()
    slugs = {m["slug"] for m in body["models"]}
    assert {d["id"] for d in body["data"]} == slugs
    m = next(m for m in body["models"] if m["slug"] == THINK)
    assert m["context_window"] == 8192 and m["truncation_policy"]["mode"] == "tokens"
    assert m["supports_reasoning_summaries"] is True and m["supports_parallel_tool_calls"] is True


def test_the_deployments_output_cap_completes_and_says_what_cut_the_message(client):
    """`smollm2-capped` is the 8K engine with a 6-token output cap. A request that set no max_output_tokens (Codex
    sets none) stopped by that cap completes — Codex fails the whole turn on `response.incomplete` — with
    `incomplete_details` and the cut message `incomplete`; the client's own limit is still `incomplete`."""
    events = list(client.responses.create(model="smollm2-capped", input="hi", stream=True,
                                          extra_body=forced("story " * 40)))
    assert events[-1].type == "response.completed"
    r = events[-1].response
    assert r.status == "completed" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]
    assert r.output[0].content[0].text.startswith("story") and r.usage.output_tokens == 6
    own = client.responses.create(model="smollm2-capped", input="hi", max_output_tokens=3,
                                  extra_body=forced("story " * 40))
    assert own.status == "incomplete" and own.incomplete_details.reason == "max_output_tokens"
    assert own.usage.output_tokens == 3
