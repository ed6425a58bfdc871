"""API keys with scopes, stored hashed: the one place that makes and checks them.

A key is a random token (`fw_` + 43 url-safe characters) shown once, when it is made; the store
keeps only its SHA-256 (a random 256-bit token needs no slow hash), its id, tenant, scopes, label
and times, in `<FLYWHEEL_HOME>/keys.json` (format version 1, replaced atomically). Scopes:
`completions`, `feedback:write`, `eval`, `weights:read` (fetch weights over HTTP), `viewer`,
`admin`. Called by the gateway (auth) and the CLI.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from core.files import atomic_write

FORMAT_VERSION = 1
SCOPES = ("completions", "feedback:write", "eval", "weights:read", "viewer", "admin")


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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class KeyStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def _load(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        body = json.loads(self.path.read_text())
        if body.get("version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: key store format version {body.get('version')!r}, this build reads 1")
        return body["keys"]

    def _save(self, keys: dict[str, dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps({"version": FORMAT_VERSION, "keys": keys}, indent=1))

    def create(self, scopes: list[str] | tuple[str, ...], tenant: str = "default", label: str = "") -> tuple[str, Key]:
        """A new key: (the token, shown only now; its record)."""
        bad = [s for s in scopes if s not in SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be a non-empty subset of {list(SCOPES)}, got {list(scopes)!r}")
        if not tenant or len(tenant) > 64:
            raise ValueError(f"tenant must be 1-64 characters, got {tenant!r}")
        token = "fw_" + secrets.token_urlsafe(32)
        key = Key(secrets.token_hex(6), tenant, tuple(scopes), label, time.time())
        with self._lock:
            keys = self._load()
            keys[_digest(token)] = asdict(key)
            self._save(keys)
        return token, key

    def verify(self, token: str) -> Key | None:
        """The live key this token is, or None."""
        if not token:
            return None
        digest = _digest(token)
        for stored, rec in self._load().items():
            if hmac.compare_digest(stored, digest):
                key = Key(**{**rec, "scopes": tuple(rec["scopes"])})
                return key if key.revoked is None else None
        return None

    def list(self) -> list[Key]:
        return [Key(**{**r, "scopes": tuple(r["scopes"])}) for r in self._load().values()]

    def revoke(self, key_id: str) -> Key:
        with self._lock:
            keys = self._load()
            for rec in keys.values():
                if rec["key_id"] == key_id and rec["revoked"] is None:
                    rec["revoked"] = time.time()
                    self._save(keys)
                    return Key(**{**rec, "scopes": tuple(rec["scopes"])})
        raise ValueError(f"no live key with id {key_id!r}")
