"""What a long `previous_response_id` conversation costs the Responses store: each turn stored with its whole
history (how records were kept before conversations) against each turn stored once, continuing its parent (now).

Conversations of `--turns` turns of ~`--turn-kb` KB each (a user message and the model's answer, as Responses
items), put through the service's own AsyncStore into a fresh store each, the layouts alternating (`--rounds` of
each) in one run. Per turn it times what the Responses API does with the store: the history lookup a follow-up
makes (`whole`: get the parent's record, read its items; `chain`: `chain(parent)`, the records' items joined;
`recent`: the same through the ingress's StoreClient, which keeps the records it stored and asks the store only
whether the parent is visible; `reader`: stored as `recent`, read through another StoreClient that stores
nothing, as the front door's Router reads every continuation, keeping the records it read and reading only the
parent's record when it holds the rest) and the put of the new response (SQLite's on the event loop when they would not
wait: this is the loop's time).
Reported per turn bucket (the median over the bucket of each turn's median over the rounds), with the bytes one
conversation holds in the store at the end and how many such conversations the default 512 MiB byte cap holds.
Every layout must read back the same history at every turn (checked, so the probe cannot compare two different
things).

    .venv/bin/python load/probe_store_chain.py --json load/results/store_chain.json
    .venv/bin/python load/probe_store_chain.py --backend postgres --json load/results/store_chain_postgres.json
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
from serve_app.ingress.responses.store import AsyncStore, StoreClient  # noqa: E402

CAP = 512 * 1024 * 1024  # ingress.response_store_max_bytes's default


def turn_items(n: int, turn_kb: int) -> list[dict]:
    half = "x" * (turn_kb * 512)
    return [{"type": "message", "role": "user", "content": f"turn {n}: {half}"},
            {"type": "message", "role": "assistant", "id": f"msg_{n}",
             "content": [{"type": "output_text", "text": f"answer {n}: {half}", "annotations": []}]}]


async def converse(layout: str, backend: str, where: str, turns: int, turn_kb: int) -> dict:
    sqlite = backend == "sqlite"
    store = AsyncStore(turns + 1, 1e9, 1 << 42, backend=backend, path=where if sqlite else None,
                       dsn=where if backend == "postgres" else None)
    # `recent`: as `chain`, through the ingress's StoreClient keeping the records it stored (ingress/responses/
    # recent.py): the chain from memory, the store asked only whether the last record is visible.
    client = StoreClient(store, timeout_s=60, recent_bytes=64 << 20) if layout in ("recent", "reader") else store
    # `reader`: the chain read by a client that stored none of it (the Router), keeping what it reads.
    reader = StoreClient(store, timeout_s=60, recent_bytes=64 << 20) if layout == "reader" else client
    history: list[dict] = []
    reads, puts = [], []
    for n in range(turns):
        parent = f"resp_{n - 1}" if n else None
        t0 = time.perf_counter()
        if parent is not None:  # the follow-up's lookup (ingress/responses/api.py `_history`)
            if layout == "whole":
                got = (await store.get(parent))["items"]
            else:
                got = [item for record in await reader.chain(parent) for item in record["items"]]
            if got != history:
                raise AssertionError(f"{layout}: turn {n} read back a different history")
        t1 = time.perf_counter()
        items = turn_items(n, turn_kb)
        response = {"id": f"resp_{n}", "object": "response", "output": items[1:]}
        if layout == "whole":
            stored = await store.put(f"resp_{n}", {"response": response, "items": [*history, *items]})
        else:
            stored = await client.put(f"resp_{n}", {"response": response, "items": items}, parent)
        t2 = time.perf_counter()
        if not stored:
            raise AssertionError(f"{layout}: turn {n} was not stored")
        history += items
        reads.append(t1 - t0)
        puts.append(t2 - t1)
    held = store.core.bytes if backend == "memory" else await _bytes(store, backend)
    closed = getattr(store.core, "close", lambda: None)()
    if asyncio.iscoroutine(closed):
        await closed
    return {"reads": reads, "puts": puts, "bytes": held}


async def _bytes(store: AsyncStore, backend: str) -> int:
    """The byte total the caps are checked against (the totals row the triggers keep)."""
    if backend == "sqlite":
        return store.core._run(lambda db: db.execute("SELECT bytes FROM totals").fetchone()[0])
    from serve_app.ingress.responses.postgres_store import TABLE

    async def read(conn):
        return (await (await conn.execute(f"SELECT bytes FROM {TABLE}_totals")).fetchone())[0]

    return await store.core._run(read)


def summarize(result: dict, buckets: list[int], turns: int) -> dict:
    rows = []
    for lo, hi in zip(buckets, buckets[1:] + [turns]):
        if lo >= hi:
            continue
        rows.append({"turns": f"{lo + 1}-{hi}",
                     "history_read_ms": round(statistics.median(result["reads"][max(lo, 1):hi] or [0]) * 1e3, 3),
                     "put_ms": round(statistics.median(result["puts"][lo:hi]) * 1e3, 3)})
    return {"buckets": rows, "bytes_held": result["bytes"], "conversations_per_512mib": CAP // result["bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres", "memory"], default="sqlite")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--turn-kb", type=int, default=8, help="one turn's items (JSON, about): a question and answer")
    ap.add_argument("--buckets", type=int, nargs="+", default=[0, 10, 50, 100, 150, 190])
    ap.add_argument("--rounds", type=int, default=3, help="conversations per layout (each turn's median is reported)")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"whole": [], "chain": [], "recent": [], "reader": []}
    with databases("postgres" if args.backend == "postgres" else "sqlite", "store_chain_") as where:
        for r in range(args.rounds):  # the layouts alternate, each in a fresh store
            for layout in runs:
                runs[layout].append(asyncio.run(converse(layout, args.backend, where(f"{layout}{r}"), args.turns,
                                                         args.turn_kb)))
    out = {}
    for layout, results in runs.items():  # each turn's median over the rounds
        merged = {k: [statistics.median(times) for times in zip(*(res[k] for res in results))]
                  for k in ("reads", "puts")}
        out[layout] = summarize({**merged, "bytes": results[0]["bytes"]}, args.buckets, args.turns)
        print(layout, out[layout], flush=True)
    w, c, m = out["whole"], out["chain"], out["recent"]
    ratios = {"bytes_held_whole_over_chain": round(w["bytes_held"] / c["bytes_held"], 2),
              "last_bucket_put_whole_over_chain": round(w["buckets"][-1]["put_ms"] / c["buckets"][-1]["put_ms"], 2),
              "last_bucket_read_whole_over_chain": round(w["buckets"][-1]["history_read_ms"]
                                                         / c["buckets"][-1]["history_read_ms"], 2),
              "last_bucket_read_recent_over_chain": round(m["buckets"][-1]["history_read_ms"]
                                                          / c["buckets"][-1]["history_read_ms"], 3),
              "last_bucket_read_reader_over_chain": round(out["reader"]["buckets"][-1]["history_read_ms"]
                                                          / c["buckets"][-1]["history_read_ms"], 3),
              "last_bucket_put_recent_over_chain": round(m["buckets"][-1]["put_ms"] / c["buckets"][-1]["put_ms"], 2)}
    print(ratios)
    if args.json:
        provenance.write(args.json, {**provenance.header("load/probe_store_chain.py", sys.argv[1:]),
                                     "backend": args.backend, "turns": args.turns, "turn_kb": args.turn_kb,
                                     "rounds": args.rounds,
                                     **out, "ratios": ratios})


if __name__ == "__main__":
    main()
