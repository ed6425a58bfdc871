"""OpenAI-compatible request bodies (validation only; responses are built in the routes).

Unknown fields are refused (400, `unknown_parameter`) rather than silently ignored, except the
few the official client sends that have no effect here, which are accepted only at their neutral
value. Range checks that depend on the served model (context length) happen in the route.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_TOKENS_LIMIT = 4096


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

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
    prompt: str | list[str] | list[StrictInt]
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: None = None
    best_of: StrictInt | None = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
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
