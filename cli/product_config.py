"""The product sections of `flywheel.toml` together (`ProductConfig`), the eval-suite plug-in,
`flywheel config show|check` and docs/config.md. The file, its sections and precedence: `cli.config`
(which the joiner imports alone: it needs neither torch nor the learner's and gate's models)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cli.config import PRODUCT_SECTIONS, RewardsSection, load_plugin, reward_spec, validate_section
from core.config_file import ConfigError, read_config
from feedback.rewards import RewardSpec
from gating.canary import CanaryConfig
from gating.gate import GateConfig
from learner.config import LearnerConfig
from product.suites import EvalSuite, OfflinePrompts
from serving.lending import LendingConfig

DEMO_SUITE = "demo.suite:demo_suite"


class GateSection(GateConfig):
    suite: str = Field(DEMO_SUITE, description="The product's offline eval suite: a plug-in path to an `EvalSuite`.")
    suite_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a callable `suite`.")


class LearnerSection(LearnerConfig):
    offline_prompts: str | None = Field(
        None,
        description="Prompts for offline group rollouts (lending): a plug-in path to a "
        "`product.suites.OfflinePrompts`; None: none.",
    )
    offline_prompts_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of a callable `offline_prompts`."
    )

    def learner_config(self) -> LearnerConfig:
        """The learner's own settings, without the plug-in."""
        return LearnerConfig(**self.model_dump(exclude={"offline_prompts", "offline_prompts_kwargs"}))


class ProductConfig(BaseModel):
    """The product sections of `flywheel.toml` (the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rewards: RewardsSection = Field(default_factory=RewardsSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    gate: GateSection = Field(default_factory=GateSection)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    lending: LendingConfig = Field(default_factory=LendingConfig)

    def gate_config(self) -> GateConfig:
        """The gate's settings: the `[gate]` section with the `[canary]` section as its canary."""
        fields = self.gate.model_dump(exclude={"suite", "suite_kwargs", "canary"})
        return GateConfig(**fields, canary=self.canary)


def load_product_config() -> ProductConfig:
    """The product sections of the config file (defaults where it is silent); a `ConfigError` names the
    key and line of the first bad one."""
    sections = {name: validate_section(name, model) for name, model in SECTION_MODELS.items()}
    return ProductConfig(**sections)


def eval_suite(cfg: ProductConfig) -> EvalSuite:
    got = load_plugin(cfg.gate.suite, cfg.gate.suite_kwargs, "gate.suite")
    if not isinstance(got, EvalSuite):
        raise ConfigError(f"gate.suite {cfg.gate.suite!r} gave a {type(got).__name__}, not a product.suites.EvalSuite")
    return got


def offline_prompts(cfg: ProductConfig) -> OfflinePrompts | None:
    """The `learner.offline_prompts` plug-in, or None when the file names none."""
    if cfg.learner.offline_prompts is None:
        return None
    got = load_plugin(cfg.learner.offline_prompts, cfg.learner.offline_prompts_kwargs, "learner.offline_prompts")
    if not isinstance(got, OfflinePrompts):
        raise ConfigError(
            f"learner.offline_prompts {cfg.learner.offline_prompts!r} gave a {type(got).__name__}, "
            "not a product.suites.OfflinePrompts"
        )
    return got


SECTION_MODELS: dict[str, type[BaseModel]] = {
    "rewards": RewardsSection,
    "learner": LearnerSection,
    "gate": GateSection,
    "canary": CanaryConfig,
    "lending": LendingConfig,
}
assert tuple(SECTION_MODELS) == PRODUCT_SECTIONS


# ---- flywheel config show | check ------------------------------------------------------------------


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    return {prefix: value}


def effective() -> list[dict[str, Any]]:
    """Every setting: its dotted key, effective value and where it came from (file, env or default)."""
    from core.settings import file_keys, load_settings

    settings, product = load_settings(), load_product_config()
    path, data, _ = read_config()
    in_file = _flat("", data)
    rows = []
    for field, dotted in sorted(file_keys().items(), key=lambda kv: kv[1]):
        env = f"FLYWHEEL_{field.upper()}"
        value = getattr(settings, field)
        source = f"env {env}" if env in os.environ else f"file {path}" if dotted in in_file else "default"
        shown = "***" if field in ("session_secret", "weights_token", "api_keys") and value else value
        rows.append({"key": dotted, "value": json.loads(json.dumps(shown, default=str)), "from": source})
    for dotted, value in sorted(_flat("", product.model_dump(mode="json")).items()):
        source = f"file {path}" if dotted in in_file or any(dotted.startswith(k + ".") for k in in_file) else "default"
        rows.append({"key": dotted, "value": value, "from": source})
    return rows


def config_command(args: Any) -> None:
    """`flywheel config show` (every setting, its value and source) or `check` (validate, plug-ins too)."""
    try:
        if args.config_cmd == "show":
            for row in effective():
                print(json.dumps(row))
            return
        from core.settings import load_settings

        load_settings()
        cfg = load_product_config()
        reward_spec(cfg.rewards)
        suite = eval_suite(cfg)
        prompts = offline_prompts(cfg)
        path, _, _ = read_config()
        print(
            f"flywheel config: {path or 'no config file (defaults)'} is valid; suite {suite.suite_version}"
            + (f"; offline prompts {prompts.name!r} ({len(prompts.prompts)})" if prompts is not None else "")
        )
    except ConfigError as e:
        sys.exit(f"flywheel config: {e}")


# ---- docs/config.md -----------------------------------------------------------------------------


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        nested = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if nested is not None and name not in ("spec",):
            out += _rows(nested, f"{prefix}.{name}")
            continue
        default = f.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = "(table)"
        text = (f.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| {prefix}.{name} | `{json.dumps(default, default=str)}` | {text} |")
    return out


def docs() -> str:
    """docs/config.md: every key of the file, its default and meaning, from the models."""
    from core.settings import Settings, file_keys

    lines = [
        "# Configuration: flywheel.toml",
        "",
        "Generated from the models by `python -m cli.product_config docs > docs/config.md` (a test keeps it current).",
        "The file is TOML, at `--config PATH` or flywheel.toml in the home (`FLYWHEEL_HOME`). Precedence,",
        "highest first: command-line flags, `FLYWHEEL_<FIELD>` variables (deployment keys only: the variable",
        "is named after the field, in the last column), the file, the defaults. `flywheel config show` prints",
        "every effective value and where it came from; `flywheel config check` validates the file and imports",
        "its plug-ins. An unknown key or a bad value is an error naming the key and its line.",
        "",
        "## Deployment: `[gateway]`, `[bus]`, `[database]`, `[limits]`",
        "",
        "| key | default | variable | meaning |",
        "|---|---|---|---|",
    ]
    for field, dotted in sorted(file_keys().items(), key=lambda kv: kv[1]):
        f = Settings.model_fields[field]
        default = f.get_default(call_default_factory=True)
        text = (f.description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {dotted} | `{json.dumps(default, default=str)}` | `FLYWHEEL_{field.upper()}` | {text} |")
    lines += ["", "## The product: " + ", ".join(f"`[{name}]`" for name in SECTION_MODELS), ""]
    lines += ["| key | default | meaning |", "|---|---|---|"]
    lines += _rows(RewardsSection, "rewards")
    lines += _rows(RewardSpec, "rewards.spec")
    lines += _rows(LearnerSection, "learner")
    lines += [r for r in _rows(GateSection, "gate") if not r.startswith("| `gate.canary.")]
    lines += _rows(CanaryConfig, "canary")
    lines += _rows(LendingConfig, "lending")
    lines += [
        "",
        "Keys are dotted paths: `[learner.trainer]` then `lr = 0.001` sets learner.trainer.lr. A plug-in",
        '(gate.suite, rewards.spec, learner.offline_prompts) is `"module:attribute"`, called with its',
        "`*_kwargs` table when callable (`cli.config.load_plugin`). An example:",
        "",
        "```toml",
        "[rewards]",
        "window_s = 900",
        "",
        "[rewards.spec]",
        'name = "my-product-v1"',
        "accepted = 1.0",
        "",
        "[learner]",
        "update_every_samples = 1024",
        "",
        "[gate]",
        'suite = "my_product.evals:suite"',
        "G = 8",
        "```",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["docs"]:
        sys.exit("usage: python -m cli.product_config docs > docs/config.md")
    sys.stdout.write(docs())
