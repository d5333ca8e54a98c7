"""How long a burst of Responses-store writes waits beside a busy event loop: in a worker thread vs on the loop.

The service's own AsyncStore (as an ingress with `response_store_placement: ingress` or the single-process launcher
opens it) takes N puts submitted at once, while a task on the same loop does bursts of Python work and yields
(`await asyncio.sleep(0)`) between them, as a loop streaming many responses does. Per backend:

* `sqlite` (the default): `thread`, every call in a worker thread (how the store ran before); `loop`, the default,
  each call made on the loop when it would not wait.
* `postgres` (a PostgreSQL 16 this probe starts itself with pgserver, a test dependency): `thread`, the store's
  calls run by a worker thread (on an event loop of its own there: a thread that must take the GIL back after
  every wait for the server, as psycopg's blocking calls in a thread pool did before); `loop`, the default, the
  calls awaited on the loop itself (serve_app/ingress/responses/store.py).

Per mode and record size: the time from submitting the burst to the puts' completions (p50 and last), how many
failed (the store's own timeout, 5 s), and the busy task's bursts per second meanwhile.

    .venv/bin/python load/probe_store_wait.py --json load/results/store_wait.json
    .venv/bin/python load/probe_store_wait.py --backend postgres --json load/results/store_wait_postgres.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import provenance  # noqa: E402
from load.busy_loop import BusyLoop  # noqa: E402
from load.store_backends import databases  # noqa: E402
from serve_app.ingress.responses.store import AsyncStore  # noqa: E402


async def burst(store: AsyncStore, n: int, record: dict, burst_iterations: int, tag: str) -> dict:
    async with BusyLoop(burst_iterations) as busy:
        done: list[float] = []
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await store.put(f"{tag}-{i}", record)
            done.append(time.perf_counter() - t0)

        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        rate = busy.rate()
    failed = [r for r in results if isinstance(r, Exception)]
    return {"puts": n, "finished": len(done), "failed": len(failed),
            "failure": type(failed[0]).__name__ if failed else None,
            "p50_ms": round(statistics.median(done) * 1e3, 1) if done else None,
            "last_ms": round(max(done) * 1e3, 1) if done else None,
            "loop_bursts_per_s": rate}


class ThreadLoop:
    """An event loop in a worker thread, for the postgres `thread` mode: coroutines submitted from the main loop
    run there, and the main loop awaits their results."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, fn, *args):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args), self.loop))

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--puts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst-iterations", type=int, default=20000, help="Python loop iterations per busy burst")
    ap.add_argument("--record-kb", type=int, nargs="+", default=[4, 400], help="record sizes (JSON, about)")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    with databases(args.backend, "store_wait_") as where:
        for kb in args.record_kb:
            for mode in ("thread", "loop"):
                out[f"{mode}_{kb}kb"] = asyncio.run(run_mode(args, where(f"{mode}_{kb}"), mode, kb))
    if args.json:
        provenance.write(args.json, {**provenance.header("load/probe_store_wait.py", sys.argv[1:]),
                                     "backend": args.backend, "puts": args.puts,
                                     "burst_iterations": args.burst_iterations, "modes": out})


async def run_mode(args, where: str, mode: str, kb: int) -> list[dict]:
    """`args.repeats` bursts of puts of ~`kb` KB records into a fresh store, its calls made as `mode` says."""
    record = {"response": {"id": "r"}, "items": [{"type": "message", "content": "x" * 1000}] * kb}
    sqlite = args.backend == "sqlite"
    store = AsyncStore(100_000, 3600, 1 << 40, backend=args.backend,
                       path=where if sqlite else None, dsn=None if sqlite else where)
    worker = None
    if sqlite:
        store.calls = "inline_first" if mode == "loop" else "thread"
    elif mode == "thread":
        worker = ThreadLoop()
        store._call = lambda fn, *a: store._bounded(worker.call(fn, *a))
    rows = []
    for r in range(args.repeats):
        rows.append(await burst(store, args.puts, record, args.burst_iterations, f"{r}"))
        print(args.backend, mode, f"{kb} KB", rows[-1], flush=True)
    if worker is not None:
        await worker.call(store.core.close)
        worker.stop()
    else:
        closed = store.core.close()
        if asyncio.iscoroutine(closed):
            await closed
    return rows


if __name__ == "__main__":
    main()
