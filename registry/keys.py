"""API keys in the registry's database, so every gateway of a fleet shares them (`flywheel keys`).

A key is a random token (`fw_` + 43 url-safe characters) shown once, when it is made; the table
(`registry.models.ApiKey`) keeps only its SHA-256 (a random 256-bit token needs no slow hash), its id,
tenant, scopes, label and times. `verify` looks the digest up, and remembers the answer for `cache_s`
(2 s), so a gateway asks the database at most once per token per 2 s; a revoke made through any
gateway or the CLI is refused everywhere within that time. Called by the gateway (auth), the CLI and
the demo; the records and scopes are `core.security.Key` and `core.security.SCOPES`.
"""

from __future__ import annotations

import secrets
import threading
import time

from sqlalchemy import update
from sqlmodel import Session, col, select

from core.security import SCOPES, Key, token_digest
from registry.db import ensure_schema, make_engine
from registry.models import ApiKey


def _key(row: ApiKey) -> Key:
    return Key(row.key_id, row.tenant, tuple(row.scopes), row.label, row.created, row.revoked)


class KeyStore:
    """The `api_key` table of the database at `url` (`core.settings.Settings.db_url`)."""

    def __init__(self, url: str, cache_s: float = 2.0):
        if not cache_s >= 0:
            raise ValueError(f"cache_s must be >= 0, got {cache_s!r}")
        self.url, self.cache_s = url, cache_s
        self.engine = make_engine(url)
        ensure_schema(self.engine)
        self._cache: dict[str, tuple[float, Key | None]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> KeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, scopes: list[str] | tuple[str, ...], tenant: str = "default", label: str = "") -> tuple[str, Key]:
        """A new key: (the token, shown only now; its record)."""
        bad = [s for s in scopes if s not in SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be a non-empty subset of {list(SCOPES)}, got {list(scopes)!r}")
        if not tenant or len(tenant) > 64:
            raise ValueError(f"tenant must be 1-64 characters, got {tenant!r}")
        if len(label) > 256:
            raise ValueError(f"label must be at most 256 characters, got {len(label)}")
        token = "fw_" + secrets.token_urlsafe(32)
        key = Key(secrets.token_hex(6), tenant, tuple(scopes), label, time.time())
        row = ApiKey(
            digest=token_digest(token),
            key_id=key.key_id,
            tenant=tenant,
            scopes=list(key.scopes),
            label=label,
            created=key.created,
        )
        with Session(self.engine) as s:
            s.add(row)
            s.commit()
        return token, key

    def verify(self, token: str) -> Key | None:
        """The live key this token is, or None (answers at most `cache_s` old)."""
        if not token:
            return None
        digest, now = token_digest(token), time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        with Session(self.engine) as s:
            row = s.get(ApiKey, digest)
            key = _key(row) if row is not None else None
        key = key if key is not None and key.revoked is None else None
        with self._lock:
            if len(self._cache) > 10_000:  # unknown tokens are cached too: bound what a scan can fill
                self._cache.clear()
            self._cache[digest] = (now, key)
        return key

    def get(self, key_id: str) -> Key | None:
        """The key with this id (live or revoked), or None."""
        with Session(self.engine) as s:
            row = s.exec(select(ApiKey).where(col(ApiKey.key_id) == key_id)).first()
            return _key(row) if row is not None else None

    def list(self) -> list[Key]:
        with Session(self.engine) as s:
            return [_key(r) for r in s.exec(select(ApiKey).order_by(col(ApiKey.created)))]

    def revoke(self, key_id: str) -> Key:
        """Revoke a live key; ValueError naming the id if there is none."""
        with Session(self.engine) as s:
            done = s.exec(
                update(ApiKey)
                .where(col(ApiKey.key_id) == key_id, col(ApiKey.revoked).is_(None))
                .values(revoked=time.time())
            )
            s.commit()
        if done.rowcount != 1:
            raise ValueError(f"no live key with id {key_id!r}")
        with self._lock:
            self._cache.clear()
        key = self.get(key_id)
        assert key is not None
        return key
