"""A task that keeps an event loop busy the way a loop streaming many responses is: bursts of Python work with an
`await asyncio.sleep(0)` between them. The probes of a thread's wait for the GIL beside such a loop share it
(probe_render_wait.py, probe_store_wait.py)."""

from __future__ import annotations

import asyncio
import time


class BusyLoop:
    """`async with BusyLoop(n) as busy:` runs the bursts (n Python loop iterations each) until the block ends;
    `busy.rate()` is the bursts per second since `busy.mark()` (how much the loop itself got done)."""

    def __init__(self, burst_iterations: int):
        self.burst_iterations = burst_iterations
        self.bursts = 0
        self._since = time.perf_counter()
        self._stop = False
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while not self._stop:
            x = 0
            for i in range(self.burst_iterations):
                x += i
            self.bursts += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> "BusyLoop":
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0.05)  # running before the measured work is submitted
        self.mark()
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop = True
        await self._task

    def mark(self) -> None:
        self.bursts, self._since = 0, time.perf_counter()

    def rate(self) -> int:
        return round(self.bursts / (time.perf_counter() - self._since))
