"""Every field of OpenAI's completions and chat completions is supported, or refused with a 400 naming it
(docs/openai.md): the fields are those the installed official client sends, and each has a row in the doc."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartParam,
    ChatCompletionContentPartRefusalParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionFunctionMessageParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat import completion_create_params as chat_params

from api.schemas import ChatMessage, ChatRequest, CompletionRequest, StreamOptions, TextPart
from tests.api.test_openai_api import PROMPT, live  # noqa: F401 (a fixture)

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
USER = [{"role": "user", "content": PROMPT}]
EXTENSIONS = {"ignore_eos", "metadata"}  # ours; `metadata` is OpenAI's on chat only


@pytest.fixture(scope="module")
def client(live):  # noqa: F811 (one for the module: a client costs a tenth of a second to make)
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _keys(*typed_dicts) -> set[str]:
    return set().union(*(t.__required_keys__ | t.__optional_keys__ for t in typed_dicts))


CLIENT_FIELDS = {
    "completions": _keys(completion_params.CompletionCreateParamsBase) | {"stream"},
    "chat": _keys(chat_params.CompletionCreateParamsBase) | {"stream"},
    "messages[]": _keys(
        ChatCompletionSystemMessageParam,
        ChatCompletionDeveloperMessageParam,
        ChatCompletionUserMessageParam,
        ChatCompletionAssistantMessageParam,
        ChatCompletionToolMessageParam,
        ChatCompletionFunctionMessageParam,
    ),
    "stream_options": _keys(ChatCompletionStreamOptionsParam),
}


def test_every_field_of_the_official_client_is_declared_and_documented():
    assert CLIENT_FIELDS["completions"] | EXTENSIONS == set(CompletionRequest.model_fields)
    assert CLIENT_FIELDS["chat"] | EXTENSIONS == set(ChatRequest.model_fields)
    assert CLIENT_FIELDS["messages[]"] == set(ChatMessage.model_fields)
    assert CLIENT_FIELDS["stream_options"] == set(StreamOptions.model_fields)
    # a content part: text (its fields are TextPart's), or a refused type (its payload is never read)
    parts = _keys(*ChatCompletionContentPartParam.__args__, ChatCompletionContentPartRefusalParam)
    assert parts - {"image_url", "input_audio", "file", "refusal"} == set(TextPart.model_fields)
    # each field has a row of docs/openai.md (a nested one as its path: `messages[].name`)
    documented = set(re.findall(r"`([a-z_\[\].]+)`", "\n".join(re.findall(r"^\| (.*?) \|", DOC.read_text(), re.M))))
    named = (
        CLIENT_FIELDS["completions"]
        | CLIENT_FIELDS["chat"]
        | {f"messages[].{k}" for k in CLIENT_FIELDS["messages[]"] - {"role", "content"}}
        | {"messages[].role", "messages[].content", "messages[].content[].prompt_cache_breakpoint"}
        | {f"stream_options.{k}" for k in CLIENT_FIELDS["stream_options"]}
        | {"metadata.context", "ignore_eos"}
    )
    assert named - {"stream_options"} - documented == set()  # stream_options: a row per field of it


def _refused(endpoint: str, fields: dict, param: str, code: str = "unsupported_parameter"):
    return pytest.param(endpoint, fields, param, code, id=f"{endpoint}:{param}={code.removeprefix('unsupported_')}")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
REFUSED = [
    # both endpoints
    *(_refused(e, {"presence_penalty": 0.5}, "presence_penalty", "unsupported_value") for e in ("completions", "chat")),
    *(
        _refused(e, {"frequency_penalty": -1}, "frequency_penalty", "unsupported_value")
        for e in ("completions", "chat")
    ),
    *(_refused(e, {"logit_bias": {"5": 100}}, "logit_bias", "unsupported_value") for e in ("completions", "chat")),
    *(
        _refused(
            e,
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "unsupported_value",
        )
        for e in ("completions", "chat")
    ),  # fmt: skip
    # completions
    _refused("completions", {"echo": True}, "echo", "unsupported_value"),
    _refused("completions", {"best_of": 3, "n": 1}, "best_of", "unsupported_value"),
    _refused("completions", {"best_of": 1, "n": 2}, "best_of", "unsupported_value"),
    _refused("completions", {"suffix": "\n    return x"}, "suffix", "unsupported_value"),
    # chat
    _refused("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    _refused("chat", {"function_call": "auto"}, "function_call"),
    _refused("chat", {"functions": [TOOL["function"]]}, "functions"),
    _refused("chat", {"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
    _refused("chat", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    _refused("chat", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    _refused("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    _refused("chat", {"prompt_cache_key": "k"}, "prompt_cache_key"),
    _refused("chat", {"prompt_cache_options": {"mode": "implicit"}}, "prompt_cache_options"),
    _refused("chat", {"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    _refused("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    _refused("chat", {"response_format": {"type": "json_object"}}, "response_format", "unsupported_value"),
    _refused("chat", {"safety_identifier": "u1"}, "safety_identifier"),
    _refused("chat", {"service_tier": "flex"}, "service_tier", "unsupported_value"),
    _refused("chat", {"store": False}, "store", "unsupported_value"),
    _refused("chat", {"tool_choice": "none"}, "tool_choice"),
    _refused("chat", {"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    _refused("chat", {"verbosity": "low"}, "verbosity"),
    _refused("chat", {"web_search_options": {}}, "web_search_options"),
    # chat messages
    _refused("chat", {"messages": [{"role": "user", "content": PROMPT, "name": "bob"}]}, "messages.0.name"),
    _refused(
        "chat",
        {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}]},
        "messages.1.tool_calls",
    ),
    _refused(
        "chat",
        {"messages": [*USER, {"role": "assistant", "content": "", "function_call": CALL["function"]}]},
        "messages.1.function_call",
    ),
    _refused("chat", {"messages": [*USER, {"role": "assistant", "audio": {"id": "a1"}}]}, "messages.1.audio"),
    _refused(
        "chat", {"messages": [*USER, {"role": "assistant", "content": "", "refusal": "no"}]}, "messages.1.refusal"
    ),
    _refused(
        "chat",
        {"messages": [*USER, {"role": "tool", "content": "4", "tool_call_id": "c1"}]},
        "messages.1.role",
        "unsupported_value",
    ),
    _refused(
        "chat",
        {"messages": [*USER, {"role": "function", "content": "4", "name": "f"}]},
        "messages.1.role",
        "unsupported_value",
    ),
    *(
        _refused(
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]},
            "messages.0.content.1.type",
            "unsupported_value",
        )
        for part in (
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-1"}},
            {"type": "refusal", "refusal": "no"},
        )
    ),  # fmt: skip
    _refused(
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {}}]}]},
        "messages.0.content.0.prompt_cache_breakpoint",
    ),
]


@pytest.mark.parametrize("endpoint, fields, param, code", REFUSED)
def test_a_refused_field_is_a_400_naming_it(live, client, endpoint, fields, param, code):
    """Sent by the official client as its own arguments: the error names the field, and says it is not supported."""
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=2, **fields)
        else:
            client.chat.completions.create(**{"model": "flywheel", "messages": USER, "max_tokens": 2, **fields})
    err = e.value.body
    assert e.value.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert "not supported" in err["message"] and param.rsplit(".")[-1] in err["message"]


def test_a_refused_field_is_reported_before_other_errors(live):
    body = {"model": "flywheel", "messages": USER, "temperature": 9, "tools": [TOOL], "bogus": 1}
    err = httpx.post(live.url + "/v1/chat/completions", json=body).json()["error"]
    assert (err["param"], err["code"]) == ("tools", "unsupported_parameter")


def test_neutral_values_and_nulls_are_accepted(live, client):
    """The values that ask for what the server does anyway are served; so is `null` for any optional field."""
    neutral = client.chat.completions.create(
        model="flywheel",
        messages=USER,
        max_tokens=2,
        store=True,
        service_tier="auto",
        modalities=["text"],
        response_format={"type": "text"},
        logit_bias={},
        presence_penalty=0,
        frequency_penalty=0.0,
    )
    assert neutral.choices[0].finish_reason in ("stop", "length")
    assert client.chat.completions.create(model="flywheel", messages=USER, max_tokens=2, service_tier="default").choices
    plain = client.completions.create(
        model="flywheel", prompt=PROMPT, max_tokens=2, echo=False, best_of=1, suffix="", logit_bias={}
    )
    assert len(plain.choices) == 1
    streamed = client.chat.completions.create(
        model="flywheel",
        messages=USER,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert [c for c in streamed if c.usage]
    nulls = {k: None for k in set(ChatRequest.model_fields) - {"model", "messages"}}
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "flywheel", "messages": USER, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 64  # max_tokens null: the default
    nulls = {k: None for k in set(CompletionRequest.model_fields) - {"model", "prompt"}}
    r = httpx.post(live.url + "/v1/completions", json={"model": "flywheel", "prompt": PROMPT, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_supported_chat_fields(live, client):
    """Every role but tool/function; `developer` reads as `system` (the text is the prompt either way)."""
    turns = [{"role": "user", "content": "# add 3"}, {"role": "assistant", "content": " to x\n"}, *USER]
    args = dict(model="flywheel", max_completion_tokens=3, seed=11, temperature=0.7, top_p=0.9, user="u7")
    dev = client.chat.completions.create(messages=[{"role": "developer", "content": "# py\n"}, *turns], **args)
    sys = client.chat.completions.create(messages=[{"role": "system", "content": "# py\n"}, *turns], **args)
    assert dev.choices[0].message.content == sys.choices[0].message.content
    assert dev.usage.prompt_tokens == sys.usage.prompt_tokens and dev.usage.completion_tokens <= 3
    many = client.chat.completions.create(
        model="flywheel", messages=USER, n=2, max_tokens=4, stop=["\n\n"], logprobs=True, top_logprobs=1, seed=2
    )
    assert [c.index for c in many.choices] == [0, 1] and all(c.logprobs is not None for c in many.choices)
