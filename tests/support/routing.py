"""Reading the routing state a served app decides with, from an integration test.

With `router.placement: ingress` (the default) decisions are made by each Ingress replica's own table; the tests
that read it run one ingress replica, so that table is the whole picture. With `placement: deployment` it is the
Router deployment's. Policy switches always go to the Router deployment (the control plane) and reach the
ingress's table on its next snapshot.
"""

from __future__ import annotations

import time


def routing_metrics(app: str) -> dict:
    from ray import serve

    by_ingress = serve.get_deployment_handle("Ingress", app_name=app).routing_metrics.remote().result(timeout_s=30)
    if by_ingress:
        return by_ingress
    return serve.get_deployment_handle("Router", app_name=app).metrics.remote().result(timeout_s=30)


def set_policy(app: str, key: str, policy: str, timeout_s: float = 30.0) -> None:
    from ray import serve

    serve.get_deployment_handle("Router", app_name=app).set_policy.remote(key, policy).result(timeout_s=30)
    deadline = time.monotonic() + timeout_s
    while routing_metrics(app).get(key, {}).get("policy") != policy:
        if time.monotonic() > deadline:
            raise AssertionError(f"policy {policy!r} did not reach the deciding routing table in {timeout_s} s")
        time.sleep(0.2)


async def routing_metrics_async(app: str) -> dict:
    """`routing_metrics` from inside an event loop."""
    from ray import serve

    by_ingress = await serve.get_deployment_handle("Ingress", app_name=app).routing_metrics.remote()
    if by_ingress:
        return by_ingress
    return await serve.get_deployment_handle("Router", app_name=app).metrics.remote()
