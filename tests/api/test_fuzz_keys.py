"""Schemathesis on every route, with a key of each scope (the CI-sized run; `FUZZ_EXAMPLES` cases per
operation, each sent as every caller).

A live gateway outside local mode (`FLYWHEEL_API_KEYS` set, a session secret), the tiny checkpoint,
a registry with a candidate awaiting approval. Callers: no key, a wrong key, an env key (the product
scopes), and a key-store key of each scope. The operations are the app's OpenAPI schema (product,
admin and weights routes) and a schema of the dashboard's routes written here (they are HTML, left out
of the app's schema); the dashboard's callers are sessions (signed in with a viewer key and with an
admin key), and a `map_case` hook on that schema puts the session's CSRF token in every form, so the
fuzzing reaches past the CSRF check.

Every response is checked:
- no 5xx;
- a caller whose scopes do not grant the operation's scope (`SCOPE`) never gets a 2xx or a redirect
  (an action done): the operation must refuse before it acts;
- the table covers every operation of the schema, so a new route cannot go untested.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.api.test_admin_api import files
from tests.conftest import LiveServer

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10"))  # per operation; raise it for a longer run
FUZZ_REPORT = os.environ.get("FUZZ_REPORT")  # a JSON file for the tallies (`python -m bench.fuzz` reads it)
ENV_KEY = "fuzz-env-key-0123456789"
PRODUCT = frozenset({"completions", "feedback:write"})  # what an env key holds
SCOPE: dict[tuple[str, str], str | None] = {
    ("GET", "/v1/models"): "completions",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/v1/chat/completions"): "completions",
    ("POST", "/v1/feedback"): "feedback:write",
    ("GET", "/admin/versions"): "viewer",
    ("GET", "/admin/versions/{version_id}"): "viewer",
    ("GET", "/admin/fleet"): "viewer",
    ("POST", "/admin/versions/{version_id}/approve"): "admin",
    ("POST", "/admin/versions/{version_id}/reject"): "admin",
    ("POST", "/admin/versions/{version_id}/rollback"): "admin",
    ("GET", "/v1/weights/{path}"): "weights:read",
    ("GET", "/healthz"): None,
    ("GET", "/metrics"): "viewer",
}
DASHBOARD_SCOPE: dict[tuple[str, str], str] = {
    ("GET", "/dashboard/versions"): "viewer",
    ("GET", "/dashboard/versions/{version_id}"): "viewer",
    ("GET", "/dashboard/fleet"): "viewer",
    ("POST", "/dashboard/versions/{version_id}/{action}"): "admin",
    ("POST", "/dashboard/logout"): "viewer",
}
DASHBOARD_SCHEMA: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "Flywheel dashboard (HTML)", "version": "1"},
    "paths": {
        "/dashboard/versions": {
            "get": {
                "parameters": [{"name": "status", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "page"}},
            }
        },
        "/dashboard/versions/{version_id}": {
            "get": {
                "parameters": [{"name": "version_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "page"}},
            }
        },
        "/dashboard/fleet": {"get": {"responses": {"200": {"description": "page"}}}},
        "/dashboard/versions/{version_id}/{action}": {
            "post": {
                "parameters": [
                    {"name": "version_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {
                        "name": "action",
                        "in": "path",
                        "required": True,
                        "schema": {"anyOf": [{"enum": ["approve", "reject", "rollback"]}, {"type": "string"}]},
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/x-www-form-urlencoded": {
                            "schema": {
                                "type": "object",
                                "properties": {"reason": {"type": "string"}, "csrf": {"type": "string"}},
                                "required": ["csrf"],
                            }
                        }
                    },
                },
                "responses": {"303": {"description": "done"}},
            }
        },
        "/dashboard/logout": {
            "post": {
                "requestBody": {
                    "content": {
                        "application/x-www-form-urlencoded": {
                            "schema": {"type": "object", "properties": {"csrf": {"type": "string"}}}
                        }
                    }
                },
                "responses": {"303": {"description": "signed out"}},
            }
        },
    },
}


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    settings = Settings(
        home=home,
        model_dir=tiny_checkpoint,
        max_batch=8,
        max_model_len=128,
        api_keys=[ENV_KEY],
        session_secret="s" * 40,
    )
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(home / "bus"), Registry(f"sqlite:///{home / 'registry.db'}")
    reg.bootstrap("base", files=files("base"))
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    keys, index = KeyStore(settings.db_url), CompletionIndex(home / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.reg = reg
        server.callers = {"no key": ({}, frozenset()), "wrong key": (_bearer("fw_nope"), frozenset())}
        server.callers["env key"] = (_bearer(ENV_KEY), PRODUCT)
        server.tokens = {}
        for scope in ("completions", "feedback:write", "eval", "weights:read", "viewer", "admin"):
            token = keys.create([scope], tenant="acme", label=scope)[0]
            server.tokens[scope] = token
            server.callers[f"{scope} key"] = (_bearer(token), frozenset({scope}))
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _granted(scopes: frozenset[str], scope: str | None) -> bool:
    return scope is None or scope in scopes or "admin" in scopes


def _check(op: str, caller: str, scopes: frozenset[str], scope: str | None, r) -> None:
    """No 5xx; and a caller the scope does not grant is refused: a 4xx, or for a page, the way to sign in."""
    assert r.status_code < 500, f"{op} as {caller}: {r.status_code} {r.text[:300]}"
    assert not (op.startswith("GET") and r.status_code == 409), f"{op}: a read is no conflict: {r.text[:300]}"
    if not _granted(scopes, scope):
        location = r.headers.get("location") or [""]  # schemathesis: each header's values, as a list
        to_login = r.status_code in (303, 307) and location[0].startswith("/dashboard/login")
        refused = r.status_code >= 400 or (op.startswith("GET /dashboard") and to_login)
        assert refused, f"{op} as {caller} (scopes {sorted(scopes)}) was allowed: {r.status_code} {r.text[:300]}"


def _fuzz(operation, run_case) -> int:
    sent = [0]

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case) -> None:
        sent[0] += run_case(case)

    run()
    return sent[0]


def _operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_every_route_with_a_key_of_each_scope(live):
    spec = httpx.get(live.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    ops = _operations(schema)
    assert {(op.method.upper(), op.path) for op in ops} == set(SCOPE), "a route without a scope in SCOPE"
    tally: Counter[tuple[str, str]] = Counter()  # (caller, allowed or refused)
    for op in ops:
        scope = SCOPE[(op.method.upper(), op.path)]

        def run_case(case, op=op, scope=scope) -> int:
            for caller, (headers, scopes) in live.callers.items():
                r = case.call(base_url=live.url, headers=headers, timeout=60)
                _check(f"{op.method.upper()} {op.path}", caller, scopes, scope, r)
                tally[caller, "2xx" if r.status_code < 300 else str(r.status_code)] += 1
            return len(live.callers)

        _fuzz(op, run_case)
    print(f"{sum(tally.values())} requests over {len(ops)} operations:", dict(sorted(tally.items())))
    _report("api", len(ops), tally)
    assert sum(tally.values()) >= len(ops) * len(live.callers)
    for caller in live.callers:  # every caller was both refused and, but for the keyless ones, served
        assert any(c == caller and s != "2xx" for c, s in tally), caller
    assert all(any(c == caller and s == "2xx" for c, s in tally) for caller in live.callers)  # /healthz at least


def _report(part: str, operations: int, tally: Counter[tuple[str, str]]) -> None:
    """Add this test's tallies to `FUZZ_REPORT` (a JSON object keyed by part), when it is set."""
    if not FUZZ_REPORT:
        return
    path = Path(FUZZ_REPORT)
    report = json.loads(path.read_text()) if path.is_file() else {}
    by_caller: dict[str, dict[str, int]] = {}
    for (caller, status), n in sorted(tally.items()):
        by_caller.setdefault(caller, {})[status] = n
    report[part] = {"examples_per_operation": FUZZ_EXAMPLES, "operations": operations,
                    "requests": sum(tally.values()), "by_caller": by_caller}  # fmt: skip
    path.write_text(json.dumps(report, indent=1))


def _session(live, token: str) -> tuple[dict[str, str], str]:
    """Signed in with `token`: the session cookie and the session's CSRF token."""
    page = httpx.get(live.url + "/dashboard/login", timeout=30)
    nonce = page.cookies.get("fw_csrf") or re.search(r"fw_csrf=([^;]+)", page.headers["set-cookie"]).group(1)
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    r = httpx.post(
        live.url + "/dashboard/login", data={"key": token, "csrf": csrf}, cookies={"fw_csrf": nonce}, timeout=30
    )
    assert r.status_code == 303, r.text
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("fw_session="))
    cookies = {"fw_session": cookie.split(";")[0].split("=", 1)[1]}
    html = httpx.get(live.url + "/dashboard/versions", cookies=cookies, timeout=30).text
    return cookies, re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def test_the_dashboard_with_a_session_of_each_scope_and_its_csrf_token(live):
    schema = schemathesis.openapi.from_dict(DASHBOARD_SCHEMA)
    sessions = {"viewer": _session(live, live.tokens["viewer"]), "admin": _session(live, live.tokens["admin"])}
    callers: dict[str, tuple[dict, str | None, frozenset[str]]] = {"no session": ({}, None, frozenset())}
    for name, (cookies, csrf) in sessions.items():
        callers[f"{name} session"] = (cookies, csrf, frozenset({name}))
    current: dict[str, str | None] = {"csrf": None}

    @schema.hook
    def map_case(context, case):  # the session's CSRF token in every form, as the page would put it
        if isinstance(case.body, dict) and current["csrf"] is not None:
            case.body = {**case.body, "csrf": current["csrf"]}
        return case

    ops = _operations(schema)
    assert {(op.method.upper(), op.path) for op in ops} == set(DASHBOARD_SCOPE)
    tally: Counter[tuple[str, str]] = Counter()  # (caller, allowed or refused)
    for op in ops:
        scope = DASHBOARD_SCOPE[(op.method.upper(), op.path)]
        for caller, (cookies, csrf, scopes) in callers.items():
            current["csrf"] = csrf

            def run_case(case, op=op, caller=caller, cookies=cookies, scopes=scopes, scope=scope) -> int:
                if op.path == "/dashboard/logout":  # signing out would end the session the rest uses
                    return 0
                r = case.call(base_url=live.url, cookies=cookies, timeout=60, allow_redirects=False)
                _check(f"{op.method.upper()} {op.path}", caller, scopes, scope, r)
                tally[caller, "2xx" if r.status_code < 300 else str(r.status_code)] += 1
                return 1

            _fuzz(op, run_case)
    _report("dashboard", len(ops), tally)
    assert live.reg.get("v1").status == "candidate"  # fuzzed forms reached no version's lifecycle
