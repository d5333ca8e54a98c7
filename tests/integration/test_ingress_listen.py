"""`ingress.listen` on the real server: the ingress replicas serve the service port themselves (SO_REUSEPORT), with
no Serve proxy or HAProxy between a client and the app, and the engines in their own process.

A second app beside the session's server, with no HTTP route in Serve (route_prefix None): it is reachable only on
its replicas' own port. Every API through the real SDKs on that port; a client that leaves a non-streamed answer
aborts its engine request (the gap Serve's HAProxy leaves, docs/serving-path.md); open streams make Serve's
autoscaler add a replica, which binds the same port, and the kernel spreads new connections over both;
and (last, since it deletes the app) a stream still open when the app is deleted runs to its end: the replica
stops accepting and drains its own requests before its engines stop.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from serve_app.engine.vllm_engine import free_port
from tests.support.apps import wait_healthy
from tests.support.streams import leave_a_non_streamed_answer

pytestmark = pytest.mark.integration

APP = "listen"
MODEL = "smollm2-135m-instruct"


def forced(script: str) -> dict:
    return {"nvext": {"forced_script": script}}


def deploy(args: dict, url: str) -> None:
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=APP, route_prefix=None)
    wait_healthy(url, f"the {APP} app")


@pytest.fixture(scope="module")
def listen_args(serve_url, serve_config) -> dict:
    args = copy.deepcopy(serve_config["applications"][0]["args"])
    args["models"] = [next(m for m in args["models"] if m["id"] == MODEL)]
    args["engine_placement"] = "ingress"
    ingress = {k: v for k, v in args.get("ingress", {}).items() if k not in ("direct_ingress", "disconnects")}
    # A drain long enough for the last test's stream on a busy CI host, under Serve's kill at graceful shutdown.
    args["ingress"] = {**ingress, "listen": {"host": "127.0.0.1", "port": free_port(), "drain_s": 120},
                       "deployment": {"num_replicas": 1, "graceful_shutdown_timeout_s": 150}}
    return args


@pytest.fixture(scope="module")
def app_url(listen_args):
    from ray import serve

    url = f"http://127.0.0.1:{listen_args['ingress']['listen']['port']}"
    deploy(listen_args, url)
    yield url
    if APP in serve.status().applications:
        serve.delete(APP)


@pytest.fixture(scope="module")
def ingress(app_url):
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=APP)


def test_every_api_answers_on_the_replicas_own_port(app_url):
    chat = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "hi"}],
              extra_body=forced("Straight to the replica."))
    assert chat.chat.completions.create(**kw).choices[0].message.content == "Straight to the replica."
    streamed = "".join(c.choices[0].delta.content or "" for c in chat.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == "Straight to the replica."
    resp = chat.responses.create(model=MODEL, input="hi", max_output_tokens=60, extra_body=forced("Responses too."))
    assert resp.output_text == "Responses too."
    msgs = anthropic.Anthropic(base_url=app_url, api_key="unused", max_retries=0, timeout=300)
    with msgs.messages.stream(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "hi"}],
                              extra_body=forced("And Messages.")) as stream:
        assert stream.get_final_message().content[0].text == "And Messages."
    bad = httpx.post(f"{app_url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_a_client_that_leaves_a_non_streamed_answer_aborts_its_engine_request(app_url, ingress):
    """Through Serve's HAProxy this request would run to its end (HAProxy keeps the replica's connection until the
    answer's head); on the replica's own port the route sees the client leave."""
    assert leave_a_non_streamed_answer(app_url, MODEL,
                                       lambda: ingress.num_unfinished.remote().result(timeout_s=30)) == 0


def _ingress_replicas() -> dict:
    from ray import serve

    return dict(serve.status().applications[APP].deployments["Ingress"].replica_states)


def test_open_streams_scale_the_ingress_up_and_the_new_replica_shares_the_port(app_url, listen_args):
    """Serve counts none of the requests on the replicas' own port; each replica reports its listener's open
    requests (ingress/autoscaling.py) and Serve's autoscaler adds a replica for them. The new replica binds the same
    port and the kernel spreads new connections over both (which answered is the `x-serve-replica` header)."""
    scaled = copy.deepcopy(listen_args)
    scaled["ingress"]["deployment"] = {
        "graceful_shutdown_timeout_s": 150,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                               "metrics_interval_s": 0.5, "look_back_period_s": 1, "upscale_delay_s": 0,
                               "downscale_delay_s": 600}}
    deploy(scaled, app_url)
    assert sum(_ingress_replicas().values()) == 1  # no request open: the minimum

    stop = threading.Event()

    def stream() -> None:  # open until told to stop (the client leaving aborts its engine request)
        body = {"model": MODEL, "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "go"}],
                **forced("word " * 900)}
        with httpx.Client(timeout=120) as client, client.stream("POST", f"{app_url}/v1/chat/completions",
                                                                 json=body) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    streams = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    for t in streams:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while sum(_ingress_replicas().values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sum(_ingress_replicas().values()) == 2, _ingress_replicas()  # starting or running
    finally:
        stop.set()
        for t in streams:
            t.join(60)
    seen: set[str] = set()
    deadline = time.monotonic() + 300  # the second replica's engine starts while the first keeps answering
    while len(seen) < 2 and time.monotonic() < deadline:
        r = httpx.post(f"{app_url}/v1/chat/completions", timeout=120, json={  # a new connection each time
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **forced("ok")})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-serve-replica"])
    assert len(seen) == 2, seen


def test_a_stream_open_when_the_app_is_deleted_runs_to_its_end(app_url):
    """Serve's graceful shutdown counts only the requests it carried; the replica drains those of its own port
    before its engines stop (ingress/listener.py), so a redeploy or scale-down does not cut an agent's stream."""
    from ray import serve

    words = 400  # seconds of streaming: Serve reaches the replica's destructor ~2 s after the delete begins
    body = {"model": MODEL, "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "go"}],
            **forced("word " * words)}
    lines: list[str] = []
    deleting = threading.Thread(target=serve.delete, args=(APP,))
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{app_url}/v1/chat/completions",
                                                             json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and not deleting.is_alive() and not deleting.ident:
                deleting.start()  # once output has started
    deleting.join(120)
    assert deleting.ident and not deleting.is_alive()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.split() == ["word"] * words
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
    with pytest.raises(httpx.HTTPError):  # and nothing listens there any more
        httpx.get(f"{app_url}/health", timeout=5)
