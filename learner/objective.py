"""The learner's objective: single-sample, off-policy-aware policy gradient. Pure functions.

Every choice, stated:
- **Single sample, no group.** Each completion has one scalar reward r (from user feedback). The
  advantage is A = r - b with b a running baseline (`RunningBaseline`: an exponential moving average
  per key — task family, tenant — falling back to the global average until a key has seen
  `min_count` rewards). No critic, no group needed. Offline rollouts come in groups of G samples
  per prompt with verifiable rewards; their advantage is group-relative (`group_advantages`:
  r_i - mean of the group, optionally divided by the group's std), and they mix with online samples
  by a configurable weight (`LossConfig.offline_weight`).
- **Staleness correction.** A completion was sampled by behaviour version μ (its recorded
  log-probabilities); the trainer is at θ. The token ratio ρ_t = π_θ(a_t|s_t) / μ(a_t|s_t) is
  computed in log space from the trainer's log-probabilities under the *same sampling transform*
  the server used (temperature, top-p; see serving.sampling) and, with router replay, the same
  experts. Two estimators:
    * "tis" (default): truncated importance sampling, REINFORCE weighted by w_t = min(ρ_t, C),
      w_t treated as a constant: loss_t = -w_t · A · log π_θ(a_t). Unbiased up to the truncation,
      bounded variance; C = `is_cap`.
    * "ppo": the PPO clipped surrogate, loss_t = -min(ρ_t A, clip(ρ_t, 1-ε, 1+ε) A), with the
      dual clip (Ye et al. 2020, "Mastering complex control in MOBA games with deep RL") for
      A < 0: loss_t = -max(min(ρ_t A, clip(ρ_t) A), c·A), c = `dual_clip_c` > 1. Without it a
      stale sample whose token became much likelier (ρ ≫ 1) under a negative advantage gets a
      surrogate ρ·A unbounded below, and a gradient that grows with ρ; with it, beyond ρ = c the
      token's objective is the constant c·A (no gradient). "tis" needs no dual clip: its weight
      min(ρ, C) is already at most C whatever the sign of A, so a token's gradient is at most
      C·|A|·|∇log π|.
  **Log-ratio clamp** (both estimators): log ρ_t is clamped to [-L, L], L = `max_log_ratio`, before
  the exponential, so one wild token (a recorded log-prob of -80, a trainer top-p cut) cannot
  overflow ρ to inf and the loss to nan. Under "ppo" a clamped token gets no gradient through ρ
  (the clamp is flat there), under "tis" its weight is the capped one anyway.
  Statistics: `clip_frac` (tokens whose weight was truncated at C, or whose PPO clip is active),
  `dual_clip_frac` (tokens where the dual-clip bound c·A is the objective), `clamp_frac` (tokens whose
  |log ρ| exceeded L), `logp_mean` / `behaviour_logp_mean` (mean log-prob of the sampled tokens under
  the trainer and as recorded).
- **KL to the promoted reference** (optional, `kl_coef` > 0). The penalty is the reverse KL,
  KL(π_θ || π_ref) = E_{a~π_θ}[log π_θ(a) - log π_ref(a)], per visited token state s_t. Its gradient
  is g = E_{a~π_θ}[δ(a) ∇log π_θ(a)] with δ = log π_θ - log π_ref (the term E_π[∇log π_θ] = ∇Σπ_θ = 0
  drops). The tokens were drawn from the behaviour μ, not π_θ, so each sampled token carries the
  importance weight w_t = min(ρ_t, C): the same truncated, detached ratio π_θ/μ (log-ratio clamp
  included) that "tis" uses, for either estimator. The loss per token is
      kl_t = w_t · ½ δ_t²            (k2, weighted),
  whose gradient w_t δ_t ∇log π_θ(a_t) has expectation over a_t ~ μ exactly g (E_μ[ρ f] = E_π[f]),
  up to the truncation at C; on-policy (μ = π_θ, w = 1) it is the plain k2 loss, whose gradient is g.
  It is reduced like the policy term (same normalisation, same sample weights) and added times
  `kl_coef`. The reported estimate `kl_k3` is the weighted k3, the token mean of
  w_t · (e^{-δ_t} + δ_t - 1): each term ≥ 0 and, untruncated, E_μ[w k3] = E_π[k3] = KL(π_θ || π_ref).
  Why not the alternatives:
    * k3 = e^{-δ} + δ - 1 *as a loss* has gradient (1 - π_ref/π_θ) ∇log π_θ, whose expectation under
      π_θ is -Σ_a π_ref(a) ∇log π_θ(a) = ∇KL(π_ref || π_θ): the forward KL's gradient, not the
      reverse's (and without importance weights, under μ, not even that).
    * ρ·k3 with ρ differentiable (DeepSeek-V3.2's unbiased KL) has the same gradient in exact
      arithmetic, but forms it as k3·∇log π + (1 - π_ref/π_θ)∇log π: two terms of size π_ref/π_θ
      that cancel, catastrophically in float32 where the policy has made a reference-likely token
      unlikely. k2 gives δ directly.
    * k1 folded into the advantage: the same gradient under "tis", but under "ppo" it would be
      clipped with the reward term, and the advantages here are one per sequence.
  Scope: this is the gradient of Σ_t KL(π_θ(·|s_t) || π_ref(·|s_t)) at the states the behaviour
  visited; θ's effect on *which* prefixes are visited (the sequence-level KL's extra term
  ∇log π_θ(a_t) · Σ_{t'>t} δ_{t'}) is not included, as in the usual per-token KL loss.
- **Entropy bonus** (optional, `entropy_coef` > 0): minus `entropy_coef` times the reduced per-token
  entropy H_t = -Σ_a π_θ(a|s_t) log π_θ(a|s_t) of the trainer's sampling distribution (`entropy`,
  from the full [B, T, V] log-probabilities; tokens a top-p cut removed add 0, with a finite gradient).
  H_t is exact at each visited state (no sampled action, so no importance weight); descending the
  loss raises it. The statistic `entropy` is its token mean, reported whether or not the bonus is on.
- **Normalisation.** "token": sum of per-token losses / number of tokens in the batch (long
  completions weigh more, every token counts the same). "sequence": mean over a sequence's
  tokens, then mean over sequences (every completion counts the same). Default "sequence": one
  user judgement per completion should move the model by about the same amount whatever its length.
- Greedy completions (temperature 0, recorded log-probability 0) carry no usable ratio; callers
  drop them before building a batch.

Shapes: B sequences, T completion tokens (right-padded; `mask` is 1 on real tokens).
Called by learner.trainer; tested against values computed by hand, and the KL term's expected gradient
against the exact reverse-KL gradient of a small categorical policy (tests/learner/test_kl.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: Literal["tis", "ppo"] = Field("tis", description="Truncated IS REINFORCE or PPO clipping.")
    is_cap: float = Field(
        2.0,
        gt=0,
        description="C in min(ρ, C): the 'tis' weight, and the KL term's importance weight (both estimators).",
    )
    clip_eps: float = Field(0.2, gt=0, lt=1, description="ε of the PPO clip range [1-ε, 1+ε].")
    dual_clip_c: float = Field(
        3.0, gt=1, description="c of the dual clip (PPO, negative advantages): the objective is at least c·A."
    )
    max_log_ratio: float = Field(
        20.0, gt=0, description="|log ρ| is clamped to this before the exponential (no overflow to inf)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the reverse KL(π_θ || π_ref) penalty: importance-weighted k2 per token, whose "
        "gradient is the reverse KL's (see the module docstring).",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Weight of the entropy bonus: the loss is lowered by this times the mean entropy."
    )
    normalize: Literal["token", "sequence"] = Field("sequence", description="How per-token losses are averaged.")
    offline_weight: float = Field(1.0, ge=0, description="Weight of offline group-rollout samples vs online ones.")


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


def _reduce(per_token_BT: torch.Tensor, mask_BT: torch.Tensor, weight_B: torch.Tensor, how: str) -> torch.Tensor:
    if how == "token":
        w = mask_BT * weight_B[:, None]
        return (per_token_BT * w).sum() / mask_BT.sum().clamp(min=1)
    per_seq = (per_token_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return (per_seq * weight_B).sum() / weight_B.numel()


def entropy(logp_BTV: torch.Tensor) -> torch.Tensor:
    """-Σ_a p log p per position [B, T], differentiable; entries at -inf (cut by top-p) add 0 and
    send no nan back (their log-probability is replaced by 0 before the product, not after)."""
    finite_logp = torch.where(torch.isfinite(logp_BTV), logp_BTV, torch.zeros_like(logp_BTV))
    return -(logp_BTV.exp() * finite_logp).sum(-1)


def policy_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    ref_logp_BT: torch.Tensor | None = None,
    weight_B: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> LossOutput:
    """The loss to minimise and its statistics (`stats` are plain floats, for logging).

    `ref_logp_BT`: the reference's log-probabilities of the same tokens (needed when `kl_coef` > 0;
    `kl_k3` is reported whenever it is given). `entropy_BT`: the per-token entropy of the trainer's
    distribution (`entropy`), with its graph when `entropy_coef` > 0 (needed then)."""
    if logp_BT.shape != behaviour_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logp {tuple(logp_BT.shape)}, behaviour_logp {tuple(behaviour_logp_BT.shape)} and "
            f"mask {tuple(mask_BT.shape)} must have the same shape"
        )
    if advantages_B.shape != logp_BT.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages_B.shape)}, expected ({logp_BT.shape[0]},)")
    mask = mask_BT.to(logp_BT.dtype)
    weight = torch.ones_like(advantages_B) if weight_B is None else weight_B.to(advantages_B.dtype)
    raw_log_ratio = logp_BT - behaviour_logp_BT
    L = cfg.max_log_ratio
    log_ratio = torch.clamp(raw_log_ratio, -L, L)
    clamped = (raw_log_ratio.detach().abs() > L).to(logp_BT.dtype)
    ratio = torch.exp(log_ratio)
    A = advantages_B[:, None]
    dual = torch.zeros_like(mask)
    if cfg.estimator == "tis":
        w = torch.clamp(ratio.detach(), max=cfg.is_cap)
        per_token = -w * A * logp_BT
        clipped = (ratio.detach() > cfg.is_cap).to(logp_BT.dtype)
    else:
        unclipped = ratio * A
        clipped_obj = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * A
        surrogate = torch.minimum(unclipped, clipped_obj)
        clipped = (clipped_obj < unclipped).to(logp_BT.dtype)
        floor = (cfg.dual_clip_c * A).expand_as(surrogate)
        dual_active = (A < 0) & (surrogate < floor)
        per_token = -torch.where(dual_active, floor, surrogate)
        dual = dual_active.to(logp_BT.dtype)
    loss = _reduce(per_token, mask, weight, cfg.normalize)
    n = mask.sum().clamp(min=1)
    kl_estimate = 0.0
    if cfg.kl_coef > 0 and ref_logp_BT is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs the reference log-probabilities (ref_logp_BT)")
    if ref_logp_BT is not None:
        if ref_logp_BT.shape != logp_BT.shape:
            raise ValueError(f"ref_logp {tuple(ref_logp_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
        w_kl = torch.clamp(ratio.detach(), max=cfg.is_cap)
        delta = logp_BT - ref_logp_BT.to(logp_BT.dtype)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * _reduce(w_kl * 0.5 * delta.square(), mask, weight, cfg.normalize)
        with torch.no_grad():
            k3 = torch.expm1(-delta) + delta
            kl_estimate = float(torch.where(mask > 0, w_kl * k3, torch.zeros_like(k3)).sum() / n)
    if cfg.entropy_coef > 0 and entropy_BT is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy (entropy_BT)")
    if entropy_BT is not None:
        if entropy_BT.shape != logp_BT.shape:
            raise ValueError(f"entropy {tuple(entropy_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * _reduce(entropy_BT, mask, weight, cfg.normalize)
    with torch.no_grad():
        stats = {
            "loss": float(loss),
            "ratio_mean": float((ratio * mask).sum() / n),
            "ratio_max": float(ratio.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 1.0,
            "clip_frac": float((clipped * mask).sum() / n),
            "dual_clip_frac": float((dual * mask).sum() / n),
            "clamp_frac": float((clamped * mask).sum() / n),
            "abs_log_ratio_mean": float((log_ratio.abs() * mask).sum() / n),
            "logp_mean": float((logp_BT * mask).sum() / n),
            "behaviour_logp_mean": float((behaviour_logp_BT * mask).sum() / n),
            "adv_mean": float(advantages_B.mean()),
            "adv_std": float(advantages_B.std()) if advantages_B.numel() > 1 else 0.0,
            "kl_k3": kl_estimate,
            "tokens": float(mask.sum()),
        }
        if entropy_BT is not None:
            stats["entropy"] = float((entropy_BT * mask).sum() / n)
    return LossOutput(loss, stats)


def group_advantages(rewards: list[float], scale: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO-style: r_i - mean(group), divided by the group's (population) std when `scale`."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


class RunningBaseline:
    """b(key): EMA of rewards per key, the global EMA until the key has `min_count` rewards.

    Updated *after* the advantage of a sample is computed, so a sample never baselines itself. At
    most `max_keys` keys are tracked; a key first seen beyond that updates the global EMA only (and
    so is always baselined by it): a stream of distinct keys cannot grow the state without bound.
    """

    max_keys: int = 10_000

    def __init__(self, decay: float = 0.99, min_count: int = 20, initial: float = 0.0, max_keys: int = 10_000):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if min_count < 0:
            raise ValueError(f"min_count must be >= 0, got {min_count}")
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.decay, self.min_count, self.max_keys = decay, min_count, max_keys
        self.global_value, self.global_count = initial, 0
        self.values: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def keyed(self, key: str | None) -> bool:
        """`value(key)` is the key's own EMA (not the global fallback): it has `min_count` rewards, and one."""
        return key is not None and self.counts.get(key, 0) >= max(self.min_count, 1)

    def value(self, key: str | None = None) -> float:
        if key is not None and self.keyed(key):
            return self.values[key]
        return self.global_value

    def update(self, reward: float, key: str | None = None) -> None:
        d = self.decay
        # Bias-corrected start: the first rewards set the level instead of being shrunk towards `initial`.
        self.global_count += 1
        a = max(1.0 - d, 1.0 / self.global_count)
        self.global_value += a * (reward - self.global_value)
        if key is not None and (key in self.counts or len(self.counts) < self.max_keys):
            c = self.counts.get(key, 0) + 1
            self.counts[key] = c
            v = self.values.get(key, reward)
            self.values[key] = v + max(1.0 - d, 1.0 / c) * (reward - v)

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "min_count": self.min_count,
            "max_keys": self.max_keys,
            "global_value": self.global_value,
            "global_count": self.global_count,
            "values": dict(self.values),
            "counts": dict(self.counts),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> RunningBaseline:
        b = cls(state["decay"], state["min_count"], max_keys=state.get("max_keys", cls.max_keys))
        b.global_value, b.global_count = state["global_value"], state["global_count"]
        b.values, b.counts = dict(state["values"]), dict(state["counts"])
        return b
