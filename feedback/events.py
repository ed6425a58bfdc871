"""Event schemas and topic names, defined once.

Owns the wire shape of everything that flows through the event bus. Every event carries an
`event_id` (idempotency: consumers drop ids they have seen), its `tenant`, a timestamp `ts`
(seconds since the epoch) and the schema `version`. Called by the gateway (producer), the
joiner and the learner (consumers). No torch here: tensors travel as compact integer arrays.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 1

TOPICS = {
    "completion": "flywheel.completions",
    "feedback": "flywheel.feedback",
    "sample": "flywheel.samples",
}


def new_event_id() -> str:
    return uuid.uuid4().hex


def hash_user(tenant: str, user: str | None) -> str | None:
    """Pseudonymous, stable per tenant: the raw user id never leaves the gateway."""
    if user is None:
        return None
    return hashlib.sha256(f"flywheel:{tenant}:{user}".encode()).hexdigest()[:32]


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_id: str = Field(default_factory=new_event_id, min_length=8, max_length=64)
    tenant: str = Field(min_length=1, max_length=64)
    ts: float = Field(default_factory=time.time)
    version: int = SCHEMA_VERSION


class RoutedExperts(BaseModel):
    """The experts each fed token was routed to: uint8 [tokens, layers, top_k], base64 of the raw bytes."""

    model_config = ConfigDict(extra="forbid")

    shape: tuple[int, int, int]
    data: str

    @classmethod
    def from_bytes(cls, shape: tuple[int, int, int], raw: bytes) -> "RoutedExperts":
        return cls(shape=shape, data=base64.b64encode(raw).decode("ascii"))

    def to_bytes(self) -> bytes:
        return base64.b64decode(self.data)

    @field_validator("data")
    @classmethod
    def _size_matches(cls, v: str, info):
        shape = info.data.get("shape")
        if shape is not None and len(base64.b64decode(v)) != shape[0] * shape[1] * shape[2]:
            raise ValueError(f"routed experts data does not hold {shape} uint8 values")
        return v


class CompletionEvent(Event):
    """One served completion: everything the learner needs to train on it later."""

    type: Literal["completion"] = "completion"
    completion_id: str
    user_id: str | None = None  # hashed (hash_user)
    model_version: str
    endpoint: Literal["completions", "chat.completions"]
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # of each output token, under the distribution it was sampled from
    routed_experts: RoutedExperts  # [len(prompt_ids) + len(output_ids) - 1, L, K]
    text: str
    finish_reason: str
    params: dict
    latency_ms: dict[str, float]
