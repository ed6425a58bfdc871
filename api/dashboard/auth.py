"""Who is looking at the dashboard: sign-in with an API key, the session cookie, CSRF, and the HTML
responses every page goes out with.

- A browser signs in by posting a key-store key (`fw_…`) with the `viewer` or `admin` scope; it gets
  `fw_session` (`core.security.SessionSigner`): HttpOnly, SameSite=Strict, Path=/dashboard, Secure
  outside local mode, Max-Age `SESSION_TTL_S` and the same expiry signed inside it. The cookie is
  never read by the API routes, which take bearer keys only.
- Every request looks the session's key up again (`signed_in`): a revoked key, or one that lost its
  scope, signs its sessions out at once.
- Every state-changing form carries a CSRF token: the HMAC of the session's id, or, on the sign-in
  form, of a random nonce kept in the `fw_csrf` cookie (double submit, signed). A POST without the
  right token is 403 and does nothing.
- Pages go out with a strict Content-Security-Policy (scripts and styles only from the app itself),
  no framing, no caching and no referrer.

`DashboardState` (on `app.state.dashboard`) holds the signer, the templates and whether cookies are
Secure. Called by `api.dashboard.routes`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from core.security import SESSION_TTL_S, Key, Session, SessionSigner, load_or_create_secret
from core.settings import Settings
from registry.keys import KeyStore

PATH = "/dashboard"
COOKIE = "fw_session"
NONCE_COOKIE = "fw_csrf"
MAX_FORM_BYTES = 16 * 1024
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HERE = Path(__file__).parent


class FormError(ValueError):
    pass


@dataclass(frozen=True)
class Who:
    key: Key
    session: Session
    csrf: str

    @property
    def can_act(self) -> bool:
        return self.key.allows("admin")

    @property
    def name(self) -> str:
        return f"{self.key.label} ({self.key.key_id})" if self.key.label else self.key.key_id

    @property
    def role(self) -> str:
        return "admin" if self.can_act else "viewer"


class DashboardState:
    def __init__(self, settings: Settings):
        if settings.session_secret is not None:
            secret = settings.session_secret.get_secret_value().encode()
        else:  # local mode only: check_production refuses a missing secret elsewhere
            secret = load_or_create_secret(settings.session_secret_path)
        self.signer = SessionSigner(secret, SESSION_TTL_S)
        self.secure = settings.env != "local"
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
        self.templates = Jinja2Templates(env=env)


def state(request: Request) -> DashboardState:
    return request.app.state.dashboard


def signed_in(request: Request, keys: KeyStore) -> Who | None:
    """The signed-in visitor: a valid, unexpired session of a live key with the viewer (or admin) scope."""
    st = state(request)
    session = st.signer.read(request.cookies.get(COOKIE))
    if session is None:
        return None
    key = keys.get(session.key_id)
    if key is None or not key.allows("viewer"):  # revoked, or lost its scope
        return None
    return Who(key, session, st.signer.csrf_token(session.sid))


def _cookie(response: Response, st: DashboardState, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path=PATH, secure=st.secure, httponly=True, samesite="strict")


def start_session(response: Response, st: DashboardState, key: Key) -> None:
    token, _ = st.signer.issue(key)
    _cookie(response, st, COOKIE, token, int(st.signer.ttl_s))
    response.delete_cookie(NONCE_COOKIE, path=PATH)


def end_session(response: Response, st: DashboardState) -> None:
    response.delete_cookie(COOKIE, path=PATH, secure=st.secure, httponly=True, samesite="strict")


def login_nonce(request: Request) -> str:
    """The signed-out visitor's CSRF nonce (from its `fw_csrf` cookie, or a new one)."""
    return request.cookies.get(NONCE_COOKIE) or secrets.token_urlsafe(18)


def keep_nonce(response: Response, st: DashboardState, nonce: str) -> None:
    _cookie(response, st, NONCE_COOKIE, nonce, 3600)


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (first value of each); any other body is no fields (so no CSRF
    token: 403). FormError if it is too large or not UTF-8."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise FormError(f"the form is larger than {MAX_FORM_BYTES} bytes")
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        return {}
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise FormError("the form is not UTF-8") from None
    return {k: v[0] for k, v in fields.items()}


def safe_next(target: str | None) -> str:
    """Where to go after sign-in: a dashboard path of this app, never another site."""
    if target and target.startswith(PATH + "/") and "//" not in target and "\\" not in target:
        return target
    return PATH + "/versions"


def render(request: Request, template: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
    ctx = {"who": None, "error": None, "notice": None, **context}
    response = state(request).templates.TemplateResponse(request, template, ctx, status_code=status)
    response.headers.update(HEADERS)
    return response


def redirect(url: str) -> RedirectResponse:
    response = RedirectResponse(url, status_code=303)
    response.headers.update(HEADERS)
    return response


def to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return redirect(f"{PATH}/login?" + urlencode({"next": safe_next(target)}))
