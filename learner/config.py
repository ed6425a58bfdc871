"""The learner service's settings: cadence, staleness, hold-back while the gate works, and its parts' configs.

The reasoning behind each default is in `learner.service`'s docstring and docs/learner.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from feedback.events import TOPICS
from learner.poisoning import PoisoningConfig
from learner.trainer import TrainerConfig


class LentRolloutConfig(BaseModel):
    """`[learner.offline]`: the learner's offline group rollouts on lent replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Queue group rollouts for lent replicas (needs learner.offline_prompts).")
    prompts_per_job: int = Field(32, ge=1, description="Prompts per rollout job (one GRPO group each).")
    group_size: int = Field(8, ge=2, description="Samples per prompt (the group).")
    shard_size: int = Field(4, ge=1, description="Prompts per shard: what one lent replica takes at a time.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature of the rollouts.")
    max_tokens: int = Field(48, ge=1, description="Longest rollout completion.")
    weight: float = Field(1.0, gt=0, description="Weight of an offline sequence against an online sample.")
    seed: int = Field(0, description="Seeds the prompt order and every sample.")


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    update_every_samples: int = Field(512, ge=1, description="Update as soon as this many samples are buffered.")
    update_every_s: float = Field(4 * 3600.0, gt=0, description="...or when this much time has passed.")
    min_samples: int = Field(32, ge=1, description="Fewest samples a time-triggered update uses.")
    max_staleness: int = Field(
        2, ge=0, description="Drop samples served more than this many versions ago (in `staleness_unit`)."
    )
    untrained_tenants: list[str] = Field(
        default_factory=list,
        description="Tenants whose feedback never trains the shared model: their samples are dropped before "
        "training, counted (`dropped_opted_out`), and not used by the poisoning screen either.",
    )
    max_lag_updates: int | None = Field(
        8,
        ge=1,
        description="Drop samples served more than this many updates before the learner's tip (policy lag, "
        "whatever `staleness_unit` says), and wait while the promoted version is this far behind; None: no "
        "bound in updates. Dropped samples are counted (`lag`).",
    )
    lag_wait_updates: int | None = Field(
        None,
        ge=1,
        description="Updates' worth of samples buffered while waiting at the lag bound, trained in one update "
        "when the gate moves on; what the old version served beyond that is then past the bound, dropped and "
        "counted. None: the bound's worth (`max_lag_updates`), keeping what users sent at the cost of one large "
        "update on the way to the next candidate; 1: an ordinary update (the demo, with samples to spare and "
        "ten minutes).",
    )
    staleness_unit: Literal["versions", "updates"] = Field(
        "versions",
        description="What staleness counts: registered versions of the lineage (with `hold_back`, at most one "
        "per gate cycle) or every update, held back or not.",
    )
    hold_back: bool = Field(
        True,
        description="While a version is in flight at the gate, keep training but register no candidate; the "
        "tip is registered once the gate is free (so the gate always gets the newest).",
    )
    min_updates_per_candidate: int = Field(
        1,
        ge=1,
        description="Updates a candidate must hold beyond its parent: fewer are held back (as while the gate "
        "is busy), so the gate and the canary get a version that differs enough to tell apart.",
    )
    hold_check_s: float = Field(5.0, ge=0, description="How often a held-back tip asks whether the gate is free.")
    group: str = Field(
        "learner",
        description="Consumer group on the sample topic (with a verifier, the poisoning screen's scout reads it "
        "in `<group>.scout`).",
    )
    topic: str = Field(TOPICS["sample"], description="The topic of `sample` events (the joiner's output).")
    snapshot_every: int = Field(8, ge=1, description="Weight store: a full snapshot every N versions, deltas between.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The update itself.")
    poisoning: PoisoningConfig = Field(
        default_factory=PoisoningConfig, description="Flag and weigh down users who dominate an update's reward."
    )
    offline: LentRolloutConfig = Field(
        default_factory=lambda: LentRolloutConfig(), description="Offline group rollouts on lent replicas."
    )

    @model_validator(mode="after")
    def _candidates_fit_under_the_lag_bound(self) -> LearnerConfig:
        # The learner waits once the promoted version is `max_lag_updates` behind its tip; a candidate that
        # needs more updates than that could never be registered, and the learner would wait forever.
        if self.max_lag_updates is not None and self.min_updates_per_candidate > self.max_lag_updates:
            raise ValueError(
                f"min_updates_per_candidate={self.min_updates_per_candidate} exceeds max_lag_updates="
                f"{self.max_lag_updates}: a candidate could never be registered under the lag bound"
            )
        return self
