"""The config file's product sections, plug-ins, and `flywheel config show|check`.

`flywheel.toml` (`core.config_file`: `--config PATH`, else in the home) has the deployment sections
`gateway`, `bus` and `database` (read by `core.settings.Settings`, under the `FLYWHEEL_*` variables) and
the product's sections, read here into `ProductConfig`:

- `[rewards]`: `window_s` (the joiner's attribution window) and `spec`, the reward table: a table
  (`[rewards.spec]`, `feedback.rewards.RewardSpec`'s fields) or a plug-in path.
- `[learner]`: `learner.config.LearnerConfig` (`[learner.trainer]`, `[learner.trainer.loss]`,
  `[learner.poisoning]` nest).
- `[gate]`: `gating.gate.GateConfig` (G, margin, guardrails...) and `suite`, the product's eval suite
  as a plug-in (`suite_kwargs` are passed to it).
- `[canary]`: `gating.canary.CanaryConfig` (steps, users per arm, step times, mixing).
- `[lending]`: `serving.lending.LendingConfig` (when idle replicas are lent to offline work and taken back).

A plug-in is `"module:attr"` (uvicorn's form): the attribute, called with the section's `*_kwargs` when
it is callable. A path that does not import is a `ConfigError` naming it, at start. `flywheel gate` and
`flywheel learner` import the suite the file names (the demo's, `demo.suite:demo_suite`, by default),
and nothing else of the demo.

The precedence, highest first: command-line flags, `FLYWHEEL_*` variables (deployment settings only),
the file, the defaults. `docs/config.md` is generated from these models (`python -m cli.product_config docs`;
tests/test_config.py keeps it current).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.config_file import ConfigError, loc_key, read_config, where
from feedback.rewards import RewardSpec

M = TypeVar("M", bound=BaseModel)
PRODUCT_SECTIONS = ("rewards", "learner", "gate", "canary", "lending")
DEPLOYMENT_SECTIONS = ("gateway", "bus", "database", "limits")


class RewardsSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    window_s: float = Field(600.0, gt=0, description="The joiner's attribution window (seconds).")
    grace_s: float = Field(
        1.0,
        ge=0,
        description="How long after a completion's window the joiner still waits for feedback stamped inside it "
        "(clients batch and retry); feedback the gateway receives later than window_s + grace_s after its "
        "completion is not recorded (`window_closed` in the answer).",
    )
    producer_stale_s: float = Field(
        300.0,
        gt=0,
        description="A gateway whose bus watermark has not been reported for this long is taken for gone: the "
        "joiner stops holding windows open for records it may still hold (logged).",
    )
    spec: RewardSpec | str = Field(
        default_factory=RewardSpec,
        description="The reward table: a table of `RewardSpec` fields, or a plug-in path to a `RewardSpec`.",
    )
    spec_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a callable `spec`.")


def load_plugin(path: str, kwargs: dict[str, Any] | None = None, what: str = "plug-in") -> Any:
    """The attribute `path` ("module:attr", attr may be dotted) names, called with `kwargs` if callable.
    Modules are found on the Python path, then in the config file's folder (a product's modules next to
    its flywheel.toml, as `examples/tiny_functions` keeps them)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {path!r}: expected 'module:attribute'")
    config_file, _, _ = read_config()
    if config_file is not None and str(config_file.parent.resolve()) not in sys.path:
        sys.path.append(str(config_file.parent.resolve()))
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable(obj):  # a factory (a class too) makes the object
        try:
            obj = obj(**(kwargs or {}))
        except Exception as e:  # the product's code: whatever it raises, name the plug-in
            raise ConfigError(
                f"{what} {path!r}: calling it with {kwargs or {}} failed: {type(e).__name__}: {e}"
            ) from None
    elif kwargs:
        raise ConfigError(f"{what} {path!r} is not callable, so it takes no keyword arguments ({kwargs})")
    return obj


def validate_section(name: str, model: type[M]) -> M:
    """Section `name` of the config file as `model` (its defaults when the file is silent); a `ConfigError`
    names the key and line of the first bad value, or an unknown section."""
    path, data, text = read_config()
    known = {*DEPLOYMENT_SECTIONS, *PRODUCT_SECTIONS}
    for key in data:
        if key not in known:
            raise ConfigError(f"{where(path, text, key)}: unknown section (expected {', '.join(sorted(known))})")
    try:
        return model.model_validate(data.get(name, {}))
    except ValidationError as e:
        err = e.errors()[0]
        dotted = ".".join(x for x in (name, loc_key(err["loc"])) if x)
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"{where(path, text, dotted)}: unknown key (docs/config.md lists them)") from None
        raise ConfigError(f"{where(path, text, dotted)}: {err['msg']}") from None


def reward_spec(rewards: RewardsSection) -> RewardSpec:
    spec = rewards.spec
    if isinstance(spec, RewardSpec):
        return spec
    got = load_plugin(spec, rewards.spec_kwargs, "rewards.spec")
    if not isinstance(got, RewardSpec):
        raise ConfigError(f"rewards.spec {spec!r} gave a {type(got).__name__}, not a feedback.rewards.RewardSpec")
    return got
