"""The joiner: attributes feedback to completions and publishes one `SampleEvent` per rewarded completion.

`JoinerCore` is a pure state machine (time passed in). Feedback counts when its `ts` is at most
`window_s` after its completion's; the first `tick(now)` past that window emits the sample (reward by
`feedback.rewards`), if any signal counted: a completion the product reported `shown` always yields
one (its reward is the spec's `silence` when nothing else came), so every exposure is a sample and an
ignored completion cannot drop out of the learner's data or the canary's metric. Feedback ahead of
its completion waits in a bounded orphan buffer until its own `ts + window_s`; feedback for a closed
completion or past its window is late (`drain_late()`). Redelivered ids, another tenant's feedback and
signals over a user's `UserBudget` are dropped, and so are the signals of a completion that earns no
reward (rule 6 of `feedback.rewards`: only dwell, never reported shown); every case is counted in
`stats` (`unrewarded_signals` for the last).

`JoinerService` runs the core as one group member on both topics (partitioned alike, so a completion
meets its feedback). A round reads the clock, then the producers' bus watermark (`watermark`, from
`registry.watermarks`: everything every live gateway accepted before it is on the bus), then where
the bus ends, and reads both topics to those ends (an empty poll is no proof: a Kafka fetch may be on
its way). Windows close `grace_s` after they end (clients batch and retry), at the earlier of the
clock and the watermark, so none closes on feedback
still in the bus or still in a gateway's spool while the broker is away. After the round's samples
are flushed, each partition is committed up to its oldest record still held: a restart rebuilds the
state, and re-emitted samples keep their id. What it consumed and produced is logged and exposed
(`core.service_metrics`, `self.metrics`). A record that is no event goes to the dead-letter topic with
its topic, partition and offset (`feedback.dead_letter`), and the joiner carries on; late feedback is
counted and logged.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from core.service_metrics import ServiceMetrics
from feedback.bus import Consumer, EventBus, Record
from feedback.dead_letter import DEAD_LETTER_TOPIC, dead_letter
from feedback.events import FEEDBACK_KINDS, TOPICS, CompletionEvent, FeedbackEvent, SampleEvent, Signal
from feedback.rewards import RewardSpec, UserBudget, counted_signals, reward, user_key

log = logging.getLogger(__name__)

Source = tuple[str, int, int]  # (topic, partition, offset) of the bus record an event came from
Orphan = tuple[FeedbackEvent, Source | None]
STAT_KEYS: tuple[str, ...] = ("completions", "feedback", "samples", "silent", "late", "duplicates", "no_feedback")
STAT_KEYS += ("dropped_by_budget", "tenant_mismatch", "orphans_expired", "orphans_overflow", "malformed")
STAT_KEYS += ("rounds_behind", "unrewarded_signals")
MAX_SEEN = MAX_CLOSED = 200_000  # event ids and closed completion ids remembered (to drop redeliveries)
MAX_LATE_KEPT = 10_000  # late feedback held for `drain_late()`
MAX_RECORDS_PER_ROUND = 50_000  # a round that reads more stops short of the end: its windows stay open
MAX_DRAIN_S = 10.0  # a round that cannot reach the bus's end in this long closes no window


def sample_event_id(completion_id: str, spec_name: str) -> str:
    """Deterministic: a replayed completion yields the same sample id, which the learner dedupes."""
    return hashlib.sha256(f"sample:{completion_id}:{spec_name}".encode()).hexdigest()[:32]


def _where(src: Source) -> str:
    return f"{src[0]}/{src[1]}@{src[2]}"


@dataclass
class _Pending:
    completion: CompletionEvent
    deadline: float
    signals: list[Signal] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    event_ids: list[str] = field(default_factory=list)  # the completion's and its attached feedback's


@dataclass(frozen=True)
class LateFeedback:
    event: FeedbackEvent
    source: Source | None
    reason: str  # "closed" (its completion was already emitted) or "past_window" (ts after the window)


class _BoundedSet(OrderedDict):
    """The last `capacity` keys added."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def add(self, key: str) -> None:
        self[key] = None
        if len(self) > self.capacity:
            self.popitem(last=False)


class JoinerCore:
    """Completions waiting for their window to close, orphan feedback, counters. `source` (optional on
    every input) is the event's bus record; `oldest_held()` is what a caller may not commit yet."""

    def __init__(
        self,
        spec: RewardSpec,
        window_s: float,
        clock: Callable[[], float] = time.time,
        *,
        max_orphans: int = 100_000,
        grace_s: float = 0.0,
    ):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s  # a window closes this long after it ends: feedback stamped inside it still on its way
        if max_orphans < 1:
            raise ValueError(f"max_orphans must be >= 1, got {max_orphans}")
        self.spec, self.window_s, self.clock, self.max_orphans = spec, window_s, clock, max_orphans
        self.budget = UserBudget.from_spec(spec)
        self.stats: dict[str, int] = {k: 0 for k in STAT_KEYS} | {f"late_{k}": 0 for k in FEEDBACK_KINDS}
        self._pending: dict[str, _Pending] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, seq, completion_id)
        self._orphans: dict[str, dict[str, Orphan]] = {}  # by completion_id, then event_id
        self._n_orphans = 0
        self._orphan_expiry: list[tuple[float, int, str, str]] = []  # heap of (expiry, seq, cid, event_id)
        self._seq = itertools.count()
        self._seen, self._closed = _BoundedSet(MAX_SEEN), _BoundedSet(MAX_CLOSED)
        self._late: list[LateFeedback] = []

    # ---- input ---------------------------------------------------------------------------------
    def on_completion(self, ev: CompletionEvent, source: Source | None = None) -> None:
        if ev.event_id in self._seen or ev.completion_id in self._pending or ev.completion_id in self._closed:
            self.stats["duplicates"] += 1
            return
        self._seen.add(ev.event_id)
        self.stats["completions"] += 1
        p = _Pending(ev, ev.ts + self.window_s, sources=[] if source is None else [source], event_ids=[ev.event_id])
        self._pending[ev.completion_id] = p
        heapq.heappush(self._deadlines, (p.deadline + self.grace_s, next(self._seq), ev.completion_id))
        for fb, src in self._orphans.pop(ev.completion_id, {}).values():
            self._n_orphans -= 1
            self._attach(p, fb, src)

    def on_feedback(self, ev: FeedbackEvent, source: Source | None = None) -> None:
        if ev.event_id in self._seen:
            self.stats["duplicates"] += 1
            return
        self._seen.add(ev.event_id)
        self.stats["feedback"] += 1
        if (p := self._pending.get(ev.completion_id)) is not None:
            self._attach(p, ev, source)
        elif ev.completion_id in self._closed:
            self._late_feedback(ev, source, "closed")
        else:
            if self._n_orphans >= self.max_orphans:
                self._evict_oldest_orphan()
            self._orphans.setdefault(ev.completion_id, {})[ev.event_id] = (ev, source)
            self._n_orphans += 1
            expiry = ev.ts + self.window_s + self.grace_s
            heapq.heappush(self._orphan_expiry, (expiry, next(self._seq), ev.completion_id, ev.event_id))

    def _attach(self, p: _Pending, ev: FeedbackEvent, source: Source | None) -> None:
        c = p.completion
        if ev.tenant != c.tenant:
            self.stats["tenant_mismatch"] += 1
            what = (ev.event_id, ev.tenant, c.completion_id, c.tenant)
            log.warning("feedback %s (tenant %r) names completion %s of tenant %r: rejected", *what)
        elif ev.ts > p.deadline:
            self._late_feedback(ev, source, "past_window")
        else:
            user = ev.user_id if ev.user_id is not None else c.user_id
            p.signals.append(Signal(kind=ev.kind, value=ev.value, ts=ev.ts, user_id=user, event_id=ev.event_id))
            p.event_ids.append(ev.event_id)
            if source is not None:
                p.sources.append(source)

    def _late_feedback(self, ev: FeedbackEvent, source: Source | None, reason: str) -> None:
        self.stats["late"] += 1
        self.stats[f"late_{ev.kind}"] += 1
        if len(self._late) >= MAX_LATE_KEPT:
            raise RuntimeError(f"{len(self._late)} late feedback events not drained: call drain_late()")
        self._late.append(LateFeedback(ev, source, reason))

    def _evict_oldest_orphan(self) -> None:
        while self._orphan_expiry:
            _, _, cid, eid = heapq.heappop(self._orphan_expiry)
            if self._drop_orphan(cid, eid):
                self.stats["orphans_overflow"] += 1
                n = self.max_orphans
                log.warning("orphan buffer full (%d): dropped feedback %s for unknown completion %s", n, eid, cid)
                return

    def _drop_orphan(self, cid: str, eid: str) -> bool:
        """Drop one orphan; False if it is gone already (attached, expired or released)."""
        if (entries := self._orphans.get(cid)) is None or entries.pop(eid, None) is None:
            return False
        self._n_orphans -= 1
        if not entries:
            del self._orphans[cid]
        return True

    # ---- output --------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[SampleEvent]:
        """Close every window that ended before `now`; expire orphans; return the new samples."""
        now = self.clock() if now is None else now
        out: list[SampleEvent] = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, cid = heapq.heappop(self._deadlines)
            if (p := self._pending.pop(cid, None)) is None:  # released (its partition went to another joiner)
                continue
            self._closed.add(cid)
            if (sample := self._close(p)) is None:
                self.stats["no_feedback"] += 1
            else:
                self.stats["samples"] += 1
                self.stats["silent"] += sample.silent
                out.append(sample)
        while self._orphan_expiry and self._orphan_expiry[0][0] < now:
            _, _, cid, eid = heapq.heappop(self._orphan_expiry)
            self.stats["orphans_expired"] += self._drop_orphan(cid, eid)
        self.budget.prune(now)
        return out

    def _close(self, p: _Pending) -> SampleEvent | None:
        c = p.completion
        counted = counted_signals(p.signals)
        admitted = set()
        for user in dict.fromkeys(user_key(s) for s in counted):  # users in first-signal order
            if self.budget.admit(f"{c.tenant}/{user}", c.completion_id, c.ts):  # per tenant: anonymous too
                admitted.add(user)
            else:
                self.stats["dropped_by_budget"] += sum(1 for s in counted if user_key(s) == user)
        kept = [s for s in counted if user_key(s) in admitted]
        if (r := reward(self.spec, kept)) is None:
            self.stats["unrewarded_signals"] += len(kept)  # rule 6: only dwell, never reported shown
            return None
        name, eid = self.spec.name, sample_event_id(c.completion_id, self.spec.name)
        return SampleEvent(
            event_id=eid, tenant=c.tenant, ts=p.deadline, completion=c, reward=r, signals=kept, reward_spec=name
        )

    def release(self, partitions: set[int]) -> int:
        """Forget what came from `partitions` (they went to another joiner): pending completions with
        their signals, and orphans. Their ids leave the seen-set, so the records count again if read
        again. Returns how many events were forgotten; events held without a source are kept."""
        forgotten: list[str] = []
        for cid, p in list(self._pending.items()):
            if p.sources and p.sources[0][0] == TOPICS["completion"] and p.sources[0][1] in partitions:
                del self._pending[cid]  # its deadline entry is skipped by tick()
                forgotten += p.event_ids
        for cid, entries in list(self._orphans.items()):
            for eid, (_, src) in list(entries.items()):
                if src is not None and src[1] in partitions and self._drop_orphan(cid, eid):
                    forgotten.append(eid)
        for eid in forgotten:
            self._seen.pop(eid, None)
        return len(forgotten)

    def drain_late(self) -> list[LateFeedback]:
        late, self._late = self._late, []
        return late

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def orphan_count(self) -> int:
        return self._n_orphans

    def oldest_held(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the smallest offset among the records whose events the core holds."""
        out: dict[tuple[str, int], int] = {}
        held = [src for p in self._pending.values() for src in p.sources]
        held += [s for es in self._orphans.values() for _, s in es.values() if s is not None]
        for topic, partition, offset in held:
            out[(topic, partition)] = min(offset, out.get((topic, partition), offset))
        return out


class JoinerService:
    """Consume completions and feedback, publish samples, commit what is safe. See the module docstring."""

    def __init__(
        self,
        bus: EventBus,
        spec: RewardSpec,
        window_s: float,
        group: str = "joiner",
        clock: Callable[[], float] = time.time,
        *,
        max_records: int = 500,
        metrics: ServiceMetrics | None = None,
        watermark: Callable[[], float | None] | None = None,
        grace_s: float = 0.0,
    ):
        self.bus, self.spec, self.clock = bus, spec, clock
        self.watermark = watermark  # the producers' bus watermark (`registry.watermarks`); None: the clock alone
        self.held_s = 0.0  # how far the last round's windows closed behind the clock (waiting on a producer)
        self.rounds_clock_only = 0  # rounds with a watermark source but no live producer: closed on the clock
        self.metrics = metrics or ServiceMetrics("joiner")
        self.max_records = max_records
        self.core = JoinerCore(spec, window_s, clock, grace_s=grace_s)
        self.consumer: Consumer = bus.consumer((TOPICS["completion"], TOPICS["feedback"]), group)
        self._consumed: dict[tuple[str, int], int] = {}  # position after the last record read
        self._committed: dict[tuple[str, int], int] = {}
        self._owned: set[int] | None = None  # partition numbers held after the last round

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    @property
    def partitions(self) -> list[int]:
        """Partition numbers (of both topics) this joiner owned after its last round."""
        return sorted(self._owned or ())

    def run_once(self, timeout_s: float = 1.0) -> list[SampleEvent]:
        """One round: read the clock, drain both topics, tick, publish, flush, commit."""
        now = self.clock()  # before draining: every event stamped before `now` is read below
        mark = self.watermark() if self.watermark is not None else None  # and before the bus's ends:
        if mark is not None:  # everything a producer accepted before its watermark lies below them
            self.held_s = max(0.0, now - mark)
            now = min(now, mark)
        elif self.watermark is not None:  # the degraded path: no producer to wait for (counted, and logged
            self.rounds_clock_only += 1  # by the source when it starts and stops)
            self.held_s = 0.0
        ends = self.consumer.ends()  # ...up to where the bus stands after `now`, not to the first empty poll
        caught_up = self._drain(timeout_s, ends)
        self._follow_assignment()
        samples = self.core.tick(now) if caught_up else []  # behind: windows stay open until caught up
        for s in samples:
            self.bus.publish(TOPICS["sample"], s.completion.completion_id, s.model_dump_json().encode())
        try:
            self.bus.flush()
        except TimeoutError as e:  # a slow or absent broker: the samples stay spooled and go out later;
            log.warning("joiner: %r; nothing committed this round", e)  # committing waits for them
        else:
            self._commit()
        self.metrics.produce(TOPICS["sample"], len(samples))
        held = {"pending": self.core.pending_count, "orphans": self.core.orphan_count, "held_s": round(self.held_s, 1)}
        held["rounds_clock_only"] = self.rounds_clock_only
        self.metrics.set_stats({**self.stats, **held})
        self.metrics.report()
        return samples

    def run(self, stop_event: threading.Event, timeout_s: float = 0.5) -> None:
        try:
            while not stop_event.is_set():
                self.run_once(timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        """Leave the group. Records still held are not committed: a restart reads them again."""
        self.consumer.close()

    def _drain(self, timeout_s: float, ends: dict[tuple[str, int], int] | None) -> bool:
        """Read both topics up to `ends` (where the bus stood after the round's clock), waiting up to
        `timeout_s` for the first record; False if they were not reached within `MAX_DRAIN_S` (a slow
        broker) or `MAX_RECORDS_PER_ROUND` stopped it: then no window closes this round."""
        n, wait = 0, timeout_s
        deadline = time.monotonic() + MAX_DRAIN_S
        while n < MAX_RECORDS_PER_ROUND:
            records = self.consumer.poll(self.max_records, timeout_s=wait)
            self._handle(records)
            n += len(records)
            if not records and self.consumer.reached(ends):
                return True
            if time.monotonic() > deadline:
                self.stats["rounds_behind"] += 1
                log.info("joiner: %d records read this round and the bus's end not reached in %g s: windows stay "
                         "open", n, MAX_DRAIN_S)  # fmt: skip
                return False
            wait = 0.0 if records else min(timeout_s, 0.05)  # a fetch on its way: wait for it, briefly
        log.info("joiner round stopped after %d records without reaching the end: windows stay open", n)
        return False

    def _follow_assignment(self) -> None:
        """Forget what came from partitions lost in a rebalance: their new owner reads them again from
        the committed position, and this member must neither emit their samples nor commit them."""
        owned = {p for _, p in self.consumer.assignment()}
        if lost := (self._owned or set()) - owned:
            forgotten = self.core.release(lost)
            for positions in (self._consumed, self._committed):
                for key in [k for k in positions if k[1] in lost]:
                    del positions[key]
            log.info("joiner: partitions %s went to another member; %d held events forgotten", sorted(lost), forgotten)
        self._owned = owned

    def _handle(self, records: list[Record]) -> None:
        for r in records:
            self.metrics.consume(r.topic)
            src: Source = (r.topic, r.partition, r.offset)
            try:
                if r.topic == TOPICS["completion"]:
                    self.core.on_completion(CompletionEvent.model_validate_json(r.value), src)
                else:
                    self.core.on_feedback(FeedbackEvent.model_validate_json(r.value), src)
            except ValidationError as e:  # set aside with where it came from (`feedback.dead_letter`), carry on
                letter = dead_letter(self.bus, r, str(e), "joiner.decode")
                log.error("joiner: malformed record at %s dead-lettered (%s)", _where(src), letter.event_id)
                self.stats["malformed"] += 1
                self.metrics.produce(DEAD_LETTER_TOPIC)
            self._consumed[r.topic, r.partition] = max(self._consumed.get((r.topic, r.partition), 0), r.offset + 1)
        for late in self.core.drain_late():  # after every batch: the core keeps at most MAX_LATE_KEPT
            ev, where = late.event, "" if late.source is None else _where(late.source)
            what = (ev.event_id, ev.kind, late.reason, ev.completion_id, where)
            log.info("late feedback %s (%s, %s) for completion %s at %s", *what)  # counted (`late_*`)

    def _commit(self) -> None:
        held, records = self.core.oldest_held(), []
        for key, consumed in self._consumed.items():
            position = min(held.get(key, consumed), consumed)
            if position > self._committed.get(key, 0):
                records.append(Record(*key, position - 1, "", b""))  # commit(records) is through the record
                self._committed[key] = position
        if records:
            self.consumer.commit(records)
