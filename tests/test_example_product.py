"""examples/tiny_functions, attached as a product team would: `flywheel up --config` on its file, its
client serving users, and the loop running on its own suite and reward table, with no demo code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.harness import free_port, http_ok, wait_until
from core.supervisor import Supervisor
from registry.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_functions"


def test_the_example_suite_is_its_own():
    """It imports no demo module (a fresh process), and none of its prompts is a demo task."""
    code = textwrap.dedent("""
        import sys
        import tiny_suite
        s = tiny_suite.suite()
        assert s.name == "tiny-functions" and len(s.items) == 24, s.name
        assert not set(s.prompts) & set(tiny_suite.USER_PROMPTS)  # the gate never scores a users' prompt
        demo = sorted(m for m in sys.modules if m == "demo" or m.startswith("demo."))
        assert not demo, demo
    """)
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)

    sys.path.insert(0, str(EXAMPLE))
    try:
        import tiny_suite
    finally:
        sys.path.remove(str(EXAMPLE))
    from demo.tasks import task_from_prompt

    prompts = [*tiny_suite.suite().prompts, *tiny_suite.USER_PROMPTS]
    assert [p for p in prompts if task_from_prompt(p) is not None] == []  # from no demo family
    v = tiny_suite.RunTheTests()
    square = tiny_suite.prompt("square", "x squared")
    assert v.verify(
        [square, square, square], ["    return x * x\n", "    return x + x\n", "    while True: pass\n"]
    ) == [
        1.0,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="not a tiny-functions prompt"):
        v.verify(["# hello\n"], ["x"])


@pytest.mark.slow  # `flywheel up` (gateway, joiner, learner, gate) and the client, about a minute
def test_flywheel_up_with_the_examples_config_runs_its_suite_and_reward_table(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {"FLYWHEEL_HOME": str(tmp_path), "FLYWHEEL_TORCH_THREADS": "1", "FLYWHEEL_HEARTBEAT_S": "1"}
    config = EXAMPLE / "flywheel.toml"
    with Supervisor("example") as sup:
        up = sup.start(
            "up",
            [sys.executable, "-m", "cli", "--config", str(config), "up", "--port", str(port)],
            env=env,
            log_path=tmp_path / "up.log",
        )
        wait_until(lambda: http_ok(url + "/healthz"), 240, what="the gateway", check=sup.check)
        client = subprocess.run(
            [sys.executable, str(EXAMPLE / "client.py"), "--url", url, "--completions", "96"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        assert "96 completions" in client.stdout
        reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")

        def judged() -> list:
            return [v for v in reg.list() if "offline" in v.gate]

        wait_until(lambda: judged(), 300, what="the gate's first verdict", check=sup.check)
        verdict = judged()[0].gate["offline"]
        assert verdict["suite_version"].startswith("tiny-functions@1#"), verdict["suite_version"]
        reg.close()
        assert up.alive()

    from feedback.bus_embedded import EmbeddedBus
    from feedback.events import TOPICS, SampleEvent

    bus = EmbeddedBus(tmp_path / "bus")
    consumer = bus.consumer(TOPICS["sample"], "test-reader")
    samples = [SampleEvent.model_validate_json(r.value) for r in consumer.poll(10_000, timeout_s=1.0)]
    bus.close()
    assert samples and {s.reward_spec for s in samples} == {"tiny-functions-v1"}
    assert json.loads((tmp_path / "models" / "learner" / "updates.jsonl").read_text().splitlines()[0])["update"] == 1
