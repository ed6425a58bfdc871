"""Where the gateway hands every completion record: a small interface and its embedded default.

`record()` returns only once the record is durable, and the gateway awaits it before it answers
(or, when streaming, before `data: [DONE]`), so nothing is served unrecorded. `LogSink` keeps
records in a local log; `BusSink` publishes them to the completion topic of an event bus (Kafka
through its spool, or the embedded bus). Called by `api/`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from pathlib import Path

from feedback.bus import EventBus
from feedback.events import TOPICS, CompletionEvent
from feedback.log import DurableLog


class CompletionSink(ABC):
    @abstractmethod
    async def record(self, event: CompletionEvent) -> None:
        """Persist one completion record; returns once it is durable."""

    def close(self) -> None:
        """Flush and release resources."""


class LogSink(CompletionSink):
    """Completion records in a local durable log (group-committed, fsynced) under `folder`."""

    def __init__(self, folder: str | Path):
        self.log = DurableLog(Path(folder) / TOPICS["completion"])

    async def record(self, event: CompletionEvent) -> None:
        await asyncio.wrap_future(self.log.append_async([event.model_dump_json().encode()]))

    def read_all(self) -> list[CompletionEvent]:
        return [CompletionEvent.model_validate_json(p) for _, p in self.log.read()]

    def close(self) -> None:
        self.log.close()


class BusSink(CompletionSink):
    """Completion records published to `TOPICS["completion"]`, keyed by completion id.

    `publish()` returns once the record is durable (fsynced to the bus's log or spool); it blocks,
    so it runs in a worker thread to keep the event loop serving. The sink does not own the bus:
    whoever made the bus closes it.
    """

    def __init__(self, bus: EventBus):
        self.bus = bus

    async def record(self, event: CompletionEvent) -> None:
        await asyncio.to_thread(self.bus.publish, TOPICS["completion"], event.completion_id,
                                event.model_dump_json().encode())
