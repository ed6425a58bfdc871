"""API keys: shown once, stored hashed, scoped, revocable."""

from __future__ import annotations

import json

import pytest

from core.security import KeyStore


def test_a_key_is_stored_hashed_verifies_and_carries_its_scopes(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    token, key = store.create(["completions", "feedback:write"], tenant="acme", label="web")
    assert token.startswith("fw_") and token not in (tmp_path / "keys.json").read_text()
    got = store.verify(token)
    assert got == key and got.tenant == "acme" and got.allows("completions") and not got.allows("eval")
    assert store.verify(token + "x") is None and store.verify("") is None
    admin_token, admin = store.create(["admin"])
    assert store.verify(admin_token).allows("eval")  # admin may do everything
    assert {k.key_id for k in KeyStore(tmp_path / "keys.json").list()} == {key.key_id, admin.key_id}


def test_a_revoked_key_no_longer_verifies(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    token, key = store.create(["viewer"])
    assert store.revoke(key.key_id).revoked is not None
    assert store.verify(token) is None
    with pytest.raises(ValueError, match=key.key_id):
        store.revoke(key.key_id)


def test_bad_scopes_tenants_and_formats_are_refused(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    with pytest.raises(ValueError, match="root"):
        store.create(["root"])
    with pytest.raises(ValueError, match="scopes"):
        store.create([])
    with pytest.raises(ValueError, match="tenant"):
        store.create(["viewer"], tenant="")
    (tmp_path / "keys.json").write_text(json.dumps({"version": 9, "keys": {}}))
    with pytest.raises(ValueError, match="version 9"):
        store.verify("fw_x")
