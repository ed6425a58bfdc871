"""Where the gateway hands every completion record: the completion topic of the event bus.

`record()` returns only once the record is durable, and the gateway awaits it before it answers (or,
when streaming, before `data: [DONE]`), so nothing is served unrecorded. Called by `api/`.
"""

from __future__ import annotations

import asyncio

from feedback.bus import EventBus
from feedback.events import TOPICS, CompletionEvent


class CompletionSink:
    """Completion records published to `TOPICS["completion"]`, keyed by completion id. The sink does
    not own the bus: whoever made the bus closes it."""

    def __init__(self, bus: EventBus):
        self.bus = bus

    async def record(self, event: CompletionEvent) -> None:
        # The publish blocks until the disk has the record: on a worker thread, the loop keeps serving.
        value = event.model_dump_json().encode()
        await asyncio.to_thread(self.bus.publish, TOPICS["completion"], event.completion_id, value)

    def close(self) -> None: ...  # nothing of its own to release
