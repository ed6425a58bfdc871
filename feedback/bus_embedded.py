"""The embedded event bus: durable local logs with Kafka's semantics, for one machine and no server.

Owns `<folder>/bus.json` (format version, partition count), `<folder>/<topic>/p<N>/` (one `DurableLog`
per partition: partition offsets are log offsets) and `<folder>/_groups/<group>--<topic>.json`
(committed positions, replaced atomically). A record goes to partition `crc32(key) % partitions`,
stored as `[u16 key length][key][value]`. Consumers of one group in this process split the partitions
round-robin (rebalanced when one joins or leaves). `publish_many()` returns once its records are fsynced.

Called by the gateway, the joiner and the learner when `FLYWHEEL_BUS=embedded` (the default).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from core.files import atomic_write
from feedback.bus import Consumer, EventBus, Record, check_name, check_record, topic_list
from feedback.log import DurableLog

FORMAT_VERSION = 1
DEFAULT_PARTITIONS = 4
MAX_PARTITIONS = 1024
_KEY_LEN = struct.Struct("<H")


def partition_for(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % partitions


class EmbeddedBus(EventBus):
    def __init__(self, folder: str | Path, partitions: int = DEFAULT_PARTITIONS, fsync: bool = True):
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, got {partitions}")
        self.folder = Path(folder)
        self.partitions, self.fsync = partitions, fsync
        self._logs: dict[tuple[str, int], DurableLog] = {}
        self._lock = threading.Lock()
        self._new_data = threading.Condition(self._lock)
        self._members: dict[tuple[str, str], list[EmbeddedConsumer]] = {}
        self._closed = False
        (self.folder / "_groups").mkdir(parents=True, exist_ok=True)
        self._check_layout()

    def _check_layout(self) -> None:
        meta = self.folder / "bus.json"
        if not meta.is_file():
            atomic_write(meta, json.dumps({"version": FORMAT_VERSION, "partitions": self.partitions}), self.fsync)
            return
        stored = json.loads(meta.read_text())
        if stored.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta}: bus format version {stored.get('version')!r}, this build reads {FORMAT_VERSION}")
        if stored["partitions"] != self.partitions:
            n = stored["partitions"]
            raise ValueError(f"{self.folder} was made with {n} partitions, not {self.partitions} (open it with {n})")

    def _log(self, topic: str, p: int) -> DurableLog:
        with self._lock:
            if self._closed:
                raise RuntimeError("bus is closed")
            log = self._logs.get((topic, p))
            if log is None:
                log = self._logs[(topic, p)] = DurableLog(self.folder / topic / f"p{p}", fsync=self.fsync)
            return log

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """One append (one write, one fsync) per partition the records fall in."""
        if self._closed:
            raise RuntimeError("bus is closed")
        check_name("topic", topic)
        per_partition: dict[int, list[bytes]] = {}
        for key, value in records:
            check_record(key, value)
            kb = key.encode()
            frames = per_partition.setdefault(partition_for(key, self.partitions), [])
            frames.append(_KEY_LEN.pack(len(kb)) + kb + bytes(value))
        for p, payloads in sorted(per_partition.items()):
            self._log(topic, p).append(payloads)
        with self._new_data:
            self._new_data.notify_all()

    def flush(self, timeout_s: float = 30.0) -> None:
        return None  # every publish is durable when it returns

    def consumer(self, topics: str | Sequence[str], group: str) -> EmbeddedConsumer:
        names = topic_list(topics)
        check_name("group", group)
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

    def _positions_path(self, topic: str, group: str) -> Path:
        return self.folder / "_groups" / f"{group}--{topic}.json"

    def committed(self, topic: str, group: str) -> dict[int, int]:
        path = self._positions_path(topic, group)
        if not path.is_file():
            return {}
        return {int(p): o for p, o in json.loads(path.read_text())["positions"].items()}

    def _commit(self, topic: str, group: str, positions: dict[int, int]) -> None:
        with self._lock:
            current = self.committed(topic, group)
            for p, o in positions.items():
                current[p] = max(current.get(p, 0), o)
            body = {"version": FORMAT_VERSION, "positions": {str(p): o for p, o in sorted(current.items())}}
            atomic_write(self._positions_path(topic, group), json.dumps(body), self.fsync)

    def close(self) -> None:
        with self._lock:
            self._closed, logs, self._logs = True, list(self._logs.values()), {}
            self._new_data.notify_all()
        for log in logs:
            log.close()


class EmbeddedConsumer(Consumer):
    def __init__(self, bus: EmbeddedBus, topics: tuple[str, ...], group: str):
        self.bus, self.topics, self.group = bus, topics, group
        self._next: dict[tuple[str, int], int] = {}  # delivered-up-to position (not yet committed)
        self._turn = 0  # which assigned partition a poll reads first: none starves behind a busy one
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

    def ends(self) -> dict[tuple[str, int], int]:
        return {(t, p): self.bus._log(t, p).end_offset for t, p in self.bus._assigned(self)}

    def positions(self) -> dict[tuple[str, int], int]:
        out = {}
        for t, p in self.bus._assigned(self):
            start = self._next.get((t, p))
            out[(t, p)] = self.bus.committed(t, self.group).get(p, 0) if start is None else start
        return out

    def _read(self, max_records: int) -> list[Record]:
        if self.bus._closed:
            return []
        assigned = self.bus._assigned(self)
        for tp in list(self._next):
            if tp not in assigned:  # rebalanced away: its new owner starts from the committed position
                del self._next[tp]
        out: list[Record] = []
        self._turn = (self._turn + 1) % max(1, len(assigned))
        for topic, p in assigned[self._turn :] + assigned[: self._turn]:
            if len(out) >= max_records:
                break
            if (start := self._next.get((topic, p))) is None:  # newly assigned: from the committed position
                start = self.bus.committed(topic, self.group).get(p, 0)
            for off, payload in self.bus._log(topic, p).read(start, limit=max_records - len(out)):
                k = _KEY_LEN.size + _KEY_LEN.unpack_from(payload)[0]  # where the key ends
                out.append(Record(topic, p, off, payload[_KEY_LEN.size : k].decode(), payload[k:]))
                start = off + 1
            self._next[(topic, p)] = start
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
