"""The feedback client for asyncio code: `FeedbackClient`'s arguments and calls, `flush` and `close` awaited.

Calls queue as `FeedbackClient`'s do (no I/O); `await flush()` / `aclose()` wait in a worker thread.
Events are sent by the client's background thread, not by the event loop.
Unclosed at interpreter exit, it sends what is queued, as `FeedbackClient` does.
"""

from __future__ import annotations

import asyncio

from feedback.sdk.client import _Client


class AsyncFeedbackClient(_Client):
    async def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far; True once it is all delivered or given up, False on timeout."""
        return await asyncio.to_thread(self._flush, timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop taking events, send what is queued (for up to `timeout` s), then give up the rest."""
        await asyncio.to_thread(self._close, timeout)

    async def __aenter__(self) -> AsyncFeedbackClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
