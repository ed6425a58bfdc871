"""POST /v1/feedback against a live gateway with a real embedded bus and completion index.

Covers: single and batch events land on the feedback topic keyed by completion id; every bad input
gets a 4xx in the OpenAI shape naming the parameter; a batch with one bad event publishes nothing;
another tenant's completion is as unknown as a made-up one; idempotent retries (sequential and
concurrent) publish once. Also the `CompletionIndex` itself (bounded idempotency record, claims).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

import httpx
import pytest

from api.main import create_app
from api.routes.feedback import FeedbackIn, event_id_for, fingerprint, fingerprint_f2, legacy_fingerprint
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex, _decode, _encode
from feedback.events import TOPICS, FeedbackEvent, hash_user
from feedback.sink import LogSink
from serving.engine import EmbeddedEngine
from tests.conftest import LiveServer

PROMPT = "# add 3 to x\ndef f(x):\n"


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("fbhome")
    settings = Settings(home=home, model_dir=tiny_checkpoint, max_batch=8, max_model_len=128)
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    sink, bus = LogSink(home / "records"), EmbeddedBus(home / "bus")
    index = CompletionIndex(home / "index.db")
    with LiveServer(create_app(settings, engine=engine, sink=sink, bus=bus, index=index)) as server:
        server.bus, server.index, server.version = bus, index, tiny_checkpoint.name
        server.engine, server.sink, server.settings = engine, sink, settings
        yield server
    engine.shutdown()
    sink.close()
    bus.close()
    index.close()


def new_completion(live, tenant: str = "default", stream: bool = False) -> str:
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 2, "stream": stream}
    r = httpx.post(live.url + "/v1/completions", json=body, headers={"X-Flywheel-Tenant": tenant}, timeout=30)
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
    return httpx.post(live.url + "/v1/feedback", json=body, timeout=30,
                      headers={"X-Flywheel-Tenant": tenant, **(headers or {})}, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code), err


# ---- accepted events ----------------------------------------------------------------------------
def test_completion_is_indexed_before_the_response(live):
    for stream in (False, True):
        c = new_completion(live, tenant="idx-tenant", stream=stream)
        entry = live.index.get(c)
        assert entry is not None and entry.tenant == "idx-tenant" and entry.model_version == live.version
    assert live.index.get("cmpl-does-not-exist") is None


def test_single_event_is_published_keyed_by_completion_with_hashed_user(live):
    c = new_completion(live)
    r = post(live, {"completion_id": c, "kind": "thumb_up", "user": "alice"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 1 and body["duplicates"] == 0 and len(body["event_ids"]) == 1
    [(key, ev)] = on_bus(live, [c])
    assert key == c and ev.kind == "thumb_up" and ev.value is None and ev.tenant == "default"
    assert ev.event_id == body["event_ids"][0]
    assert ev.user_id == hash_user("default", "alice") and "alice" not in ev.model_dump_json()


def test_batch_of_every_kind_is_published(live):
    c1, c2 = new_completion(live), new_completion(live)
    events = [{"completion_id": c1, "kind": "thumb_up"}, {"completion_id": c1, "kind": "thumb_down"},
              {"completion_id": c1, "kind": "rating", "value": 4},
              {"completion_id": c2, "kind": "accepted", "user": "bob"},
              {"completion_id": c2, "kind": "rejected"},
              {"completion_id": c2, "kind": "edited", "value": 0.75, "edit_distance": 9},
              {"completion_id": c2, "kind": "copied", "ts": 1_700_000_000.5},
              {"completion_id": c2, "kind": "regenerated"},
              {"completion_id": c2, "kind": "dwell", "value": 12.5}]
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
    assert by_kind["copied"].ts == 1_700_000_000.5
    assert by_kind["accepted"].user_id == hash_user("default", "bob")


# ---- refused events -----------------------------------------------------------------------------
def _ev(**kw):
    return lambda cid: {"completion_id": cid, **kw}


def _batch(n_good: int, bad: dict):
    return lambda cid: {"events": [{"completion_id": cid, "kind": "copied"}] * n_good
                        + [{"completion_id": cid, **bad}]}


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
    (_ev(kind="copied", ts=4_000_000_000), 400, "ts", "invalid_value"),
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
    (_batch(2, {"kind": "copied", "completion_id": "cmpl-made-up"}), 404, "events.2.completion_id",
     "completion_not_found"),
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
    r = post(live, {"completion_id": c, "kind": "copied", "idempotency_key": "a"},
             headers={"Idempotency-Key": "b"})
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
    b2 = post(live, {"events": [{"completion_id": c, "kind": "accepted", "idempotency_key": "k3"},
                                {"completion_id": c, "kind": "dwell", "value": 3, "idempotency_key": "k4"}]
                     + [{"completion_id": c, "kind": "dwell", "value": 3, "idempotency_key": "k4"}]}).json()
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
    r = post(live, {"events": [{"completion_id": c, "kind": "copied", "idempotency_key": "r2"},
                               {"completion_id": c, "kind": "accepted", "idempotency_key": "r2"}]})
    assert_error(r, 409, "events.1.idempotency_key", "idempotency_key_reused")
    r = post(live, {"events": [{"completion_id": c, "kind": "copied", "idempotency_key": "r3"},
                               {"completion_id": c, "kind": "rating", "value": 2, "idempotency_key": "r1"}]})
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
    app = create_app(live.settings, engine=live.engine, sink=live.sink, bus=broken, index=live.index)
    event = {"completion_id": c, "kind": "accepted", "idempotency_key": "p1"}
    with LiveServer(app) as other:
        r = httpx.post(other.url + "/v1/feedback", json=event, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "publish_failed"
    ok = post(live, event).json()  # the retry, through a healthy gateway, is not taken for a duplicate
    assert (ok["accepted"], ok["duplicates"]) == (1, 0) and len(on_bus(live, [c])) == 1


# ---- the index on its own -----------------------------------------------------------------------
def test_index_claims_confirm_release_and_stale_claims(tmp_path):
    idx = CompletionIndex(tmp_path / "i.db", stale_claim_s=10)
    c = idx.claim({"a": "fa", "b": "fb"}, now=100)
    assert c.claimed == ["a", "b"] and not c.done and not c.pending
    assert idx.claim({"a": "fa"}, now=101).pending == ["a"]  # still being published by the first claimer
    idx.confirm(["a"], now=102)
    idx.release(["b"])
    again = idx.claim({"a": "fa", "b": "fb"}, now=103)
    assert again.done == {"a": "fa"} and again.claimed == ["b"]
    assert idx.claim({"b": "fb"}, now=120).claimed == ["b"]  # its claimer died: claimable again
    idx.close()
    with pytest.raises(RuntimeError, match="closed"):
        idx.get("x")


def test_index_accepted_record_is_bounded_by_ttl_and_size(tmp_path):
    idx = CompletionIndex(tmp_path / "i.db", accepted_ttl_s=50, accepted_max=10, prune_every=10**9)
    for i in range(30):
        eid = f"e{i}"
        assert idx.claim({eid: "f"}, now=1000 + i).claimed == [eid]
        idx.confirm([eid], now=1000 + i)
    assert idx.accepted_count() == 30
    idx.prune(now=1030)  # nothing is older than the TTL yet: the row cap keeps the newest 10
    assert idx.accepted_count() == 10
    assert idx.claim({"e29": "f"}, now=1030).done == {"e29": "f"}  # the newest are kept
    assert idx.claim({"e0": "f"}, now=1030).claimed == ["e0"]  # the oldest are forgotten
    idx.confirm(["e0"], now=1030)
    idx.prune(now=1030 + 51)
    assert idx.accepted_count() == 0
    idx.add("c1", "t", "v1", ts=5.0)
    assert idx.get_many(["c1", "c2"]) == {"c1": ("t", "v1", 5.0)}
    idx.close()
    with pytest.raises(ValueError, match="accepted_max"):
        CompletionIndex(tmp_path / "j.db", accepted_max=0)


def test_index_prunes_as_it_writes_and_keeps_accepted_ids_across_a_restart(tmp_path):
    idx = CompletionIndex(tmp_path / "i.db", accepted_max=25, prune_every=10, write_every_s=0.02)
    for i in range(60):
        c = idx.claim({f"e{i}": "f"})
        idx.confirm(c.claimed)
    deadline = time.monotonic() + 10
    while idx._unwritten or idx._writing:  # written behind, without a flush
        assert time.monotonic() < deadline, "the confirmed ids were never written"
        time.sleep(0.02)
    assert 25 <= idx.accepted_count() < 60  # pruned to the cap on the way, within one prune period
    idx.confirm(idx.claim({"last": "f"}).claimed)
    idx.close()  # writes what is left
    again = CompletionIndex(tmp_path / "i.db")
    assert again.claim({"last": "f", "e59": "f", "new": "g"}) == (["new"], {"last": "f", "e59": "f"}, [])
    again.confirm(["never-claimed"])  # not claimed: nothing to confirm
    assert again.claim({"never-claimed": "f"}).claimed == ["never-claimed"]
    again.close()
    with pytest.raises(ValueError, match="write_every_s"):
        CompletionIndex(tmp_path / "k.db", write_every_s=0)


def test_index_finds_completions_beyond_its_memory(tmp_path):
    idx = CompletionIndex(tmp_path / "i.db", recent_max=2)
    for i in range(5):
        idx.add(f"c{i}", f"t{i}", "v1", ts=float(i))
    assert len(idx._recent) == 2  # the newest two in memory, all five in the table
    assert idx.get_many(["c0", "c4", "nope"]) == {"c0": ("t0", "v1", 0.0), "c4": ("t4", "v1", 4.0)}
    idx.add("c0", "other", "v2", ts=9.0)  # a second add replaces, in memory and in the table
    assert idx.get("c0") == ("other", "v2", 9.0)
    idx.close()
    again = CompletionIndex(tmp_path / "i.db", recent_max=0)
    assert again.get("c0") == ("other", "v2", 9.0) and again.get("c3") == ("t3", "v1", 3.0)
    again.close()
    with pytest.raises(ValueError, match="recent_max"):
        CompletionIndex(tmp_path / "k.db", recent_max=-1)


def test_index_checkpoints_its_log_in_the_background(tmp_path):
    path = tmp_path / "i.db"
    idx = CompletionIndex(path, checkpoint_every_s=0.05)
    assert idx._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # never inside a request's commit
    size0 = path.stat().st_size
    for i in range(3000):  # ~100 pages of log, under SQLite's automatic threshold (1000) anyway
        idx.add(f"c{i}", "t", "v1", ts=float(i))
    deadline = time.monotonic() + 10
    while path.stat().st_size <= size0:  # the pages reach the database file only by a checkpoint
        assert time.monotonic() < deadline, "no checkpoint ran"
        time.sleep(0.05)
    idx.close()
    wal = tmp_path / "i.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # closing leaves no log behind
    again = CompletionIndex(path)
    assert again.get("c2999") == ("t", "v1", 2999.0)
    again.close()
    with pytest.raises(ValueError, match="checkpoint_every_s"):
        CompletionIndex(tmp_path / "k.db", checkpoint_every_s=0)


def test_requests_are_counted_by_route_and_status(live, cid):
    def count(status: str) -> float:
        for line in httpx.get(live.url + "/metrics").text.splitlines():
            if line.startswith(f'flywheel_requests_total{{endpoint="/v1/feedback",model_version="",status="{status}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    ok, missing = count("200"), count("404")
    assert post(live, {"completion_id": cid, "kind": "thumb_up"}).status_code == 200
    assert post(live, {"events": [{"completion_id": cid, "kind": "copied"}] * 2}).status_code == 200
    assert post(live, {"completion_id": "cmpl-nope", "kind": "thumb_up"}).status_code == 404
    assert count("200") == ok + 2 and count("404") == missing + 1
    assert httpx.get(live.url + "/no/such/route").status_code == 404  # no route: not counted
    assert "/no/such/route" not in httpx.get(live.url + "/metrics").text


_HEX_IDS = [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(2502)]


@pytest.mark.parametrize("style", ["hex", "text"])
def test_index_writes_accepted_ids_as_one_row_per_batch(tmp_path, style):
    """The write-behind stores a batch as one row (ids in confirmation order, their fingerprints and
    ms): packed bytes for the gateway's ids (32 hex digits, fingerprints of one width), JSON for
    any other; a new index reads them back; a retry of a written id finds its fingerprint there."""
    name = (lambda i: _HEX_IDS[i]) if style == "hex" else (lambda i: f"e{i}")
    idx = CompletionIndex(tmp_path / "i.db")
    ids = {name(i): f"fp{i % 7}" for i in range(2500)}
    now = time.time()  # within the TTL: the write-behind's pruning keeps them
    idx.confirm(idx.claim(ids, now=now).claimed, now=now + 0.25)
    idx.flush()
    idx.confirm(idx.claim({"late": "fl"}, now=now).claimed, now=now + 1)  # not hex: a JSON row
    idx.flush()
    rows = idx._db.execute("SELECT first_seq, n, last_ts, ids FROM accepted_batches ORDER BY first_seq").fetchall()
    ms = round((now + 0.25) * 1000)  # kept to the millisecond
    assert [r[:3] for r in rows] == [(0, 2500, ms / 1000), (2500, 1, round((now + 1) * 1000) / 1000)]
    assert type(rows[0][3]) is (bytes if style == "hex" else str) and type(rows[1][3]) is str
    assert len(rows[0][3]) == (2 + 2500 * (16 + 8 + 3) if style == "hex" else len(rows[0][3]))
    assert _decode(rows[0][3]) == [list(ids), list(ids.values()), [ms] * 2500]
    assert idx.accepted_count() == 2501
    idx.close()
    again = CompletionIndex(tmp_path / "i.db")
    assert again.claim({name(5): "x", name(2499): "y", "late": "z", "new": "n"}) == (
        ["new"], {name(5): "fp5", name(2499): "fp0", "late": "fl"}, [])  # 2499 % 7 == 0
    assert again.accepted_count() == 2501
    again.close()


def test_index_packs_only_what_it_can_give_back_exactly():
    """A batch is packed only when every id is 32 lowercase hex digits and the fingerprints share
    one width; anything else (upper case, other lengths, mixed widths, non-ASCII) stays JSON."""
    h = _HEX_IDS
    assert type(_encode({h[0]: ("f3" + "a" * 16, 1), h[1]: ("f3" + "b" * 16, 2)})[3]) is bytes
    for batch in ({h[0].upper(): ("f3", 1)}, {h[0][:30]: ("f3", 1)}, {h[0] + "00": ("f3", 1)},
                  {"ab" * 8: ("f3", 1), "cd" * 24: ("f3", 2)},  # 16 + 48 hex digits: 32 each on average
                  {h[0]: ("f3", 1.5)}, {h[0]: ("f3", 1 << 70)},  # ms that are no int64
                  {h[0]: ("f3ab", 1), h[1]: ("legacy", 2)}, {h[0]: ("é", 1)}, {h[0]: ("", 1)}):
        n, first_ts, last_ts, ids = _encode(batch)
        assert type(ids) is str and _decode(ids) == [list(batch), *map(list, zip(*batch.values()))], batch
    n, first_ts, last_ts, ids = _encode({h[0]: ("f3x", 5000), h[1]: ("f3y", 1000)})  # the clock went back
    assert (n, first_ts, last_ts) == (2, 1.0, 5.0) and _decode(ids) == [[h[0], h[1]], ["f3x", "f3y"], [5000, 1000]]


@pytest.mark.parametrize("old", ["accepted_events", "accepted_log"])
def test_index_takes_over_the_accepted_ids_of_earlier_tables(tmp_path, old):
    """Databases of the versions that kept one row per accepted id -- `accepted_events` (keyed by
    event id, with a state column; only done ids count) or `accepted_log` (by seq): the ids move to
    batch rows, oldest first, the old table goes, and they are still duplicates after."""
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    now = time.time()
    if old == "accepted_events":
        db.executescript("""
            CREATE TABLE accepted_events (event_id TEXT PRIMARY KEY, state INTEGER NOT NULL,
                fingerprint TEXT NOT NULL, ts REAL NOT NULL);
            CREATE INDEX accepted_events_ts ON accepted_events (ts);""")
        db.executemany("INSERT INTO accepted_events VALUES (?, ?, ?, ?)",
                       [("b", 1, "fb", now + 2), ("a", 1, "fa", now + 1), ("p", 0, "fp", now + 3)])
    else:
        db.execute("CREATE TABLE accepted_log (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL, "
                   "fingerprint TEXT NOT NULL, ts REAL NOT NULL)")
        db.executemany("INSERT INTO accepted_log VALUES (?, ?, ?, ?)",
                       [(7, "b", "fb", now + 2), (6, "a", "fa", now + 1)])  # pruned up to seq 6
    db.commit()
    db.close()
    idx = CompletionIndex(path)
    assert idx.claim({"a": "fa", "b": "fb", "p": "fp", "n": "fn"}) == (["p", "n"], {"a": "fa", "b": "fb"}, [])
    assert idx._db.execute("SELECT first_seq, n FROM accepted_batches").fetchall() == [(0, 2)]
    assert idx._db.execute(f"SELECT name FROM sqlite_master WHERE name LIKE '{old}%'").fetchall() == []
    idx.confirm(["p", "n"])
    idx.flush()
    assert idx._db.execute("SELECT first_seq, n FROM accepted_batches").fetchall() == [(0, 2), (2, 2)]
    idx.close()
    again = CompletionIndex(path)
    assert again.claim({"a": "x", "n": "y"}).done == {"a": "fa", "n": "fn"}
    again.close()


def test_index_opens_a_batch_table_without_first_ts(tmp_path):
    """`accepted_batches` as it was first written had no `first_ts`: the column is added (0 for the
    old rows), the ids are still duplicates, and the TTL still cuts inside such a row."""
    import sqlite3

    path = tmp_path / "i.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE accepted_batches (first_seq INTEGER PRIMARY KEY, n INTEGER NOT NULL, "
               "last_ts REAL NOT NULL, ids TEXT NOT NULL)")
    db.execute("INSERT INTO accepted_batches VALUES (0, 3, 1002.0, ?)",
               (json.dumps([["a", "b", "c"], ["fa", "fb", "fc"], [1000_000, 1001_000, 1002_000]]),))
    db.commit()
    db.close()
    idx = CompletionIndex(path, accepted_ttl_s=100, prune_every=10**9)
    assert idx.claim({"b": "x"}, now=1050).done == {"b": "fb"}
    idx.confirm(idx.claim({"d": "fd"}, now=1050).claimed, now=1050)
    idx.prune(now=1101.5)  # a and b are past the TTL
    assert idx.claim({"a": "x", "c": "y", "d": "z"}, now=1102) == (["a"], {"c": "fc", "d": "fd"}, [])
    assert idx.accepted_count() == 2
    idx.close()


@pytest.mark.parametrize("style", ["hex", "text"])
def test_index_prunes_inside_a_batch_row(tmp_path, style):
    """The TTL and the cap cut the ids where they fall, also inside one batch row (packed or JSON):
    the row keeps its newer ids, which stay duplicates (after a restart too); the older ones are
    forgotten."""
    e = (lambda i: _HEX_IDS[i]) if style == "hex" else (lambda i: f"e{i}")
    idx = CompletionIndex(tmp_path / "i.db", accepted_ttl_s=100, accepted_max=1000, prune_every=10**9)
    for i in range(6):  # one batch of ids confirmed at 1000..1005
        idx.confirm(idx.claim({e(i): f"f{i}"}, now=1000 + i).claimed, now=1000 + i)
    idx.flush()
    idx.prune(now=1102.5)  # ids confirmed before 1002.5 are past the TTL
    assert idx.accepted_count() == 3
    assert idx._db.execute("SELECT first_seq, n, typeof(ids) FROM accepted_batches").fetchall() == [
        (3, 3, "blob" if style == "hex" else "text")]
    assert idx.claim({e(2): "f2", e(3): "x", e(5): "y"}, now=1103) == ([e(2)], {e(3): "f3", e(5): "f5"}, [])
    idx.close()
    again = CompletionIndex(tmp_path / "i.db", accepted_ttl_s=100, prune_every=10**9)
    assert again.claim({e(3): "x", e(0): "z"}, now=1103) == ([e(0)], {e(3): "f3"}, [])
    again.close()


def test_index_tells_apart_two_asked_ids_of_one_hash(tmp_path, monkeypatch):
    """Two ids of one claim with the same hash (forced here): the written one is found as done,
    the other is claimed."""
    import builtins

    import feedback.completion_index as ci

    monkeypatch.setattr(ci, "hash", lambda s: 7 if s in ("x1", "x2") else builtins.hash(s), raising=False)
    idx = CompletionIndex(tmp_path / "i.db")
    idx.confirm(idx.claim({"x1": "f1"}).claimed)
    idx.flush()
    assert idx.claim({"x1": "f1", "x2": "f2"}) == (["x2"], {"x1": "f1"}, [])
    idx.close()


def test_index_checks_a_hash_match_against_the_stored_id(tmp_path):
    """Written ids are found in memory by hash; a different id whose hash matches a stored row's
    (forced here) is not taken for that row's duplicate."""
    idx = CompletionIndex(tmp_path / "i.db")
    idx.confirm(idx.claim({"known": "f1"}).claimed)
    idx.flush()
    seq = idx._accepted[hash("known")]
    idx._accepted[hash("stranger")] = seq  # as if "stranger" hashed like "known"
    assert idx.claim({"stranger": "f2", "known": "f1"}) == (["stranger"], {"known": "f1"}, [])
    idx.close()


@pytest.mark.parametrize("on_loop", [True, False])
def test_feedback_is_written_on_the_loop_when_the_bus_is_idle(live, cid, monkeypatch, on_loop):
    """settings.feedback_write_on_loop: the events are written by `publish_many_now` on the event
    loop (the bus's writer is idle between these requests); off, they go to the writer thread.
    Either way they are on the bus once the answer comes."""
    calls = []
    now, later = live.bus.publish_many_now, live.bus.publish_many_async
    monkeypatch.setattr(live.bus, "publish_many_now", lambda *a: calls.append(("now", ok := now(*a))) or ok)
    monkeypatch.setattr(live.bus, "publish_many_async", lambda *a: calls.append(("async", None)) or later(*a))
    monkeypatch.setattr(live.settings, "feedback_write_on_loop", on_loop)
    events = [{"completion_id": cid, "kind": k, "idempotency_key": f"loop-{uuid.uuid4()}"} for k in ("copied", "accepted")]
    r = post(live, {"events": events})
    assert r.status_code == 200 and r.json()["accepted"] == 2
    assert calls == ([("now", True)] if on_loop else [("async", None)])
    assert {ev.event_id for _, ev in on_bus(live, [cid])} >= set(r.json()["event_ids"])


def test_a_failed_write_on_the_loop_answers_503_and_leaves_nothing_claimed(live, cid, monkeypatch):
    """The loop's own write failing is a publish failure like any other: 503, the keys released
    (the retry is accepted), nothing counted as publishing."""
    def broken(topic, records):
        raise OSError("disk gone")

    monkeypatch.setattr(live.bus, "publish_many_now", broken)
    body = {"completion_id": cid, "kind": "copied", "idempotency_key": f"broken-{uuid.uuid4()}"}
    r = post(live, body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "publish_failed"
    assert r.headers["retry-after"] == "1"
    monkeypatch.undo()
    assert live.server.config.app.state.gateway.feedback_publishing == 0
    r = post(live, body)
    assert r.status_code == 200 and r.json()["accepted"] == 1


def test_a_large_batch_goes_to_the_writer_thread(live, cid, monkeypatch):
    """Over LOOP_WRITE_MAX_BYTES of events the loop does not wait for the disk itself."""
    from api.routes.feedback import LOOP_WRITE_MAX_BYTES

    calls = []
    now = live.bus.publish_many_now
    monkeypatch.setattr(live.bus, "publish_many_now", lambda *a: calls.append("now") or now(*a))
    events = [{"completion_id": cid, "kind": "dwell", "value": 1.0, "user": f"u{i}"} for i in range(400)]
    r = post(live, {"events": events})
    assert r.status_code == 200 and r.json()["accepted"] == 400 and calls == []
    ids = set(r.json()["event_ids"])  # their wire form (= the model's JSON, tested) is over the bound
    assert sum(len(ev.model_dump_json()) for _, ev in on_bus(live, [cid]) if ev.event_id in ids) > LOOP_WRITE_MAX_BYTES
    r = post(live, {"events": events[:2]})
    assert r.status_code == 200 and calls == ["now"]


def test_requests_ready_together_leave_the_write_to_the_writer_thread(tmp_path):
    """A request writes on the loop only if it is alone: requests that reach their publish in the
    same pass of the loop all go to the writer thread (one group commit), a later lone one does
    not; with the setting off, none does."""
    import types

    from api.routes.feedback import _alone_to_publish

    gw = types.SimpleNamespace(settings=Settings(home=tmp_path), feedback_publishing=0)

    async def publish() -> bool:  # as the route: counted from its publish until its events are durable
        gw.feedback_publishing += 1
        try:
            alone = await _alone_to_publish(gw, [("cmpl-1", b"x" * 100)])
            await asyncio.sleep(0 if alone else 0.01)  # on the loop: done; else: waits for the group commit
            return alone
        finally:
            gw.feedback_publishing -= 1

    async def scenario() -> tuple:
        together = await asyncio.gather(*(publish() for _ in range(3)))
        return together, await publish()

    assert asyncio.run(scenario()) == ([False, False, False], True)
    gw.feedback_publishing = 1  # this request alone
    assert asyncio.run(_alone_to_publish(gw, [("cmpl-1", b"x" * (64 << 10))])) is True  # at the bound
    assert asyncio.run(_alone_to_publish(gw, [("cmpl-1", b"x" * (64 << 10)), ("cmpl-2", b"x")])) is False
    gw.feedback_publishing = 0
    gw.settings = Settings(home=tmp_path, feedback_write_on_loop=False)
    assert asyncio.run(scenario()) == ([False, False, False], False)


def test_fingerprints_are_stable_and_numbers_compare_as_numbers():
    """An idempotency key's fingerprint is stored with the accepted id: its form may never change
    silently (a retry across an upgrade would be refused as a reused key)."""
    item = FeedbackIn(completion_id="cmpl-1", kind="rating", value=4, user="u-1", idempotency_key="k")
    assert fingerprint(item, "default") == "f3277a19cdb99fda35"
    assert fingerprint(item.model_copy(update={"ts": 1.7e9}), "default") == "f34ea005b6bbb52d12"
    assert fingerprint_f2(item) == "f2bd87049764b256b1"  # what versions before "f3" stored
    assert legacy_fingerprint(item) == "6c9eae12b59a097a"  # what versions before "f2" stored
    same = FeedbackIn(completion_id="cmpl-1", kind="rating", value=4.0, user="u-1", idempotency_key="other")
    assert fingerprint(same, "default") == fingerprint(item, "default")  # 4 and 4.0: one event; not the key
    for other in ({"value": 5}, {"user": "u-2"}, {"user": None}, {"ts": 1.0e9}, {"completion_id": "cmpl-2"},
                  {"kind": "dwell", "value": 4.0}):
        changed = item.model_copy(update=other)
        assert fingerprint(changed, "default") != fingerprint(item, "default"), other
        assert fingerprint_f2(changed) != fingerprint_f2(item), other


def test_the_gateway_stores_the_fingerprint_of_the_event(live, cid):
    """What the route stores for a key (made from the parts it formats for the wire) is
    `fingerprint(event, tenant)`, for an event with and without its own ts."""
    for extra in ({}, {"ts": 1.7e9, "user": "u-\u00e9", "value": 0.5, "edit_distance": 3}):
        key = f"fp-{uuid.uuid4()}"
        body = {"completion_id": cid, "kind": "edited" if extra else "thumb_up", "idempotency_key": key, **extra}
        assert post(live, body).status_code == 200
        claim = live.index.claim({event_id_for("default", key): "f3-anything"})
        assert claim.done == {event_id_for("default", key): fingerprint(FeedbackIn.model_validate(body), "default")}


@pytest.mark.parametrize("prefix", ["f2", "f3"])
def test_a_legacy_fingerprint_that_starts_like_a_newer_one_is_still_legacy(live, cid, prefix):
    """A legacy fingerprint is 16 hex digits, and 2 in 256 of them start with "f2" or "f3": the
    version is told by the length, so a retry of such an id is still its duplicate."""
    body = next(b for i in range(100_000) if legacy_fingerprint(FeedbackIn.model_validate(
        b := {"completion_id": cid, "kind": "dwell", "value": float(i), "user": "u-legacy"})).startswith(prefix))
    body["idempotency_key"] = key = f"legacy-{prefix}-{uuid.uuid4()}"
    eid = event_id_for("default", key)
    live.index.confirm(live.index.claim({eid: legacy_fingerprint(FeedbackIn.model_validate(body))}).claimed)
    r = post(live, body)
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 1, "event_ids": [eid]}
    assert post(live, {**body, "value": body["value"] + 0.5}).status_code == 409


@pytest.mark.parametrize("stored_by", [legacy_fingerprint, fingerprint_f2])
def test_a_retry_of_an_event_accepted_under_an_earlier_fingerprint(live, cid, stored_by):
    """Ids accepted before the "f3" fingerprints hold an earlier one ("f2", or the legacy one before
    it): the same event again is a duplicate, a different event with the key is still refused."""
    key = f"legacy-{uuid.uuid4()}"
    body = {"completion_id": cid, "kind": "rating", "value": 4, "idempotency_key": key}
    eid = event_id_for("default", key)
    claim = live.index.claim({eid: stored_by(FeedbackIn.model_validate(body))})
    live.index.confirm(claim.claimed)
    r = post(live, body)
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 1, "event_ids": [eid]}
    r = post(live, {**body, "value": 5})
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"


_BODIES = [  # batches: (JSON text, Idempotency-Key header)
    ('{"events": [{"completion_id": "c1", "kind": "thumb_up"}]}', None),
    ('{"events": [{"completion_id": "c1", "kind": "rating", "value": 4, "ts": 1700000000, "user": "u\\u00e9",'
     ' "idempotency_key": "k1"}, {"completion_id": "c2", "kind": "edited", "value": 0.25, "edit_distance": 3},'
     ' {"completion_id": "c3", "kind": "dwell", "value": 12.5, "ts": 1700000000.25}]}', "h"),
    ('{"events":[{"completion_id":"c1","kind":"rating","value":4,"value":5}]}', None),  # last one wins
    ('{"events": [{"completion_id": "c\\ud800", "kind": "copied"}]}', None),  # a lone surrogate
    # refused, each for its own reason:
    ('{"events": [{"completion_id": "c1", "kind": "thumbs"}]}', None),
    ('{"events": [{"completion_id": "c1", "kind": "rating", "value": "4"}]}', None),
    ('{"events": [{"completion_id": "c1", "kind": "dwell", "value": NaN}]}', None),
    ('{"events": [{"completion_id": "c1", "kind": "dwell", "value": 1e999}]}', None),
    ('{"events": [{"completion_id": "c1", "kind": "edited", "edit_distance": 2.0}]}', None),
    ('{"events": [], "more": 1}', None),
    ('{"events": []}', None),
    ('{"events": [{"completion_id": "c1", "kind": "thumb_up"}]}', ""),
    ('{"events": [{"completion_id": "c1", "kind": "thumb_up"}] trailing', None),
]


@pytest.mark.parametrize("text,header", _BODIES)
def test_batch_fast_path_parses_as_the_full_path(text, header):
    """A batch body starting `{"events"` is validated straight from the bytes; any other spelling
    goes through json.loads and the models. Both give the same events and keys, and a refused body
    the same error (the fast path hands what it refuses to the full one)."""
    from fastapi.exceptions import RequestValidationError

    from api.errors import APIError
    from api.routes.feedback import _parse

    def outcome(raw: bytes):
        try:
            items, prefix = _parse(raw, header)
        except RequestValidationError as e:
            return "invalid", e.errors()
        except APIError as e:
            return "api", e.status, e.code, e.param  # (the message quotes positions in the text)
        return [(it.model_dump(), type(it.value), key) for it, key in items], prefix

    fast = text.encode()
    slow = fast.replace(b'{"events"', b'{\n"events"', 1)  # not the fast path's prefix
    assert slow != fast
    assert outcome(fast) == outcome(slow)


def test_batch_fast_path_is_taken_for_a_valid_batch(monkeypatch):
    """The SDK's batch spelling never reaches json.loads (it is validated from the bytes); another
    spelling of the same body does."""
    import types

    import api.routes.feedback as route

    calls = []
    monkeypatch.setattr(route, "json", types.SimpleNamespace(loads=lambda raw: calls.append(raw) or json.loads(raw)))
    body = b'{"events": [{"completion_id": "c1", "kind": "thumb_up"}]}'
    assert route._parse(body, None)[1] == ("events",) and calls == []
    assert route._parse(body.replace(b"{", b"{ ", 1), None)[1] == ("events",) and len(calls) == 1


def test_accepted_feedback_reports_its_stages(live, cid):
    """An accepted request says how long it spent before the publish and waiting for the events to
    be on disk (Server-Timing), and /metrics counts both stages."""
    import re

    def count(stage: str) -> float:
        for line in httpx.get(live.url + "/metrics").text.splitlines():
            if line.startswith(f'flywheel_feedback_stage_seconds_count{{stage="{stage}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("validate"), count("commit")
    r = post(live, {"events": [{"completion_id": cid, "kind": "copied"}, {"completion_id": cid, "kind": "thumb_up"}]})
    assert r.status_code == 200
    m = re.fullmatch(r"validate;dur=(\d+\.\d\d), commit;dur=(\d+\.\d\d)", r.headers["server-timing"])
    assert m and float(m[2]) > 0, r.headers["server-timing"]  # the disk write takes time
    assert (count("validate"), count("commit")) == (before[0] + 1, before[1] + 1)
    assert post(live, {"completion_id": "cmpl-nope", "kind": "thumb_up"}).status_code == 404  # refused: not counted
    assert (count("validate"), count("commit")) == (before[0] + 1, before[1] + 1)


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
