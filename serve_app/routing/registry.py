"""The routing policies by name: the one list (the Serve config's `router.policy` names one of these).

Adding a policy: a `Policy` subclass (routing/policies.py or its own module, with its options as a `Config`
dataclass), and its class in `POLICIES` below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serve_app.routing.policies import (
    KvPolicy,
    LeastLoadedPolicy,
    Policy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    SessionPolicy,
)
from serve_app.routing.ttft import TtftPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (TtftPolicy, KvPolicy, LeastLoadedPolicy, RoundRobinPolicy, SessionPolicy, PrefixAffinityPolicy)
}


def make_policy(name: str, **options: Any) -> Policy:
    """A new `name` policy. `options` may name any policy's settings: each policy takes those its `Config`
    declares and ignores the rest (so one router config serves whichever policy is chosen); None means unset."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {sorted(POLICIES)}") from None
    if cls.Config is None:
        return cls()
    known = {f.name for f in dataclasses.fields(cls.Config)}
    return cls(cls.Config(**{k: v for k, v in options.items() if k in known and v is not None}))
