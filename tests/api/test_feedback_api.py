"""POST /v1/feedback against a live gateway with a real embedded bus and completion index.

Covers: single and batch events land on the feedback topic keyed by completion id; every bad input
gets a 4xx in the OpenAI shape naming the parameter; a batch with one bad event publishes nothing;
another tenant's completion is as unknown as a made-up one; idempotent retries (sequential and
concurrent) publish once; the reward inputs the gateway vouches for (time, user).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, FeedbackEvent, event_id_for, hash_user
from feedback.ingest import FeedbackIn, fingerprint
from registry.keys import KeyStore
from serving.engine import EmbeddedEngine
from tests.conftest import LiveServer

PROMPT = "# add 3 to x\ndef f(x):\n"
FP_RATING_4 = "v1:10942f2d289bbbe514aa4fa73123b2f1"


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("fbhome")
    settings = Settings(home=home, model_dir=tiny_checkpoint, max_batch=8, max_model_len=128)
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus = EmbeddedBus(home / "bus")
    index = CompletionIndex(home / "index.db")
    keys = KeyStore(settings.db_url)
    with LiveServer(create_app(settings, engine=engine, bus=bus, index=index)) as server:
        server.bus, server.index, server.version = bus, index, tiny_checkpoint.name
        server.engine, server.settings, server.keys, server.tokens = engine, settings, keys, {}
        yield server
    keys.close()
    engine.shutdown()
    bus.close()
    index.close()


def as_tenant(live, tenant: str) -> dict[str, str]:
    """Headers of a caller of `tenant`: local mode's one tenant ("default") by its header, any other
    with a key of its own (local mode refuses a header naming another tenant)."""
    if tenant == "default":
        return {"X-Flywheel-Tenant": tenant}
    if tenant not in live.tokens:
        live.tokens[tenant], _ = live.keys.create(["completions", "feedback:write"], tenant=tenant, label=tenant)
    return {"Authorization": f"Bearer {live.tokens[tenant]}"}


def new_completion(live, tenant: str = "default", stream: bool = False, user: str | None = None) -> str:
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 2, "stream": stream}
    if user is not None:
        body["user"] = user
    r = httpx.post(live.url + "/v1/completions", json=body, headers=as_tenant(live, tenant), timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
        return r.text.split('"id": "', 1)[1].split('"', 1)[0]
    return r.json()["id"]


@pytest.fixture(scope="module")
def cid(live) -> str:
    return new_completion(live)


def on_bus(live, completion_ids) -> list[tuple[str, FeedbackEvent]]:
    """(record key, event) of every feedback record about `completion_ids`, read by a fresh group."""
    ids, out = set(completion_ids), []
    consumer = live.bus.consumer(TOPICS["feedback"], "test-" + uuid.uuid4().hex[:8])
    try:
        while recs := consumer.poll(max_records=1000, timeout_s=0.05):
            for r in recs:
                ev = FeedbackEvent.model_validate_json(r.value)
                if ev.completion_id in ids:
                    out.append((r.key, ev))
    finally:
        consumer.close()
    return out


def post(live, body, tenant: str = "default", headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(
        live.url + "/v1/feedback", json=body, timeout=30, headers={**as_tenant(live, tenant), **(headers or {})}, **kw
    )


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    assert (err["param"], err["code"]) == (param, code), err


# ---- accepted events ----------------------------------------------------------------------------
def test_completion_is_indexed_before_the_response(live):
    for stream in (False, True):
        c = new_completion(live, tenant="idx-tenant", stream=stream)
        entry = live.index.get(c)
        assert entry is not None and entry.tenant == "idx-tenant" and entry.model_version == live.version
    assert live.index.get("cmpl-does-not-exist") is None


def test_single_event_is_published_keyed_by_completion_with_hashed_user(live):
    c = new_completion(live, user="alice")
    r = post(live, {"completion_id": c, "kind": "thumb_up", "user": "alice"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 1 and body["duplicates"] == 0 and len(body["event_ids"]) == 1
    [(key, ev)] = on_bus(live, [c])
    assert key == c and ev.kind == "thumb_up" and ev.value is None and ev.tenant == "default"
    assert ev.event_id == body["event_ids"][0]
    assert ev.user_id == hash_user("default", "alice") and "alice" not in ev.model_dump_json()


def test_batch_of_every_kind_is_published(live):
    c1, c2 = new_completion(live), new_completion(live, user="bob")
    events = [
        {"completion_id": c1, "kind": "thumb_up"},
        {"completion_id": c1, "kind": "thumb_down"},
        {"completion_id": c1, "kind": "rating", "value": 4},
        {"completion_id": c2, "kind": "accepted", "user": "bob"},
        {"completion_id": c2, "kind": "rejected"},
        {"completion_id": c2, "kind": "edited", "value": 0.75, "edit_distance": 9},
        {"completion_id": c2, "kind": "copied", "ts": 1_700_000_000.5},
        {"completion_id": c2, "kind": "regenerated"},
        {"completion_id": c2, "kind": "dwell", "value": 12.5},
    ]
    r = post(live, {"events": events})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 9 and body["duplicates"] == 0 and len(set(body["event_ids"])) == 9
    got = on_bus(live, [c1, c2])
    assert [ev.event_id for _, ev in got if ev.completion_id == c1] == body["event_ids"][:3]  # key order
    assert all(key == ev.completion_id for key, ev in got)
    by_kind = {ev.kind: ev for _, ev in got}
    assert len(got) == 9 and set(by_kind) == {e["kind"] for e in events}
    assert by_kind["rating"].value == 4 and by_kind["dwell"].value == 12.5
    assert by_kind["edited"].value == 0.75 and by_kind["edited"].edit_distance == 9
    assert by_kind["copied"].ts == live.index.get(c2).ts  # before it was served: clamped to the served time
    assert by_kind["accepted"].user_id == hash_user("default", "bob")


# ---- refused events -----------------------------------------------------------------------------
def _ev(**kw):
    return lambda cid: {"completion_id": cid, **kw}


def _batch(n_good: int, bad: dict):
    return lambda cid: {"events": [{"completion_id": cid, "kind": "copied"}] * n_good + [{"completion_id": cid, **bad}]}


BAD = [
    (_ev(kind="smile"), 400, "kind", "invalid_value"),
    (_ev(kind="rating", value=7), 400, "value", "invalid_value"),
    (_ev(kind="rating", value=4.5), 400, "value", "invalid_value"),
    (_ev(kind="rating"), 400, "value", "invalid_value"),
    (_ev(kind="rating", value="4"), 400, "value", "invalid_value"),
    (_ev(kind="rating", value=True), 400, "value", "invalid_value"),
    (_ev(kind="thumb_up", value=1), 400, "value", "invalid_value"),
    (_ev(kind="edited", value=1.5), 400, "value", "invalid_value"),
    (_ev(kind="dwell", value=-1), 400, "value", "invalid_value"),
    (_ev(kind="dwell", value=90_000), 400, "value", "invalid_value"),
    (_ev(kind="edited", value=0.5, edit_distance=-1), 400, "edit_distance", "invalid_value"),
    (_ev(kind="edited", value=0.5, edit_distance=2.5), 400, "edit_distance", "invalid_value"),
    (_ev(kind="copied", ts="yesterday"), 400, "ts", "invalid_value"),
    (_ev(kind="copied", user=42), 400, "user", "invalid_value"),
    (_ev(kind="copied", idempotency_key=""), 400, "idempotency_key", "invalid_value"),
    (_ev(kind="copied", mood="happy"), 400, "mood", "unknown_parameter"),
    (lambda cid: {"completion_id": cid}, 400, "kind", "missing_required_parameter"),
    (lambda cid: {"kind": "copied"}, 400, "completion_id", "missing_required_parameter"),
    (lambda cid: {"completion_id": 123, "kind": "copied"}, 400, "completion_id", "invalid_value"),
    (lambda cid: {"events": []}, 400, "events", "invalid_value"),
    (lambda cid: {"events": "x"}, 400, "events", "invalid_value"),
    (_batch(1000, {"kind": "copied"}), 400, "events", "invalid_value"),  # 1001 events
    (_batch(3, {"kind": "rating", "value": 9}), 400, "events.3.value", "invalid_value"),
    (_batch(1, {"kind": "nope"}), 400, "events.1.kind", "invalid_value"),
    (_ev(kind="copied", completion_id="cmpl-made-up"), 404, "completion_id", "completion_not_found"),
    (
        _batch(2, {"kind": "copied", "completion_id": "cmpl-made-up"}),
        404,
        "events.2.completion_id",
        "completion_not_found",
    ),
]


@pytest.mark.parametrize("make,status,param,code", BAD)
def test_bad_feedback_gets_openai_error_and_publishes_nothing(live, make, status, param, code):
    c = new_completion(live)
    assert_error(post(live, make(c)), status, param, code)
    assert on_bus(live, [c]) == []  # in a batch, the good events before the bad one were not published either


def test_malformed_bodies(live):
    r = httpx.post(live.url + "/v1/feedback", content=b"{not json", timeout=10)
    assert_error(r, 400, None, "invalid_json")
    assert_error(post(live, [1, 2]), 400, None, "invalid_request")
    r = post(live, {"completion_id": "x", "kind": "copied"}, headers={"Idempotency-Key": "a"})
    assert r.status_code == 404  # the header alone is fine; the id is not
    c = new_completion(live)
    r = post(live, {"completion_id": c, "kind": "copied", "idempotency_key": "a"}, headers={"Idempotency-Key": "b"})
    assert_error(r, 400, "idempotency_key", "invalid_value")
    assert on_bus(live, [c]) == []


def test_other_tenants_completion_is_not_found(live):
    theirs = new_completion(live, tenant="acme")
    r = post(live, {"completion_id": theirs, "kind": "thumb_up"}, tenant="default")
    assert_error(r, 404, "completion_id", "completion_not_found")
    made_up = post(live, {"completion_id": "cmpl-x", "kind": "thumb_up"}, tenant="default")
    message = r.json()["error"]["message"]
    assert message.replace(theirs, "?") == made_up.json()["error"]["message"].replace("cmpl-x", "?")
    r = post(live, {"events": [{"completion_id": theirs, "kind": "copied"}]}, tenant="other")
    assert_error(r, 404, "events.0.completion_id", "completion_not_found")
    assert on_bus(live, [theirs]) == []
    r = post(live, {"completion_id": theirs, "kind": "thumb_up"}, tenant="acme")
    assert r.status_code == 200
    [(_, ev)] = on_bus(live, [theirs])
    assert ev.tenant == "acme"


# ---- idempotency --------------------------------------------------------------------------------
def test_retried_request_is_acknowledged_but_published_once(live):
    c = new_completion(live)
    first = post(live, {"completion_id": c, "kind": "rating", "value": 5, "idempotency_key": "k1"}).json()
    again = post(live, {"completion_id": c, "kind": "rating", "value": 5, "idempotency_key": "k1"}).json()
    assert (first["accepted"], first["duplicates"]) == (1, 0)
    assert (again["accepted"], again["duplicates"]) == (0, 1) and again["event_ids"] == first["event_ids"]
    # The header works for single events; the same key from another tenant is another event.
    h1 = post(live, {"completion_id": c, "kind": "copied"}, headers={"Idempotency-Key": "k2"}).json()
    h2 = post(live, {"completion_id": c, "kind": "copied", "idempotency_key": "k2"}).json()
    assert h1["accepted"] == 1 and h2["duplicates"] == 1 and h1["event_ids"] == h2["event_ids"]
    # A batch retried with one new event publishes only the new one; a key twice in one batch counts once.
    b1 = post(live, {"events": [{"completion_id": c, "kind": "accepted", "idempotency_key": "k3"}]}).json()
    b2 = post(
        live,
        {
            "events": [
                {"completion_id": c, "kind": "accepted", "idempotency_key": "k3"},
                {"completion_id": c, "kind": "dwell", "value": 3, "idempotency_key": "k4"},
            ]
            + [{"completion_id": c, "kind": "dwell", "value": 3, "idempotency_key": "k4"}]
        },
    ).json()
    assert b1["accepted"] == 1 and (b2["accepted"], b2["duplicates"]) == (1, 2)
    assert b2["event_ids"][0] == b1["event_ids"][0] and b2["event_ids"][1] == b2["event_ids"][2]
    got = on_bus(live, [c])
    assert sorted(ev.kind for _, ev in got) == ["accepted", "copied", "dwell", "rating"]
    assert len({ev.event_id for _, ev in got}) == 4


def test_reused_key_for_a_different_event_is_refused(live):
    c = new_completion(live)
    r = post(live, {"completion_id": c, "kind": "rating", "value": 5, "idempotency_key": "r1"})
    assert r.status_code == 200
    r = post(live, {"completion_id": c, "kind": "rating", "value": 1, "idempotency_key": "r1"})
    assert_error(r, 409, "idempotency_key", "idempotency_key_reused")
    r = post(
        live,
        {
            "events": [
                {"completion_id": c, "kind": "copied", "idempotency_key": "r2"},
                {"completion_id": c, "kind": "accepted", "idempotency_key": "r2"},
            ]
        },
    )
    assert_error(r, 409, "events.1.idempotency_key", "idempotency_key_reused")
    r = post(
        live,
        {
            "events": [
                {"completion_id": c, "kind": "copied", "idempotency_key": "r3"},
                {"completion_id": c, "kind": "rating", "value": 2, "idempotency_key": "r1"},
            ]
        },
    )
    assert_error(r, 409, "events.1.idempotency_key", "idempotency_key_reused")
    assert [ev.value for _, ev in on_bus(live, [c])] == [5]
    # The refused batch released its claim on r3: it can be sent now.
    assert post(live, {"completion_id": c, "kind": "copied", "idempotency_key": "r3"}).json()["accepted"] == 1


def test_concurrent_retries_publish_once(live):
    c = new_completion(live)
    body = {"events": [{"completion_id": c, "kind": "copied", "idempotency_key": f"c{i}"} for i in range(20)]}

    async def burst():
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post(live.url + "/v1/feedback", json=body) for _ in range(6)))

    answers = [r.json() for r in asyncio.run(burst())]
    assert sum(a["accepted"] for a in answers) == 20 and sum(a["duplicates"] for a in answers) == 5 * 20
    got = on_bus(live, [c])
    assert len(got) == 20 and len({ev.event_id for _, ev in got}) == 20


def test_publish_failure_is_503_and_releases_the_claim(live, tmp_path):
    broken = EmbeddedBus(tmp_path / "bus")
    broken.close()  # a real bus that refuses every publish
    c = new_completion(live)
    app = create_app(live.settings, engine=live.engine, bus=broken, index=live.index)
    event = {"completion_id": c, "kind": "accepted", "idempotency_key": "p1"}
    with LiveServer(app) as other:
        r = httpx.post(other.url + "/v1/feedback", json=event, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "publish_failed"
    ok = post(live, event).json()  # the retry, through a healthy gateway, is not taken for a duplicate
    assert (ok["accepted"], ok["duplicates"]) == (1, 0) and len(on_bus(live, [c])) == 1


def test_requests_are_counted_by_route_and_status(live, cid):
    def count(status: str) -> float:
        for line in httpx.get(live.url + "/metrics").text.splitlines():
            if line.startswith(
                f'flywheel_requests_total{{endpoint="/v1/feedback",model_version="",status="{status}"}}'
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    ok, missing = count("200"), count("404")
    assert post(live, {"completion_id": cid, "kind": "thumb_up"}).status_code == 200
    assert post(live, {"events": [{"completion_id": cid, "kind": "copied"}] * 2}).status_code == 200
    assert post(live, {"completion_id": "cmpl-nope", "kind": "thumb_up"}).status_code == 404
    assert count("200") == ok + 2 and count("404") == missing + 1
    assert httpx.get(live.url + "/no/such/route").status_code == 404  # no route: not counted
    assert "/no/such/route" not in httpx.get(live.url + "/metrics").text


def test_fingerprints_are_stable_and_numbers_compare_as_numbers():
    """A key's fingerprint is stored with it: its form may not change silently (a retry across an
    upgrade would be refused as a reused key)."""
    item = FeedbackIn(completion_id="cmpl-1", kind="rating", value=4, user="u-1", idempotency_key="k")
    assert fingerprint(item, "default") == FP_RATING_4
    same = FeedbackIn(completion_id="cmpl-1", kind="rating", value=4.0, user="u-1", idempotency_key="other")
    assert fingerprint(same, "default") == fingerprint(item, "default")  # 4 and 4.0: one event; not the key
    for other in (
        {"value": 5},
        {"user": "u-2"},
        {"user": None},
        {"ts": 1.0e9},
        {"completion_id": "cmpl-2"},
        {"kind": "dwell", "value": 4.0},
    ):
        assert fingerprint(item.model_copy(update=other), "default") != fingerprint(item, "default"), other
    assert fingerprint(item, "other-tenant") != fingerprint(item, "default")  # the user hash is per tenant


def test_the_gateway_stores_the_fingerprint_of_the_event(live):
    c = new_completion(live, user="u-\u00e9")
    for extra in ({}, {"ts": 1.7e9, "user": "u-\u00e9", "value": 0.5, "edit_distance": 3}):
        key = f"fp-{uuid.uuid4()}"
        body = {"completion_id": c, "kind": "edited" if extra else "thumb_up", "idempotency_key": key, **extra}
        assert post(live, body).status_code == 200
        eid = event_id_for("default", key)
        assert live.index.claim({eid: fingerprint(FeedbackIn.model_validate(body), "default")}).done.keys() == {eid}
        assert live.index.claim({eid: "v1:something-else"}).mismatched == [eid]


# ---- reward inputs the gateway vouches for ------------------------------------------------------
def test_the_gateway_stamps_the_time_and_clamps_a_client_ts(live):
    c = new_completion(live, user="u1")
    served = live.index.get(c).ts
    t0 = time.time()
    events = [
        {"completion_id": c, "kind": "copied"},  # no ts: the receive time
        {"completion_id": c, "kind": "accepted", "ts": served - 3600},  # back-dated before it was served
        {"completion_id": c, "kind": "dwell", "value": 5, "ts": 4_000_000_000},  # from the future
        {"completion_id": c, "kind": "thumb_up", "ts": served + 0.001},
    ]  # inside: kept as sent
    assert post(live, {"events": events}).status_code == 200
    t1 = time.time()
    by_kind = {ev.kind: ev.ts for _, ev in on_bus(live, [c])}
    assert t0 <= by_kind["copied"] <= t1 and t0 <= by_kind["dwell"] <= t1
    assert by_kind["accepted"] == served and by_kind["thumb_up"] == served + 0.001


def test_feedback_from_another_user_is_refused(live):
    c = new_completion(live, user="alice")
    r = post(
        live,
        {
            "events": [
                {"completion_id": c, "kind": "thumb_up", "user": "alice"},
                {"completion_id": c, "kind": "thumb_down", "user": "mallory"},
            ]
        },
    )
    assert_error(r, 403, "events.1.user", "user_mismatch")
    assert_error(
        post(live, {"completion_id": c, "kind": "rating", "value": 1, "user": "mallory"}), 403, "user", "user_mismatch"
    )
    assert r.json()["error"]["type"] == "permission_error" and on_bus(live, [c]) == []
    # No user on the feedback: it is the completion's user's.
    assert post(live, {"completion_id": c, "kind": "copied"}).status_code == 200
    [(_, ev)] = on_bus(live, [c])
    assert ev.user_id == hash_user("default", "alice")


def test_feedback_on_a_completion_served_without_a_user_is_anonymous(live):
    c = new_completion(live)
    assert (
        post(
            live,
            {
                "events": [
                    {"completion_id": c, "kind": "thumb_up", "user": "someone"},
                    {"completion_id": c, "kind": "copied"},
                ]
            },
        ).status_code
        == 200
    )
    assert [ev.user_id for _, ev in on_bus(live, [c])] == [None, None]


def test_openapi_documents_the_feedback_body(live):
    """/openapi.json shows what POST /v1/feedback takes: one event or a batch of them."""
    doc = httpx.get(live.url + "/openapi.json", timeout=10).json()
    body = doc["paths"]["/v1/feedback"]["post"]["requestBody"]
    one, batch = body["content"]["application/json"]["schema"]["oneOf"]
    assert body["required"] is True and one["required"] == ["completion_id", "kind"]
    assert one["additionalProperties"] is False and "thumb_up" in one["properties"]["kind"]["enum"]
    events = batch["properties"]["events"]
    assert batch["required"] == ["events"] and events["items"] == one
    assert (events["minItems"], events["maxItems"]) == (1, 1000)
    assert "$ref" not in json.dumps(body)  # nothing points at a definition the document lacks


def test_local_mode_serves_one_tenant_and_another_needs_a_key(live):
    """No FLYWHEEL_API_KEYS: a request without a key is local mode's one tenant; a header cannot pick
    another (isolation rests on keys), on completions and on feedback alike."""
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(live.url + "/v1/completions", json=body, headers={"X-Flywheel-Tenant": "acme"}, timeout=30)
    assert_error(r, 403, None, "tenant_needs_key")
    assert "needs an API key of its own" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/feedback", json={"completion_id": "cmpl-x", "kind": "copied"},
                   headers={"X-Flywheel-Tenant": "acme"}, timeout=30)  # fmt: skip
    assert_error(r, 403, None, "tenant_needs_key")
    assert live.index.get(new_completion(live)).tenant == "default"  # no header: the local tenant
    assert live.index.get(new_completion(live, tenant="acme")).tenant == "acme"  # with acme's key


def test_feedback_after_the_attribution_window_is_not_recorded_and_the_answer_says_so(live):
    """With the joiner's window set (`serve` reads `rewards.window_s`), a new event received after its
    completion's window is listed in `window_closed` and not published, while the rest of its batch
    is; an event accepted in time and retried later is still acknowledged as a duplicate."""
    gw = live.app.state.gateway
    c, fresh = new_completion(live), None
    first = post(live, {"completion_id": c, "kind": "accepted", "idempotency_key": "w1"}).json()
    assert first["window_closed"] == []
    gw.feedback_window_s = 1.0
    try:
        time.sleep(1.1)
        fresh = new_completion(live)
        batch = {
            "events": [
                {"completion_id": c, "kind": "accepted", "idempotency_key": "w1"},
                {"completion_id": c, "kind": "copied", "idempotency_key": "w2"},
                {"completion_id": fresh, "kind": "copied", "idempotency_key": "w3"},
            ]
        }
        got = post(live, batch).json()
        assert (got["accepted"], got["duplicates"], got["window_closed"]) == (1, 1, [1])
        assert got["event_ids"][0] == first["event_ids"][0]
        gw.feedback_window_s = 600.0
        again = post(live, {"completion_id": c, "kind": "copied", "idempotency_key": "w2"}).json()
        assert again["accepted"] == 1  # the late key's claim was given back: nothing half-claimed
    finally:
        gw.feedback_window_s = None
    assert sorted(ev.kind for _, ev in on_bus(live, [c])) == ["accepted", "copied"]
    assert [ev.kind for _, ev in on_bus(live, [fresh])] == ["copied"]
