"""The learner beyond one machine: one policy-gradient update, data-parallel over torch.distributed.

Owns how a data-parallel update runs: the process group, the DistributedDataParallel wrapper, which
sequences each rank trains on, and how the per-rank losses add up to the single-process update.
Called by a learner started once per rank (torchrun or a scheduler setting MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE) and, through `spawn_update`, by tests and demos.

Every choice, stated:
- **DDP, not FSDP.** The policy fits on one device, so every rank holds the whole model and the
  whole AdamW state; only gradients travel (one all-reduce per optimizer step). The backend here is
  gloo on CPU (nccl, with the model on each rank's GPU, is the intended path there; not exercised yet).
- **Process group** (`init_process_group`): `env://` by default — torch itself reads MASTER_ADDR,
  MASTER_PORT, RANK and WORLD_SIZE, so no Flywheel code reads the environment — or an explicit
  `tcp://addr:port` with rank and world size. A timeout bounds every collective: a rank that dies
  makes the others fail loudly instead of waiting forever.
- **Every rank gets the whole batch**, same sequences in the same order. It computes the advantages
  from all of it against its own copy of the running baseline, then lets that baseline learn all of
  it (`Trainer.batch_advantages`, centred over the whole batch): deterministic, so the advantages
  and the baselines are identical on every rank without any communication. A rank then trains on its shard only.
- **Shards are contiguous chunks** (`shard_indices`): rank r takes the r-th of W consecutive slices
  whose sizes differ by at most one (the first N mod W ranks take one more, as `numpy.array_split`).
  A batch with fewer sequences than ranks is trained whole by every rank (equal gradients, so the
  average is the single process's): every rank must take part in every all-reduce.
- **Same gradient as one process on the whole batch, unequal shards included.** The trainer weights
  each micro-batch's loss by its share of the *whole* batch (sequences, or tokens under "token"
  normalisation) times W (`learner.trainer.Shard`); DDP averages over the W ranks, so the sum is
  Σ_r (1/W)·W·Σ_{c∈r} share_c ∇L_c = Σ_c share_c ∇L_c, the single process's gradient. A plain
  per-rank mean averaged by DDP would be right only for equal shards (and, under "token"
  normalisation, equal token counts); the scaling needs no special case for either.
- **One all-reduce per optimizer step**: micro-batches before a rank's last run under DDP's
  `no_sync`, so ranks with different micro-batch counts issue the same collectives.
- **`find_unused_parameters=True`**: an expert no token of a rank's shard is routed to gets no
  gradient on that rank; without the flag DDP would never all-reduce that parameter's bucket.
- Gradient clipping and AdamW then run on identical gradients on every rank; DDP broadcast rank 0's
  parameters when it wrapped the model, so the parameters stay identical, step after step.
- **Statistics** (`DataParallelTrainer.update`) are combined over ranks: the objective's statistics
  are summed (each rank weighted its micro-batches by their share of the whole batch, so the sum is
  what one process gets with the same micro-batches), `samples` summed, `reward_mean` over the whole
  batch, throughputs summed, `update_seconds` the slowest rank's; the rest (`grad_norm`, the same on
  every rank; serving-vs-trainer mismatch, measured on a rank's first micro-batch) are rank 0's.
"""

from __future__ import annotations

import datetime
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from core.harness import free_port
from feedback.bus import Record
from feedback.events import SampleEvent
from learner.objective import RunningBaseline
from learner.replay import Sequence
from learner.trainer import NonFiniteUpdate, Shard, Trainer, TrainerConfig, UpdateResult
from serving.model import ModelArgs, Transformer

# learner.objective.policy_loss's statistics: the trainer weights them by each micro-batch's share of
# the whole batch, so over ranks they add up.
LOSS_STATS = (
    "loss",
    "ratio_mean",
    "clip_frac",
    "dual_clip_frac",
    "clamp_frac",
    "abs_log_ratio_mean",
    "logp_mean",
    "behaviour_logp_mean",
    "entropy",
    "adv_mean",
    "adv_std",
    "kl_k3",
    "tokens",
    "clipped_tokens",
    "dual_clipped_tokens",
    "clamped_tokens",
    "truncated_frac",
    "masked_frac",
    "masked_ratio_frac",
    "masked_dppo_frac",
    "masked_top_p_frac",
    "policy_abs_log_ratio_mean",
    "truncated_tokens",
    "masked_tokens",
    "masked_ratio_tokens",
    "masked_dppo_tokens",
    "masked_top_p_tokens",
    "missing_routing_sequences",
    "replay_off_micro_batches",
)
"""Statistics that are maxima (over micro-batches and passes): over ranks, the largest."""
MAX_STATS = ("ratio_max", "policy_ratio_max")


def from_rank0(value, world_size: int):
    """Rank 0's `value` on every rank (a collective when there are several; one rank: `value`)."""
    box = [value]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def init_process_group(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> None:
    """Join the process group: from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (no arguments), or explicitly."""
    explicit = (rank, world_size, master_addr, master_port)
    timeout = datetime.timedelta(seconds=timeout_s)
    if all(a is None for a in explicit):
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    if rank is None or world_size is None or master_addr is None or master_port is None:
        raise ValueError("give rank, world_size, master_addr and master_port together, or none of them (env://)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size, timeout=timeout
    )


def shard_indices(n: int, world_size: int, rank: int) -> list[int]:
    """The contiguous chunk of a batch of `n` sequences that `rank` trains on (sizes differ by at most 1)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if n < world_size:
        raise ValueError(f"a batch of {n} sequences cannot give each of {world_size} ranks at least one")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


class DataParallelTrainer:
    """A `Trainer` whose updates run data-parallel; build one on every rank, after `init_process_group`."""

    def __init__(self, trainer: Trainer):
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call init_process_group first")
        self.trainer = trainer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Broadcasts rank 0's parameters: every rank starts from the same weights.
        trainer.forward_model = DistributedDataParallel(trainer.model, find_unused_parameters=True)

    def update(
        self,
        seqs: list[Sequence],
        group_advantages: list[float | None] | None = None,
        behaviour_is_current: bool = False,
    ) -> UpdateResult:
        """One update; every rank passes the *whole* batch (same sequences, same order). A batch with
        fewer sequences than ranks is trained whole by every rank (the all-reduce then averages equal
        gradients: still the single process's update)."""
        baseline_before = self.trainer.baseline.state_dict()
        adv = self.trainer.batch_advantages(seqs, group_advantages)  # whole batch: identical on every rank
        try:
            result = self._update(seqs, adv, behaviour_is_current)
        except NonFiniteUpdate:  # every rank raises it (the trainer all-reduces the verdict)
            self.trainer.baseline = RunningBaseline.from_state_dict(baseline_before)
            raise
        result.stats.update(self.trainer.baseline_usage)
        result.stats.update(self.trainer.advantage_stats)
        return result

    def _update(self, seqs: list[Sequence], adv: torch.Tensor, behaviour_is_current: bool) -> UpdateResult:
        tokens = float(sum(len(s.output_ids) for s in seqs))
        if len(seqs) < self.world_size:
            local = self.trainer.update(
                seqs,
                behaviour_is_current=behaviour_is_current,
                advantages=adv,
                shard=Shard(samples=len(seqs), tokens=tokens, world_size=1),
            )
            return UpdateResult(dict(local.stats, world_size=float(self.world_size)))
        idx = shard_indices(len(seqs), self.world_size, self.rank)
        shard = Shard(samples=len(seqs), tokens=tokens, world_size=self.world_size)
        local = self.trainer.update(
            [seqs[i] for i in idx], behaviour_is_current=behaviour_is_current, advantages=adv[idx], shard=shard
        )
        per_rank: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(per_rank, local.stats)
        return UpdateResult(self._combine([s for s in per_rank if s is not None], seqs))

    @staticmethod
    def _combine(per_rank: list[dict[str, float]], seqs: list[Sequence]) -> dict[str, float]:
        stats = dict(per_rank[0])
        for k in LOSS_STATS:
            if k in stats:
                stats[k] = sum(s[k] for s in per_rank)
        for k in MAX_STATS:
            if k in stats:
                stats[k] = max(s[k] for s in per_rank)
        for k in [k for k in stats if k.startswith("clip_frac_step")]:
            stats[k] = sum(s[k] for s in per_rank)
        for k in ("samples", "tokens_per_s", "samples_per_s"):
            stats[k] = sum(s[k] for s in per_rank)
        stats["reward_mean"] = sum(s.reward for s in seqs) / len(seqs)
        stats["update_seconds"] = max(s["update_seconds"] for s in per_rank)
        stats["world_size"] = float(len(per_rank))
        return stats


@dataclass
class RankResult:
    state_dict: dict[str, torch.Tensor]  # parameters after the update
    grads: dict[str, torch.Tensor]  # the last step's all-reduced, clipped gradients (absent: no gradient)
    stats: dict[str, float]  # combined over ranks: the same on every rank
    baseline: dict  # the running baseline's state after the update


@dataclass
class SpawnResult:
    state_dict: dict[str, torch.Tensor]  # rank 0's
    stats: dict[str, float]  # rank 0's (combined over ranks)
    ranks: list[RankResult]  # every rank's, to check they agree


@dataclass
class _Job:
    args: ModelArgs
    state: dict[str, torch.Tensor]
    seqs: list[Sequence]
    cfg: TrainerConfig
    n_vocab: int | None
    pad_id: int
    group_advantages: list[float | None] | None
    baseline: dict | None
    port: int
    timeout_s: float
    out_dir: str


def gather_batch(
    buffer: list[tuple[Record, SampleEvent | None]], offline: list, trained: set[str], world_size: int
) -> tuple[list[Record], list[tuple[Record, SampleEvent]], list]:
    """The learner service's whole batch under data parallelism (a collective): every rank's buffered
    records ordered by (partition, offset) and de-duplicated (a rebalance can hand a partition's
    uncommitted records to two ranks), the (record, event) pairs among them without an event already
    trained on, and rank 0's offline groups; the same lists, in the same order, on every rank."""
    mine = [(r, ev.model_dump_json() if ev is not None else None) for r, ev in buffer]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (mine, offline))
    by_position: dict[tuple[int, int], tuple[Record, str | None]] = {}
    for rank_records, _ in gathered:
        for r, ev_json in rank_records:
            by_position[(r.partition, r.offset)] = (Record(r.topic, r.partition, r.offset, r.key, b""), ev_json)
    records, events, seen = [], [], set(trained)
    for pos in sorted(by_position):
        rec, ev_json = by_position[pos]
        records.append(rec)
        if ev_json is not None:
            ev = SampleEvent.model_validate_json(ev_json)
            if ev.event_id not in seen:
                seen.add(ev.event_id)
                events.append((rec, ev))
    return records, events, gathered[0][1]


def _worker(rank: int, world_size: int, job: _Job) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_process_group(rank, world_size, "127.0.0.1", job.port, timeout_s=job.timeout_s)
    try:
        _rank_update(rank, job)
        # No rank closes its connections while another still reads from them: a rank that tore its
        # gloo pairs down first once aborted the other ("terminate called without an active exception").
        dist.barrier()
    finally:
        gc.collect()  # the DistributedDataParallel wrapper (and its reducer's hold on the group) goes first
        dist.destroy_process_group()


def _rank_update(rank: int, job: _Job) -> None:
    model = Transformer(job.args)
    model.load_state_dict(job.state)
    trainer = Trainer(model, job.cfg, job.n_vocab, job.pad_id)
    if job.baseline is not None:
        trainer.baseline = RunningBaseline.from_state_dict(job.baseline)
    result = DataParallelTrainer(trainer).update(job.seqs, job.group_advantages)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(
        {"state_dict": state, "grads": grads, "stats": result.stats, "baseline": trainer.baseline.state_dict()},
        Path(job.out_dir) / f"rank{rank}.pt",
    )


def spawn_update(
    world_size: int,
    model: Transformer,
    seqs: list[Sequence],
    cfg: TrainerConfig,
    n_vocab: int | None,
    pad_id: int,
    group_advantages: list[float | None] | None = None,
    baseline_state: dict | None = None,
    port: int | None = None,
    timeout_s: float = 120.0,
) -> SpawnResult:
    """One data-parallel update of a copy of `model` by `world_size` local processes (gloo, CPU).

    `model` itself is not modified; `baseline_state` (a `RunningBaseline.state_dict()`) seeds every
    rank's baseline. A failing rank raises here (`torch.multiprocessing.ProcessRaisedException`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not seqs:
        raise ValueError("an update needs at least one sequence")
    with tempfile.TemporaryDirectory(prefix="flywheel-ddp-") as out_dir:
        job = _Job(
            model.args,
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            seqs,
            cfg,
            n_vocab,
            pad_id,
            group_advantages,
            baseline_state,
            port or free_port(),
            timeout_s,
            out_dir,
        )
        mp.spawn(_worker, args=(world_size, job), nprocs=world_size, join=True)
        ranks = [RankResult(**torch.load(Path(out_dir) / f"rank{r}.pt")) for r in range(world_size)]
    return SpawnResult(ranks[0].state_dict, ranks[0].stats, ranks)
