"""What one Responses-store put costs as the store fills: the put's time at each fill level, per backend.

The service's own AsyncStore (as an ingress with `response_store_placement: ingress` or the single-process launcher
opens it) takes puts of ~`--record-kb` KB records, one after another, into a fresh store until it holds
`--records`; every put is timed (SQLite's run on the event loop when they would not wait: this is the loop's time).
The caps are set above the fill, so no put evicts and what grows is only what the store holds; with `--cap N`
the item cap is N, so every put past it evicts the oldest record (a store that has filled up). Per backend and
fill bucket: the median and p90 put time. Run it at two commits to compare (the script needs nothing from the
code beyond AsyncStore).

    .venv/bin/python load/probe_store_fill.py --json load/results/store_fill.json
    .venv/bin/python load/probe_store_fill.py --backend postgres --json load/results/store_fill_postgres.json
    .venv/bin/python load/probe_store_fill.py --backend postgres --cap 3000 --json store_fill_pg_cap.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import provenance  # noqa: E402
from load.store_backends import databases  # noqa: E402
from serve_app.ingress.responses.store import AsyncStore  # noqa: E402


async def fill(backend: str, where: str, records: int, record_kb: int, buckets: list[int],
               cap: int | None = None) -> list[dict]:
    record = {"response": {"id": "r"}, "items": [{"type": "message", "content": "x" * 1000}] * record_kb}
    sqlite = backend == "sqlite"
    store = AsyncStore(cap or records + 1, 1e9, 1 << 42, backend=backend, path=where if sqlite else None,
                       dsn=None if sqlite else where)
    times: list[float] = []
    for i in range(records):
        t0 = time.perf_counter()
        await store.put(f"resp_{i}", record)
        times.append(time.perf_counter() - t0)
    rows = []
    for lo, hi in zip(buckets, buckets[1:] + [records]):
        if lo >= hi:
            continue
        part = sorted(times[lo:hi])
        rows.append({"stored_before": f"{lo}-{hi - 1}", "puts": len(part),
                     "median_ms": round(statistics.median(part) * 1e3, 3),
                     "p90_ms": round(part[int(0.9 * (len(part) - 1))] * 1e3, 3)})
        print(backend, rows[-1], flush=True)
    closed = store.core.close()
    if asyncio.iscoroutine(closed):
        await closed
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--record-kb", type=int, default=80,
                    help="record size (JSON, about): a long agent session's history")
    ap.add_argument("--buckets", type=int, nargs="+", default=[0, 100, 1000, 2000, 4000, 5000])
    ap.add_argument("--cap", type=int, help="the store's item cap (default: above --records, so nothing evicts)")
    ap.add_argument("--json")
    args = ap.parse_args()
    with databases(args.backend, "store_fill_") as where:
        rows = asyncio.run(fill(args.backend, where("fill"), args.records, args.record_kb, args.buckets, args.cap))
    if args.json:
        provenance.write(args.json, {**provenance.header("load/probe_store_fill.py", sys.argv[1:]),
                                     "backend": args.backend, "records": args.records,
                                     "record_kb": args.record_kb, "cap": args.cap, "fill": rows})


if __name__ == "__main__":
    main()
