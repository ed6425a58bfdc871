"""The event bus interface: topics of keyed records, consumer groups, commit after processing.

Two implementations pass one contract suite (tests/feedback/test_bus_contract.py): `EmbeddedBus`
(durable local logs, the default) and `KafkaBus` (a local spool forwarded to Kafka). A record's key is
its completion id, so a completion and its feedback stay in order in one partition. `publish_many`
returns once the records are durable on this machine, never waiting for a broker.

Called by the gateway (completion and feedback producers), the joiner and the learner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

MAX_KEY_BYTES = 1 << 12


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes


def check_name(kind: str, name: str) -> str:
    """A topic or group name: 1-200 characters of [A-Za-z0-9._-] (a ValueError naming it otherwise)."""
    if not isinstance(name, str) or not name or len(name) > 200 or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"{kind} name must be 1-200 characters of [A-Za-z0-9._-], got {name!r}")
    return name


def check_record(key: str, value: bytes) -> None:
    """What both buses accept as a record: a non-empty str key (under 4 KiB) and a bytes value."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty str (the completion id), got {key!r}")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"key must be at most {MAX_KEY_BYTES} bytes, got {len(key.encode())}")
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"value must be bytes, got {type(value).__name__}")


def topic_list(topics: str | Sequence[str]) -> tuple[str, ...]:
    """`consumer()`'s topics argument as a tuple: one name or several distinct names."""
    out = (topics,) if isinstance(topics, str) else tuple(topics)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"topics must be one topic name or several distinct names, got {topics!r}")
    for t in out:
        check_name("topic", t)
    return out


class Consumer(ABC):
    """One member of a consumer group on one or more topics. A member of several topics (of equal
    partition counts) gets the same partition numbers of each: the joiner relies on this to meet a
    completion and its feedback."""

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
    def ends(self) -> dict[tuple[str, int], int] | None:
        """Per (topic, partition) this member owns: the offset the next record written there will get,
        asked of the bus now. Every record the bus acknowledged before this call lies below it. None
        when the bus cannot say (its broker unreachable)."""

    @abstractmethod
    def positions(self) -> dict[tuple[str, int], int] | None:
        """Per (topic, partition) this member owns: the offset of the next record `poll` returns; None
        when the bus cannot say."""

    def reached(self, ends: dict[tuple[str, int], int] | None) -> bool:
        """This member has read everything below `ends` in the partitions it still owns (False when
        either is unknown). An empty poll does not say so: a Kafka client's fetch may be on its way."""
        here = self.positions()
        if ends is None or here is None:
            return False
        return all(here.get(tp, 0) >= end for tp, end in ends.items() if tp in here)

    @abstractmethod
    def close(self) -> None:
        """Leave the group (uncommitted records are redelivered to the group later)."""

    def _positions(self, records: list[Record]) -> dict[tuple[str, int], int]:
        """Position after the last of `records` per (topic, partition); ValueError for a foreign topic."""
        positions: dict[tuple[str, int], int] = {}
        for r in records:
            if r.topic not in self.topics:
                raise ValueError(f"record of topic {r.topic!r} committed on a consumer of {list(self.topics)}")
            key = (r.topic, r.partition)
            positions[key] = max(positions.get(key, 0), r.offset + 1)
        return positions


class EventBus(ABC):
    def publish(self, topic: str, key: str, value: bytes) -> None:
        """Durably accept one record."""
        self.publish_many(topic, [(key, value)])

    @abstractmethod
    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """Durably accept several (key, value) records; per-key order is the list's order. Every
        record is checked first: one bad record raises ValueError and none is written."""

    @abstractmethod
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything published so far is on the broker (a no-op where there is none)."""

    def pending_since(self) -> float | None:
        """The wall time the oldest record published here and not yet on the bus was published, None
        when there is none (a bus that writes synchronously never has one). A producer's watermark."""
        return None

    @abstractmethod
    def consumer(self, topics: str | Sequence[str], group: str) -> Consumer:
        """Join `group` on one topic or several co-partitioned ones (see `Consumer`)."""

    @abstractmethod
    def close(self) -> None:
        """Flush what can be flushed and release resources."""
