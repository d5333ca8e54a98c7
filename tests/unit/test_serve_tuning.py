"""The replicas' start-up heap is frozen out of the garbage collector's reach (serve_tuning.freeze_startup_heap)."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs with an ordinary collector


def _tracked(obj) -> bool:
    # gc.get_objects() lists what a collection walks; frozen objects are not among them
    return any(o is obj for o in gc.get_objects())


def test_freeze_takes_the_existing_heap_out_of_collections(unfrozen):
    from serve_app.serve_tuning import freeze_startup_heap

    startup = [{"i": i} for i in range(10_000)]
    assert _tracked(startup)
    frozen = freeze_startup_heap()
    assert frozen >= 10_000
    assert not _tracked(startup)
    later = [{"i": 1}]  # what serving allocates afterwards is still collected
    assert _tracked(later)


def test_router_replica_freezes_its_start_up_heap(unfrozen):
    from serve_app.routing.deployment import Router

    router = Router.func_or_class({"kv_events": False})
    assert gc.get_freeze_count() > 0
    assert not _tracked(router.table)


def test_the_app_can_take_disconnects_over_from_serves_direct_ingress_wrapper(monkeypatch):
    """`ingress.disconnects: app` relies on the name Serve's replica reads the disconnect header through; a Ray
    upgrade that drops it fails here instead of leaving Serve's per-request watcher silently back on."""
    from ray.serve._private import replica

    from serve_app.serve_tuning import app_watches_disconnects

    monkeypatch.setattr(replica, "parse_disconnect_disabled_header", replica.parse_disconnect_disabled_header)
    assert replica.parse_disconnect_disabled_header({}) is False  # Serve's own reading: it watches
    assert app_watches_disconnects()
    assert replica.parse_disconnect_disabled_header({}) is True
    assert replica.parse_disconnect_disabled_header({b"x-request-disconnect-disabled": b"?0"}) is True
