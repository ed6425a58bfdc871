"""Where the gateway hands every completion record: the completion topic of the event bus, and the
completion index.

`record()` returns only once the record is durable on the bus and its id is in the index (when the
sink has one), and the gateway awaits it before it answers (or, when streaming, before
`data: [DONE]`), so nothing is served unrecorded and feedback on a served id is never refused as
unknown.

**Group commit.** One writer thread takes every record waiting when it is free and writes them
together: one `publish_many` (one append and one fsync per partition touched, rather than one per
record) and one index insert. Under concurrent load a batch fills while the previous one is being
fsynced, so the cost per record falls with the load and an idle gateway adds no wait. Each caller is
answered once *its* batch is durable; a batch that fails fails every caller in it (each answers 503,
the gateway's rule for an unrecorded completion). Called by `api/`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable

from feedback.bus import EventBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, CompletionEvent

log = logging.getLogger(__name__)
MAX_BATCH = 512


class SinkClosed(RuntimeError):
    """The sink was closed: the record was not written."""


class CompletionSink:
    """Completion records published to `TOPICS["completion"]`, keyed by completion id, and added to
    `index` (if given) after they are on the bus. The sink owns its writer thread, not the bus or the
    index: whoever made them closes them (after the sink)."""

    def __init__(
        self,
        bus: EventBus,
        index: CompletionIndex | None = None,
        max_batch: int = MAX_BATCH,
        on_batch: Callable[[int], object] | None = None,
    ):
        """`on_batch(n)` is called on the writer thread after each batch of `n` records is written."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        self.bus, self.index, self.max_batch, self.on_batch = bus, index, max_batch, on_batch
        self._queue: deque[tuple[CompletionEvent, bytes, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0  # written batches (and records, below): how well group commit groups
        self.records = 0
        self._thread = threading.Thread(target=self._writer, name="completion-sink", daemon=True)
        self._thread.start()

    async def record(self, event: CompletionEvent) -> None:
        value = event.model_dump_json().encode()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cond:
            if self._closed:
                raise SinkClosed("the completion sink is closed")
            self._queue.append((event, value, fut, loop))
            self._cond.notify()
        await fut

    def _writer(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                n = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
            error: BaseException | None = None
            try:
                self.bus.publish_many(TOPICS["completion"], [(ev.completion_id, value) for ev, value, _, _ in batch])
                if self.index is not None:
                    self.index.add_many(
                        [(ev.completion_id, ev.tenant, ev.model_version, ev.ts, ev.user_id, ev.arm) for ev, *_ in batch]
                    )
                self.batches += 1
                self.records += len(batch)
            except Exception as e:  # every caller in the batch answers that it was not recorded
                log.error("completion sink: a batch of %d records was not written: %r", len(batch), e)
                error = e
            if error is None and self.on_batch is not None:
                try:
                    self.on_batch(len(batch))
                except Exception:  # a metric: never fails the records, which are written
                    log.exception("completion sink: on_batch failed")
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
            for _, _, fut, loop in batch:
                by_loop.setdefault(loop, []).append(fut)
            for loop, futs in by_loop.items():  # one wake-up of each caller's loop per batch
                try:
                    loop.call_soon_threadsafe(_settle, futs, error)
                except RuntimeError:  # that loop is closed: nobody waits for those answers
                    pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer; later `record` calls raise `SinkClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)


def _settle(futs: list[asyncio.Future], error: BaseException | None) -> None:
    for fut in futs:
        if fut.done():  # the caller was cancelled (its client went away): the record is written anyway
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
