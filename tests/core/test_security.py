"""API keys: shown once, stored hashed in the registry's database, scoped, revocable, shared by every
gateway that reads that database."""

from __future__ import annotations

import sqlite3
import time

import pytest

from registry.keys import KeyStore


def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


def stored_rows(tmp_path) -> str:
    with sqlite3.connect(tmp_path / "registry.db") as c:
        return repr(c.execute("SELECT * FROM api_key").fetchall())


def test_a_key_is_stored_hashed_verifies_and_carries_its_scopes(tmp_path):
    store = KeyStore(url(tmp_path))
    token, key = store.create(["completions", "feedback:write"], tenant="acme", label="web")
    assert token.startswith("fw_") and token not in stored_rows(tmp_path) and key.key_id in stored_rows(tmp_path)
    got = store.verify(token)
    assert got == key and got.tenant == "acme" and got.allows("completions") and not got.allows("eval")
    assert store.verify(token + "x") is None and store.verify("") is None
    admin_token, admin = store.create(["admin"])
    assert store.verify(admin_token).allows("eval")  # admin may do everything
    assert {k.key_id for k in KeyStore(url(tmp_path)).list()} == {key.key_id, admin.key_id}
    assert store.get(key.key_id) == key and store.get("nope") is None


def test_a_revoked_key_no_longer_verifies(tmp_path):
    store = KeyStore(url(tmp_path))
    token, key = store.create(["viewer"])
    assert store.verify(token) == key
    assert store.revoke(key.key_id).revoked is not None
    assert store.verify(token) is None  # the revoking store forgets its cache at once
    with pytest.raises(ValueError, match=key.key_id):
        store.revoke(key.key_id)


def test_two_gateways_share_keys_and_a_revoke_reaches_the_other_within_its_cache_time(tmp_path):
    one, other = KeyStore(url(tmp_path), cache_s=0.5), KeyStore(url(tmp_path), cache_s=0.5)
    token, key = one.create(["completions"], tenant="acme")
    assert other.verify(token) == key  # made through one, used on the other
    one.revoke(key.key_id)
    assert other.verify(token) == key  # the other's answer is at most cache_s old...
    time.sleep(0.6)
    assert other.verify(token) is None  # ...and then it asks again


def test_bad_scopes_tenants_and_urls_are_refused(tmp_path):
    store = KeyStore(url(tmp_path))
    with pytest.raises(ValueError, match="root"):
        store.create(["root"])
    with pytest.raises(ValueError, match="scopes"):
        store.create([])
    with pytest.raises(ValueError, match="tenant"):
        store.create(["viewer"], tenant="")
    with pytest.raises(ValueError, match="cache_s"):
        KeyStore(url(tmp_path), cache_s=-1)
    with pytest.raises(ValueError, match="mysql"):
        KeyStore("mysql://h/db")
