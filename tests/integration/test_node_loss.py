"""Engine replicas come and go on a multi-node Ray cluster (Ray's own `ray.cluster_utils.Cluster`, on this one
machine): a replica that joins gets traffic without a restart, and a node lost with streams running on it fails
only those streams, each with its API's error event, while a non-streamed request it was generating runs again on
the live replica and comes back whole, new requests go on to the live replica and the Router forgets the dead one
without leaking reservations or admission slots.

It needs a cluster of its own, so it cannot use the session server: it is marked `own_cluster`, runs last and
stops the session's Ray first (tests/conftest.py). Cheap on purpose: one SmolLM2 engine per node (eager, 1 GiB
of KV cache), one ingress, one test. The engine deployment asks for two replicas, each needing one `engine_slot`,
a custom resource every node has one of: the head's replica starts with the app, the second stays pending until
a worker node joins (as when a cluster autoscaler adds a node), and is lost with it.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import psutil
import pytest

from serve_app import metrics
from serve_app.engine.vllm_engine import free_port
from tests.support.prometheus import samples
from tests.support.routing import routing_metrics, routing_metrics_async
from tests.support.streams import APIS, assert_engine_error, is_delta, still_running, stream_body

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

SERVE_PORT = free_port()  # not a fixed one: something outside this session may hold it
APP = "nodeloss"
MODEL = "smollm2-135m-instruct"
WORDS = "cache router block prefix token engine replica stream parser session agent tool patch test".split()

ARGS = {
    "models": [{
        "id": MODEL,
        "max_model_len": 4096,
        "max_output_tokens": 3800,
        "chat_template": "serve_app/templates/smollm2_tools.jinja",
        # Two engines share the cores: the OS schedules their threads instead of both pinning the same ones.
        "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        "engine_kwargs": {"enforce_eager": True},
        "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5, "resources": {"engine_slot": 1}}},
    }],
    # The ingress and the Router stay on the head node: only the engine replica is lost with the worker.
    "router": {"deployment": {"ray_actor_options": {"resources": {"head": 1}}}},
    "ingress": {"deployment": {"num_replicas": 1, "ray_actor_options": {"resources": {"head": 1}}}},
    "testing": {"forced_scripts": True},
}


@pytest.fixture(scope="module")
def cluster(without_session_server):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"head": 100, "engine_slot": 1}, "include_dashboard": False})
    try:
        ray.init(address=c.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": SERVE_PORT},
                    controller_options={"runtime_env": {"env_vars": {
                        "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}}})
        yield c
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def app(cluster):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    # Not blocking: the app stays DEPLOYING while its second replica waits for a node.
    serve._run(build_app(ARGS), _blocking=False, name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{SERVE_PORT}"
    key = engine_key(AppSettings.model_validate(ARGS).models[0])
    router = APP  # the routing table that decides is read through the app (tests/support/routing.py)
    wait_for(lambda: _ready(url) and len(_replicas(router, key)) == 1, 900, "the head's engine replica")
    yield url, router, key, serve.get_deployment_handle(key, app_name=APP)


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.5)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _router_metrics(app: str, key: str) -> dict:
    return routing_metrics(app).get(key, {})


def _replicas(router: str, key: str) -> dict:
    return _router_metrics(router, key).get("replicas", {})


def _running(key: str) -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    deployment = app.deployments.get(key) if app else None
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def _admitted(url: str) -> float:
    """Requests holding an admission slot in the (single) ingress replica, as its node's metrics agent exports
    them (Ray reports a replica's metrics every few seconds)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    name = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "queue_depth"
    # never set: nothing was ever admitted
    return sum(v for n, labels, v in samples(text) if n == name and labels.get("component") == "ingress")


def _chat(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}],
        "nvext": {"forced_script": "ok"}})


async def _output_or_end(i: int, api: str, task: asyncio.Task, started: asyncio.Event, lines: dict) -> None:
    """Wait for stream `i`'s first model output; a stream that ends or fails first says how, not just a timeout."""
    waiter = asyncio.ensure_future(started.wait())
    done, _ = await asyncio.wait({waiter, task}, timeout=180, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if started.is_set():
        return
    if task in done:
        task.result()  # its own failure (a refused request), if it raised
        raise AssertionError(f"stream {i} ({api}) ended before any output: {lines.get(i, [])[-6:]}")
    raise AssertionError(f"stream {i} ({api}) showed no output within 180 s: {lines.get(i, [])[-6:]}")


def _raylet_tree(node) -> list[psutil.Process]:
    """The processes of a cluster node's raylet: its workers (the engine replica) and their vLLM children."""
    import ray._private.ray_constants as rc

    raylet = psutil.Process(node.all_processes[rc.PROCESS_TYPE_RAYLET][0].process.pid)
    return raylet.children(recursive=True)


def test_a_replica_joins_and_a_lost_node_fails_only_its_streams(cluster, app):
    url, router, key, engine = app
    (first,) = _replicas(router, key)

    # -- a node with an engine slot joins: the pending replica starts there and gets traffic, nothing restarts
    worker = cluster.add_node(num_cpus=2, resources={"engine_slot": 1})
    wait_for(lambda: _running(key) == 2, 900, "Serve to run the joining replica")
    replicas = wait_for(lambda: (r := _replicas(router, key)) and len(r) == 2 and r, 60, "it to register")
    (joined,) = set(replicas) - {first}
    rng = random.Random(7)
    for i in range(6):  # fresh prompts: nothing cached anywhere, so the idle newcomer is the cheaper place
        r = _chat(url, f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(200)))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text[:300]
    replicas = _replicas(router, key)
    assert set(replicas) == {first, joined}, replicas  # the first replica is the same one: no restart
    assert replicas[joined]["routed"] > 0, replicas

    node_procs = _raylet_tree(worker)
    assert any("Engine" in " ".join(p.cmdline()) for p in node_procs), "the joined replica runs on the worker"

    # -- streams on both replicas; learn where each went from the Router's per-replica counts
    # Long enough that no stream can finish before the node is lost, however fast this machine decodes (the
    # streams start one after another until each API has one on the joining replica).
    script = " ".join(rng.choice(WORDS) for _ in range(4000))
    on: dict[int, str] = {}
    lines: dict[int, list[str]] = {}
    survivors_after_kill: dict[int, int] = {}
    killed = asyncio.Event()
    t_kill = 0.0
    after_kill: list[tuple[float, float, int, str]] = []  # (sent, seconds after the kill; took; status; content)
    ended: dict[int, float] = {}  # stream -> seconds after the kill it ended
    finished_early: set[int] = set()  # streams that ended before the kill (the test's own premise broken)
    dropped = [None]  # seconds after the kill the Router no longer listed the lost replica
    whole_script = " ".join(rng.choice(WORDS) for _ in range(40))
    whole: dict[int, asyncio.Task] = {}  # non-streamed requests running when the node is lost
    whole_on: dict[int, str] = {}  # -> the replica the Router sent each to

    async def stream(i: int, api: str, client: httpx.AsyncClient, started: asyncio.Event):
        path, body = stream_body(api, MODEL, script, 3600,
                                 prompt=f"stream {i}: " + " ".join(rng.choice(WORDS) for _ in range(100)))
        lines[i] = []
        async with client.stream("POST", url + path, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                lines[i].append(line)
                if is_delta(line):
                    started.set()
                    if killed.is_set():
                        survivors_after_kill[i] = survivors_after_kill.get(i, 0) + 1
                        if survivors_after_kill[i] >= 20 and on[i] == first:
                            break  # still streaming well after the node went: enough, hang up
        if killed.is_set():
            ended[i] = time.monotonic() - t_kill
        else:
            finished_early.add(i)

    async def scenario():
        nonlocal t_kill
        tasks = {}
        async with httpx.AsyncClient(timeout=300) as client:
            async def routed_now() -> dict:
                return {r: m["routed"] for r, m in (await routing_metrics_async(router)).get(key, {})["replicas"].items()}

            routed = await routed_now()
            for i in range(12):
                api = APIS[i % 3]
                started = asyncio.Event()
                tasks[i] = asyncio.create_task(stream(i, api, client, started))
                await _output_or_end(i, api, tasks[i], started, lines)
                now = await routed_now()
                (on[i],) = [r for r in now if now[r] != routed.get(r)]
                routed = now
                victims = {APIS[j % 3] for j in on if on[j] == joined}
                if victims == set(APIS) and first in on.values():
                    break
            assert {APIS[j % 3] for j in on if on[j] == joined} == set(APIS), on  # each API has a stream there
            assert first in on.values(), on

            # -- non-streamed requests, one after another until one is on the joining replica: it is generating
            # there when the node is lost, but its client has seen nothing, so it must come back whole (it runs
            # again on the live replica, service.complete). Short enough to finish in seconds on the live one.
            for n in range(8):
                whole[n] = asyncio.create_task(client.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 200, "nvext": {"forced_script": whole_script},
                    "messages": [{"role": "user", "content": f"whole {n}: " + " ".join(rng.choice(WORDS)
                                                                                        for _ in range(100))}]}))
                for _ in range(120):  # until the Router has placed it
                    await asyncio.sleep(0.25)
                    now = await routed_now()
                    if now != routed:
                        break
                (whole_on[n],) = [r for r in now if now[r] != routed.get(r)]
                routed = now
                if whole_on[n] == joined:
                    break
            assert joined in whole_on.values(), whole_on
            await asyncio.sleep(2)  # its first tokens: the loss comes after output, not before acceptance

            # -- the worker node is lost (its processes killed, not drained)
            t_kill = time.monotonic()
            await asyncio.to_thread(cluster.remove_node, worker, False)
            killed.set()

            async def probe(n: int):  # new requests meanwhile, each on its own, every half second
                await asyncio.sleep(n * 0.5)
                sent = time.monotonic() - t_kill
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"hi {n}"}],
                    "nvext": {"forced_script": "ok"}})
                content = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
                after_kill.append((sent, time.monotonic() - t_kill - sent, r.status_code, content))

            async def watch_router():
                while time.monotonic() - t_kill < 30:
                    if joined not in (await routing_metrics_async(router)).get(key, {}).get("replicas", {}):
                        dropped[0] = time.monotonic() - t_kill
                        return
                    await asyncio.sleep(0.25)

            await asyncio.wait_for(asyncio.gather(watch_router(), *(probe(n) for n in range(40)),
                                                  *tasks.values(), *whole.values()), 300)

    asyncio.run(scenario())

    for n, task in whole.items():  # on either replica: the whole answer, no error
        r = task.result()
        assert r.status_code == 200, (n, whole_on[n], r.text[:300])
        assert r.json()["choices"][0]["message"]["content"] == whole_script, (n, whole_on[n], r.text[:300])

    assert not finished_early, f"streams {sorted(finished_early)} ended before the node was lost: make them longer"
    victims = [i for i in on if on[i] == joined]
    for i in victims:
        assert_engine_error(APIS[i % 3], lines[i])
    for i in on:
        if on[i] == first:  # unaffected: no error, and it kept streaming after the node was gone
            assert survivors_after_kill.get(i, 0) >= 20 or any('"message_stop"' in x or "[DONE]" in x
                                                              or "response.completed" in x for x in lines[i]), i
            assert not any(x == "event: error" or x.startswith('data: {"error"') or '"response.failed"' in x
                           for x in lines[i]), lines[i][-3:]

    print(f"node loss: streams {on}; ended after {sorted((round(t, 1), i) for i, t in ended.items())}; "
          f"Router dropped the replica after {dropped[0]} s; requests after (sent, took, status): "
          f"{sorted((round(a, 1), round(b, 1), c) for a, b, c, _ in after_kill)}")
    # A lost node's processes run on until they notice their raylet is gone (the streams on it ended 0.9-3 s after
    # the loss here), and its replica accepts and runs new requests until then: one sent in that window can be
    # served there and lose its replica midway (seen in CI: sent at 0.5 s, lost at 0.94 s with the streams). These
    # requests are not streamed, so nothing has reached the client: such a request runs again on the live replica
    # (service.complete). Every request was served; none was held longer than Ray takes to declare a node dead
    # (3.8 s at most here).
    assert len(after_kill) == 40, after_kill
    assert all((status, content) == (200, "ok") for _, _, status, content in after_kill), after_kill
    assert max(took for _, took, _, _ in after_kill) < 30, after_kill
    # The Router dropped the dead replica with its blocks and load (4.5 s after the loss here); nothing it
    # reserved is left.
    assert dropped[0] is not None, "the Router still lists the lost replica 30 s after the loss"
    wait_for(lambda: set(_replicas(router, key)) == {first}, 60, "the Router to drop the lost replica")
    wait_for(lambda: _router_metrics(router, key)["inflight"] == 0, 60, "the Router's reservations to clear")
    # Those of the lost replica too: each request handed over took its reservation to the live replica
    # (RouterCore.redirect), and each that failed released its own.
    wait_for(lambda: _router_metrics(router, key)["orphaned_reservations"] == 0, 60, "the lost replica's reservations")
    (left,) = _replicas(router, key).values()
    assert left["active_requests"] == 0 and left["active_prefill_tokens"] == 0 and left["active_decode_tokens"] == 0
    # Admission slots in the ingress and requests in the surviving engine: all given back.
    wait_for(lambda: _admitted(url) == 0, 60, "the ingress's admission slots")
    wait_for(lambda: engine.num_unfinished.remote().result(timeout_s=30) == 0, 60, "the live engine to idle")
    # Nothing of the lost node outlives it, its vLLM engine processes included.
    assert not still_running(node_procs, within_s=60), "processes of the lost node are still running"
    r = _chat(url, "after")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
