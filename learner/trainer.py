"""One policy-gradient update of the MoE model from served completions and their rewards.

Owns the optimizer state and the running baseline across updates, and the order of operations in
one update: advantages against the baseline *before* it sees this batch's rewards, centred per batch
(`center_advantages`); `steps_per_update` (default 2) passes over the batch, each with trainer
log-probabilities under router replay, the decoupled-PPO loss (`learner.objective`), gradient
clipping and an AdamW step. The algorithm, for a reader: docs/learner.md.

- **The proximal policy** is the weights at the start of the update: the first pass's
  log-probabilities, detached (the same forward, before the first optimizer step), are π_prox for
  every pass, and so is the set of tokens the trainer's own top-p cuts at π_prox (masked). The
  behaviour weight π_prox/μ and the mask are therefore fixed for the update; the PPO clip on
  π_θ/π_prox binds from the second pass on (`clip_frac_step1` is 0 by construction, `clip_frac_step2`
  is what the clip did). Why 2 by default: with 1 no trust region acts (the clip ratio is 1), and
  the update is truncated-and-masked importance-weighted REINFORCE; 2 passes cost twice the compute
  of 1 and let the clip bound the second step against the first.
- **Micro-batches by routing.** Replay is per micro-batch (one routing tensor): sequences without
  recorded routing are put in micro-batches of their own, so they never switch replay off for
  sequences that have it. Counted every update: `missing_routing_sequences`,
  `replay_off_micro_batches`.
- **Statistics** every update: reward, advantages (`adv_raw_mean` / `adv_raw_std` before the
  per-batch normalisation, `adv_mean` / `adv_std` after), samples baselined by their key vs the
  fallback (`learner.baselines`), the behaviour ratio (`ratio_mean`, `ratio_max`,
  `abs_log_ratio_mean`, `truncated_frac`), the mask (`masked_frac` and its reasons, with token
  counts `masked_tokens`, `masked_top_p_tokens`, ...), clip / dual-clip / clamp fractions, entropy,
  mean sampled log-prob, |Δlog-prob| serving vs trainer at the behaviour version, routing
  disagreement without replay, grad norm. Fractions are means over the passes; `*_max` are maxima.

- **A non-finite update changes nothing.** If the loss or the clipped gradient norm of any step is
  not finite, the update raises `NonFiniteUpdate` *before* `opt.step()`: the parameters, the AdamW
  state, the running baseline and the update count are as they were (with `steps_per_update` > 1 the
  parameters and optimizer state are snapshotted first and restored). Data-parallel ranks agree on
  the verdict (one all-reduce). The learner service quarantines the batch.
- **KL to a frozen reference.** With `loss.kl_coef` > 0 the trainer needs a reference model (the
  promoted version, `set_reference`; a ValueError otherwise); its log-probabilities are computed
  with the same router replay and sampling transform as the policy's, without gradient. The loss
  term is the importance-weighted k2 of `learner.objective` (its gradient is the reverse
  KL(π_θ || π_ref)'s); `kl_k3` logs the importance-weighted k3 estimate of that KL per token.
- **Entropy** (`entropy`): the mean per-token entropy of the trainer's distribution *under the
  sampling transform* (temperature, then top-p: the distribution the tokens were drawn from), before
  the step; with `loss.entropy_coef` > 0 it is also the entropy bonus, computed with its gradient.
  `logp_mean`: the mean trainer log-prob of the sampled tokens.

Called by the learner service and the demo loop.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from learner.baselines import usage
from learner.objective import LossConfig, RunningBaseline, entropy, exact_kl, policy_loss
from learner.replay import (
    Sequence,
    chosen_logprobs,
    make_batch,
    mismatch_stats,
    sampling_distribution,
    top_p_cut,
)
from serving.model import Transformer

log = logging.getLogger(__name__)


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-4, gt=0, description="Adam learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    micro_batch: int = Field(64, ge=1, description="Sequences per forward/backward.")
    steps_per_update: int = Field(
        2,
        ge=1,
        description="Optimizer steps per update (passes over the batch). From the second on, the PPO clip bounds "
        "π_θ/π_prox; with 1 the correction is the truncated-and-masked behaviour weight alone.",
    )
    advantage_norm: Literal["center", "center_scale", "none"] = Field(
        "center",
        description="Per batch: subtract the weighted mean of the online advantages; 'center_scale' also "
        "divides by their weighted standard deviation (see `center_advantages`).",
    )
    replay: bool = Field(True, description="Route every token to its recorded experts.")
    batch_invariant: bool = Field(
        True,
        description="Recompute log-probs with the model's batch-invariant float32 kernels (as the engine "
        "decodes by default): bit-identical to the served values at the behaviour version.",
    )
    baseline_decay: float = Field(0.95, gt=0, lt=1, description="EMA decay of the running reward baseline.")
    baseline_min_count: int = Field(20, ge=0, description="Rewards a key needs before its own baseline is used.")
    loss: LossConfig = Field(default_factory=LossConfig, description="The objective's settings.")


COUNTED: dict[str, str | None] = {
    "tokens": None,
    "clipped_tokens": "clip_frac",
    "dual_clipped_tokens": "dual_clip_frac",
    "clamped_tokens": "clamp_frac",
    "truncated_tokens": "truncated_frac",
    "masked_tokens": "masked_frac",
    "masked_ratio_tokens": "masked_ratio_frac",
    "masked_dppo_tokens": "masked_dppo_frac",
    "masked_top_p_tokens": "masked_top_p_frac",
}
"""Statistics that are token counts of the whole batch (per step): name -> the fraction it counts (None: all)."""


def center_advantages(
    adv: torch.Tensor, weights: torch.Tensor, online: torch.Tensor, how: str, eps: float = 1e-6
) -> torch.Tensor:
    """Per-batch normalisation of the online samples' advantages (`online`: bool [B]).

    "center": A_i - m, with m = Σ w_i A_i / Σ w_i over the online samples (w: the samples' loss
    weights, 1 unless the poisoning screen weighed a user down), so the batch's weighted advantages
    sum to 0: the batch's common level (the part of the rewards that no baseline tracked yet) moves
    the policy nowhere. A sample's own reward is in m, with weight w_i / Σ w: a bias of 1/B of its
    advantage (0.4% at B = 256). "center_scale": then divided by the weighted standard deviation
    sqrt(Σ w_i (A_i - m)² / Σ w_i) + `eps`. "none": unchanged. Offline samples (group-relative
    advantages, already centred per group) are never touched. Computed in float64."""
    if how == "none" or not bool(online.any()):
        return adv
    a, w = adv.to(torch.float64), weights.to(torch.float64) * online.to(torch.float64)
    total = w.sum()
    if float(total) <= 0:
        return adv
    m = (w * a).sum() / total
    out = torch.where(online, a - m, a)
    if how == "center_scale":
        sd = torch.sqrt((w * (a - m).square()).sum() / total)
        out = torch.where(online, (a - m) / (sd + eps), a)
    return out.to(adv.dtype)


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


class NonFiniteUpdate(FloatingPointError):
    """An update whose loss or gradient norm was not finite; it changed nothing (see the docstring)."""


@dataclass
class UpdateResult:
    stats: dict[str, float]


@dataclass(frozen=True)
class Shard:
    """This process's part of a data-parallel batch (`learner.distributed`): micro-batch losses are
    weighted by their share of the *whole* batch, times `world_size` because the all-reduce averages."""

    samples: int  # sequences in the whole batch, all ranks together
    tokens: float  # completion tokens in the whole batch
    world_size: int


class Trainer:
    def __init__(
        self,
        model: Transformer,
        cfg: TrainerConfig,
        n_vocab: int | None,
        pad_id: int,
        reference: Transformer | None = None,
    ):
        self.model, self.cfg, self.n_vocab, self.pad_id = model, cfg, n_vocab, pad_id
        if cfg.loss.kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef={cfg.loss.kl_coef} needs a reference model (the promoted version)")
        self.reference: Transformer | None = None
        if reference is not None:
            self.set_reference(reference)
        # The loss's forward goes through this: the model itself, or a DistributedDataParallel wrapper
        # of it (learner.distributed); `self.model` stays the plain Transformer either way.
        self.forward_model: torch.nn.Module = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.baseline = RunningBaseline(cfg.baseline_decay, cfg.baseline_min_count)
        self.baseline_usage: dict[str, float] = {}  # of the last `advantages` (learner.baselines.usage)
        self.advantage_stats: dict[str, float] = {}  # of the last `batch_advantages`, before normalisation
        self.updates = 0

    def set_reference(self, reference: Transformer) -> None:
        """The frozen model the KL term pulls towards (eval mode, no gradients)."""
        self.reference = reference.eval().requires_grad_(False)

    def advantages(self, seqs: list[Sequence], group_advantages: list[float | None] | None = None) -> torch.Tensor:
        """A = r - b(key), with b as it was before this batch; then the baseline learns this batch.
        Logs, and keeps in `baseline_usage`, how many samples their key's baseline and the fallback served."""
        adv = []
        for i, s in enumerate(seqs):
            given = group_advantages[i] if group_advantages is not None else None
            adv.append(given if given is not None else s.reward - self.baseline.value(s.key))
        keys = [s.key for i, s in enumerate(seqs) if group_advantages is None or group_advantages[i] is None]
        self.baseline_usage = usage(self.baseline, keys)
        u = self.baseline_usage
        log.info(
            "baselines: %d samples keyed, %d fallback (%d without a key); %d keys tracked",
            *(int(u[k]) for k in ("baseline_keyed", "baseline_fallback", "baseline_unkeyed", "baseline_keys")),
        )
        for i, s in enumerate(seqs):
            if group_advantages is None or group_advantages[i] is None:
                self.baseline.update(s.reward, s.key)
        return torch.tensor(adv, dtype=torch.float32)

    def batch_advantages(
        self, seqs: list[Sequence], group_advantages: list[float | None] | None = None
    ) -> torch.Tensor:
        """`advantages`, then normalised per batch (`center_advantages`, `cfg.advantage_norm`); the
        online advantages' weighted mean and std before it are kept in `advantage_stats`."""
        raw = self.advantages(seqs, group_advantages)
        online = torch.tensor([group_advantages is None or group_advantages[i] is None for i in range(len(seqs))])
        weights = torch.tensor([s.weight for s in seqs], dtype=torch.float64)
        a, w = raw.to(torch.float64)[online], weights[online]
        self.advantage_stats = {}
        if a.numel() and float(w.sum()) > 0:
            m = float((w * a).sum() / w.sum())
            self.advantage_stats = {
                "adv_raw_mean": m,
                "adv_raw_std": float(torch.sqrt((w * (a - m) ** 2).sum() / w.sum())),
            }
        return center_advantages(raw, weights, online, self.cfg.advantage_norm)

    def update(
        self,
        seqs: list[Sequence],
        group_advantages: list[float | None] | None = None,
        behaviour_is_current: bool = False,
        *,
        advantages: torch.Tensor | None = None,
        shard: Shard | None = None,
    ) -> UpdateResult:
        """`advantages` (one per sequence) replaces `self.advantages(...)`, and then the baseline is not
        touched; `shard` says `seqs` are this rank's part of a bigger batch (both: learner.distributed)."""
        if not seqs:
            raise ValueError("an update needs at least one sequence")
        t0 = time.perf_counter()
        args = self.model.args
        baseline_before = self.baseline.state_dict()
        if advantages is None:
            adv = self.batch_advantages(seqs, group_advantages)
        elif tuple(advantages.shape) == (len(seqs),):
            adv = advantages.to(torch.float32)
        else:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({len(seqs)},)")
        weights = torch.tensor([s.weight for s in seqs], dtype=torch.float32)
        stats: dict[str, float] = {"samples": float(len(seqs)), "reward_mean": sum(s.reward for s in seqs) / len(seqs)}
        if advantages is None:
            stats.update(self.baseline_usage)
            stats.update(self.advantage_stats)
        # Sequences without recorded routing go into micro-batches of their own: replay is on or off
        # per micro-batch (the model takes one routing tensor), so one such sequence would switch it off
        # for every sequence it shares a micro-batch with.
        routed = [i for i, s in enumerate(seqs) if s.has_routing or not self.cfg.replay]
        unrouted = [i for i, s in enumerate(seqs) if self.cfg.replay and not s.has_routing]
        chunks = _chunks(routed, self.cfg.micro_batch) + _chunks(unrouted, self.cfg.micro_batch)
        batches = [
            make_batch([seqs[j] for j in c], self.pad_id, args.n_layers, args.top_k, self.cfg.replay) for c in chunks
        ]
        stats["missing_routing_sequences"] = float(len(unrouted))
        stats["replay_off_micro_batches"] = float(sum(self.cfg.replay and b.replay_BSLK is None for b in batches))
        if unrouted:
            log.warning("update: %d sequences without recorded routing, trained without replay", len(unrouted))
        if behaviour_is_current:  # the model still is the behaviour version: measure serving vs trainer
            self.model.eval()
            stats.update(mismatch_stats(self.model, batches[0], self.n_vocab, self.cfg.batch_invariant))
        # Several steps: the state to restore if a later one is not finite (one step checks before it).
        snapshot = None
        if self.cfg.steps_per_update > 1:
            snapshot = (
                {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                copy.deepcopy(self.opt.state_dict()),
            )
        self.forward_model.train()
        agg: dict[str, float] = {}
        maxima: dict[str, float] = {}
        counts: dict[str, float] = {}
        total_tokens = sum(float(b.mask_BT.sum()) for b in batches)
        norm_samples, norm_tokens = (shard.samples, shard.tokens) if shard else (len(seqs), total_tokens)
        grad_scale = shard.world_size if shard else 1
        no_sync = getattr(self.forward_model, "no_sync", None)  # DDP: all-reduce on the last micro-batch only
        kl = self.cfg.loss.kl_coef > 0
        bonus = self.cfg.loss.entropy_coef > 0
        if kl and self.reference is None:
            raise ValueError(f"kl_coef={self.cfg.loss.kl_coef} needs a reference model (Trainer.set_reference)")
        # The proximal policy: the weights at the start of the update. Its log-probabilities (and the
        # tokens its top-p cut) are the first step's forward, detached: taken before the first
        # optimizer step, without gradient, once per update.
        prox: list[torch.Tensor] = []
        cut: list[torch.Tensor] = []
        for step in range(self.cfg.steps_per_update):
            self.opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            step_clip = 0.0
            for k_mb, (c, batch) in enumerate(zip(chunks, batches)):
                sync = nullcontext() if no_sync is None or k_mb == len(batches) - 1 else no_sync()
                with sync:
                    logp_BTV, _ = sampling_distribution(
                        self.forward_model,
                        batch,
                        self.n_vocab,
                        replay=self.cfg.replay,
                        batch_invariant=self.cfg.batch_invariant,
                    )
                    logp = chosen_logprobs(logp_BTV, batch)
                    if step == 0:
                        prox.append(logp.detach().clone())
                        cut.append(top_p_cut(logp_BTV, batch))
                    ref = kl_BT = None
                    if kl and self.reference is not None:
                        with torch.no_grad():
                            ref_BTV, _ = sampling_distribution(
                                self.reference,
                                batch,
                                self.n_vocab,
                                replay=self.cfg.replay,
                                batch_invariant=self.cfg.batch_invariant,
                            )
                            ref = chosen_logprobs(ref_BTV, batch)
                        if self.cfg.loss.kl_estimator == "exact":
                            kl_BT = exact_kl(logp_BTV, ref_BTV, self.cfg.loss.max_log_ratio)
                    with nullcontext() if bonus else torch.no_grad():
                        ent = entropy(logp_BTV)
                    out = policy_loss(
                        logp,
                        batch.behaviour_BT,
                        adv[c],
                        batch.mask_BT,
                        self.cfg.loss,
                        ref,
                        weights[c],
                        ent,
                        prox_logp_BT=prox[k_mb],
                        exclude_BT=cut[k_mb],
                        kl_BT=kl_BT,
                    )
                    # Micro-batches weigh by their share of the (whole) batch: tokens or sequences,
                    # as normalised.
                    share = (
                        float(batch.mask_BT.sum()) / norm_tokens
                        if self.cfg.loss.normalize == "token"
                        else len(c) / norm_samples
                    )
                    (out.loss * (share * grad_scale)).backward()
                step_loss += out.stats["loss"] * share
                step_clip += out.stats["clip_frac"] * share
                for k, v in out.stats.items():
                    if k.endswith("_max"):  # a maximum over micro-batches and steps, not a weighted sum
                        maxima[k] = max(maxima.get(k, v), v)
                    else:
                        agg[k] = agg.get(k, 0.0) + v * share
                for k, frac in COUNTED.items():  # exact token counts (a share-weighted `tokens` is not one)
                    counts[k] = counts.get(k, 0.0) + (out.stats[frac] if frac else 1.0) * out.stats["tokens"]
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            bad = torch.tensor(float(not (math.isfinite(step_loss) and bool(torch.isfinite(gn)))))
            if shard is not None and shard.world_size > 1:  # every rank takes the same decision
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                self.opt.zero_grad(set_to_none=True)
                if snapshot is not None:
                    self.model.load_state_dict(snapshot[0])
                    self.opt.load_state_dict(snapshot[1])
                self.baseline = RunningBaseline.from_state_dict(baseline_before)
                self.forward_model.eval()
                raise NonFiniteUpdate(
                    f"non-finite loss {step_loss} or gradient norm {float(gn)} at update {self.updates + 1}, "
                    f"step {step + 1}: nothing was changed"
                )
            self.opt.step()
            stats["grad_norm"] = float(gn)
            stats[f"clip_frac_step{step + 1}"] = step_clip
        for k, v in {**agg, **counts}.items():
            stats[k] = v / self.cfg.steps_per_update
        stats.update(maxima)
        self.forward_model.eval()
        self.updates += 1
        stats["update_seconds"] = time.perf_counter() - t0
        stats["tokens_per_s"] = total_tokens * self.cfg.steps_per_update / stats["update_seconds"]
        stats["samples_per_s"] = len(seqs) * self.cfg.steps_per_update / stats["update_seconds"]
        log.info("update %d: %s", self.updates, {k: round(v, 5) for k, v in stats.items()})
        return UpdateResult(stats)
