"""The dashboard's routes: sign-in and out, the three pages, and the three actions.

Pages (GET, any signed-in key with `viewer` or `admin`; anyone else is sent to the sign-in page and
sees no data): `/dashboard/versions[?status=…]`, `/dashboard/versions/{id}`, `/dashboard/fleet`.

Actions (POST `/dashboard/versions/{id}/approve|reject|rollback`, a form with `reason` and `csrf`):
signed in (else 401), the session's CSRF token (else 403), an `admin` key (else 403), then the very
route function of the admin API (`api.routes.admin.approve` / `reject` / `rollback`) with the
session's key as its caller: the same registry call, the same lifecycle checks, the same audit row
naming the key (`key:<id> (<label>)`). A refused step (404, 409) re-renders the page with the error;
the registry wrote nothing. Success redirects back to the version's page (post/redirect/get).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError

from api.dashboard import views
from api.dashboard.auth import (
    PATH,
    FormError,
    Who,
    end_session,
    keep_nonce,
    login_nonce,
    read_form,
    redirect,
    render,
    safe_next,
    signed_in,
    start_session,
    state,
    to_login,
)
from api.deps import Caller, Gateway, GatewayDep
from api.errors import APIError
from api.routes import admin
from registry.registry import UnknownVersion

router = APIRouter(prefix=PATH, include_in_schema=False)
ACTIONS = {"approve": admin.approve, "reject": admin.reject, "rollback": admin.rollback}
DONE = {"approve": "Approved: the fleet is moving to it.", "reject": "Rejected.", "rollback": "Rolled back."}


def _problem(request: Request, status: int, title: str, message: str, who: Who | None = None) -> HTMLResponse:
    return render(request, "problem.html", {"title": title, "message": message, "who": who}, status)


@router.get("")
async def home() -> Response:
    return redirect(PATH + "/versions")


@router.get("/login")
async def login_page(request: Request, gw: GatewayDep, next: str | None = None) -> Response:
    if signed_in(request, gw.key_store) is not None:
        return redirect(safe_next(next))
    nonce = login_nonce(request)
    st = state(request)
    response = render(request, "login.html", {"csrf": st.signer.csrf_token(nonce), "next": safe_next(next)})
    keep_nonce(response, st, nonce)
    return response


@router.post("/login")
async def login(request: Request, gw: GatewayDep) -> Response:
    st = state(request)
    try:
        form = await read_form(request)
    except FormError as e:
        return _problem(request, 400, "Bad request", str(e))
    nonce = request.cookies.get("fw_csrf")
    target = safe_next(form.get("next"))

    def again(status: int, error: str) -> HTMLResponse:
        fresh = login_nonce(request)
        response = render(
            request, "login.html", {"csrf": st.signer.csrf_token(fresh), "next": target, "error": error}, status
        )
        keep_nonce(response, st, fresh)
        return response

    if not st.signer.csrf_ok(nonce, form.get("csrf")):
        return again(403, "This sign-in form had expired or did not come from this page: sign in again.")
    key = gw.key_store.verify(form.get("key", "").strip())
    if key is None:
        return again(401, "Incorrect or revoked API key.")
    if not key.allows("viewer"):
        return again(
            403, f"Key {key.key_id} has the scopes {', '.join(key.scopes)}; the dashboard needs 'viewer' or 'admin'."
        )
    response = redirect(target)
    start_session(response, st, key)
    return response


@router.post("/logout")
async def logout(request: Request, gw: GatewayDep) -> Response:
    who = signed_in(request, gw.key_store)
    if who is not None:
        try:
            form = await read_form(request)
        except FormError as e:
            return _problem(request, 400, "Bad request", str(e), who)
        if not state(request).signer.csrf_ok(who.session.sid, form.get("csrf")):
            return _problem(request, 403, "Forbidden", "Missing or wrong CSRF token: you are still signed in.", who)
    response = redirect(PATH + "/login")
    end_session(response, state(request))
    return response


@router.get("/versions")
async def versions(request: Request, gw: GatewayDep, status: str | None = None) -> Response:
    who = signed_in(request, gw.key_store)
    if who is None:
        return to_login(request)
    try:
        page = await asyncio.to_thread(views.versions_page, gw.registry, status or None)
    except ValueError as e:
        return _problem(request, 400, "Bad request", str(e), who)
    return render(request, "versions.html", {"who": who, **page})


async def _version(request: Request, gw: Gateway, who: Who, vid: str, status: int = 200, **extra: Any) -> Response:
    try:
        page = await asyncio.to_thread(views.version_page, gw.registry, vid)
    except UnknownVersion as e:
        return _problem(request, 404, "Not found", str(e), who)
    return render(request, "version.html", {"who": who, **page, **extra}, status)


@router.get("/versions/{version_id}")
async def version(request: Request, version_id: str, gw: GatewayDep, done: str | None = None) -> Response:
    who = signed_in(request, gw.key_store)
    if who is None:
        return to_login(request)
    return await _version(request, gw, who, version_id, notice=DONE.get(done or ""))


@router.post("/versions/{version_id}/{action}")
async def act(request: Request, version_id: str, action: str, gw: GatewayDep) -> Response:
    who = signed_in(request, gw.key_store)
    if who is None:
        return _problem(request, 401, "Sign in first", "Your session is missing or has ended: nothing was done.")
    try:
        form = await read_form(request)
    except FormError as e:
        return _problem(request, 400, "Bad request", str(e), who)
    if not state(request).signer.csrf_ok(who.session.sid, form.get("csrf")):
        return _problem(request, 403, "Forbidden", "Missing or wrong CSRF token: nothing was done.", who)
    if action not in ACTIONS:
        return _problem(request, 404, "Not found", f"No action {action!r}; there are {', '.join(ACTIONS)}.", who)
    if not who.can_act:
        msg = f"Key {who.name} has the viewer scope; {action} needs an admin key. Nothing was done."
        return _problem(request, 403, "Forbidden", msg, who)
    try:
        body = admin.Action(reason=form.get("reason", "").strip())
    except ValidationError:
        return await _version(
            request, gw, who, version_id, 400, error=f"{action}: a reason (1-2000 characters) is needed."
        )
    caller = Caller(who.key.tenant, frozenset(who.key.scopes), who.key)
    try:
        done = await ACTIONS[action](version_id, body, gw, caller)
    except APIError as e:
        return await _version(
            request, gw, who, version_id, e.status, error=f"{action} refused: {e.message} Nothing changed."
        )
    target = version_id if action != "rollback" else done["id"]
    return redirect(f"{PATH}/versions/{target}?done={action}")


@router.get("/fleet")
async def fleet(request: Request, gw: GatewayDep) -> Response:
    who = signed_in(request, gw.key_store)
    if who is None:
        return to_login(request)
    page = await asyncio.to_thread(views.fleet_page, gw.registry, gw.settings.heartbeat_s)
    rates = await asyncio.to_thread(_request_rates, gw.registry, gw.settings.heartbeat_s)
    loop = gw.fleet.lending if gw.fleet is not None else None
    lending = views.lending_card(loop.manager.states, loop.counters()) if loop is not None else None
    return render(request, "fleet.html", {"who": who, **page, "requests": rates, "lending": lending})


def _request_rates(reg: Any, interval_s: float) -> list[dict[str, Any]]:
    """Requests, requests/s, errors and mean latency per version over every live replica of every
    gateway, from their last heartbeats (each reports what it served since its previous one)."""
    fleet = reg.fleet(interval_s=interval_s)
    per: dict[str, dict[str, float]] = {}
    for b in fleet.replicas:
        if b.replica_id not in fleet.up:
            continue
        for vid, t in b.traffic.items():
            acc = per.setdefault(vid, {"requests": 0.0, "errors": 0.0, "seconds": 0.0, "rate": 0.0, "window_s": 0.0})
            acc["requests"] += t.get("requests", 0.0)
            acc["errors"] += t.get("errors", 0.0)
            acc["seconds"] += t.get("seconds", 0.0)
            window = max(t.get("window_s", interval_s), 1e-9)
            acc["rate"] += t.get("requests", 0.0) / window  # replicas serve side by side: rates add up
            acc["window_s"] = max(acc["window_s"], window)
    return [
        {
            "version": vid,
            "requests": int(a["requests"]),
            "errors": int(a["errors"]),
            "rate": a["rate"],
            "window_s": a["window_s"],
            "latency_ms": 1000 * a["seconds"] / (a["requests"] - a["errors"]) if a["requests"] > a["errors"] else None,
        }
        for vid, a in sorted(per.items())
    ]
