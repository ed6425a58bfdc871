"""The dead-letter topic: records a consumer could not use, kept with where they came from and why.

A consumer that meets a record it cannot process (invalid JSON, a schema violation, a batch whose
loss is not finite) publishes a `DeadLetter` on `DEAD_LETTER_TOPIC` and carries on, instead of
crashing on the record forever or dropping it silently. The letter names the record's topic,
partition and offset, the stage that gave up (`"learner.decode"`, `"learner.quarantine"`, ...), the
error, and the raw value: as text when it is valid UTF-8, else base64 (`DeadLetter.raw()` gives the
bytes back), so the record can be inspected and replayed by hand.

A letter's `event_id` is derived from (topic, partition, offset, stage): a consumer that crashes
after dead-lettering but before committing dead-letters the record again under the same id, which
a reader can drop. Published with `EventBus.publish` (durable on this machine when it returns), keyed
by the record's key (its completion id), so a completion's letters stay in order.

Called by the learner (`learner.service`: stages `learner.decode`, `learner.quarantine`), the gate
(`gating.gate`: `gate.decode`, a malformed joined sample) and the joiner
(`feedback.joiner`: `joiner.decode` for a malformed record).
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from feedback.bus import EventBus, Record

DEAD_LETTER_TOPIC = "flywheel.dead_letter"
MAX_REASON_CHARS = 4000


class DeadLetter(BaseModel):
    """One record that a consumer gave up on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str = Field(min_length=8, max_length=64)
    ts: float = Field(description="When it was dead-lettered (seconds since the epoch).")
    stage: str = Field(min_length=1, description="Who gave up, and where: 'learner.decode', ...")
    reason: str = Field(description="The error, truncated to MAX_REASON_CHARS.")
    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    key: str
    encoding: Literal["text", "base64"] = Field(description="How `value` holds the raw bytes.")
    value: str

    def raw(self) -> bytes:
        """The record's value, byte for byte."""
        return self.value.encode() if self.encoding == "text" else base64.b64decode(self.value)


def letter_id(record: Record, stage: str) -> str:
    return hashlib.sha256(f"dead:{record.topic}:{record.partition}:{record.offset}:{stage}".encode()).hexdigest()[:32]


def letter_for(record: Record, reason: str, stage: str, now: float | None = None) -> DeadLetter:
    encoding: Literal["text", "base64"] = "text"
    try:
        value = bytes(record.value).decode("utf-8")
    except UnicodeDecodeError:
        value, encoding = base64.b64encode(record.value).decode("ascii"), "base64"
    return DeadLetter(
        event_id=letter_id(record, stage),
        ts=time.time() if now is None else now,
        stage=stage,
        reason=reason[:MAX_REASON_CHARS],
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        encoding=encoding,
        value=value,
    )


def dead_letter(bus: EventBus, record: Record, reason: str, stage: str) -> DeadLetter:
    """Publish `record` on the dead-letter topic with `reason` and `stage`; returns the letter."""
    letter = letter_for(record, reason, stage)
    key = record.key or f"{record.topic}/{record.partition}@{record.offset}"
    bus.publish(DEAD_LETTER_TOPIC, key, letter.model_dump_json().encode())
    return letter
