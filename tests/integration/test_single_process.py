"""`python -m serve_app run config.yaml --single-process`, for real: config.yaml's service in one process without
Ray (serve_app/single_process.py) — no Ray process at all, the three APIs through the real SDKs with a tool call
parsed in the stream, the Responses store, a turn that reuses the previous one's cached prefix, the service's and
vLLM's metrics on /metrics, a killed engine core replaced in place while the other engine serves on, and Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stopping the
server and every engine process with status 0.

config.yaml as shipped with the test hooks only (tests/support/launched.py). Marked `own_cluster` so that it runs
after the session's Ray server has stopped: two cores are not shared with another server's engines.
"""

from __future__ import annotations

import json
import os
import re
import signal

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.launched import interrupted_cleanly, kill_tree, launch, start, titles, tree

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

MODEL = "smollm2-135m-instruct"
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def forced(script: str) -> dict:
    return {"nvext": {"forced_script": script}}


@pytest.fixture(scope="module")
def launched(without_session_server, tmp_path_factory):
    yield from launch(tmp_path_factory.mktemp("single"), "--single-process")


def test_no_ray_process_runs(launched):
    proc, _, _ = launched
    names = titles(tree(proc.pid))
    assert not [t for t in names if "raylet" in t or "gcs_server" in t or "ray::" in t or "dashboard" in t], names
    # The engines are this process's children: vLLM's engine cores (one per engine of config.yaml: two).
    cores = [p for p in tree(proc.pid)[1:] if "EngineCore" in " ".join(titles([p])) or "VLLM" in p.name()]
    assert len(cores) >= 2, names


def test_chat_answers_through_the_openai_sdk(launched):
    _, url, _ = launched
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body=forced("One process, no Ray."))
    assert reply.choices[0].message.content == "One process, no Ray."
    assert reply.usage.completion_tokens > 0


def test_a_messages_stream_parses_the_tool_call_as_the_batch_answer_does(launched):
    _, url, _ = launched
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
    args = {"city": "Zürich \"old town\"\nnorth"}
    script = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    kw = dict(model=MODEL, max_tokens=200, tools=[WEATHER], messages=[{"role": "user", "content": "weather?"}],
              extra_body=forced(script))
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    batch = client.messages.create(**kw)
    for message in (streamed, batch):
        assert message.stop_reason == "tool_use"
        text, call = message.content
        assert text.text == "Checking."
        assert (call.name, call.input) == ("get_weather", args)
    assert "input_json" in kinds  # the arguments arrived as deltas of the stream, not only at its end


def test_responses_are_stored_and_continued(launched):
    _, url, log = launched
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    first = client.responses.create(model=MODEL, input="Remember the word teal.", max_output_tokens=8, store=True,
                                    extra_body=forced("Noted: teal."))
    second = client.responses.create(model=MODEL, input="Which word?", previous_response_id=first.id,
                                     max_output_tokens=8, extra_body=forced("teal"))
    assert second.output_text == "teal"
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == "Noted: teal."
    assert (log.parent / "responses.sqlite3").stat().st_size > 0  # config.yaml's SQLite file, opened here


def test_the_next_turn_reuses_the_cached_prefix(launched):
    _, url, _ = launched
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer plainly." for i in range(60))
    history = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    one = client.chat.completions.create(model=MODEL, messages=history, extra_body=forced("Done once."))
    history += [{"role": "assistant", "content": "Done once."}, {"role": "user", "content": "second"}]
    two = client.chat.completions.create(model=MODEL, messages=history, extra_body=forced("Done twice."))
    block = 128  # vLLM's CPU block size: the cache holds whole blocks
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - block, (one.usage, two.usage)


def test_metrics_show_the_service_and_the_engines(launched):
    _, url, _ = launched
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"serve_app_requests", "serve_app_ttft_seconds", "vllm:generation_tokens"} <= names, sorted(names)


def _engine_cores(pid: int, log) -> dict:
    """The process's vLLM engine cores by their engine's context length, from the line each engine core logs as it
    starts (config.yaml's engines start together: which core is whose is not their order)."""
    procs = {p.pid: p for p in tree(pid)[1:] if "EngineCore" in " ".join(titles([p]))}
    lines = re.finditer(r"\(EngineCore pid=(\d+)\)[^\n]*Initializing a V1 LLM engine[^\n]*max_seq_len=(\d+)",
                        log.read_text())
    return {int(m[2]): procs[int(m[1])] for m in lines if int(m[1]) in procs}


def test_a_dead_engine_is_replaced_while_the_other_engine_serves_on(launched):
    """The 8K engine's core is killed (an OOM kill, a crash) while the 32K engine streams: that stream ends whole,
    the 8K model's requests get 503 with retry-after while its engine is replaced in place, then answer again; the
    process never stops, and /metrics holds each engine once."""
    import time

    proc, url, log = launched
    cores = _engine_cores(proc.pid, log)
    assert sorted(cores) == [8192, 32768], (cores, titles(tree(proc.pid)))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    script = " ".join(f"step{i}" for i in range(40))
    stream = client.chat.completions.create(model="smollm2-135m-instruct-32k", stream=True,
                                            messages=[{"role": "user", "content": "count"}],
                                            extra_body=forced(script))
    text, killed = "", False
    for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if text and not killed:
            cores[8192].kill()  # the 8K model's engine
            killed = True
    assert killed and text == script

    deadline = time.monotonic() + 60
    while "replacing it" not in log.read_text():  # seen by the next health check (every 10 s) or request
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)  # a new engine takes seconds to start: the request below arrives well before it serves
    refusals = 0
    deadline = time.monotonic() + 300
    while True:
        try:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "back?"}],
                                                   extra_body=forced("Back again."))
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and float(e.response.headers["retry-after"]) == 5, e.response.text
            assert "restarting" in e.response.json()["error"]["message"]
            refusals += 1
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
    assert refusals >= 1, "no request was refused while the engine was replaced"
    assert reply.choices[0].message.content == "Back again."
    assert proc.poll() is None and "replaced, serving again" in log.read_text()
    now = _engine_cores(proc.pid, log)
    assert sorted(now) == [8192, 32768] and now[8192].pid != cores[8192].pid and now[32768].pid == cores[32768].pid
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for model in (MODEL, "smollm2-135m-instruct-32k"):
        assert metrics.count(f'vllm:num_requests_running{{engine="0",model_name="{model}"}}') == 1, model
    (restarts,) = [f for f in text_string_to_metric_families(metrics) if f.name == "serve_app_engine_restarts"]
    assert [(s.labels["outcome"], s.value) for s in restarts.samples if s.name.endswith("_total")] == [("replaced", 1)]


def test_ctrl_c_stops_the_server_and_its_engines(launched):
    proc, url, log = launched
    # A terminal's Ctrl-C reaches the whole foreground group: the engine processes get it too.
    interrupted_cleanly(proc, url, log, lambda: os.killpg(proc.pid, signal.SIGINT), timeout_s=120)


def test_a_sigterm_during_start_up_leaves_no_engine_behind(without_session_server, tmp_path):
    """A supervisor's stop (SIGTERM to the process alone) while the engines start: the process ends and takes every
    engine process it started with it (by default the signal ended it at once and left them running)."""
    import time

    import psutil

    proc, _, log = start(tmp_path, "--single-process")
    try:
        deadline = time.monotonic() + 300
        while "EngineCore" not in log.read_text():  # an engine core is starting
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        procs = tree(proc.pid)
        assert len(procs) > 1, titles(procs)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        deadline = time.monotonic() + 60
        while left := [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, f"left running: {titles(left)}"
            time.sleep(1)
    finally:
        kill_tree(proc)
