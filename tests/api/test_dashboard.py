"""The dashboard without a browser, against a live gateway: sign-in and the session cookie's flags,
who may see and do what (anonymous, viewer, admin, a revoked key), CSRF on every form, actions that
go through the admin API's code path and are audited with the key's owner, refused actions that
change nothing, and the pages' content."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from api.dashboard.svg import Series, chart
from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from gating.canary import CanaryOutcomes
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.api.test_admin_api import files
from tests.conftest import LiveServer


def offline_numbers(cand: float, inc: float, passed: bool = True) -> dict:
    return {
        "reward": {"candidate": cand, "incumbent": inc},
        "non_inferiority": {"mean_diff": cand - inc, "lower_bound": cand - inc - 0.02, "margin": 0.03,
                            "alpha": 0.05, "passed": passed, "n_prompts": 20},
        "families": {"add": {"n_prompts": 10, "candidate": cand, "incumbent": inc, "mean_diff": cand - inc,
                             "lower_bound": -0.01, "p_value": 0.01, "passed": True}},
        "checks": {"non_inferiority": passed, "families": True, "length": True, "malformed": True,
                   "repetition": True, "kl": True},
        "suite": {"n_prompts": 20}, "sampling": {"G": 2},
    }  # fmt: skip


def to_awaiting_approval(reg: Registry, vid: str, cand: float = 0.5) -> None:
    """As the gate takes a candidate through: offline verdict, canary with counts, awaiting approval."""
    inc = reg.incumbent().id
    reg.transition(vid, "evaluating", "gate", "offline eval")
    verdict = {"passed": True, "incumbent_id": inc, "artifact_sha256": reg.get(vid).artifact_sha256,
               "suite_version": "s1", "numbers": offline_numbers(cand, 0.4)}  # fmt: skip
    reg.record_gate(vid, "offline", verdict, "gate")
    reg.transition(vid, "canary", "gate", "offline passed")
    # per user: reward n, sum, sum of squares; latency n, sum; errors; verifier-scored n, sum; TTFT n, sum; TPOT n, sum
    counts = CanaryOutcomes(steps={0: {"candidate": {"u1": [2, 1.0, 0.5, 2, 200.0, 0, 2, 1.0, 2, 40.0, 2, 30.0], "u2": [1, 0.5, 0.25, 1, 90.0, 0, 1, 1.0, 1, 20.0, 1, 15.0]},
                                       "incumbent": {"u3": [1, 0.0, 0.0, 1, 80.0, 0, 1, 0.0, 1, 20.0, 1, 15.0], "u4": [1, 1.0, 1.0, 1, 95.0, 1, 1, 1.0, 1, 21.0, 1, 16.0]}}})  # fmt: skip
    history = [{"t": 1.0, "step": 0, "share": 0.5, "users": {"candidate": 1, "incumbent": 1}},
               {"t": 2.0, "step": 0, "share": 0.5, "users": {"candidate": 2, "incumbent": 2},
                "diff": [0.25, -0.01, 0.5], "means": {"candidate": 0.5, "incumbent": 0.25}}]  # fmt: skip
    progress = {"step": 0, "share": 0.5, "started_at": datetime.now(UTC), "counts": counts.to_dict(),
                "history": history, "rho": 5.0, "expected_users": 41.0, "expected_from": "measured",
                "active_s": 2.0, "lapsed_s": 30.0}  # fmt: skip
    reg.record_gate(vid, "canary", progress, "gate")
    numbers = {"margin": 0.03, "alpha": 0.05, "share": 0.5, "users": {"candidate": 2, "incumbent": 2},
               "reward": {"lower": -0.01, "upper": 0.5, "estimate": 0.25, "se": 0.1, "radius": 0.26},
               "srm": {"statistic": 0.0, "p_value": 1.0, "threshold": 0.001}}  # fmt: skip
    reg.transition(vid, "awaiting_approval", "gate", "canary passed", numbers)


COUNTED = {  # the learner's counters: the last update's shares, and the sums since the parent
    "masked_frac": 0.0364,
    "since_parent": {"samples": 2048, "masked_tokens": 1761, "replay_off_micro_batches": 3, "dropped_lag": 57},
}


@pytest.fixture
def live(tiny_checkpoint, tmp_path):
    settings = Settings(home=tmp_path, model_dir=tiny_checkpoint)
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(settings.db_url)
    reg.bootstrap("base", files=files("base"))
    poisoning = {
        "users": 12,
        "flagged_users": 1,
        "flagged_samples": 9,
        "flagged_reward_share": 0.41,
        "flags": [{"user": "u9abcdef", "reasons": ["share 41.0% of the reward > 20.0%"]}],
    }
    reg.register(version_id="v1", parent_id="base", files=files("v1"), metrics={"reward_mean": 0.25, "poisoning": poisoning, **COUNTED},
                 data_range={"feedback.samples": {0: (0, 40), 1: (0, 24)}})  # fmt: skip
    to_awaiting_approval(reg, "v1")
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.reg, server.keys = reg, keys
        server.admin_token, server.admin_key = keys.create(["admin"], label="alice")
        server.viewer_token, server.viewer_key = keys.create(["viewer"], label="bob")
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def sign_in(live, token: str) -> httpx.Client:
    c = httpx.Client(base_url=live.url, timeout=30)
    page = c.get("/dashboard/login")
    r = c.post("/dashboard/login", data={"key": token, "csrf": csrf_of(page.text), "next": "/dashboard/versions"})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/versions", r.text
    return c


def test_anonymous_visitors_get_the_sign_in_page_and_no_data(live):
    for path in ("/dashboard/versions", "/dashboard/versions/v1", "/dashboard/fleet", "/dashboard"):
        r = httpx.get(live.url + path, follow_redirects=True, timeout=30)
        assert r.status_code == 200 and r.url.path == "/dashboard/login", path
        # The page asked for and the random CSRF token (which may spell "v1") are not data.
        shown = re.sub(r'name="(next|csrf)" value="[^"]*"', "", r.text)
        assert "v1" not in shown and "base" not in shown and "promoted" not in shown and 'id="key"' in shown
    r = httpx.post(live.url + "/dashboard/versions/v1/approve", data={"reason": "x", "csrf": "x"}, timeout=30)
    assert r.status_code == 401 and live.reg.get("v1").status == "awaiting_approval"


def test_sign_in_sets_a_strict_httponly_expiring_cookie_and_refuses_bad_keys(live):
    c = httpx.Client(base_url=live.url, timeout=30)
    page = c.get("/dashboard/login")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    token = csrf_of(page.text)
    assert c.post("/dashboard/login", data={"key": "fw_nope", "csrf": token}).status_code == 401
    completions = live.keys.create(["completions"])[0]
    r = c.post("/dashboard/login", data={"key": completions, "csrf": csrf_of(page.text)})
    assert r.status_code == 403 and "viewer" in r.text and "fw_session" not in r.headers.get("set-cookie", "")
    fresh = httpx.Client(base_url=live.url, timeout=30)  # a form posted without its nonce cookie (another site's form)
    assert fresh.post("/dashboard/login", data={"key": live.admin_token, "csrf": token}).status_code == 403
    r = c.post("/dashboard/login", data={"key": live.admin_token, "csrf": csrf_of(c.get("/dashboard/login").text)})
    assert r.status_code == 303
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("fw_session="))
    flags = {f.strip().split("=")[0].lower(): f.strip() for f in cookie.split(";")[1:]}
    assert {"httponly", "max-age", "path", "samesite"} <= set(flags) and "secure" not in flags  # local mode
    assert flags["samesite"].lower() == "samesite=strict" and flags["path"] == "Path=/dashboard"
    assert flags["max-age"] == "Max-Age=28800"
    assert live.admin_token not in cookie
    assert c.get("/dashboard/versions").status_code == 200


def test_outside_local_mode_the_cookie_is_secure_and_a_session_secret_is_required(tiny_checkpoint, tmp_path):
    engine = EmbeddedEngine(max_batch=2, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    base = {"home": tmp_path, "model_dir": tiny_checkpoint, "env": "production", "api_keys": ["t:k"],
            "limit_completions_per_s": 10, "limit_feedback_events_per_s": 100}  # fmt: skip
    with pytest.raises(ValueError, match="FLYWHEEL_SESSION_SECRET"):
        create_app(Settings(**base), engine=engine)
    with pytest.raises(ValueError, match="at least 32"):
        create_app(Settings(**base, session_secret="short"), engine=engine)
    settings = Settings(**base, session_secret="s" * 40)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(settings.db_url)
    reg.bootstrap("base", files=files("base"))
    token = KeyStore(settings.db_url).create(["viewer"])[0]
    try:
        with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg)) as server:
            c = httpx.Client(base_url=server.url, timeout=30)
            login = c.get("/dashboard/login")
            assert "secure" in login.headers["set-cookie"].lower()  # the sign-in nonce too
            # httpx keeps Secure cookies off plain http, as a browser would: post the nonce by hand
            nonce = login.cookies["fw_csrf"]
            r = httpx.post(server.url + "/dashboard/login", data={"key": token, "csrf": csrf_of(login.text)},
                           cookies={"fw_csrf": nonce}, timeout=30)  # fmt: skip
            assert r.status_code == 303
            cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("fw_session="))
            assert "secure" in [f.strip().lower() for f in cookie.split(";")]
    finally:
        engine.shutdown()
        bus.close()
        reg.close()
    assert not (tmp_path / "session.secret").exists()  # no default secret was made outside local mode


def test_a_viewer_sees_everything_and_can_act_on_nothing(live):
    c = sign_in(live, live.viewer_token)
    page = c.get("/dashboard/versions/v1")
    assert page.status_code == 200 and "bob" in page.text and "viewer" in page.text
    assert re.search(r'<button type="submit" id="approve" class="approve" disabled>', page.text)
    assert "only an admin key can approve" in page.text
    r = c.post("/dashboard/versions/v1/approve", data={"reason": "ship it", "csrf": csrf_of(page.text)})
    assert r.status_code == 403 and "viewer scope" in r.text
    api = httpx.post(live.url + "/admin/versions/v1/approve", json={"reason": "x"},
                     headers={"Authorization": f"Bearer {live.viewer_token}"}, timeout=30)  # fmt: skip
    assert api.status_code == 403 and api.json()["error"]["code"] == "insufficient_scope"
    assert live.reg.get("v1").status == "awaiting_approval"
    assert (
        c.get("/dashboard/fleet").status_code == 200 and c.get("/dashboard/versions?status=promoted").status_code == 200
    )


def test_every_form_needs_its_csrf_token(live):
    c = sign_in(live, live.admin_token)
    page = c.get("/dashboard/versions/v1")
    for data in ({"reason": "ship it"}, {"reason": "ship it", "csrf": "forged"}):
        r = c.post("/dashboard/versions/v1/approve", data=data)
        assert r.status_code == 403 and "CSRF" in r.text
    other = sign_in(live, live.admin_token)  # another session's token is not this one's
    r = c.post(
        "/dashboard/versions/v1/approve", data={"reason": "x", "csrf": csrf_of(other.get("/dashboard/versions").text)}
    )
    assert r.status_code == 403
    assert c.post("/dashboard/logout", data={}).status_code == 403  # logout is a form too
    assert (
        live.reg.get("v1").status == "awaiting_approval"
        and [a.action for a in live.reg.audit("v1")][-1] == "transition"
    )
    assert csrf_of(page.text) != csrf_of(other.get("/dashboard/versions").text)


def test_an_admin_approves_and_rolls_back_audited_with_the_key(live):
    c = sign_in(live, live.admin_token)
    page = c.get("/dashboard/versions/v1")
    assert "Promotes v1" in page.text and "base, promoted now, becomes superseded" in page.text
    csrf = csrf_of(page.text)
    r = c.post("/dashboard/versions/v1/approve", data={"reason": "  ", "csrf": csrf})
    assert r.status_code == 400 and "reason" in r.text and live.reg.get("v1").status == "awaiting_approval"
    r = c.post("/dashboard/versions/v1/approve", data={"reason": "better on every family", "csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/versions/v1?done=approve"
    assert live.reg.promoted().id == "v1"
    row = live.reg.audit("v1")[-1]
    assert (row.action, row.actor, row.reason) == (
        "approve",
        f"key:{live.admin_key.key_id} (alice)",
        "better on every family",
    )
    page = c.get("/dashboard/versions/v1?done=approve")
    assert "Approved" in page.text and "restores base on every replica" in page.text
    r = c.post("/dashboard/versions/v1/rollback", data={"reason": "users complain", "csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/versions/base?done=rollback"
    assert live.reg.promoted().id == "base" and live.reg.get("v1").status == "rolled_back"
    assert live.reg.audit("v1")[-1].actor == f"key:{live.admin_key.key_id} (alice)"


def test_a_refused_action_shows_the_error_and_changes_nothing(live):
    c = sign_in(live, live.admin_token)
    csrf = csrf_of(c.get("/dashboard/versions/v1").text)
    before = live.reg.last_seq()
    r = c.post("/dashboard/versions/base/rollback", data={"reason": "try", "csrf": csrf})  # nothing superseded
    assert r.status_code == 409 and "rollback refused" in r.text and "Nothing changed" in r.text
    page = c.get("/dashboard/versions/base")
    assert re.search(r'id="rollback" class="rollback" disabled', page.text) and "Nothing to restore" in page.text
    r = c.post("/dashboard/versions/v1/rollback", data={"reason": "try", "csrf": csrf})
    assert r.status_code == 409 and "not the promoted version" in r.text
    r = c.post("/dashboard/versions/nope/approve", data={"reason": "try", "csrf": csrf})
    assert r.status_code == 404
    # v2 was compared with base; once v1 is promoted its verdict is stale: the button says why, approve refuses
    live.reg.approve("v1", "test", "promote")
    live.reg.register(version_id="v2", parent_id="v1", files=files("v2"))
    live.reg.transition("v2", "evaluating", "gate", "eval")
    verdict = {"passed": True, "incumbent_id": "base", "artifact_sha256": live.reg.get("v2").artifact_sha256,
               "suite_version": "s1", "numbers": offline_numbers(0.5, 0.4)}  # fmt: skip
    live.reg.record_gate("v2", "offline", verdict, "gate")
    live.reg.transition("v2", "canary", "gate", "ok")
    live.reg.transition("v2", "awaiting_approval", "gate", "ok")
    before = live.reg.last_seq()
    page = c.get("/dashboard/versions/v2")
    assert re.search(r'id="approve" class="approve" disabled', page.text)
    assert "compared with base, but v1 is promoted now" in page.text
    r = c.post("/dashboard/versions/v2/approve", data={"reason": "try", "csrf": csrf})
    assert r.status_code == 409 and "evaluate it again" in r.text
    assert live.reg.last_seq() == before and live.reg.get("v2").status == "awaiting_approval"


def test_revoking_the_key_ends_its_sessions_and_logout_clears_the_cookie(live):
    c = sign_in(live, live.viewer_token)
    assert c.get("/dashboard/versions").status_code == 200
    live.keys.revoke(live.viewer_key.key_id)
    assert c.get("/dashboard/versions").status_code == 303
    a = sign_in(live, live.admin_token)
    r = a.post("/dashboard/logout", data={"csrf": csrf_of(a.get("/dashboard/versions").text)})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
    assert 'fw_session=""' in r.headers["set-cookie"] or "Max-Age=0" in r.headers["set-cookie"]
    assert a.get("/dashboard/versions").status_code == 303


def test_the_pages_show_the_evidence(live):
    c = sign_in(live, live.viewer_token)
    lst = c.get("/dashboard/versions").text
    assert 'id="row-v1"' in lst and "awaiting approval" in lst and "+0.250" in lst  # reward mean
    assert "feedback.samples: 64 records from 2 partitions" in lst and "<svg" in lst
    assert 'id="row-base"' not in c.get("/dashboard/versions?status=awaiting_approval").text
    assert c.get("/dashboard/versions?status=bogus").status_code == 400
    page = c.get("/dashboard/versions/v1").text
    for text in ("compared with base, which is promoted now", "pass rate 0.500 vs 0.400",
                 "always-valid band [-0.010, +0.500] vs −margin −0.03", "p = 1", "Canary share over time",
                 "Reward from flagged users", "record_gate canary"):  # fmt: skip
        assert text in page, text
    assert "41.0% of the update reward, from 1 of 12 users" in page and "share 41.0% of the reward" in page
    counters = page[page.index("Counted since each version") :]
    assert "micro-batches without replay" in counters and "dropped: lag" in counters
    assert all(f"<td>{n}</td>" in counters for n in ("2048", "1761", "3", "57")), counters[:2000]
    assert "masked share" in page and "<td>0.0364</td>" in page
    live.reg.approve("v1", "test", "promote")
    alert = {"metric": "latency_ms", "harmed": True}
    watch = {"promoted_at": "2026-01-01T00:00:00+00:00", "done": False, "alerts": [alert], "users": {"candidate": 12},
             "guardrails": {"latency_ms": {"estimate": 30.0, "lower": 5.0, "upper": 55.0, "harmed": True}}}  # fmt: skip
    live.reg.record_gate("v1", "watch", watch, "gate")
    page = c.get("/dashboard/versions/v1").text
    assert "After promotion" in page and "alert: latency_ms harmed since promotion" in page
    fleet = c.get("/dashboard/fleet").text
    assert "No replica has sent a heartbeat" in fleet and 'id="fleet-state"' in fleet


def test_charts_escape_text_and_say_when_there_is_nothing():
    svg = chart("<b>t</b>", [Series("a&b", [(0, 1.0), (1, 2.0)], "#000")])
    assert "<b>" not in svg and "&lt;b&gt;" in svg and "a&amp;b" in svg and "<polyline" in svg
    assert "no data yet" in chart("empty", [Series("a", [], "#000")])


def test_the_canary_plots_come_from_the_stored_progress_and_a_lapsed_lease_shows(live):
    """The plots read `gate["canary"]["history"]` (no audit row per look); a canary with no live gate
    lease says so on its page and on the fleet page; the step's lapsed time is shown as not counted."""
    c = sign_in(live, live.viewer_token)
    live.reg.reject("v1", "test", "one version in flight at a time")
    live.reg.register(version_id="v3", parent_id="base", files=files("v3"))
    live.reg.transition("v3", "evaluating", "gate", "eval")
    live.reg.transition("v3", "canary", "gate", "ok")
    counts = CanaryOutcomes().to_dict()
    history = [{"t": 5.0, "step": 0, "share": 0.2, "users": {"candidate": 3, "incumbent": 9},
                "diff": [0.1, -0.2, 0.4], "means": {"candidate": 0.3, "incumbent": 0.2}}]  # fmt: skip
    progress = {
        "step": 0,
        "share": 0.2,
        "started_at": datetime.now(UTC),
        "counts": counts,
        "history": history,
        "rho": 7.5,
        "expected_users": 62.0,
        "expected_from": "measured",
        "active_s": 5.0,
        "lapsed_s": 40.0,
    }
    live.reg.record_gate("v3", "canary", progress, "gate", "canary started", audit=True)
    page = c.get("/dashboard/versions/v3").text
    assert "Canary share over time" in page and "always-valid band (at the step" in page
    assert 'id="gate-lease"' in page and "a canary is routed to nobody" in page
    assert "40 s lapsed (not counted)" in page and "ρ 7.5 for 62 expected users (measured)" in page
    live.reg.beat_gate("g1", host="h", pid=7, beat_s=5.0)
    page = c.get("/dashboard/versions/v3").text
    assert "gate g1 (h pid 7), last beat" in page and "lapsed:" not in page
    fleet = c.get("/dashboard/fleet").text
    assert 'id="gate-lease"' in fleet and "gate g1 (h pid 7)" in fleet
    live.reg.beat_gate("g1", host="h", pid=7, beat_s=5.0, at=datetime.now(UTC) - timedelta(seconds=60))
    assert "lapsed: gate g1" in c.get("/dashboard/fleet").text


def test_the_fleet_page_shows_this_gateways_lending(live):
    """With lending on, the fleet page lists the gateway's replicas by lending state and its totals:
    replica-seconds lent, lends, reclaims, rollouts, preemptions and latency-objective violations."""
    from types import SimpleNamespace

    from api.lending import LendingLoop
    from registry.jobs import JobQueue
    from serving.lending import LendingConfig

    c = sign_in(live, live.viewer_token)
    assert 'id="lending"' not in c.get("/dashboard/fleet").text  # lending off: no card
    queue = JobQueue(live.reg.engine.url.render_as_string(hide_password=False))
    loop = LendingLoop(SimpleNamespace(live_on_lent=0), lambda: {"r0": object(), "r1": object()},
                       LendingConfig(enabled=True), queue)  # fmt: skip
    loop.manager.states["r1"] = "lent"
    loop.manager.counters.update(lends=3, reclaims=2, slow_first_tokens=7)
    loop.manager.lent_seconds = 125.4
    gw = live.server.config.app.state.gateway
    gw.fleet = SimpleNamespace(lending=loop)
    try:
        page = c.get("/dashboard/fleet").text
    finally:
        gw.fleet = None
        queue.close()
    card = page[page.index('id="lending"') :]
    assert "<td>r1</td><td>lent</td>" in card and "<td>r0</td><td>serving</td>" in card
    assert "<th>replica-seconds lent</th><td>125</td>" in card and "<th>lends</th><td>3</td>" in card
    assert "<th>first tokens over the latency objective</th><td>7</td>" in card
