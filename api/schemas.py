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
INT64 = (-(2**63), 2**63 - 1)  # the range of `seed`, as OpenAI's


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
    if isinstance(v, list) and v and isinstance(v[0], list):
        return "id_lists"
    return "texts" if isinstance(v, list) else "text"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts"), Field(fail_fast=True)]
    | Annotated[list[StrictInt], Tag("ids"), Field(fail_fast=True)]
    | Annotated[list[Annotated[list[StrictInt], Field(fail_fast=True)]], Tag("id_lists"), Field(fail_fast=True)],
    Discriminator(_prompt_kind),
]
PROMPT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


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
    seed: StrictInt | None = Field(None, ge=INT64[0], le=INT64[1])
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

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info):
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

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
            raise ValueError(f"prompt must be {PROMPT_KINDS}") from None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
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


class TextPart(_Body):
    """One part of a message's `content` given as a list: only text parts (a model of text alone)."""

    type: Literal["text"]
    text: str


def _content(v: Any, handler: Any) -> Any:
    if isinstance(v, list):
        bad = next((p for p in v if not (isinstance(p, dict) and p.get("type") == "text")), None)
        if bad is not None:
            kind = bad.get("type") if isinstance(bad, dict) else type(bad).__name__
            raise ValueError(f"only text content parts are supported, got {kind!r}")
    return handler(v)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)]
    name: str | None = Field(None, max_length=256)

    _parts = field_validator("content", mode="wrap")(_content)

    @property
    def text(self) -> str:
        """The content as text: a list of text parts is joined in order."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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
    return "".join(m.text for m in messages)
