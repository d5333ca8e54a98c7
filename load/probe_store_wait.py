"""How long a burst of Responses-store writes waits beside a busy event loop: in a worker thread vs on the loop.

The service's own AsyncStore on SQLite (the default backend, as an ingress with `response_store_placement: ingress`
or the single-process launcher opens it) takes N puts submitted at once, while a task on the same loop does bursts
of Python work and yields (`await asyncio.sleep(0)`) between them, as a loop streaming many responses does.
`thread`: every call in a worker thread (how the store ran before); `loop`: the default, each call made on the loop
when it would not wait (serve_app/ingress/responses/store.py). Per mode and record size: the time from submitting
the burst to the puts' completions (p50 and last), how many failed (the store's own timeout, 5 s), and the busy
task's bursts per second meanwhile.

    .venv/bin/python load/probe_store_wait.py --json load/results/store_wait.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import provenance  # noqa: E402
from load.busy_loop import BusyLoop  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst-iterations", type=int, default=20000, help="Python loop iterations per busy burst")
    ap.add_argument("--record-kb", type=int, nargs="+", default=[4, 400], help="record sizes (JSON, about)")
    ap.add_argument("--json")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="store_wait_")
    out = {f"{mode}_{kb}kb": run_mode(args, f"{folder}/{mode}-{kb}.db", mode, kb)
           for kb in args.record_kb for mode in ("thread", "loop")}
    if args.json:
        provenance.write(args.json, {**provenance.header("load/probe_store_wait.py", sys.argv[1:]),
                                     "puts": args.puts, "burst_iterations": args.burst_iterations, "modes": out})


def run_mode(args, path: str, mode: str, kb: int) -> list[dict]:
    """`args.repeats` bursts of puts of ~`kb` KB records into a fresh store, its calls made as `mode` says."""
    record = {"response": {"id": "r"}, "items": [{"type": "message", "content": "x" * 1000}] * kb}
    store = AsyncStore(100_000, 3600, 1 << 40, backend="sqlite", path=path)
    store._now_first = mode == "loop"  # thread: how every call ran before
    rows = []
    for r in range(args.repeats):
        rows.append(asyncio.run(burst(store, args.puts, record, args.burst_iterations, f"{r}")))
        print(mode, f"{kb} KB", rows[-1], flush=True)
    store.core.close()
    return rows


if __name__ == "__main__":
    main()
