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

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes


class Consumer(ABC):
    """One member of a consumer group on one topic."""

    @abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Records after the group's committed position (in order within a partition)."""

    @abstractmethod
    def commit(self, records: list[Record]) -> None:
        """Mark `records` (and everything before them in their partitions) processed for the group."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group (uncommitted records are redelivered to the group later)."""


class EventBus(ABC):
    @abstractmethod
    def publish(self, topic: str, key: str, value: bytes) -> None:
        """Durably accept one record (to the broker, or to the local spool while it is down)."""

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """Durably accept several (key, value) records with one write where the bus allows it
        (one fsync per batch instead of one per record). Per-key order is the list's order."""
        for key, value in records:
            self.publish(topic, key, value)

    @abstractmethod
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything published so far is on the broker."""

    @abstractmethod
    def consumer(self, topic: str, group: str) -> Consumer:
        """Join `group` on `topic`."""

    @abstractmethod
    def close(self) -> None:
        """Flush what can be flushed and release resources."""
