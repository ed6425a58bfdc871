"""OpenAI-compatible request bodies (validation only; responses are built in the routes).

Unknown fields are refused (400, `unknown_parameter`) rather than silently ignored, except the
few the official client sends that have no effect here, which are accepted only at their neutral
value. Range checks that depend on the served model (context length, and the text lengths it
bounds: prompts, messages, stop strings) happen in the route, before anything is tokenized.

Validating a body costs time linear in its size (bounded by the gateway's body limit), and
produces a bounded number of errors however it is malformed: lists stop at their first bad item,
a prompt is validated as the one kind its first item says, and of many unknown fields only the
first reaches validation (the answer names one parameter anyway).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from feedback.events import ContextKey

MAX_TOKENS_LIMIT = 4096
MAX_CHOICES = 128  # prompts x n of one request
MAX_MESSAGES = 1024


def first_unknown_only(data: Any, model: type[BaseModel]) -> Any:
    """`data` with, of the fields `model` does not know, only the first (a model that forbids
    unknown fields then reports one error, not one per field)."""
    if isinstance(data, dict):
        fields = model.model_fields.keys()
        unknown = data.keys() - fields
        if len(unknown) > 1:
            first = next(k for k in data if k in unknown)
            data = {k: v for k, v in data.items() if k in fields or k == first}
    return data


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_only(cls, data: Any) -> Any:
        return first_unknown_only(data, cls)


def _prompt_kind(v: Any) -> str:
    if isinstance(v, list) and v and isinstance(v[0], int):
        return "ids"
    return "texts" if isinstance(v, list) else "text"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts"), Field(fail_fast=True)]
    | Annotated[list[StrictInt], Tag("ids"), Field(fail_fast=True)],
    Discriminator(_prompt_kind),
]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class Metadata(_Body):
    """The request's `metadata`: of OpenAI's free-form string pairs, only the keys used here."""

    context: ContextKey | None = None  # the product's context key, recorded with each completion


class _Common(_Body):
    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    seed: StrictInt | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    metadata: Metadata | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _str_or_strs(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("stop must be a string or a list of strings") from None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return ()
        stops = (v,) if isinstance(v, str) else tuple(v)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported by this server (only 0)")
        return v


class CompletionRequest(_Common):
    prompt: Prompt
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_kind(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings or a list of token ids") from None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return v


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = Field(None, max_length=256)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 64


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The demo product's chat convention: it is a code-completion model, so the conversation's
    text (system, then the turns in order) is the code context, joined without role markers."""
    return "".join(m.content for m in messages)
