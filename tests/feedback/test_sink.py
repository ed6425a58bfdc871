"""The completion sink's group commit: concurrent records share one bus append and one index insert,
each caller returns only once its record is on the bus and in the index, a failed batch fails every
caller in it (and only them), and a closed sink writes what it holds, then refuses."""

from __future__ import annotations

import asyncio
import threading

import pytest

from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, CompletionEvent
from feedback.sink import CompletionSink, SinkClosed
from tests.feedback.conftest import completion_event


class HeldBus(EmbeddedBus):
    """The embedded bus, whose first `publish_many` waits for `release` (so records queue behind it)
    and whose appends can be made to fail (`fail_next`: an OSError, as a full disk would raise)."""

    def __init__(self, folder):
        super().__init__(folder)
        self.entered, self.release = threading.Event(), threading.Event()
        self.fail_next = False
        self.calls: list[int] = []

    def publish_many(self, topic, records):
        self.calls.append(len(records))
        self.entered.set()
        self.release.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise OSError(28, "No space left on device")
        super().publish_many(topic, records)


def event(i: int) -> CompletionEvent:
    return completion_event(i, user_id=f"u{i % 3}")


def on_bus(bus, n: int) -> dict[str, CompletionEvent]:
    c = bus.consumer(TOPICS["completion"], "check")
    got: dict[str, CompletionEvent] = {}
    for _ in range(100):
        for r in c.poll(max_records=1000, timeout_s=0.1):
            got[r.key] = CompletionEvent.model_validate_json(r.value)
        if len(got) >= n:
            break
    c.close()
    return got


@pytest.fixture
def parts(tmp_path):
    bus, index = HeldBus(tmp_path / "bus"), CompletionIndex(tmp_path / "index.db")
    sink = CompletionSink(bus, index)
    yield bus, index, sink
    bus.release.set()
    sink.close()
    index.close()
    bus.close()


def test_records_waiting_behind_a_write_go_in_one_batch_and_each_caller_returns_once_it_is_durable(parts):
    bus, index, sink = parts
    events = [event(i) for i in range(200)]

    async def main():
        first = asyncio.create_task(sink.record(events[0]))
        await asyncio.to_thread(bus.entered.wait, 30)  # the writer holds the first record
        rest = [asyncio.create_task(sink.record(e)) for e in events[1:]]
        await asyncio.sleep(0.2)
        assert not first.done() and not any(t.done() for t in rest)  # nobody answered before the write
        bus.release.set()
        await asyncio.gather(first, *rest)

    asyncio.run(main())
    assert bus.calls == [1, 199]  # the 199 that queued behind the first write went as one batch
    assert sink.batches == 2 and sink.records == 200
    assert on_bus(bus, 200) == {e.completion_id: e for e in events}
    rows = index.get_many([e.completion_id for e in events])
    assert {cid: (r.tenant, r.user_id) for cid, r in rows.items()} == {
        e.completion_id: ("acme", e.user_id) for e in events
    }


def test_a_failed_batch_fails_every_caller_in_it_and_the_next_batch_is_written(parts):
    bus, index, sink = parts
    bus.fail_next = True
    bus.release.set()

    async def main():
        with pytest.raises(OSError, match="No space left"):
            await sink.record(event(0))
        await sink.record(event(1))

    asyncio.run(main())
    assert set(on_bus(bus, 1)) == {"cmpl-1"}
    assert index.get("cmpl-0") is None and index.get("cmpl-1") is not None


def test_a_closed_sink_writes_what_it_holds_then_refuses(parts):
    bus, index, sink = parts

    async def main():
        held = asyncio.create_task(sink.record(event(0)))
        await asyncio.to_thread(bus.entered.wait, 30)
        queued = asyncio.create_task(sink.record(event(1)))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(asyncio.to_thread(sink.close))
        await asyncio.sleep(0.05)
        bus.release.set()
        await asyncio.gather(held, queued, closing)
        with pytest.raises(SinkClosed):
            await sink.record(event(2))

    asyncio.run(main())
    assert set(on_bus(bus, 2)) == {"cmpl-0", "cmpl-1"}


def test_max_batch_must_be_positive(tmp_path):
    bus = EmbeddedBus(tmp_path / "bus")
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        CompletionSink(bus, max_batch=0)
    bus.close()
