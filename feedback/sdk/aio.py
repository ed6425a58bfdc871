"""The feedback client for asyncio products: the same calls as `FeedbackClient`, sent by an asyncio task.

`AsyncFeedbackClient(base_url, ...)` takes the same arguments. The calls (`thumbs_up`, `rating`, …,
`send`) are plain synchronous methods — validate, key, append to a bounded deque — to be called from
the event loop's thread; the first one starts the sender task on the running loop. `await flush()`
sends what is queued; `await aclose()` sends it and stops. Batching, retries, idempotency and
`on_error` behave exactly as in `feedback.sdk.client` (shared code). An unclosed client at
interpreter exit cannot await its sends: it logs how many events it leaves behind.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httpx

from feedback.sdk.client import (_LIVE, ClientClosedError, ClientConfig, Delivery, FeedbackCalls,
                                 FeedbackError, OnError, QueueFullError, log)


class AsyncFeedbackClient(FeedbackCalls):
    def __init__(self, base_url: str, api_key: str | None = None, tenant: str | None = None,
                 batch_size: int = 100, flush_interval_s: float = 1.0, max_queue: int = 10_000,
                 max_retries: int = 8, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 timeout_s: float = 10.0, on_error: OnError | None = None):
        self.cfg = ClientConfig(base_url, api_key, tenant, batch_size, flush_interval_s, max_queue,
                                max_retries, backoff_s, max_backoff_s, timeout_s, on_error)
        self._closed = False
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        self._queue: deque[tuple[float, dict]] = deque()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._progress: asyncio.Event | None = None
        self._stop = False
        self._enqueued = self._resolved = self._flush_to = 0
        self._dropped = self._sent = self._failed = 0

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def failed(self) -> int:
        return self._failed

    @property
    def pending(self) -> int:
        return self._enqueued - self._resolved

    def _enqueue(self, event: dict) -> str | None:
        if self._closed or (self._task is not None and self._task.done()):
            err: FeedbackError = ClientClosedError("the feedback client is closed")
        elif len(self._queue) >= self.cfg.max_queue:
            err = QueueFullError(f"the feedback queue holds {self.cfg.max_queue} events; event dropped")
        else:
            self._queue.append((time.monotonic(), event))
            self._enqueued += 1
            if self._task is None:
                self._start()
            elif len(self._queue) == self.cfg.batch_size:
                self._wake.set()  # type: ignore[union-attr]
            return event["idempotency_key"]
        self._dropped += 1
        self.cfg.report(err, [event])
        return None

    def _start(self) -> None:
        loop = asyncio.get_running_loop()  # RuntimeError outside a loop: the async client needs one
        self._wake, self._progress = asyncio.Event(), asyncio.Event()
        self._task = loop.create_task(self._run(), name="flywheel-feedback")
        self._task.add_done_callback(_log_death)

    async def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far; True once it is all delivered or given up, False on timeout."""
        if self._task is None:
            return True
        target = self._flush_to = max(self._flush_to, self._enqueued)
        self._wake.set()  # type: ignore[union-attr]
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._resolved < target:
            if self._task.done():
                raise RuntimeError("the feedback sender task ended") from self._task.exception()
            self._progress.clear()  # type: ignore[union-attr]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                wait = self._progress.wait()  # type: ignore[union-attr]
                await asyncio.wait_for(wait, 0.5 if left is None else min(left, 0.5))
            except TimeoutError:
                continue
        return True

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop taking events, send what is queued (for up to `timeout` s), then give up the rest."""
        self._closed = True
        _LIVE.discard(self)
        if self._task is None:
            return
        self._wake.set()  # type: ignore[union-attr]
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            self._stop = True
            self._wake.set()  # type: ignore[union-attr]
            await asyncio.wait({self._task}, timeout=self.cfg.timeout_s + 1.0)

    async def __aenter__(self) -> "AsyncFeedbackClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def close_at_exit(self, timeout: float) -> None:
        if self.pending:
            log.warning("feedback: AsyncFeedbackClient not closed at exit; %d event(s) not sent",
                        self.pending)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s, headers=self.cfg.headers) as http:
            while (batch := await self._next_batch()) is not None:
                await self._deliver(http, batch)
                self._resolved += len(batch)
                self._progress.set()  # type: ignore[union-attr]

    async def _next_batch(self) -> list[dict] | None:
        cfg, q, wake = self.cfg, self._queue, self._wake
        assert wake is not None
        while True:
            wake.clear()
            timeout = None
            if not q:
                if self._closed:
                    return None
            else:
                age = time.monotonic() - q[0][0]
                if (len(q) >= cfg.batch_size or self._flush_to > self._resolved or self._closed
                        or age >= cfg.flush_interval_s):
                    return [q.popleft()[1] for _ in range(min(cfg.batch_size, len(q)))]
                timeout = cfg.flush_interval_s - age
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except TimeoutError:
                pass  # the oldest event is now due

    async def _deliver(self, http: httpx.AsyncClient, events: list[dict]) -> None:
        d = Delivery(self.cfg, events, self._give_up)
        while d.events:
            if self._stop:
                d.abandon()
                break
            try:
                delay = d.after(await http.post(self.cfg.url, content=d.body()))
            except httpx.TransportError as e:  # deliberate retry at the I/O boundary (Delivery logs it)
                delay = d.after(e)
            if delay:
                try:
                    await asyncio.wait_for(self._wait_stop(), delay)
                except TimeoutError:
                    pass  # the backoff ran out: retry
        self._sent += d.sent

    async def _wait_stop(self) -> None:
        while not self._stop:
            await self._wake.wait()  # type: ignore[union-attr]
            self._wake.clear()  # type: ignore[union-attr]

    def _give_up(self, events: list[dict], exc: BaseException) -> None:
        self._failed += len(events)
        self.cfg.report(exc, events)


def _log_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("feedback sender task died", exc_info=task.exception())
