"""The demo's joiner, learner and gate, each the main of a process that `demo.system` starts under the
supervisor: `python -m demo.services <name> <json list of arguments>`. SIGTERM ends each the way
Ctrl-C does (`core.supervisor.child_setup`), and each dies with its parent."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def service_settings(home: str, base: str, **extra: Any):
    from core.settings import Settings

    return Settings(home=Path(home), model_dir=Path(base), env="local", **extra)


def _log_to_file(home: str, name: str) -> None:
    """A service process of the demo logs to <home>/<name>.log, as the gateway does."""
    handler = logging.FileHandler(Path(home) / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def joiner(home: str, base: str, window_s: float) -> None:
    _log_to_file(home, "joiner")
    from core.service_metrics import ServiceMetrics
    from feedback.connect import open_bus
    from feedback.joiner import JoinerService
    from feedback.rewards import RewardSpec

    settings = service_settings(home, base)
    bus = open_bus(settings)
    service = JoinerService(bus, RewardSpec(), window_s, metrics=ServiceMetrics("joiner", settings.home / "metrics"))
    try:
        while True:
            service.run_once(timeout_s=0.2)
    finally:
        service.close()
        bus.close()


def learner(home: str, base: str, cfg_json: str) -> None:
    _log_to_file(home, "learner")
    import torch

    from core.service_metrics import ServiceMetrics
    from demo.checker import DemoVerifier
    from feedback.connect import open_bus
    from learner.service import LearnerConfig, LearnerService
    from registry.registry import Registry

    torch.set_num_threads(1)
    settings = service_settings(home, base)
    bus = open_bus(settings)
    registry = Registry(settings.db_url)
    cfg = LearnerConfig.model_validate_json(cfg_json)
    metrics = ServiceMetrics("learner", settings.home / "metrics")
    models, base_dir = settings.learner_models_dir, settings.served_model_dir
    service = LearnerService(bus, registry, models, base_dir, cfg, metrics=metrics, verifier=DemoVerifier())
    try:
        while True:
            service.run_once(timeout_s=0.2)
    finally:
        service.close()
        bus.close()
        registry.close()


def gate(home: str, base: str, cfg_json: str, prompts: int) -> None:
    _log_to_file(home, "gate")
    import threading

    from demo.suite import demo_suite
    from feedback.connect import open_bus
    from gating.gate import GateConfig
    from gating.gate_process import run_gate

    settings = service_settings(home, base, torch_threads=1)
    bus = open_bus(settings)
    try:
        run_gate(settings, threading.Event(), demo_suite(n=prompts), GateConfig.model_validate_json(cfg_json), bus=bus)
    finally:
        bus.close()


SERVICES: dict[str, Callable[..., None]] = {"joiner": joiner, "learner": learner, "gate": gate}


def command(name: str, *args: Any) -> list[str]:
    """The argv that runs service `name` with `args` (JSON-serialisable)."""
    if name not in SERVICES:
        raise ValueError(f"unknown demo service {name!r}; expected one of {sorted(SERVICES)}")
    return [sys.executable, "-m", "demo.services", name, json.dumps(list(args))]


if __name__ == "__main__":
    from core.supervisor import child_setup

    child_setup()
    try:
        SERVICES[sys.argv[1]](*json.loads(sys.argv[2]))
    except KeyboardInterrupt:
        sys.exit(0)
