"""The request's `metadata.context`: recorded on the completion event on the bus (both endpoints, streamed
or not, sent the way the official client sends it), and refused in the OpenAI error shape when invalid."""

from __future__ import annotations

import httpx
import pytest

from tests.api.test_openai_api import PROMPT, client, live, records_by_id  # noqa: F401 (fixtures)


def test_the_context_key_rides_on_the_completion_event(live, client):
    # /v1/completions has no `metadata` parameter in the client: the demo's users send it in the body.
    plain = client.completions.create(
        model="flywheel", prompt=PROMPT, max_tokens=4, extra_body={"metadata": {"context": "add"}}
    )
    chat = client.chat.completions.create(
        model="flywheel", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, metadata={"context": "a/b-1"}
    )
    streamed = client.chat.completions.create(
        model="flywheel",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        stream=True,
        metadata={"context": "streamed"},
    )
    (stream_id,) = {chunk.id for chunk in streamed}
    without = client.completions.create(model="flywheel", prompt=PROMPT, max_tokens=4)
    recs = records_by_id(live)  # one choice each: its completion id is the response's id
    assert recs[plain.id].context == "add" and recs[chat.id].context == "a/b-1"
    assert recs[stream_id].context == "streamed" and recs[without.id].context is None


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize(
    "metadata, param, code",
    [
        ({"context": ""}, "metadata.context", "invalid_value"),
        ({"context": "x" * 65}, "metadata.context", "invalid_value"),
        ({"context": "two words"}, "metadata.context", "invalid_value"),
        ({"context": "tenant:key"}, "metadata.context", "invalid_value"),
        ({"context": 7}, "metadata.context", "invalid_value"),
        ({"team": "x"}, "metadata.team", "unknown_parameter"),
        ("add", "metadata", "invalid_value"),
    ],
)
def test_a_bad_context_key_is_refused(live, endpoint, metadata, param, code):
    body = {"model": "flywheel", "max_tokens": 4, "metadata": metadata}
    body |= {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    r = httpx.post(f"{live.url}/v1/{endpoint}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert err["message"]
