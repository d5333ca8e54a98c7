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
