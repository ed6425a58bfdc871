"""The event bus interface: topics of keyed records, consumer groups, commit after processing.

Two implementations pass one contract suite (tests/feedback/test_bus_contract.py):
`feedback.bus_embedded.EmbeddedBus` (durable local logs, the default, no server) and
`feedback.bus_kafka.KafkaBus` (kafka-python: acks=all idempotent producer, consumer groups,
topics partitioned by key = completion id). Producers never block the caller on a broker outage:
`feedback.spool` keeps what could not be delivered on local disk and delivers it, in order per key,
when the broker is back. Consumers drop event ids they have already processed.

Called by the gateway (completion and feedback producers), the joiner and the learner.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from feedback.log import settle


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes


def all_of(futures: list[Future], then=None) -> Future:
    """A future that resolves once every one of `futures` did: to None, after calling `then()` (in
    the thread that finished the last one), or to the first error among them (`then` not called)."""
    out: Future = Future()
    left = [len(futures) + 1]  # + 1: this call's own turn, so an empty list resolves too
    lock = threading.Lock()

    def one_done(_: Future | None) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            settle(out, error=errors[0])
            return
        try:
            if then is not None:
                then()
        except BaseException as e:
            settle(out, error=e)
        else:
            settle(out)

    for f in futures:
        f.add_done_callback(one_done)
    one_done(None)
    return out


def topic_list(topics: str | Sequence[str]) -> tuple[str, ...]:
    """`consumer()`'s topics argument as a tuple: one name or several distinct names."""
    out = (topics,) if isinstance(topics, str) else tuple(topics)
    if not out or len(set(out)) != len(out) or not all(isinstance(t, str) for t in out):
        raise ValueError(f"topics must be one topic name or several distinct names, got {topics!r}")
    return out


class Consumer(ABC):
    """One member of a consumer group on one or more topics.

    A member subscribed to several topics gets the same partition numbers of each (the topics must
    have equal partition counts): records keyed alike on different topics meet in one member. The
    joiner relies on this for a completion and its feedback.
    """

    topics: tuple[str, ...]

    @abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Records after the group's committed position (in order within a partition)."""

    @abstractmethod
    def commit(self, records: list[Record]) -> None:
        """Mark `records` (and everything before them in their partitions) processed for the group."""

    @abstractmethod
    def assignment(self) -> list[tuple[str, int]]:
        """(topic, partition) pairs this member owns now, sorted; empty until the group has settled.
        It changes only inside `poll()`."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group (uncommitted records are redelivered to the group later)."""

    def _positions(self, records: list[Record]) -> dict[tuple[str, int], int]:
        """Position after the last of `records` per (topic, partition); a ValueError for a topic
        this member does not consume."""
        positions: dict[tuple[str, int], int] = {}
        for r in records:
            if r.topic not in self.topics:
                raise ValueError(f"record of topic {r.topic!r} committed on a consumer of {list(self.topics)}")
            key = (r.topic, r.partition)
            positions[key] = max(positions.get(key, 0), r.offset + 1)
        return positions


class EventBus(ABC):
    @abstractmethod
    def publish(self, topic: str, key: str, value: bytes) -> None:
        """Durably accept one record (to the broker, or to the local spool while it is down)."""

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """Durably accept several (key, value) records with one write where the bus allows it
        (one fsync per batch instead of one per record). Per-key order is the list's order."""
        for key, value in records:
            self.publish(topic, key, value)

    def publish_many_async(self, topic: str, records: list[tuple[str, bytes]]) -> Future:
        """`publish_many` without waiting: bad records raise ValueError at once (nothing is written);
        the future resolves (to None) once every record is durable, or to the write's error. For
        callers that must not park a thread while the disk syncs (the gateway's event loop awaits it
        with `asyncio.wrap_future`). This default writes before it returns."""
        fut: Future = Future()
        self.publish_many(topic, records)
        fut.set_result(None)
        return fut

    def publish_many_now(self, topic: str, records: list[tuple[str, bytes]]) -> bool:
        """Publish on the caller's thread if that costs no wait behind other writes: True once every
        record is durable; False, with nothing written, where the caller should use
        `publish_many_async` (a write of the bus's writer thread is under way, or the bus writes no
        local log of its own). Bad records raise ValueError first (nothing written), as
        `publish_many_async` would. This default: False."""
        return False

    @abstractmethod
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything published so far is on the broker."""

    @abstractmethod
    def consumer(self, topics: str | Sequence[str], group: str) -> Consumer:
        """Join `group` on one topic or several co-partitioned ones (see `Consumer`)."""

    @abstractmethod
    def close(self) -> None:
        """Flush what can be flushed and release resources."""


def open_bus(settings) -> EventBus:
    """The configured event bus (`core.settings.Settings`): the embedded durable log, or Kafka
    (kafka-python imported only when asked for). Used by every process's entry point."""
    if settings.bus == "kafka":
        from feedback.bus_kafka import KafkaBus
        return KafkaBus(settings.kafka_bootstrap, spool_dir=settings.home / "spool")
    from feedback.bus_embedded import EmbeddedBus
    return EmbeddedBus(settings.home / "bus")
