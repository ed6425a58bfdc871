"""`flywheel.toml`: sections, precedence, errors naming key and line, plug-ins, `flywheel config`, and
docs/config.md generated from the models."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli import main as cli
from cli.config import load_plugin
from cli.product_config import SECTION_MODELS, config_command, docs, effective, load_product_config
from core.config_file import ConfigError, line_of
from core.settings import get_settings, load_settings
from feedback.rewards import RewardSpec

ROOT = Path(__file__).resolve().parents[1]
FILE = """\
# a product's config
[gateway]
port = 9001

[rewards]
window_s = 30

[rewards.spec]
name = "mine-v1"
accepted = 0.9

[learner]
update_every_samples = 64

[learner.trainer]
lr = 0.001

[gate]
G = 4

[canary]
steps = [0.1, 0.5]
"""
SUITE_MODULE = """
from product.suites import EvalSuite

class Exact:
    def verify(self, prompts, completions):
        return [1.0 if c.strip() == "ok" else 0.0 for c in completions]

def suite(n=2):
    items = [(f"{fam}: say ok {i}:", fam) for fam in ("a", "b") for i in range(n)]
    return EvalSuite.of("tiny", "1", items, Exact())
"""


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.delenv("FLYWHEEL_CONFIG", raising=False)
    for name in ("FLYWHEEL_PORT", "FLYWHEEL_BUS"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_docs_config_md_is_generated_from_the_models():
    assert (ROOT / "docs" / "config.md").read_text() == docs(), (
        "run: python -m cli.product_config docs > docs/config.md"
    )
    text = docs()
    for name, model in SECTION_MODELS.items():  # every key of every product section is listed
        for field in model.model_fields:
            assert f"| {name}.{field} " in text or f"| {name}.{field}." in text, f"{name}.{field}"


def test_the_file_sets_every_section_and_the_environment_overrides_it(home, monkeypatch):
    (home / "flywheel.toml").write_text(FILE)
    assert load_settings().port == 9001
    cfg = load_product_config()
    assert cfg.rewards.window_s == 30 and cfg.rewards.spec == RewardSpec(name="mine-v1", accepted=0.9)
    assert cfg.learner.update_every_samples == 64 and cfg.learner.trainer.lr == 0.001
    gate = cfg.gate_config()
    assert gate.G == 4 and gate.canary.steps == (0.1, 0.5)
    monkeypatch.setenv("FLYWHEEL_PORT", "9005")
    assert load_settings().port == 9005
    rows = {r["key"]: r for r in effective()}
    assert rows["gateway.port"]["value"] == 9005 and rows["gateway.port"]["from"] == "env FLYWHEEL_PORT"
    assert rows["learner.trainer.lr"]["from"].startswith("file ") and rows["learner.trainer.betas"]["from"] == "default"
    with cli.joiner_service(get_settings()) as joiner:  # the joiner takes the file's reward table and window
        assert joiner.spec.name == "mine-v1" and joiner.core.window_s == 30


@pytest.mark.parametrize(
    "text,expected",
    [
        (
            "[learner]\nupdate_every_samples = 64\n\n[learner.trainer]\nlrr = 0.1\n",
            ":5: learner.trainer.lrr: unknown key",
        ),
        ("[gate]\nG = 0\n", ":2: gate.G: Input should be greater than or equal to 1"),
        ("[lerner]\nx = 1\n", ":1: lerner: unknown section"),
        ("[gateway]\nprot = 1\n", ":2: gateway.prot: unknown key"),
        ("[gateway]\n\nport = 'high'\n", ":3: gateway.port: Input should be a valid integer"),
        ("[database]\nurl = 3\n", ":2: database.url: Input should be a valid string"),
        (
            '[gateway]\nengine = "embedded"\nengine_nice = 3\n',
            ":3: gateway.engine_nice: Value error, engine_nice=3 needs engine 'process' (got 'embedded')",
        ),
        ("[gate\n", "not valid TOML"),
    ],
)
def test_a_bad_file_names_the_key_and_its_line(home, text, expected):
    path = home / "flywheel.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings()
        load_product_config()
    assert str(e.value).startswith(str(path)) and expected in str(e.value), str(e.value)


def test_line_of_finds_keys_and_tables():
    text = 'a = 1\n[x]\nb = 2\n[x.y]\n  c = "d"\n'
    assert [line_of(text, k) for k in ("a", "x", "x.b", "x.y", "x.y.c", "x.z")] == [1, 2, 3, 4, 5, None]


def test_plug_ins_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "tinysuite.py").write_text(SUITE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(load_plugin("tinysuite:suite", {"n": 3}).items) == 6
    assert load_plugin("feedback.rewards:RewardSpec", {"name": "x"}).name == "x"  # a class is a factory
    for path, message in (
        ("tinysuite", "expected 'module:attribute'"),
        ("nope.mod:x", "cannot import 'nope.mod'"),
        ("tinysuite:missing", "has no attribute 'missing'"),
        ("tinysuite:suite", "calling it with"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            load_plugin(path, {"bogus": 1} if path == "tinysuite:suite" else None)
        assert path in str(e.value)


def test_the_gate_imports_no_demo_code_with_a_product_suite(tmp_path):
    """`flywheel gate`'s imports and the suite the file names, in a fresh process: no `demo` module."""
    (tmp_path / "tinysuite.py").write_text(SUITE_MODULE)
    (tmp_path / "flywheel.toml").write_text('[gate]\nsuite = "tinysuite:suite"\nsuite_kwargs = {n = 2}\n')
    code = textwrap.dedent("""
        import sys
        import cli.main, gating.gate_process
        from cli.product_config import eval_suite, load_product_config
        suite = eval_suite(load_product_config())
        assert suite.name == "tiny", suite.name
        demo = sorted(m for m in sys.modules if m == "demo" or m.startswith("demo."))
        assert not demo, demo
    """)
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    env.pop("FLYWHEEL_CONFIG", None)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_flywheel_config_check_and_show(tmp_path, monkeypatch, capsys):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(FILE)
    bad.write_text("[learner]\nupdate_evry_samples = 3\n")
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(good))
    monkeypatch.delenv("FLYWHEEL_PORT", raising=False)
    for cmd in ("check", "show"):
        config_command(argparse.Namespace(config_cmd=cmd))
    out = capsys.readouterr().out
    assert "good.toml is valid" in out and '{"key": "gate.G", "value": 4, "from": "file ' in out
    # the command line, in a fresh process: a misspelt key is one line naming it, exit 1, no traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | {"FLYWHEEL_HOME": str(tmp_path)}
    no = subprocess.run(
        [sys.executable, "-m", "cli", "--config", str(bad), "config", "check"], env=env, capture_output=True, text=True
    )
    assert no.returncode == 1 and f"{bad}:2: learner.update_evry_samples: unknown key" in no.stderr, no.stderr
    assert "Traceback" not in no.stderr


def test_offline_prompts_by_import_path(home, monkeypatch):
    from cli.product_config import offline_prompts
    from demo.split import split_of
    from demo.tasks import task_from_prompt

    assert offline_prompts(load_product_config()) is None  # none named: none
    (home / "flywheel.toml").write_text(
        '[learner]\noffline_prompts = "demo.suite:demo_offline_prompts"\noffline_prompts_kwargs = {n = 36}\n'
    )
    got = offline_prompts(load_product_config())
    assert got is not None and got.name == "demo-train" and len(got.prompts) == 36
    assert {split_of(task_from_prompt(p)) for p in got.prompts} == {"train"}  # never a gate or report prompt
    (home / "flywheel.toml").write_text('[learner]\noffline_prompts = "demo.suite:demo_suite"\n')
    with pytest.raises(ConfigError, match="'demo.suite:demo_suite' gave a EvalSuite, not a product.suites.Offline"):
        offline_prompts(load_product_config())


def test_the_demo_runs_flywheel_up_on_a_file_of_its_own(home):
    """`flywheel demo` writes its settings as a config file (no second copy of the service wiring)."""
    from core.config_file import dump_toml
    from demo.stack import demo_config
    from demo.system import DemoSystemConfig

    cfg = DemoSystemConfig(seed=3)
    (home / "flywheel.toml").write_text(dump_toml(demo_config(cfg, 8123)))
    product, settings = load_product_config(), load_settings()
    assert (settings.port, settings.replicas, settings.torch_threads) == (8123, cfg.replicas, 1)
    assert settings.engine == "process" and settings.engine_nice == cfg.serving_nice == 10
    assert product.learner.update_every_samples == cfg.learner_every_samples
    assert product.learner.trainer.loss.kl_coef == cfg.kl_coef and product.learner.trainer.lr == cfg.lr
    assert product.learner.trainer.loss.kl_estimator == cfg.kl_estimator == "k2"
    gate = product.gate_config()
    assert (gate.G, gate.seed, gate.canary.margin, gate.canary.steps) == (cfg.gate_G, 3, cfg.canary_margin, (0.2, 0.5))
    assert gate.guardrails.kl_samples_per_prompt == cfg.gate_kl_samples == 1
    assert product.gate.suite == "demo.suite:demo_suite" and product.gate.suite_kwargs == {"n": cfg.gate_prompts}
    assert product.rewards.window_s == cfg.window_s
    assert product.learner.learner_config().max_lag_updates == cfg.max_lag_updates
    assert product.learner.learner_config().min_updates_per_candidate == cfg.updates_per_candidate
    with pytest.raises(ValueError, match="max_lag_updates=4 is below updates_per_candidate=8"):
        DemoSystemConfig(max_lag_updates=4)


def test_the_demos_lending_run_lends_on_its_compressed_clock(home):
    """`flywheel demo --diurnal`: `[lending]` on, scaled to the run, with the work lent replicas run: the
    gate's eval sampling and the learner's rollouts of the demo's offline (train-split) prompts."""
    from cli.product_config import offline_prompts
    from core.config_file import dump_toml
    from demo.stack import demo_config
    from demo.system import DemoSystemConfig

    cfg = DemoSystemConfig(seed=1, diurnal_trough=0.15, lending=True)
    (home / "flywheel.toml").write_text(dump_toml(demo_config(cfg, 8123)))
    product = load_product_config()
    assert product.lending.enabled and product.lending.target_concurrency == cfg.concurrency / cfg.replicas
    assert product.lending.lend_after_s < cfg.traffic_s / 10  # its nights last a minute or two
    assert product.gate_config().lend_eval and product.learner.learner_config().offline.enabled
    source = offline_prompts(product)
    assert source is not None and source.name == "demo-train"
    assert "lending" not in demo_config(DemoSystemConfig(), 8123)  # off unless asked
    with pytest.raises(ValueError, match="lending needs at least 2 replicas"):
        DemoSystemConfig(lending=True, replicas=1)


def test_rate_limits_come_from_the_files_limits_section(home):
    (home / "flywheel.toml").write_text("[limits]\ncompletions_per_s = 5\nfeedback_events_per_s = 50\n")
    s = load_settings()
    assert (s.limit_completions_per_s, s.limit_feedback_events_per_s, s.limit_completions_burst) == (5, 50, None)
    (home / "flywheel.toml").write_text("[limits]\ncompletions_per_s = -1\n")
    with pytest.raises(ConfigError, match="limits.completions_per_s"):
        load_settings()
    (home / "flywheel.toml").write_text("[limits]\nrequests_per_s = 5\n")
    with pytest.raises(ConfigError, match="limits.requests_per_s.*unknown key"):
        load_settings()
