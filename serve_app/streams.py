"""A read-ahead buffer between an async stream and a consumer that may fall behind.

`Pump` reads its source in a task of its own. A consumer that keeps up gets one item per read, exactly as if it
read the source itself; one that falls behind gets everything produced since its last read in one batch, so it
pays its per-read costs (parse, frame, send across a process boundary) once per batch instead of once per item.
There is no timer: batching happens only when the consumer lags, so latency at low load is unchanged.

Used by SSE keep-alive (events framed into one write); engine deltas get the same treatment from their inbox
(serve_app/engine/delta_channel.py). Closing the pump cancels the read in flight and closes the source, so a
client disconnect still aborts the engine request.
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Generic, TypeVar

T = TypeVar("T")


class Pump(Generic[T]):
    def __init__(self, source: AsyncIterator[T]):
        self._source = source
        self._it = source.__aiter__()
        self._buf: list[T] = []
        self._done = False
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # The keep-alive timeout: one timer per stream that moves its own deadline, not one per wait (a wait per
        # streamed token: scheduling and cancelling a timer each time was a tenth of the ingress's loop).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = False

    async def _run(self) -> None:
        try:
            while True:
                item = await self._it.__anext__()
                self._buf.append(item)
                self._wake.set()
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer after the items before it
            self._error = e
        finally:
            self._done = True
            self._wake.set()

    async def next_batch(self, timeout: float | None = None) -> list[T]:
        """Every item read since the last call (at least one), waiting for one if there is none.

        Returns [] when `timeout` seconds pass with nothing read; raises StopAsyncIteration at the end, and the
        source's exception once the items read before it have been returned.
        """
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        if not self._buf and not self._done:
            self._wake.clear()
            self._arm(timeout)
            self._waiting = True
            try:
                await self._wake.wait()
            finally:
                self._waiting = False
        if self._buf:
            batch, self._buf = self._buf, []
            return batch
        if self._done:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopAsyncIteration
        return []  # timed out

    def _arm(self, timeout: float | None) -> None:
        if timeout is None:  # this wait has no deadline: a timer left from an earlier wait must not end it
            self._deadline = math.inf
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        """The timer's time came: wake a waiter whose deadline has passed; one whose deadline moved since the timer
        was set waits on, with the timer set again for it. With no one waiting the timer is dropped (the next
        wait sets one)."""
        self._timer = None
        if not self._waiting or self._deadline == math.inf:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self._deadline:
            self._wake.set()
        else:
            self._timer = loop.call_at(self._deadline, self._expire)

    def drain(self) -> list[T]:
        """The items read so far, without waiting (an error or the end is left for `next_batch`)."""
        batch, self._buf = self._buf, []
        return batch

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: the error has nowhere to go
                pass
        self._done = True
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except (RuntimeError, Exception):  # noqa: BLE001 - already closed, or closing failed on its own
                pass
