"""`flywheel`: what each command loads, and the gateway's --host / --port."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli import main as cli
from core.settings import get_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(monkeypatch, tmp_path):
    """FLYWHEEL_HOME in a temporary folder, the gateway's address from the environment, fresh settings."""
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("FLYWHEEL_HOST", "127.0.0.2")
    monkeypatch.setenv("FLYWHEEL_PORT", "8001")
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_the_joiner_loads_neither_fastapi_nor_torch(tmp_path):
    code = textwrap.dedent("""
        import sys
        from cli import main as cli
        from core.settings import get_settings

        with cli.joiner_service(get_settings(), window_s=60.0) as service:
            service.run_once(timeout_s=0.01)
        loaded = sorted(m for m in ("fastapi", "torch") if m in sys.modules)
        assert not loaded, loaded
    """)
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path), "FLYWHEEL_BUS": "embedded"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    assert (tmp_path / "bus").is_dir()  # the joiner really opened the configured bus


@pytest.mark.parametrize("command", ["serve", "up"])
def test_serve_help_lists_host_and_port(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--host" in out and "--port" in out


def test_flags_override_the_settings(env):
    args = cli.build_parser().parse_args(["serve", "--port", "9123"])
    settings = cli.serve_settings(args)
    assert (settings.host, settings.port) == ("127.0.0.2", 9123)  # the port from the flag, the host from the env
    args = cli.build_parser().parse_args(["up", "--host", "0.0.0.0", "--port", "0"])
    assert (cli.serve_settings(args).host, cli.serve_settings(args).port) == ("0.0.0.0", 0)
    plain = cli.serve_settings(cli.build_parser().parse_args(["serve"]))
    assert (plain.host, plain.port) == ("127.0.0.2", 8001)
    assert get_settings().port == 8001  # the shared settings object is not changed
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--port", "70000"])


def test_serve_hands_the_overridden_settings_to_the_gateway(env, monkeypatch):
    import api.main

    (env / "models" / "demo-base").mkdir(parents=True)
    (env / "models" / "demo-base" / "config.json").write_text("{}")  # present: no bootstrap
    served = []
    monkeypatch.setattr(api.main, "serve", lambda settings, lending=None, window_s=None: served.append(settings))
    cli.main(["serve", "--port", "9124"])
    assert [(s.host, s.port, s.home) for s in served] == [("127.0.0.2", 9124, env)]


def test_a_fresh_home_serves_a_copy_of_the_shipped_base(env, monkeypatch):
    import api.main
    from demo.bootstrap import REPORT, SHIPPED_BASE

    monkeypatch.setattr(api.main, "serve", lambda settings, lending=None, window_s=None: None)
    cli.main(["serve"])
    copied = env / "models" / "demo-base"
    for name in ("model.safetensors", "tokenizer.json", "config.json", REPORT):
        assert (copied / name).read_bytes() == (SHIPPED_BASE / name).read_bytes(), name
    assert sorted(p.name for p in copied.parent.iterdir()) == ["demo-base"]  # no temp folder left


def test_up_makes_a_fresh_admin_key_and_revokes_the_last_sessions(tmp_path):
    from cli.main import up_admin_key
    from core.settings import Settings
    from registry.keys import KeyStore

    settings = Settings(home=tmp_path)
    first, second = up_admin_key(settings), up_admin_key(settings)
    store = KeyStore(settings.db_url)
    assert store.verify(first) is None and store.verify(second).allows("admin")
    assert first not in (tmp_path / "registry.db").read_bytes().decode(errors="replace")
