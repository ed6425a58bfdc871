"""docker-compose.yml runs every service from one mounted config. No Docker engine here: the file is
checked as YAML against the services' commands and the config file, and with `docker compose config`
where the compose plugin is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"gateway-a": "serve", "gateway-b": "serve", "joiner": "joiner", "learner": "learner", "gate": "gate"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_runs_from_the_one_mounted_config():
    services = compose()["services"]
    assert set(services) == {"kafka", "postgres", *SERVICES}
    for name, command in SERVICES.items():
        s = services[name]
        assert s["command"] == ["flywheel", command], name
        env = s["environment"]
        assert env["FLYWHEEL_CONFIG"] == "/etc/flywheel/flywheel.toml" and env["FLYWHEEL_ENV"] == "production", name
        assert "./deploy/flywheel.toml:/etc/flywheel/flywheel.toml:ro" in s["volumes"], name
        assert set(s["depends_on"]) == {"kafka", "postgres"}, name
    ports = [services[g]["ports"] for g in ("gateway-a", "gateway-b")]
    assert ports == [["8000:8000"], ["8001:8000"]]  # two gateways, two ports
    ids = {services[g]["environment"]["FLYWHEEL_GATEWAY_ID"] for g in ("gateway-a", "gateway-b")}
    assert ids == {"gateway-a", "gateway-b"}
    # The learner writes the models volume; the gate and the gateways read it.
    assert "learner-models:/data/models/learner" in services["learner"]["volumes"]
    assert "learner-models:/data/models/learner:ro" in services["gate"]["volumes"]
    assert all("learner-models:/weights:ro" in services[g]["volumes"] for g in ("gateway-a", "gateway-b"))


def test_the_mounted_config_is_valid_and_points_at_the_compose_services(tmp_path, monkeypatch):
    from cli.product_config import load_product_config
    from core.settings import get_settings, load_settings

    monkeypatch.setenv("FLYWHEEL_CONFIG", str(ROOT / "deploy" / "flywheel.toml"))
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        s = load_settings()
        assert (s.bus, s.kafka_bootstrap, s.weights_url) == ("kafka", "kafka:9092", "/weights")
        assert "@postgres:5432/" in (s.database_url or "") and "@postgres:5432/" in (s.index_url or "")
        product = load_product_config()
        assert product.gate.G == 8 and product.learner.update_every_samples == 512
    finally:
        get_settings.cache_clear()


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI here: checked as YAML above only")
def test_docker_compose_config_accepts_the_file():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI here has no compose plugin: checked as YAML above only")
    env = {**os.environ, "FLYWHEEL_API_KEYS": "acme:k", "FLYWHEEL_SESSION_SECRET": "s" * 32}
    r = subprocess.run(["docker", "compose", "config", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
