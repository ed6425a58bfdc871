"""API key records and scopes, and the dashboard's signed sessions: the one place that checks them.

A key is a random token (`fw_` + 43 url-safe characters) shown once, when it is made; a store keeps
only its SHA-256 (`token_digest`), its id, tenant, scopes, label and times. The store is the
registry's database (`registry.keys.KeyStore`), which every gateway shares. Scopes: `completions`,
`feedback:write`, `eval`, `weights:read` (fetch weights over HTTP), `viewer`, `admin`.

A dashboard session (`SessionSigner`) is what a browser holds after signing in with a key: the key's
id, a random session id and an expiry, signed with HMAC-SHA256 under a server secret. It names the
key rather than copying its scopes, so the gateway looks the key up on every request: revoking a key
ends its sessions at once. CSRF tokens are HMACs of a nonce under the same secret, in their own
domain (a session token is never a valid CSRF token). Outside local mode the secret comes from the
settings (there is no default); in local mode `load_or_create_secret` makes one per home, in a
file only its owner can read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

SCOPES = ("completions", "feedback:write", "eval", "weights:read", "viewer", "admin")
SESSION_TTL_S = 8 * 3600.0
"""How long a dashboard session lasts after sign-in (the cookie's Max-Age and the signed expiry)."""
MIN_SECRET_BYTES = 32


@dataclass(frozen=True)
class Key:
    key_id: str
    tenant: str
    scopes: tuple[str, ...]
    label: str
    created: float
    revoked: float | None = None

    def allows(self, scope: str) -> bool:
        return self.revoked is None and (scope in self.scopes or "admin" in self.scopes)


def token_digest(token: str) -> str:
    """What a key store keeps of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


# -- dashboard sessions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    key_id: str
    sid: str  # random per sign-in: the CSRF nonce of this session
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionSigner:
    """Signs and checks session tokens (`body.mac`, both base64url) and CSRF tokens under one secret."""

    def __init__(self, secret: bytes, ttl_s: float = SESSION_TTL_S):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a session secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self._secret, self.ttl_s = secret, ttl_s

    def _mac(self, domain: str, text: str) -> bytes:
        return hmac.new(self._secret, f"{domain}|{text}".encode(), hashlib.sha256).digest()

    def issue(self, key: Key, now: float | None = None) -> tuple[str, Session]:
        """A new session for `key`: (the token for the cookie, what it says)."""
        session = Session(key.key_id, secrets.token_urlsafe(18), (time.time() if now is None else now) + self.ttl_s)
        body = _b64(json.dumps({"k": session.key_id, "s": session.sid, "e": session.expires}).encode())
        return f"{body}.{_b64(self._mac('session', body))}", session

    def read(self, token: str | None, now: float | None = None) -> Session | None:
        """The session a token is, if its signature holds and it has not expired; else None."""
        body, _, mac = (token or "").partition(".")
        try:
            if not hmac.compare_digest(_unb64(mac), self._mac("session", body)):
                return None
            fields = json.loads(_unb64(body))
            session = Session(str(fields["k"]), str(fields["s"]), float(fields["e"]))
        except (ValueError, KeyError, TypeError):  # not base64, not JSON, not our shape: no session
            return None
        return session if session.expires > (time.time() if now is None else now) else None

    def csrf_token(self, nonce: str) -> str:
        """The CSRF token of forms posted with `nonce` (a session's sid, or a signed-out visitor's)."""
        return _b64(self._mac("csrf", nonce))

    def csrf_ok(self, nonce: str | None, token: str | None) -> bool:
        return bool(nonce) and bool(token) and hmac.compare_digest(self.csrf_token(nonce or ""), token or "")


def load_or_create_secret(path: str | Path) -> bytes:
    """The secret kept in `path`, made there first (64 hex characters, mode 0600) if there is none:
    local mode's per-home session secret. ValueError if the file is readable by others or too short."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # whole or not at all; a racing process that linked first wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or remove it for a new one")
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; a session secret needs at least {MIN_SECRET_BYTES}")
    return secret
