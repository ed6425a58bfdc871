"""OpenAI-compatible request bodies (validation only; responses are built in the routes).

Every field of OpenAI's reference for the two endpoints is declared here (docs/openai.md is the
table): it is supported, or refused with 400 `unsupported_parameter` / `unsupported_value` naming
it. A refused field is accepted only at a value that asks for what this server does anyway (`echo:
false`, `logit_bias: {}`, `store: true`, ...: `Refused.neutral`); `null` is accepted for every
optional field and means its default, as OpenAI reads it. Fields OpenAI does not define are refused
too (400 `unknown_parameter`), except vLLM's `ignore_eos` and the product's `metadata.context`.
Range checks that depend on the served model (context length, and the text lengths it bounds:
prompts, messages, stop strings) happen in the route, before anything is tokenized.

Validating a body costs time linear in its size (bounded by the gateway's body limit), and
produces a bounded number of errors however it is malformed: lists stop at their first bad item,
a prompt is validated as the one kind its first item says, and of many unknown fields only the
first reaches validation (the answer names one parameter anyway).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from feedback.events import ContextKey

MAX_TOKENS_LIMIT = 4096
MAX_CHOICES = 128  # prompts x n of one request
MAX_MESSAGES = 1024
INT64 = (-(2**63), 2**63 - 1)  # the range of `seed`, as OpenAI's
UNSUPPORTED = ("unsupported_parameter", "unsupported_value")  # the error types (and codes) of a refused field


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


@dataclass(frozen=True)
class Refused:
    """An OpenAI field this server does not support: why, and the values accepted anyway because
    they ask for what it does regardless (compared with their JSON type: `false` is not `0`)."""

    why: str
    neutral: tuple = ()

    def accepts(self, v: Any) -> bool:
        return any(type(v) is type(n) and v == n for n in self.neutral)

    def error(self, field: str) -> PydanticCustomError:
        if not self.neutral:
            message = f"Unsupported parameter: '{field}' is not supported by this server: {self.why}."
            return unsupported("unsupported_parameter", message)
        only = " or ".join(json.dumps(n) for n in self.neutral)
        message = f"Unsupported value: '{field}' is not supported by this server except as {only}: {self.why}."
        return unsupported("unsupported_value", message)


def unsupported(kind: str, message: str) -> PydanticCustomError:
    """A refusal of a field (`kind`: one of `UNSUPPORTED`); `api.errors` answers it with its message
    as is, the kind as the code and the field's path as `param`."""
    return PydanticCustomError(kind, message)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    REFUSED: ClassVar[dict[str, Refused]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_first_unknown(cls, data: Any) -> Any:
        """`null` for an optional field is its default (OpenAI's reading); of the unknown fields, the first."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required())}
        return first_unknown_only(data, cls)


def _refuse(cls: type[_Body], v: Any, info: ValidationInfo) -> Any:
    """The validator of every field in `cls.REFUSED`: its neutral values pass, anything else is refused."""
    assert info.field_name is not None
    refused = cls.REFUSED[info.field_name]
    if refused.accepts(v):
        return v
    raise refused.error(info.field_name)


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

NO_TOOLS = "this model has no tool or function calling"
TEXT_ONLY = "this model reads and writes text only"
NO_CACHE = "this server has no prompt cache to configure"
ZERO = (0, 0.0)


class StreamOptions(_Body):
    REFUSED = {"include_obfuscation": Refused("streamed chunks carry no obfuscation padding", (False,))}

    include_usage: StrictBool = False
    include_obfuscation: Any = None

    _refused = field_validator(*REFUSED)(_refuse)


class Metadata(_Body):
    """The request's `metadata`: of OpenAI's free-form string pairs, only the keys used here."""

    context: ContextKey | None = None  # the product's context key, recorded with each completion


class _Common(_Body):
    REFUSED = {
        "presence_penalty": Refused("sampling applies no penalties", ZERO),
        "frequency_penalty": Refused("sampling applies no penalties", ZERO),
        "logit_bias": Refused("sampling applies no per-token bias", ({},)),
    }

    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    seed: StrictInt | None = Field(None, ge=INT64[0], le=INT64[1])
    user: str | None = Field(None, max_length=256)
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    metadata: Metadata | None = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    _refused = field_validator(*REFUSED)(_refuse)

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


class CompletionRequest(_Common):
    REFUSED = _Common.REFUSED | {
        "echo": Refused("the prompt is not echoed back", (False,)),
        "suffix": Refused("there is no insertion (fill-in-the-middle) mode", ("",)),
    }

    prompt: Prompt
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    _refused = field_validator(*REFUSED)(_refuse)

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

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        # 1 with n = 1 is what every request gets: one sample per choice, none discarded
        if type(v) is int and v == 1 and info.data.get("n", 1) == 1:
            return v
        raise Refused("each choice is one sample, none discarded (1 needs n = 1)", (1,)).error("best_of")


PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")  # OpenAI's, in any message


class TextPart(_Body):
    """One part of a message's `content` given as a list: only text parts (a model of text alone)."""

    REFUSED = {"prompt_cache_breakpoint": Refused(NO_CACHE)}

    type: str
    text: str
    prompt_cache_breakpoint: Any = None

    _refused = field_validator(*REFUSED)(_refuse)

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v in PART_TYPES[1:]:
            raise unsupported(
                "unsupported_value", f"Unsupported value: content parts of type '{v}' are not supported: {TEXT_ONLY}."
            )
        if v != "text":
            raise ValueError(f"a content part's type is one of {', '.join(map(repr, PART_TYPES))}")
        return v


ROLES = ("system", "developer", "user", "assistant")  # served; OpenAI's others: "tool", "function"


class ChatMessage(_Body):
    """A message of any of OpenAI's roles, with the union of their fields: those of tool calling
    and audio are refused, as are the roles `tool` and `function`."""

    REFUSED = {
        "name": Refused("messages are joined as plain text, without participant names"),
        "tool_calls": Refused(NO_TOOLS),
        "tool_call_id": Refused(NO_TOOLS),
        "function_call": Refused(NO_TOOLS),
        "audio": Refused(TEXT_ONLY),
        "refusal": Refused("this model's replies carry no refusals"),
    }

    role: str
    content: Annotated[list[TextPart], Field(fail_fast=True)]
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    _refused = field_validator(*REFUSED)(_refuse)

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v in ("tool", "function"):
            raise unsupported("unsupported_value", f"Unsupported value: role '{v}' is not supported: {NO_TOOLS}.")
        if v not in ROLES:
            raise ValueError(f"role must be one of {', '.join(map(repr, ROLES))}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _as_parts(cls, v):
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if isinstance(v, list):
            return v
        raise ValueError("content must be a string or a list of content parts")

    @property
    def text(self) -> str:
        """The content as text: a list of text parts is joined in order."""
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    REFUSED = _Common.REFUSED | {
        "audio": Refused(TEXT_ONLY),
        "function_call": Refused(NO_TOOLS),
        "functions": Refused(NO_TOOLS),
        "modalities": Refused(TEXT_ONLY, (["text"],)),
        "moderation": Refused("this server runs no moderation"),
        "parallel_tool_calls": Refused(NO_TOOLS),
        "prediction": Refused("there are no predicted outputs"),
        "prompt_cache_key": Refused(NO_CACHE),
        "prompt_cache_options": Refused(NO_CACHE),
        "prompt_cache_retention": Refused(NO_CACHE),
        "reasoning_effort": Refused("this is not a reasoning model"),
        "response_format": Refused("there is no JSON mode or structured output", ({"type": "text"},)),
        "safety_identifier": Refused("identify the end user with 'user'"),
        "service_tier": Refused("there is one processing tier", ("auto", "default")),
        "store": Refused("every completion is recorded, to learn from", (True,)),
        "tool_choice": Refused(NO_TOOLS),
        "tools": Refused(NO_TOOLS),
        "verbosity": Refused("there is no verbosity control"),
        "web_search_options": Refused("there is no web search"),
    }

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: Any = None  # before the fields that depend on it, so that it is the one reported
    functions: Any = None
    audio: Any = None
    function_call: Any = None
    modalities: Any = None
    moderation: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    response_format: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    store: Any = None
    tool_choice: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    _refused = field_validator(*REFUSED)(_refuse)

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 64


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The demo product's chat convention: it is a code-completion model, so the conversation's
    text (system, then the turns in order) is the code context, joined without role markers."""
    return "".join(m.text for m in messages)
