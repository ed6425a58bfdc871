"""The feedback client for asyncio products: `FeedbackClient`'s arguments and calls, sent by an asyncio task.

The calls are plain synchronous methods, to be called from the event loop's thread; the first starts
the sender task on the running loop. `await flush()` sends what is queued, `await aclose()` sends it
and stops. Unclosed at interpreter exit, the client cannot await its sends: it logs what it leaves.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from feedback.sdk.client import _LIVE, ClientClosedError, _body, _Client, log


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class AsyncFeedbackClient(_Client):
    def _reset(self) -> None:
        super()._reset()
        self._wake, self._progress, self._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def _start(self) -> asyncio.Task:
        loop = asyncio.get_running_loop()  # RuntimeError outside a loop: the async client needs one
        return loop.create_task(self._run(), name="flywheel-feedback")

    async def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far; True once it is all delivered or given up, False on timeout."""
        if self._sender is None:
            return True
        target = self._flush_to = max(self._flush_to, self._enqueued)
        self._wake.set()
        try:
            async with asyncio.timeout(timeout):
                while self._resolved < target:
                    if self._dead is not None:
                        raise RuntimeError("the feedback sender died") from self._dead
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop taking events, send what is queued (for up to `timeout` s), then give up the rest."""
        self._closed = True
        _LIVE.discard(self)
        if self._sender is None:
            return
        self._wake.set()
        done, _ = await asyncio.wait({self._sender}, timeout=timeout)
        if not done:
            self._stop.set()
            await asyncio.wait({self._sender}, timeout=self.timeout_s + 1.0)

    async def __aenter__(self) -> AsyncFeedbackClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def close_at_exit(self, timeout: float) -> None:
        if self.pending:
            log.warning("feedback: AsyncFeedbackClient not closed at exit; %d event(s) not sent", self.pending)

    async def _run(self) -> None:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as http:
                while batch := await self._next_batch():
                    await self._deliver(http, batch)
                    self._resolved += len(batch)
                    self._progress.set()
        except BaseException as e:  # a bug, or the loop cancelling the task
            self._dead = e
            self._progress.set()
            if not isinstance(e, Exception):
                raise
            log.exception("feedback sender task died")

    async def _next_batch(self) -> list[dict]:
        while True:
            self._wake.clear()
            due = self._due()
            if isinstance(due, list):
                return due
            await _wait(self._wake, due)

    async def _deliver(self, http: httpx.AsyncClient, events: list[dict]) -> None:
        attempt = 0
        while events and not self._stop.is_set():
            try:
                outcome: httpx.Response | Exception = await http.post(self.url, content=_body(events))
            except httpx.TransportError as e:  # retried at the I/O boundary
                outcome = e
            events, attempt, delay = self._after(events, attempt, outcome)
            if delay:
                await _wait(self._stop, delay)
        if events:
            self._give_up(events, ClientClosedError("closed before these events could be sent"))
