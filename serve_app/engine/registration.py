"""How an engine tells the Router where it publishes its KV events: an Engine replica for its one engine, an
ingress replica with `engine_placement: ingress` and `router.front_door` for each engine in its process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

REREGISTER_S = 30.0  # how soon a restarted Router relearns this replica's KV event endpoints


def registration(engine_key: str, replica_id: str, engine, host: str) -> tuple:
    """The Router's `register_replica` arguments for a started VLLMEngine reachable at `host`."""
    return (
        engine_key,
        replica_id,
        f"tcp://{host}:{engine.kv_events_port}" if engine.kv_events_port else None,
        f"tcp://{host}:{engine.kv_replay_port}" if engine.kv_replay_port else None,
        engine.block_size,
    )


async def register_forever(router, registration: tuple, interval_s: float = REREGISTER_S,
                           extra: Callable[[], dict] | None = None) -> None:
    """Retried until the Router answers (it may start later), then repeated every `interval_s` so that a Router
    replica that restarted (and lost its table) learns this engine again; a repeat of a registration the Router
    holds changes nothing there. `extra`: more keyword arguments, taken fresh for each call. Runs until
    cancelled."""
    attempt = 0
    registered = False
    while True:
        try:
            await router.register_replica.remote(*registration, refresh=registered, **(extra() if extra else {}))
            registered, attempt = True, 0
            await asyncio.sleep(interval_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep serving; routing falls back to load only
            attempt += 1
            if attempt == 1 or attempt % 30 == 0:
                log.info("router registration attempt %d failed: %s", attempt, exc)
            await asyncio.sleep(min(2.0, 0.2 * attempt))
