"""The embedded event bus: durable local logs with Kafka's semantics, for one machine and no server.

Owns `<folder>/<topic>/p<N>/` (one `DurableLog` per partition) and `<folder>/_groups/` (committed
positions, one small JSON file per group and topic, replaced atomically). A record's partition is
`crc32(key) % partitions`, so all records of one key (one completion) stay in order in one
partition. Consumers of one group in this process split the partitions between them (round-robin
over the members, rebalanced when one joins or leaves; a member of several topics gets the same
partition numbers of each); `commit()` records the position after the
last processed record, and a consumer that closes without committing leaves its records to be
delivered again. `publish()` returns once the record is fsynced: there is no broker to be down.

Called by the gateway, the joiner and the learner when `FLYWHEEL_BUS=embedded` (the default).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from feedback.bus import Consumer, EventBus, Record, all_of, topic_list
from feedback.log import DurableLog

DEFAULT_PARTITIONS = 4


def partition_for(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % partitions


def _check_name(kind: str, name: str) -> str:
    if not name or len(name) > 200 or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"{kind} name must be 1-200 characters of [A-Za-z0-9._-], got {name!r}")
    return name


class EmbeddedBus(EventBus):
    def __init__(self, folder: str | Path, partitions: int = DEFAULT_PARTITIONS, fsync: bool = True):
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.folder = Path(folder)
        self.partitions, self.fsync = partitions, fsync
        self._logs: dict[tuple[str, int], DurableLog] = {}
        self._lock = threading.Lock()
        self._new_data = threading.Condition(self._lock)
        self._members: dict[tuple[str, str], list[EmbeddedConsumer]] = {}
        self._closed = False
        (self.folder / "_groups").mkdir(parents=True, exist_ok=True)

    def _log(self, topic: str, partition: int) -> DurableLog:
        with self._lock:
            log = self._logs.get((topic, partition))
            if log is None:
                log = DurableLog(self.folder / topic / f"p{partition}", fsync=self.fsync)
                self._logs[(topic, partition)] = log
            return log

    def publish(self, topic: str, key: str, value: bytes) -> None:
        self.publish_many(topic, [(key, value)])

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """One group-committed append (one fsync) per partition touched."""
        self.publish_many_async(topic, records).result(timeout=30)

    def publish_many_async(self, topic: str, records: list[tuple[str, bytes]]) -> Future:
        if self._closed:
            raise RuntimeError("bus is closed")
        _check_name("topic", topic)
        by_partition: dict[int, list[bytes]] = {}
        for key, value in records:
            if not isinstance(value, (bytes, bytearray)):
                raise ValueError(f"value must be bytes, got {type(value).__name__}")
            frame = json.dumps({"k": key}).encode() + b"\n" + bytes(value)
            by_partition.setdefault(partition_for(key, self.partitions), []).append(frame)
        return all_of([self._log(topic, p).append_async(frames) for p, frames in by_partition.items()],
                      then=self._wake_consumers)

    def _wake_consumers(self) -> None:
        with self._new_data:
            self._new_data.notify_all()

    def flush(self, timeout_s: float = 30.0) -> None:
        return None  # every publish is durable when it returns

    def consumer(self, topics: str | Sequence[str], group: str) -> EmbeddedConsumer:
        names = topic_list(topics)
        for t in names:
            _check_name("topic", t)
        _check_name("group", group)
        c = EmbeddedConsumer(self, names, group)
        with self._lock:
            for t in names:
                self._members.setdefault((t, group), []).append(c)
        return c

    def _assigned(self, c: EmbeddedConsumer) -> list[tuple[str, int]]:
        """Round-robin per topic over the members in joining order: members that consume the same
        topics get the same partition numbers of each."""
        out = []
        with self._lock:
            for t in c.topics:
                members = self._members.get((t, c.group), [])
                if c in members:
                    i, n = members.index(c), len(members)
                    out += [(t, p) for p in range(self.partitions) if p % n == i]
        return out

    def _leave(self, c: EmbeddedConsumer) -> None:
        with self._lock:
            for t in c.topics:
                members = self._members.get((t, c.group), [])
                if c in members:
                    members.remove(c)

    # ---- committed positions ------------------------------------------------------------
    def _positions_path(self, topic: str, group: str) -> Path:
        return self.folder / "_groups" / f"{group}--{topic}.json"

    def committed(self, topic: str, group: str) -> dict[int, int]:
        path = self._positions_path(topic, group)
        if not path.is_file():
            return {}
        return {int(p): o for p, o in json.loads(path.read_text()).items()}

    def _commit(self, topic: str, group: str, positions: dict[int, int]) -> None:
        with self._lock:
            current = self.committed(topic, group)
            for p, o in positions.items():
                current[p] = max(current.get(p, 0), o)
            path = self._positions_path(topic, group)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump({str(p): o for p, o in current.items()}, f)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            logs = list(self._logs.values())
            self._logs.clear()
            self._new_data.notify_all()
        for log in logs:
            log.close()


class EmbeddedConsumer(Consumer):
    def __init__(self, bus: EmbeddedBus, topics: tuple[str, ...], group: str):
        self.bus, self.topics, self.group = bus, topics, group
        self._next: dict[tuple[str, int], int] = {}  # delivered-up-to position (not yet committed)
        self._closed = False

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        if self._closed:
            raise RuntimeError("consumer is closed")
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._read(max_records)
            if out or time.monotonic() >= deadline or self.bus._closed:
                return out
            with self.bus._new_data:
                self.bus._new_data.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))

    def assignment(self) -> list[tuple[str, int]]:
        return sorted(self.bus._assigned(self))

    def _read(self, max_records: int) -> list[Record]:
        assigned = self.bus._assigned(self)
        for tp in list(self._next):
            if tp not in assigned:  # rebalanced away: its new owner starts from the committed position
                del self._next[tp]
        committed: dict[str, dict[int, int]] = {}  # read only for partitions not yet positioned
        out: list[Record] = []
        for topic, p in assigned:
            if len(out) >= max_records:
                break
            start = self._next.get((topic, p))
            if start is None:
                if topic not in committed:
                    committed[topic] = self.bus.committed(topic, self.group)
                start = committed[topic].get(p, 0)
            log = self.bus._log(topic, p)
            for off, frame in log.read(start, limit=max_records - len(out)):
                head, _, value = frame.partition(b"\n")
                out.append(Record(topic, p, off, json.loads(head)["k"], value))
                self._next[(topic, p)] = off + 1
        return out

    def commit(self, records: list[Record]) -> None:
        by_topic: dict[str, dict[int, int]] = {}
        for (topic, p), o in self._positions(records).items():
            by_topic.setdefault(topic, {})[p] = o
        for topic, positions in by_topic.items():
            self.bus._commit(topic, self.group, positions)

    def close(self) -> None:
        self._closed = True
        self.bus._leave(self)
