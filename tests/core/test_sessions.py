"""Dashboard sessions and CSRF tokens (`core.security.SessionSigner`), the local per-home secret, the
settings that refuse to start without a secret outside local mode, and `flywheel keys`."""

from __future__ import annotations

import base64
import json
import os
import stat

import pytest

from cli import main as cli
from core.security import SessionSigner, load_or_create_secret
from core.settings import Settings, get_settings
from registry.keys import KeyStore

SECRET = b"k" * 32


def test_a_session_names_its_key_expires_and_cannot_be_forged(tmp_path):
    key = KeyStore(f"sqlite:///{tmp_path / 'registry.db'}").create(["viewer"])[1]
    signer = SessionSigner(SECRET, ttl_s=60)
    token, session = signer.issue(key, now=1000.0)
    assert signer.read(token, now=1059.0) == session and session.key_id == key.key_id
    assert signer.read(token, now=1060.0) is None  # expired
    assert SessionSigner(b"o" * 32).read(token, now=1000.0) is None  # another secret
    body, mac = token.split(".")
    forged = json.dumps({"k": "someone-else", "s": session.sid, "e": 9e9}).encode()

    assert signer.read(base64.urlsafe_b64encode(forged).decode().rstrip("=") + "." + mac) is None
    for junk in ("", ".", "x.y", body, token + "x", None):
        assert signer.read(junk, now=1000.0) is None
    with pytest.raises(ValueError, match="32 bytes"):
        SessionSigner(b"short")


def test_csrf_tokens_are_bound_to_their_nonce_and_are_not_session_tokens(tmp_path):
    signer = SessionSigner(SECRET)
    t = signer.csrf_token("sid-1")
    assert signer.csrf_ok("sid-1", t) and not signer.csrf_ok("sid-2", t)
    assert not signer.csrf_ok("sid-1", None) and not signer.csrf_ok(None, t) and not signer.csrf_ok("", "")
    key = KeyStore(f"sqlite:///{tmp_path / 'registry.db'}").create(["viewer"])[1]
    token, session = signer.issue(key)
    assert not signer.csrf_ok(session.sid, token.split(".")[1])  # the session's MAC is in another domain


def test_the_local_secret_is_made_once_per_home_readable_only_by_its_owner(tmp_path):
    path = tmp_path / "home" / "session.secret"
    first = load_or_create_secret(path)
    assert len(first) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["session.secret"]  # no temporary file left
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_or_create_secret(path)
    os.chmod(path, 0o600)
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 32"):
        load_or_create_secret(path)


def test_outside_local_mode_the_settings_refuse_a_missing_or_short_secret(tmp_path):
    Settings(home=tmp_path).check_production()  # local: a secret is made when the gateway starts
    for env in ("test", "production"):
        with pytest.raises(ValueError, match="FLYWHEEL_SESSION_SECRET must be set"):
            Settings(home=tmp_path, env=env, api_keys=["k"]).check_production()
    short = Settings(home=tmp_path, env="production", api_keys=["k"], session_secret="x" * 31)
    with pytest.raises(ValueError, match="31 characters") as e:
        short.check_production()
    assert "x" * 31 not in str(e.value)  # the value is never printed
    limits = {"limit_completions_per_s": 20, "limit_feedback_events_per_s": 200}  # production needs both
    Settings(home=tmp_path, env="production", api_keys=["k"], session_secret="x" * 32, **limits).check_production()
    assert "x" * 32 not in repr(Settings(session_secret="x" * 32))


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_flywheel_keys_creates_lists_and_revokes(home, capsys):
    cli.main(["keys", "create", "--scope", "viewer", "--scope", "eval", "--label", "alice", "--tenant", "acme"])
    out, err = capsys.readouterr()
    token = out.strip()
    assert (
        token.startswith("fw_")
        and "shown once" in err
        and token not in (home / "registry.db").read_bytes().decode(errors="replace")
    )
    key = KeyStore(f"sqlite:///{home / 'registry.db'}").verify(token)
    assert key is not None and key.scopes == ("eval", "viewer") and (key.tenant, key.label) == ("acme", "alice")
    cli.main(["keys", "list"])
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(k["key_id"], k["scopes"], k["label"]) for k in listed] == [(key.key_id, ["eval", "viewer"], "alice")]
    assert token not in json.dumps(listed)
    cli.main(["keys", "revoke", key.key_id])
    assert "revoked" in capsys.readouterr().out and KeyStore(f"sqlite:///{home / 'registry.db'}").verify(token) is None
    cli.main(["keys", "list"])
    assert capsys.readouterr().out == ""
    cli.main(["keys", "list", "--all"])
    assert json.loads(capsys.readouterr().out)["revoked"] is not None
    with pytest.raises(SystemExit, match=key.key_id):
        cli.main(["keys", "revoke", key.key_id])  # already revoked
    with pytest.raises(SystemExit):
        cli.main(["keys", "create", "--scope", "root"])
    with pytest.raises(SystemExit):
        cli.main(["keys", "create"])  # a scope is required
