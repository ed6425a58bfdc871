"""`flywheel learner`: consume `sample` events, update the model on a cadence, publish candidates.

Owns the learner's durable state and its exactly-once accounting:
- **Cadence.** An update runs when `update_every_samples` samples are buffered, or when
  `update_every_s` has passed since the last one and at least `min_samples` are buffered (hours in
  production, seconds in the demo).
- **Bounded staleness, in gate cycles and in updates.** A sample served by a version more than
  `max_staleness` (default 2) *registered* versions behind the learner's anchor (`learner.lineage`),
  or more than `max_lag_updates` (default 8) updates behind its tip, is dropped and counted
  (`learner.update_stats`); what is kept is corrected the decoupled-PPO way (docs/learner.md). The
  learner waits at the lag bound (`_at_lag_bound`) rather than drop what the promoted version serves.
- **Hold back while the gate is busy** (`hold_back`, default on). While a version is in flight, or
  its last candidate still waits for the gate, an update becomes the lineage's tip but is not
  registered; once the gate is free (asked every `hold_check_s`) the tip is registered, covering the
  held-back updates' samples. So the gate gets the newest weights, one candidate per cycle, and a
  bound in registered versions is a bound in gate cycles (bench/staleness.py compares it with
  `hold_back=False, staleness_unit="updates"`).
- **Poisoning screen** (`learner.poisoning`), with the product's `verifier` when it has one.
- **Never twice, never lost.** After an update the new version's checkpoint (weights, tokenizer,
  `learner_state.pt`: optimizer, baseline, the screen's tally) is renamed into place; then
  `learner.json` (versions and their folders, relative so the home can move; the bus positions they
  cover; recent sample ids) is replaced atomically; only then are the bus offsets committed. A crash
  before `learner.json` trains the samples again, once; a crash after it makes the bus redeliver
  samples below the recorded positions (or with a recorded id), which are skipped.
- **Registry.** Each registered version is a `candidate` with its parent, the bus positions it
  covers (`data_range`), its update statistics and its files with hashes.
- **What a long run meets.** A record that is not a valid `SampleEvent` goes to the dead-letter topic
  (`feedback.dead_letter`) and is skipped. A batch whose loss or gradient is not finite
  (`learner.trainer.NonFiniteUpdate`: no optimizer step) is quarantined: counted, dead-lettered, its
  positions committed like a trained batch's (never retried); no version is published for it.
- **KL reference.** With `trainer.loss.kl_coef` > 0 the trainer's frozen reference is the promoted
  version's checkpoint, reloaded before an update when the registry promotes another version.
- **Fleet pulls** the weight store (`serving.weight_store`): snapshots every `snapshot_every`
  versions, lossless deltas between them.

- **Data-parallel instances split the partitions.** One instance per rank
  (`learner.distributed.init_process_group`), all in one consumer group on the sample topic. The
  ranks decide the cadence together; an update gathers every rank's samples
  (`learner.distributed.gather_batch`), so every rank trains the same batch (`DataParallelTrainer`).
  Rank 0 alone writes the version, the registry, the store and `learner.json`, then broadcasts the
  state; only then does each rank commit its offsets. A dead rank times the others out: the job
  restarts as a whole and resumes from `learner.json`.

Called by the `flywheel learner` process; the in-process demo loop (`demo.loop`) drives this class too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError

from core.files import atomic_write
from core.service_metrics import ServiceMetrics
from feedback.bus import EventBus, Record
from feedback.dead_letter import dead_letter
from feedback.events import SampleEvent
from learner.checkpoints import OPT_STATE, STATE, file_entry, free_id, new_state, store_entry
from learner.config import LearnerConfig
from learner.distributed import from_rank0
from learner.lag_bound import LagBound
from learner.lent_rollouts import LentRollouts
from learner.lineage import anchor, merge_covered, staleness, staleness_stats
from learner.poisoning import Scout, VerifiedTally, screen
from learner.rollout_weights import RolloutWeights
from learner.samples import cadence_met, partition, sequence_from_sample, set_aside
from learner.trainer import NonFiniteUpdate, Trainer
from learner.update_stats import append_update, counters, since_parent
from product.suites import Verifier
from registry.publish import SHIPPING_DTYPE, publish_base
from registry.registry import Registry, UnknownVersion
from serving.checkpoint import CONFIG, load_checkpoint, save_checkpoint
from serving.model import Transformer
from serving.tokenizer import Tokenizer
from serving.weight_store import WeightStore, shipping_state

log = logging.getLogger(__name__)
MAX_REMEMBERED_IDS = 100_000


def _at(rec: Record) -> tuple[str, int, int]:
    return rec.topic, rec.partition, rec.offset


class LearnerService(RolloutWeights, LagBound):
    def __init__(
        self,
        bus: EventBus,
        registry: Registry,
        models_dir: str | Path,
        base_dir: str | Path,
        cfg: LearnerConfig | None = None,
        clock=time.time,
        metrics: ServiceMetrics | None = None,
        verifier: Verifier | None = None,
        lent: LentRollouts | None = None,
    ):
        """`lent`: offline group rollouts on lent replicas (`learner.lent_rollouts`), mixed into updates."""
        cfg = cfg or LearnerConfig()
        self.bus, self.registry, self.cfg, self.clock = bus, registry, cfg, clock
        self.tally = VerifiedTally()
        self.lent = lent
        self._rollout_ids: set[str] = set()  # `rollout` versions registered here, withdrawn once unused
        if verifier is None and cfg.poisoning.enabled:
            log.warning("learner: no verifier: the poisoning screen's verified rule is off")
        self.models_dir = Path(models_dir)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.models_dir / STATE
        self.store = WeightStore(self.models_dir / "store", snapshot_every=cfg.snapshot_every)
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if self.rank == 0:
            self._init_state(base_dir)
        if self.world_size > 1:
            dist.barrier()  # rank 0 has created or found learner.json
            if self.rank != 0:
                self.state = json.loads(self.state_path.read_text())
        cur_dir = self.checkpoint_dir(self.state["current"])
        self.tokenizer = Tokenizer.from_file(cur_dir)
        self.model = load_checkpoint(cur_dir)
        if self.tokenizer.pad_id is None:
            raise ValueError(f"{cur_dir}: the tokenizer has no padding token; the trainer needs one")
        self.reference_id: str | None = None
        reference = None
        if cfg.trainer.loss.kl_coef > 0:
            self.reference_id = self._promoted_id()
            reference = self._load_version(self.reference_id)
        self.trainer = Trainer(
            self.model, cfg.trainer, self.tokenizer.vocab_size, self.tokenizer.pad_id, reference=reference
        )
        if (cur_dir / OPT_STATE).is_file():
            saved = torch.load(cur_dir / OPT_STATE, weights_only=False)
            self.trainer.opt.load_state_dict(saved["optimizer"])
            self.trainer.baseline = saved["baseline"]
            self.trainer.updates = saved["updates"]
            if "verified_tally" not in saved:
                raise ValueError(f"{cur_dir / OPT_STATE}: no verified_tally (an older learner's state): use a new home")
            self.tally = saved["verified_tally"]
        self.dp = None
        if self.world_size > 1:
            from learner.distributed import DataParallelTrainer

            self.dp = DataParallelTrainer(self.trainer)
        self.trained_ids = deque(self.state["trained_ids"], maxlen=MAX_REMEMBERED_IDS)
        self._trained_set = set(self.trained_ids)
        self.consumer = bus.consumer(cfg.topic, cfg.group)
        self.scout: Scout | None = None  # the verified rule's evidence, on rank 0 (`learner.poisoning.Scout`)
        if verifier is not None and cfg.poisoning.enabled and self.rank == 0:
            skip = frozenset(cfg.untrained_tenants)
            self.scout = Scout(bus.consumer(cfg.topic, f"{cfg.group}.scout"), verifier, self.tokenizer.decode, skip)
        self.buffer: list[tuple[Record, SampleEvent | None]] = []
        self.offline: list = []  # (Sequence, advantage) from off-peak group rollouts, mixed into the next update
        self._buffered_ids: set[str] = set()
        self._set_aside: set[str] = set()  # dropped, not yet committed (`set_aside`): a redelivery is a duplicate
        self._aside_dropped: Counter[str] = Counter()
        self._group_buffered = 0  # samples buffered by all ranks at the last cadence check
        self.partitions_read: set[int] = set()  # sample-topic partitions this instance has read from
        self.counters: Counter = Counter()
        self.metrics = metrics or ServiceMetrics("learner")
        self.last_update = clock()
        self.last_stats: dict[str, Any] = {}  # the last update's statistics (also in the registry once registered)
        self._held_checked = float("-inf")
        self._lag_wait, self._lag_checked = False, float("-inf")
        self._gate_seen = False  # a gate takes candidates from this registry (one was seen in flight)
        if lent is not None and self.rank == 0:  # a restart: the jobs start again (`LentRollouts`), on new weights
            for old in registry.list("rollout"):
                registry.transition(old.id, "withdrawn", "learner", "a restarted learner's rollout jobs start again")

    def _init_state(self, base_dir: str | Path) -> None:
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text())
        else:
            # The lineage starts at the promoted version: the base (named after its folder, as the
            # gateway serves it), published and promoted here if nobody did yet.
            base = publish_base(self.registry, self.models_dir, base_dir, self.cfg.snapshot_every)
            folder = self.models_dir / base.id
            self.state = new_state(base.id, self._rel(folder if folder.is_dir() else Path(base_dir)))
            atomic_write(self.state_path, json.dumps(self.state))

    def _rel(self, folder: Path) -> str:
        """How `learner.json` names a checkpoint folder: relative to the models folder (which can move)."""
        return os.path.relpath(folder, self.models_dir)

    def checkpoint_dir(self, version_id: str) -> Path:
        """A version's checkpoint folder in this lineage (relative in `learner.json`)."""
        return self.models_dir / self.state["dirs"][version_id]

    def _promoted_id(self) -> str:
        """The promoted version, as rank 0 read it (every rank must call this: a collective)."""
        promoted = from_rank0(self.registry.incumbent().id if self.rank == 0 else None, self.world_size)
        assert promoted is not None
        return promoted

    def _load_version(self, version_id: str) -> Transformer:
        """A version's weights from its checkpoint folder: the lineage's, else `<models>/<version>`."""
        folder = self.checkpoint_dir(version_id) if version_id in self.state["dirs"] else self.models_dir / version_id
        if not (folder / CONFIG).is_file():
            raise ValueError(f"no checkpoint of version {version_id!r} in {folder} (needed as the KL reference)")
        return load_checkpoint(folder)

    def _sync_reference(self) -> None:
        """kl_coef > 0: reload the reference if another version was promoted since it was loaded."""
        if self.cfg.trainer.loss.kl_coef <= 0:
            return
        promoted = self._promoted_id()
        if promoted != self.reference_id:
            log.info("learner: KL reference %s -> %s (promoted)", self.reference_id, promoted)
            self.trainer.set_reference(self._load_version(promoted))
            self.reference_id = promoted
            self.counters["reference_reloads"] += 1

    @property
    def current(self) -> str:
        return self.state["current"]

    def poll(self, timeout_s: float = 1.0) -> int:
        """Buffer new samples; returns how many were taken (duplicates and replays are counted, not taken)."""
        taken = 0
        positions = {int(p): o for p, o in self.state["positions"].items()}
        # An update's worth (all ranks together; skipped records do not count); waiting at the lag bound,
        # `lag_wait_updates` of them (default: the bound's worth), to train in one update when the gate
        # moves on.
        wait = (self.cfg.lag_wait_updates or self.cfg.max_lag_updates or 1) if self._lag_wait else 1
        cap = self.cfg.update_every_samples * wait
        room = cap - max(len(self._buffered_ids), self._group_buffered)
        if room <= 0:  # full (waiting at the lag bound, say): wait as an empty poll would, not spin
            time.sleep(timeout_s)
            return 0
        for rec in self.consumer.poll(max_records=room, timeout_s=timeout_s):
            self.partitions_read.add(rec.partition)
            if rec.offset < positions.get(rec.partition, 0):
                self.counters["skipped_already_trained_offset"] += 1
                continue
            skipped = Record(rec.topic, rec.partition, rec.offset, rec.key, b"")  # advances the position once committed
            try:
                ev = SampleEvent.model_validate_json(rec.value)
            except ValidationError as e:  # invalid JSON or not a SampleEvent: set aside, carry on
                letter = dead_letter(self.bus, rec, str(e), "learner.decode")
                log.error("learner: malformed sample at %s/%d@%d dead-lettered (%s)", *_at(rec), letter.event_id)
                self.counters["dead_lettered_malformed"] += 1
                self.buffer.append((skipped, None))
                continue
            if ev.event_id in self._trained_set or ev.event_id in self._buffered_ids or ev.event_id in self._set_aside:
                self.counters["skipped_duplicate_id"] += 1
                self.buffer.append((skipped, None))
                continue
            self.buffer.append((rec, ev))
            self._buffered_ids.add(ev.event_id)
            taken += 1
        return taken

    def add_offline(self, batch) -> None:
        """Queue a `learner.offline.GroupBatch` to be mixed into the next update (weights as rolled out)."""
        self.offline.extend(zip(batch.sequences, batch.advantages))

    def due(self) -> bool:
        """Cadence: enough samples buffered (by all ranks together), or enough time with some. Ranks
        decide together, on rank 0's clock (a collective: every rank calls it every round)."""
        n = sum(1 for _, ev in self.buffer if ev is not None)
        elapsed = self.clock() - self.last_update
        if self.world_size > 1:
            per_rank: list = [None] * self.world_size
            dist.all_gather_object(per_rank, (n, elapsed))
            n, elapsed = sum(c for c, _ in per_rank), per_rank[0][1]
            self._group_buffered = n
        return self._trainable(n, elapsed)

    def _trainable(self, n: int, elapsed: float | None = None) -> bool:
        """The cadence on `n` samples (`due`: buffered; `update`: those that survive the drops)."""
        elapsed = self.clock() - self.last_update if elapsed is None else elapsed
        c = self.cfg
        return cadence_met(n, elapsed, c.update_every_samples, c.min_samples, c.update_every_s)

    def _whole_batch(self) -> tuple[list[Record], list[tuple[Record, SampleEvent]], list]:
        """Every rank's buffered records, the (record, event) pairs among them, and rank 0's offline
        groups: the same lists, in the same order, on every rank (one rank: its own)."""
        if self.world_size == 1:
            return [r for r, _ in self.buffer], [(r, ev) for r, ev in self.buffer if ev is not None], self.offline
        from learner.distributed import gather_batch

        return gather_batch(self.buffer, self.offline if self.rank == 0 else [], self._trained_set, self.world_size)

    def rebase(self) -> bool:
        """A lineage whose tip was withdrawn, rejected, aborted or rolled back continues from the
        promoted version (`Registry.base_for_next_candidate`): its weights and optimizer state are
        loaded, and it is appended to the lineage so staleness counts from it. True if it rebased."""
        tip = anchor(self.state)  # the held-back updates on a failed candidate go with it
        base = self.registry.base_for_next_candidate(tip)
        if base.id == tip:
            return False
        folder = self.checkpoint_dir(base.id) if base.id in self.state["dirs"] else self.models_dir / base.id
        if not (folder / CONFIG).is_file():
            log.warning("learner: cannot rebase onto %s: no checkpoint of it in %s", base.id, self.models_dir)
            return False
        self.model.load_state_dict(load_checkpoint(folder).state_dict())
        if (folder / OPT_STATE).is_file():
            saved = torch.load(folder / OPT_STATE, weights_only=False)
            self.trainer.opt.load_state_dict(saved["optimizer"])
            self.trainer.baseline = saved["baseline"]
        log.info("learner: %s is %s; rebased onto %s", tip, self.registry.get(tip).status, base.id)
        self.counters["dropped_held_versions"] += len(self.state["held"])
        self.state["held"] = {}
        if base.id not in self.state["published"]:
            self.state["published"].append(base.id)
        self.state["dirs"].setdefault(base.id, self._rel(folder))
        self.state["versions"].append(base.id)
        self.state["current"] = base.id
        if self.rank == 0:
            atomic_write(self.state_path, json.dumps(self.state))
        self.counters["rebased"] += 1
        return True

    def update(self) -> str | None:
        """Train on the buffer and make the next version; its id (registered, or held back while the
        gate is busy: `state["held"]`), or None if nothing was trainable, the batch was quarantined, or
        the learner waits at the lag bound (`_at_lag_bound`: the samples stay buffered)."""
        if self._lag_wait and not self._recheck_due():
            return None
        self.rebase()
        self._sync_reference()
        if self._at_lag_bound():
            return None
        mine = [r for r, _ in self.buffer]  # committed by this rank once the version is durable
        records, batch, offline_all = self._whole_batch()
        behind = staleness(self.state, self.cfg.staleness_unit)
        lag = staleness(self.state, "updates")
        max_lag = self.cfg.max_lag_updates
        untrained = frozenset(self.cfg.untrained_tenants)
        kept, dropped = partition(batch, behind, self.cfg.max_staleness, lag, max_lag, untrained)
        if not self._trainable(len(kept) + len(offline_all)):  # drops left too few: no step on a handful
            kept_now = {ev.event_id for _, ev in kept}
            self.buffer, gone = set_aside(self.buffer, kept_now)
            self._buffered_ids.difference_update(gone)
            self._set_aside.update(gone)
            self._aside_dropped.update(dropped)  # in the next update's statistics too
            self.counters.update({f"dropped_{k}": v for k, v in dropped.items()} | {"set_aside_updates": 1})
            log.info("learner: %d samples left after dropping %s: buffering on", len(kept), dict(dropped))
            return None
        aside, self._aside_dropped = self._aside_dropped, Counter()
        events = [ev for _, ev in kept]
        if self.scout is not None:  # the evidence on every sample that has arrived, these included
            self.scout.catch_up(self.tally, max_records=20_000)
        screening = from_rank0(
            screen(events, self.cfg.poisoning, self.tally if self.scout is not None else None)
            if self.rank == 0
            else None,
            self.world_size,
        )
        seqs = [
            dataclasses.replace(sequence_from_sample(ev), weight=w)
            for (_, ev), w in zip(kept, screening.weights, strict=True)
        ]
        if screening.flags:
            self.counters["flagged_users"] += len(screening.flags)
            self.counters["flagged_samples"] += sum(f.samples for f in screening.flags)
            log.warning("learner: flagged %s", [f.as_dict() for f in screening.flags])
        self.counters.update({f"dropped_{k}": v for k, v in dropped.items()})
        positions = {int(p): o for p, o in self.state["positions"].items()}
        for r in records:
            positions[r.partition] = max(positions.get(r.partition, 0), r.offset + 1)
        new_id = None
        offline = [
            (s, a)
            for s, a in offline_all
            if behind.get(s.version, self.cfg.max_staleness + 1) <= self.cfg.max_staleness
            and (max_lag is None or lag.get(s.version, 0) <= max_lag)
        ]
        self.counters["dropped_offline_stale"] += len(offline_all) - len(offline)
        self.offline = []
        trained = False
        if seqs or offline:
            behaviour_now = all(s.version == self.current for s in seqs) and bool(seqs)
            advs = [None] * len(seqs) + [a for _, a in offline]
            train = self.dp.update if self.dp is not None else self.trainer.update
            try:
                stats: dict[str, Any] = train(
                    seqs + [s for s, _ in offline],
                    group_advantages=advs if offline else None,
                    behaviour_is_current=behaviour_now,
                ).stats
                trained = True
            except NonFiniteUpdate as e:  # nothing changed: set the batch aside rather than retry it forever
                self._quarantine(kept, len(offline), str(e))
        else:
            log.warning("learner: nothing trainable in %d buffered samples (dropped: %s)", len(batch), dict(dropped))
        if trained:
            stats["offline_samples"] = len(offline)
            scouted = self.scout.take() if self.scout is not None else None
            self.counters.update({f"poisoning_scout_{k}": v for k, v in (scouted or {}).items()})
            stats.update(counters(dropped + aside, screening, len(offline_all) - len(offline), scouted))
            stats.update(staleness_stats(self.state, [s.version for s in seqs]))
            stats["lag_updates_mean"] = stats["staleness_updates_mean"]
            stats["lag_updates_max"] = stats["staleness_updates_max"]
            self.last_stats = stats
            before = {int(p): o for p, o in self.state["positions"].items()}
            touched = {r.partition for r in records}
            covered = {str(p): (before.get(p, 0), positions[p]) for p in sorted(touched)}
            if self.rank == 0:
                new_id = self._publish(stats, covered)
        for _, ev in batch:
            self.trained_ids.append(ev.event_id)
        if self.rank == 0:
            self.state.update(positions={str(p): o for p, o in positions.items()}, trained_ids=list(self.trained_ids))
            atomic_write(self.state_path, json.dumps(self.state))  # the point of no return: these samples are used
            if new_id is not None and self.scout is not None:  # its tally, with the scout's positions, is durable
                self.scout.commit()
        if self.world_size > 1:  # after rank 0 made the update durable: every rank takes its state
            self.state = from_rank0(self.state if self.rank == 0 else None, self.world_size)
            new_id = self.state["current"] if trained else None
        self.consumer.commit(mine)
        self._trained_set = set(self.trained_ids)
        self.buffer.clear()
        self._buffered_ids.clear()
        self._set_aside.clear()
        self._group_buffered = 0
        if trained:
            self.counters["trained"] += len(seqs)
            self.counters["trained_offline"] += len(offline)
        self.counters["updates"] += 1 if new_id else 0
        self.last_update = self.clock()
        return new_id

    def _quarantine(self, kept: list[tuple[Record, SampleEvent]], n_offline: int, reason: str) -> None:
        """A batch whose update was not finite: counted, its samples dead-lettered (rank 0), and its
        positions committed by the caller like any other batch's."""
        log.error("learner: batch of %d samples quarantined: %s", len(kept), reason)
        self.counters["quarantined_batches"] += 1
        self.counters["quarantined_samples"] += len(kept)
        self.counters["quarantined_offline"] += n_offline
        if self.rank != 0:
            return
        for rec, ev in kept:  # data-parallel: other ranks' records travel bare
            full = Record(rec.topic, rec.partition, rec.offset, rec.key, rec.value or ev.model_dump_json().encode())
            dead_letter(self.bus, full, reason, "learner.quarantine")

    def _enough_updates(self, pending: int) -> bool:
        """The tip holds `min_updates_per_candidate` updates beyond the last registered version
        (`pending`: the update being published, not yet in `held`)."""
        return len(self.state["held"]) + pending >= self.cfg.min_updates_per_candidate

    def _gate_busy(self) -> bool:
        """Hold back: a version is in flight, or (once a gate was seen taking versions from this
        registry) the last registered candidate still waits for it."""
        if not self.cfg.hold_back:
            return False
        if self.registry.in_flight() is not None:
            self._gate_seen = True
            return True
        return self._gate_seen and self.registry.get(anchor(self.state)).status == "candidate"

    def _publish(self, stats: dict, covered: dict[str, tuple[int, int]]) -> str:
        """Checkpoint the trained model as the lineage's next version and make it current; register it
        as a candidate, or hold it back while a version is in flight (`hold_back`). `covered`: partition
        -> [start, end) of the samples it was trained on."""
        tmp = self.models_dir / f".next-{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(self.model, tmp, tokenizer=self.tokenizer)
        torch.save(
            {
                "optimizer": self.trainer.opt.state_dict(),
                "baseline": self.trainer.baseline,
                "updates": self.trainer.updates,
                "verified_tally": self.tally,
            },
            tmp / OPT_STATE,
        )
        used = set(self.state["versions"])  # a rebase lists its base twice
        vid = free_id(len(used), used, self.registry, self.store)
        parent = self.current
        if self._gate_busy() or not self._enough_updates(pending=1):
            self.state["held"][vid] = {"covered": covered, "stats": stats}
            self.counters["held_back"] += 1
        else:
            # Registered before it is renamed into place: a crash in between leaves a registered candidate
            # whose folder is missing (the registry's file hash tells it apart), never a folder without a row.
            self._register(vid, tmp, stats, covered)
        folder = self.models_dir / vid
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        self.state["versions"].append(vid)
        self.state["dirs"][vid] = self._rel(folder)
        self.state["current"] = vid
        append_update(self.models_dir / "updates.jsonl", vid, parent, self.trainer.updates, stats)
        log.info(
            "learner: %s %s (parent %s): %d samples, reward %.4f, entropy %.4f, logp %.4f, clip %.4f",
            "held back" if vid in self.state["held"] else "published",
            *(vid, parent, stats.get("samples", 0), stats.get("reward_mean", float("nan"))),
            *(stats.get(k, float("nan")) for k in ("entropy", "logp_mean", "clip_frac")),
        )
        return vid

    def _register(self, vid: str, folder: Path, stats: dict, covered: dict[str, tuple[int, int]]) -> None:
        """`vid` (the weights of `self.model`, checkpointed in `folder`) into the weight store and the
        registry as a candidate child of the anchor, covering the held-back updates' samples too.
        Idempotent: a crash before `learner.json` was replaced left it stored or registered already."""
        parent, held = anchor(self.state), self.state["held"]
        covered = merge_covered([h["covered"] for h in held.values()] + [covered])
        metrics = {**stats, "held_back_updates": len(held)}
        metrics["samples_since_parent"] = stats["samples"] + sum(h["stats"]["samples"] for h in held.values())
        metrics["since_parent"] = since_parent([h["stats"] for h in held.values()] + [stats])
        if self.store.path(vid) is None:
            self.store.put(vid, shipping_state(self.model, SHIPPING_DTYPE), parent=parent)
        entry = store_entry(self.store, self.models_dir, vid)
        metrics["shipping"] = {"kind": entry["kind"], "bytes": entry["bytes"]}
        try:
            self.registry.get(vid)
        except UnknownVersion:
            self.registry.register(
                version_id=vid,
                parent_id=parent,
                metrics=metrics,
                files=[file_entry(folder, "snapshot", vid), entry],
                delta_base_id=parent if entry["kind"] == "delta" else None,
                data_range={self.cfg.topic: covered},
                reason=f"learner update {self.trainer.updates}"
                + (f" ({len(held)} held-back updates since {parent})" if held else ""),
            )
        self.state["published"].append(vid)
        self.state["parents"][vid] = parent
        self.state["held"] = {}

    def publish_held(self) -> str | None:
        """The held-back tip, registered as the candidate once nothing is in flight (asked every
        `hold_check_s`) and its anchor still goes on (else the next update rebases); its id, or None.
        Data-parallel ranks: a collective while the tip is held (rank 0 decides and writes)."""
        if self.current not in self.state["held"]:
            return None
        go = False
        if self.rank == 0 and self.clock() - self._held_checked >= self.cfg.hold_check_s:
            self._held_checked = self.clock()
            tip = anchor(self.state)
            go = (
                self.registry.base_for_next_candidate(tip).id == tip
                and self._enough_updates(pending=0)
                and not self._gate_busy()
            )
            if go:
                last = self.state["held"].pop(self.current)
                self._register(self.current, self.checkpoint_dir(self.current), last["stats"], last["covered"])
                atomic_write(self.state_path, json.dumps(self.state))
                log.info("learner: gate free: published the held-back tip %s", self.current)
        go = from_rank0(go, self.world_size)
        if go and self.world_size > 1:
            self.state = from_rank0(self.state if self.rank == 0 else None, self.world_size)
        if not go:
            return None
        self.counters["published_held"] += 1
        return self.current

    def run_once(self, timeout_s: float = 1.0) -> str | None:
        """Poll, register a held-back tip if the gate is free, update if due; the new version's id."""
        before = len(self.buffer)
        self.poll(timeout_s)
        self.metrics.consume(self.cfg.topic, len(self.buffer) - before)
        self.publish_held()
        if self.scout is not None:
            self.scout.catch_up(self.tally, max_records=2000)
        if self.lent is not None and self.rank == 0 and len(self.offline) < 4 * self.cfg.update_every_samples:
            try:  # offline groups travel from rank 0 (`_whole_batch`); at most 4 updates' worth wait
                got = self.lent.tick(self._rollout_weights, self._fresh_for_rollouts)
                self._retire_rollout_versions()
            except Exception:  # the online loop goes on without them
                log.exception("learner: lent rollouts failed")
                self.counters["offline_errors"] += 1
                got = None
            if got is not None:
                self.add_offline(got)
                self.counters["offline_groups"] += got.groups
        new = self.update() if self.due() else None
        self.metrics.set_stats(dict(self.counters))
        self.metrics.report()
        return new

    def close(self) -> None:
        self.consumer.close()
        if self.scout is not None:
            self.scout.close()
