"""The gateway against a live server: the official openai client, streaming, errors, records, metrics."""

from __future__ import annotations

import json
import queue
import uuid
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest
import torch

from api.main import create_app
from core.harness import wait_until
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, CompletionEvent
from registry.keys import KeyStore
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.scoring import score
from serving.swap import hot_swap
from tests.conftest import LiveServer, assert_close_ulps

PROMPT = "# add 3 to x\ndef f(x):\n"


@contextmanager
def tiny_gateway(checkpoint, home, **settings):
    """A live gateway serving `checkpoint` on an embedded engine (context 128) with an embedded bus;
    `settings`: deployment settings besides those."""
    config = Settings(home=home, model_dir=checkpoint, max_batch=8, max_model_len=128, **settings)
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version(checkpoint.name, checkpoint, default=True)
    bus = EmbeddedBus(home / "bus")
    try:
        with LiveServer(create_app(config, engine=engine, bus=bus)) as server:
            server.engine, server.bus, server.version, server.settings = engine, bus, checkpoint.name, config
            yield server
    finally:
        engine.shutdown()
        bus.close()


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    with tiny_gateway(tiny_checkpoint, tmp_path_factory.mktemp("home")) as server:
        yield server


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def recorded(live) -> list[CompletionEvent]:
    """Every completion record on the bus, read by a fresh consumer group."""
    c = live.bus.consumer(TOPICS["completion"], "test-" + uuid.uuid4().hex[:8])
    out = []
    try:
        while recs := c.poll(max_records=1000, timeout_s=0.05):
            out += [CompletionEvent.model_validate_json(r.value) for r in recs]
    finally:
        c.close()
    return out


def records_by_id(live) -> dict:
    return {r.completion_id: r for r in recorded(live)}


def test_completion_with_openai_client_is_recorded_with_exact_logprobs_and_routing(live, client, tiny_checkpoint):
    r = client.completions.create(
        model="flywheel", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, logprobs=2, seed=5, user="alice"
    )
    assert r.model == live.version and r.system_fingerprint == live.version
    assert r.id.startswith("cmpl-")
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.token_logprobs) == r.usage.completion_tokens
    rec = records_by_id(live)[r.id]
    assert rec.model_version == live.version and rec.text == choice.text
    assert rec.user_id and rec.user_id != "alice"
    assert rec.logprobs == choice.logprobs.token_logprobs
    # The recorded logprobs and routing equal a full forward pass of the same version.
    model = load_checkpoint(tiny_checkpoint)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12)
    ref_lp, ref_experts = score(
        model, rec.prompt_ids, rec.output_ids, params, n_vocab=live.engine.tokenizer().vocab_size
    )
    # float32 both sides; a full forward against incremental decoding may round differently by a few
    # ulps of the log-probs' magnitude (docs/numerics.md)
    assert_close_ulps(torch.tensor(rec.logprobs), ref_lp, ulps=64, what="recorded vs recomputed log-probs")
    experts = np.frombuffer(rec.routed_experts.to_bytes(), dtype=np.uint8).reshape(rec.routed_experts.shape)
    assert np.array_equal(experts, ref_experts.numpy().astype(np.uint8))
    # Same seed, same completion.
    again = client.completions.create(
        model=live.version, prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=5
    )
    assert again.choices[0].text == choice.text and again.id != r.id


def test_chat_and_streaming(live, client):
    chat = client.chat.completions.create(
        model="flywheel", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, logprobs=True, top_logprobs=2
    )
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    stream = client.chat.completions.create(
        model="flywheel",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        stream=True,
        seed=3,
        stream_options={"include_usage": True},
    )
    text, ids, finish, usage = "", set(), None, None
    for ch in stream:
        ids.add(ch.id)
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert len(ids) == 1 and finish in ("stop", "length") and usage.completion_tokens >= 1
    assert records_by_id(live)[ids.pop()].text == text
    plain = client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=10, stream=True, seed=3)
    streamed = "".join(c.choices[0].text for c in plain)
    same = client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=10, seed=3)
    assert streamed == same.choices[0].text


def test_raw_sse_ends_with_done_and_n_choices(live):
    with httpx.stream(
        "POST",
        live.url + "/v1/completions",
        json={"model": "flywheel", "prompt": PROMPT, "max_tokens": 5, "stream": True, "n": 3},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    body = httpx.post(
        live.url + "/v1/completions", json={"model": "flywheel", "prompt": [PROMPT, "# x"], "max_tokens": 3, "n": 2}
    ).json()
    assert len(body["choices"]) == 4 and len({c["completion_id"] for c in body["choices"]}) == 4


def test_models_health_metrics(live, client):
    ids = [m.id for m in client.models.list().data]
    assert live.version in ids and "flywheel" in ids
    h = httpx.get(live.url + "/healthz")
    assert h.status_code == 200 and h.json()["default_version"] == live.version
    client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=2)
    m = httpx.get(live.url + "/metrics").text
    assert f'flywheel_requests_total{{endpoint="/v1/completions",model_version="{live.version}",status="200"}}' in m
    assert (
        f'flywheel_request_latency_seconds_bucket{{endpoint="completions",le="0.005",model_version="{live.version}"}}'
        in m
    )
    assert "flywheel_completion_tokens_total" in m


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"model": "flywheel", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_value"),
        ({"model": "flywheel", "prompt": "x" * 2000, "max_tokens": 10}, 400, "prompt", "context_length_exceeded"),
        ({"model": "flywheel", "prompt": "x", "max_tokens": 127}, 400, "prompt", "context_length_exceeded"),
        ({"model": "flywheel"}, 400, "prompt", "missing_required_parameter"),
        ({"model": "flywheel", "prompt": "x", "bogus": 1}, 400, "bogus", "unknown_parameter"),
        ({"model": "flywheel", "prompt": [99999]}, 400, "prompt", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "stop": "s" * 5000}, 400, "stop", "invalid_value"),
        ({"model": "flywheel", "prompt": ["x"] * 65, "n": 2}, 400, "prompt", "invalid_value"),
        ({"model": "flywheel", "prompt": list(range(120)), "max_tokens": 10}, 400, "prompt", "context_length_exceeded"),
        ({"model": "flywheel", "prompt": "x", "seed": 2**63}, 400, "seed", "invalid_value"),
        ({"model": "flywheel", "prompt": "x", "seed": -(2**63) - 1, "stream": True}, 400, "seed", "invalid_value"),
        (
            {"model": "flywheel", "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            "invalid_value",
        ),
        ({"model": "flywheel", "prompt": [[1, 2], []]}, 400, "prompt", "invalid_value"),
        ({"model": "flywheel", "prompt": [[1, 2], ["x"]]}, 400, "prompt", "invalid_value"),
        ({"model": "flywheel", "prompt": [[1, 99999]]}, 400, "prompt", "invalid_value"),
    ],
)
def test_bad_completion_requests_get_openai_errors(live, body, status, param, code):
    before = len(recorded(live))
    r = httpx.post(live.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert len(recorded(live)) == before  # nothing recorded for a refused request


def test_malformed_json_and_chat_errors(live):
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "flywheel", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        live.url + "/v1/chat/completions", json={"model": "flywheel", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.role")
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_request_shapes_the_sdks_send(live, client):
    """Text content parts, a seed at int64's ends (streamed too: [DONE], no in-stream error) and a prompt of
    token-id lists are served as OpenAI serves them; an image part is a 400 naming the message's content."""
    parts = [{"type": "text", "text": PROMPT[:10]}, {"type": "text", "text": PROMPT[10:]}]
    as_parts = client.chat.completions.create(
        model="flywheel", messages=[{"role": "user", "content": parts}], max_tokens=6, seed=4
    )
    as_text = client.chat.completions.create(
        model="flywheel", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, seed=4
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    for seed in (2**63 - 1, -(2**63)):
        assert client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=3, seed=seed).choices
        body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 3, "seed": seed, "stream": True, "n": 2}
        r = httpx.post(live.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    ids = [client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=1).usage.prompt_tokens]
    tok = live.engine.tokenizer()
    lists = [tok.encode_prompt(PROMPT), tok.encode_prompt(PROMPT[:20])]
    out = client.completions.create(model="flywheel", prompt=lists, max_tokens=4, seed=1)
    assert (
        [c.index for c in out.choices] == [0, 1]
        and out.usage.prompt_tokens == sum(map(len, lists))
        and ids[0] == len(lists[0])
    )
    greedy = client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = greedy.choices[0].logprobs  # the model's own log-probabilities at temperature 0, as OpenAI's
    assert all(x <= 0 for x in lp.token_logprobs) and any(x < 0 for x in lp.token_logprobs)
    assert all(x == max(top.values()) for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True))
    image = {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}
    r = httpx.post(
        live.url + "/v1/chat/completions",
        json={"model": "flywheel", "messages": [{"role": "user", "content": [image]}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), r.text
    assert "image_url" in r.json()["error"]["message"]


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="flywheel", prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


def test_a_stream_the_client_drops_is_still_recorded(live):

    with httpx.stream(
        "POST",
        live.url + "/v1/completions",
        json={
            "model": "flywheel",
            "prompt": PROMPT,
            "max_tokens": 100,
            "stream": True,
            "ignore_eos": True,
            "temperature": 1.0,
        },
    ) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        cid = json.loads(first[6:])["id"]
    # the client is gone; the gateway cancels the generation and records what it served
    rec = wait_until(lambda: records_by_id(live).get(cid), 10, what="the dropped stream's record", interval_s=0.05)
    assert rec.finish_reason in ("abort", "length") and len(rec.output_ids) >= 1
    print("dropped stream recorded:", rec.finish_reason, len(rec.output_ids))


@pytest.fixture
def swap_after_resolve(tiny_checkpoint, tmp_path):
    """A gateway on an engine serving v1 whose route, right after resolving a request's model (before
    it submits), sees a hot swap to v2 retire v1: the window of the alias/swap race, opened by a hook,
    not by timing. A request bound to v1 before the swap (`held`) is still in flight on it."""
    settings = Settings(home=tmp_path, model_dir=tiny_checkpoint, max_batch=8, max_model_len=128)
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version("v1", tiny_checkpoint, default=True)
    bus = EmbeddedBus(tmp_path / "bus")
    app = create_app(settings, engine=engine, bus=bus)
    with LiveServer(app) as server:
        gw = app.state.gateway
        resolve, held = gw.resolve_model, []

        def resolve_then_swap(*args, **kwargs):
            resolved = resolve(*args, **kwargs)
            if not held:  # once: bind a long request to v1, then swap (v1 now refuses new requests)
                ids = engine.tokenizer("v1").encode_prompt(PROMPT)
                events: queue.SimpleQueue = queue.SimpleQueue()
                engine.submit(ids, SamplingParams(max_tokens=100, ignore_eos=True), "v1", sink=events.put)
                held.append(events)
                hot_swap(engine, "v2", tiny_checkpoint, wait=False)
            return resolved

        gw.resolve_model = resolve_then_swap
        server.engine, server.bus, server.held = engine, bus, held
        server.eval_key = KeyStore(settings.db_url).create(["completions", "eval"])[0]
        yield server
    engine.shutdown()
    bus.close()


@pytest.mark.parametrize("stream", [False, True])
def test_an_alias_request_whose_version_retires_before_submit_is_resubmitted(swap_after_resolve, stream):
    live = swap_after_resolve
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text  # not 400 "retired": re-resolved to v2 and resubmitted
    assert r.headers["x-flywheel-model-version"] == "v2"
    if stream:
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        cid, models = chunks[0]["id"], {c["model"] for c in chunks}
    else:
        cid, models = r.json()["id"], {r.json()["model"]}
    assert models == {"v2"} and records_by_id(live)[cid].model_version == "v2"
    held = None
    while held is None:  # the request in flight on v1 when it retired finished there
        held = live.held[0].get(timeout=30).completion
    assert held.version == "v1" and len(held.output_ids) == 100


def test_an_explicitly_named_version_that_retires_before_submit_is_never_replaced(swap_after_resolve):
    live = swap_after_resolve
    body = {"model": "v1", "prompt": PROMPT, "max_tokens": 4}
    auth = {"Authorization": f"Bearer {live.eval_key}"}
    r = httpx.post(live.url + "/v1/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model") and "retired" in err["message"]
    assert not [c for c in recorded(live) if c.model_version == "v2"]  # nothing was served in its place
