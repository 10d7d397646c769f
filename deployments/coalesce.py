"""Groups a request's token deltas into fewer chunks: every chunk that crosses Serve costs a Ray
message, so under load we send what accumulated in a short window, but never delay the first."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, List, TypeVar, Union

T = TypeVar("T")


async def coalesce(
    deltas: AsyncIterator[T], interval_s: Union[float, Callable[[], float]], is_last=lambda d: False
) -> AsyncIterator[List[T]]:
    """Yields lists of deltas: the first delta alone and at once; later ones are held until
    `interval_s` (a number, or a function read at each chunk) has passed since the previous yield;
    a delta arriving later than that goes out at once. Closing this generator closes `deltas`
    (which aborts the engine request)."""
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    it = deltas.__aiter__()
    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None
    try:
        first = await it.__anext__()
        yield [first]
        if is_last(first):
            return
        last_yield, batch, window = loop.time(), [], interval()
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            timeout = None if not batch else max(0.0, last_yield + window - loop.time())
            done, _ = await asyncio.wait((pending,), timeout=timeout)
            if done:
                fut, pending = pending, None
                try:
                    delta = fut.result()
                except StopAsyncIteration:
                    break
                batch.append(delta)
                if is_last(delta):
                    break
            if batch and loop.time() - last_yield >= window:
                yield batch
                last_yield, batch, window = loop.time(), [], interval()
        if batch:
            yield batch
    except StopAsyncIteration:  # the source ended before its first delta
        return
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):
                pass
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
