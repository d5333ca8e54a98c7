"""Serve autoscaling for ingress replicas that serve their own port (`ingress.listen`).

Serve's own policy scales on the requests Serve carried to a replica (its handles and proxies count them). With
`ingress.listen` no request goes through Serve: clients connect to the replicas' port, so Serve's count stays at
zero and an `autoscaling_config` would keep the ingress at its minimum however busy it is. Each replica reports
the HTTP requests its listener holds open (`Ingress.record_autoscaling_stats`, a Serve custom metric), and this
policy is Serve's queue-length policy over that count plus Serve's own: desired replicas = requests /
`target_ongoing_requests`. Serve applies the config's bounds, delays and scaling factors around it, as it does
around its default policy. Plain functions of Serve's AutoscalingContext: nothing here starts Ray.
"""

from __future__ import annotations

from typing import Any

# The custom metric each ingress replica reports: HTTP requests open on its own listener.
LISTENER_REQUESTS = "listener_requests"
POLICY = "serve_app.ingress.autoscaling:listener_policy"


def listener_requests(ctx) -> float:
    """Requests open on the running replicas' listeners (each replica's value aggregated over Serve's look-back
    window), plus those Serve itself carried to them."""
    per_replica = (ctx.aggregated_metrics or {}).get(LISTENER_REQUESTS, {})
    return sum(per_replica.values()) + ctx.total_num_requests


def listener_policy(ctx) -> tuple[float, dict[str, Any]]:
    """The replicas needed for the open requests at `target_ongoing_requests` each (before Serve's bounds and
    delays). With no replica running yet there is nothing to measure: keep Serve's target."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    return listener_requests(ctx) / ctx.config.get_target_ongoing_requests(), {}


def with_listener_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """`autoscaling_config` with this policy, unless it names a policy of its own."""
    if autoscaling_config.get("policy") is not None:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": POLICY}}
