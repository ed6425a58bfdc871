"""Event schemas and topic names, defined once: the wire shape of everything on the event bus.

Every event carries an `event_id` (consumers drop ids they have seen), its `tenant`, a timestamp `ts`
(seconds since the epoch) and the schema `version`. Called by the gateway (producer), the joiner and
the learner (consumers). No torch here: tensors travel as compact integer arrays.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
import uuid
from dataclasses import fields
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 1

TOPICS = {"completion": "flywheel.completions", "feedback": "flywheel.feedback", "sample": "flywheel.samples"}

MAX_CONTEXT_CHARS = 64
ContextKey = Annotated[str, Field(min_length=1, max_length=MAX_CONTEXT_CHARS, pattern=r"^[A-Za-z0-9_./-]+$")]
"""A completion's context key (`CompletionEvent.context`): 1-64 of letters, digits, `_ . / -`."""


def new_event_id() -> str:
    return uuid.uuid4().hex


def hash_user(tenant: str, user: str | None) -> str | None:
    """Pseudonymous, stable per tenant: the raw user id never leaves the gateway."""
    if user is None:
        return None
    return hashlib.sha256(f"flywheel:{tenant}:{user}".encode()).hexdigest()[:32]


def event_id_for(tenant: str, idempotency_key: str) -> str:
    """The event id an idempotency key names: the same key from the same tenant, the same id."""
    return hashlib.sha256(json.dumps(["flywheel.feedback", tenant, idempotency_key]).encode()).hexdigest()[:32]


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
    def from_bytes(cls, shape: tuple[int, int, int], raw: bytes) -> RoutedExperts:
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
    arm: str | None = None  # experiment arm; "eval": a version named by an eval key, outside canary statistics
    # The product's context key (the request's `metadata.context`): the learner keeps a reward baseline
    # per (tenant, context). Optional and left out of the JSON when None, so an event without one has
    # the wire form it had before the field existed; a consumer built before it refuses an event that
    # sets it (extra fields are forbidden): upgrade the joiner and learner before the gateways.
    context: ContextKey | None = Field(None, exclude_if=lambda v: v is None)

    @classmethod
    def from_completion(
        cls, c, tenant: str, user: str | None, endpoint: str, arm: str | None = None, context: str | None = None
    ) -> CompletionEvent:
        """From an engine's `serving.engine.Completion` (duck-typed: feedback/ does not import torch)."""
        return cls(
            tenant=tenant,
            completion_id=c.request_id,
            user_id=hash_user(tenant, user),
            model_version=c.version,
            endpoint=endpoint,
            prompt_ids=list(c.prompt_ids),
            output_ids=list(c.output_ids),
            logprobs=list(c.logprobs),
            routed_experts=RoutedExperts.from_bytes(tuple(c.routed_experts.shape), c.routed_experts.tobytes()),
            text=c.text,
            finish_reason=c.finish_reason,
            params={f.name: getattr(c.params, f.name) for f in fields(c.params)},  # flat: no deep copy
            latency_ms={"queued": c.queued_s * 1e3, "first_token": c.first_token_s * 1e3, "total": c.total_s * 1e3},
            arm=arm,
            context=context,
        )


# ---- feedback ---------------------------------------------------------------------------------
FeedbackKind = Literal[
    "shown", "thumb_up", "thumb_down", "rating", "accepted", "rejected", "edited", "copied", "regenerated", "dwell"
]
FEEDBACK_KINDS: tuple[str, ...] = get_args(FeedbackKind)
MAX_DWELL_S = 24 * 3600.0


def check_value(kind: str, v: float | None) -> float | None:
    """`FeedbackEvent.value`'s rule for a valid `kind`: the value as a float (or None), or a ValueError."""
    if v is not None:
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"value must be a finite number, got {v!r}")
    if kind == "rating":
        if v is None or v != int(v) or not 1 <= v <= 5:
            raise ValueError(f"rating needs an integer value 1..5, got {v!r}")
    elif kind == "edited":
        if v is None or not 0.0 <= v <= 1.0:
            raise ValueError(f"edited needs value = kept fraction in [0, 1], got {v!r}")
    elif kind == "dwell":
        if v is None or not 0.0 <= v <= MAX_DWELL_S:
            raise ValueError(f"dwell needs value = seconds in [0, {MAX_DWELL_S:.0f}], got {v!r}")
    elif v is not None:
        raise ValueError(f"{kind} takes no value, got {v!r}")
    return v


def value_fits_kind(v: float | None, info) -> float | None:
    """`check_value` as the `value` validator of a model whose `kind` field comes before it."""
    kind = info.data.get("kind")
    return v if kind is None else check_value(kind, v)


class FeedbackEvent(Event):
    """One user-satisfaction signal about one completion.

    `shown` is exposure: the product displayed the completion to its user. It carries no reward by
    itself; the reward spec says what silence after it means (`feedback.rewards`).
    `value` by kind: rating → 1..5 (integer); edited → kept fraction of the completion in [0, 1]
    (`edit_distance`, characters, may be given too); dwell → seconds in [0, 24 h]; every other kind
    → no value. Anything else is refused with a ValueError naming the field.
    """

    type: Literal["feedback"] = "feedback"
    completion_id: str = Field(min_length=1, max_length=128)
    user_id: str | None = None  # hashed (hash_user)
    kind: FeedbackKind
    value: float | None = Field(None, validate_default=True)
    edit_distance: int | None = Field(None, ge=0)

    _value_fits_kind = field_validator("value")(value_fits_kind)

    @classmethod
    def received(
        cls,
        *,
        event_id: str,
        tenant: str,
        completion_id: str,
        kind: str,
        value: float | None,
        edit_distance: int | None,
        client_ts: float | None,
        now: float,
        served_ts: float,
        served_user: str | None,
    ) -> FeedbackEvent:
        """The event the gateway publishes for feedback it received at `now` about a completion served
        at `served_ts` to `served_user` (hashed): the user is the completion's, and the time is `now`,
        or the client's `ts` clamped to [served_ts, now]."""
        ts = now if client_ts is None else min(max(client_ts, served_ts), now)
        what: dict[str, Any] = dict(completion_id=completion_id, kind=kind, value=value, edit_distance=edit_distance)
        return cls(event_id=event_id, tenant=tenant, ts=ts, user_id=served_user, **what)


class Signal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: FeedbackKind
    value: float | None = None
    ts: float
    user_id: str | None = None
    event_id: str = Field(min_length=8, max_length=64)
    """The feedback event this signal came from: every accepted event can be traced to the one sample it
    counts in (`bench/faults.py` checks exactly that after killing the services under load)."""


class SampleEvent(Event):
    """The joiner's output: one completion, its scalar reward and the signals it came from."""

    type: Literal["sample"] = "sample"
    completion: CompletionEvent
    reward: float
    signals: list[Signal]
    reward_spec: str  # name/version of the reward spec that produced `reward`

    @property
    def exposed(self) -> bool:
        """The product reported the completion as shown."""
        return any(s.kind == "shown" for s in self.signals)

    @property
    def silent(self) -> bool:
        """Shown, and no signal carrying a reward of its own: the reward is the spec's `silence`."""
        return self.exposed and all(s.kind in ("shown", "dwell") for s in self.signals)
