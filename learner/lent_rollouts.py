"""The learner's offline group rollouts, sampled on lent replicas through the job queue.

`LentRollouts.tick(weights, fresh)` keeps one `rollout` job in the registry's queue (`registry.jobs`):
while none is open it submits the next `prompts_per_job` prompts of the product's offline prompt source
(`product.suites.OfflinePrompts`, named by `learner.offline_prompts`), each with `group_size` seeded
samples on `weights()`: the registered version that holds the learner's current weights, and the
learner's own id for them. The service (`LearnerService._rollout_weights`) gives its current version
when that is registered, else registers those weights as a `rollout` version (`registry.models.Status`:
hash-checked, never gated, no user routed to it), so rollouts are on-policy up to the updates made while
the job runs. Lent replicas load that version and run the shards (`api.lending`). Once the job is done,
`tick` scores every sample with the source's verifier, forms GRPO groups
(`learner.objective.group_advantages`; a group whose samples all scored the same carries no signal and
is dropped, counted) and returns them as a `learner.offline.GroupBatch`, which the service mixes into
its next update (`LearnerService.add_offline`) with `weight`. The samples carry the learner's id of the
weights they were made with, their log-probs and routed experts, so the update corrects them for the
learner having moved since like any served sample, and drops them beyond the staleness bounds
(counted).

An open job whose weights are no longer `fresh` (the learner moved past its lag bound, or rebased) or
that was cancelled is dropped, counted, and the next is queued. With nothing lent, the job waits in the
queue, and the learner trains on online samples alone.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from learner.config import LentRolloutConfig
from learner.objective import group_advantages
from learner.offline import GroupBatch
from learner.replay import Sequence
from product.suites import OfflinePrompts
from registry.job_worker import experts_array
from registry.jobs import JobQueue

log = logging.getLogger(__name__)


class LentRollouts:
    def __init__(self, queue: JobQueue, source: OfflinePrompts, tokenizer, cfg: LentRolloutConfig):
        self.queue, self.source, self.tokenizer, self.cfg = queue, source, tokenizer, cfg
        self.order = list(range(len(source.prompts)))
        random.Random(cfg.seed).shuffle(self.order)
        self.next = 0
        self.jobs = 0
        self.job: str | None = None
        self.counters = {"jobs_submitted": 0, "jobs_used": 0, "jobs_dropped": 0, "groups": 0, "dropped_flat_groups": 0}
        for old in queue.open_jobs("rollout"):  # a learner that restarted: its open jobs start again
            if old.spec.get("source") == source.name:
                queue.cancel(old.job_id)
                self.counters["jobs_dropped"] += 1

    def _prompts(self) -> list[str]:
        out = []
        for _ in range(min(self.cfg.prompts_per_job, len(self.order))):
            out.append(self.source.prompts[self.order[self.next % len(self.order)]])
            self.next += 1
        return out

    def submit(self, version: str, weights_of: str | None = None) -> str:
        """Queue the next job on registered `version`, which holds the learner's `weights_of` (default:
        `version` itself)."""
        c = self.cfg
        params = {"temperature": c.temperature, "max_tokens": c.max_tokens, "stop": list(self.source.stop)}
        items = [
            {
                "prompt": p,
                "prompt_ids": self.tokenizer.encode_prompt(p),
                "params": params,
                "seeds": [
                    c.seed * 1_000_003 + (self.jobs * c.prompts_per_job + i) * c.group_size + g
                    for g in range(c.group_size)
                ],
            }
            for i, p in enumerate(self._prompts())
        ]
        spec = {"source": self.source.name, "weights_of": weights_of or version}
        self.job = self.queue.submit("rollout", version, items, c.group_size, c.shard_size, spec)
        self.jobs += 1
        self.counters["jobs_submitted"] += 1
        log.info("learner: rollout job %s queued: %d prompts x %d on %s", self.job, len(items), c.group_size, version)
        return self.job

    def tick(self, weights: Callable[[], tuple[str, str]], fresh: Callable[[str], bool]) -> GroupBatch | None:
        """Queue a job if none is open; the groups of a finished one (then the next is queued), else None.
        `weights()`: (the registered version to sample, the learner's id of its weights), asked only when
        a job is queued; `fresh(weights_of)`: whether an open job's weights are still worth sampling. A
        job on weights no longer fresh, or a cancelled one, is dropped, counted, and the next is queued."""
        if self.job is None:
            self.submit(*weights())
            return None
        job = self.queue.job(self.job)
        if job.status == "cancelled" or (job.status == "open" and not fresh(self.weights_of(job))):
            if job.status == "open":
                self.queue.cancel(job.job_id)
            log.info("learner: rollout job %s on %s dropped (%s)", job.job_id, job.version_id, job.status)
            self.counters["jobs_dropped"] += 1
            self.submit(*weights())
            return None
        if job.status != "done":
            return None
        batch = self.groups(self.job)
        self.counters["jobs_used"] += 1
        self.counters["groups"] += batch.groups
        self.counters["dropped_flat_groups"] += batch.dropped_flat_groups
        self.job = None
        self.submit(*weights())
        return batch

    @staticmethod
    def weights_of(job) -> str:
        """The learner's id of the weights a job samples (its registered version may be a `rollout` one)."""
        return str(job.spec.get("weights_of") or job.version_id)

    def groups(self, job_id: str) -> GroupBatch:
        """A finished job's samples, scored and grouped (module docstring)."""
        job = self.queue.job(job_id)
        rows = self.queue.results(job_id)
        shards: dict[int, list] = {}
        for r in rows:
            shards.setdefault(r.shard, []).append(r)
        c = self.cfg
        out = GroupBatch()
        scored = passed = 0
        for shard in sorted(shards):
            by_item: dict[int, list] = {}
            for r in shards[shard]:
                by_item.setdefault(r.item, []).append(r)
            items = self._shard_items(job_id, shard)
            for i, group in sorted(by_item.items()):
                group.sort(key=lambda r: r.sample)
                prompt = items[i]["prompt"]
                texts = [r.result["text"] for r in group]
                rewards = [float(x) for x in self.source.verifier.verify([prompt] * len(texts), texts)]
                scored += len(rewards)
                passed += sum(x == 1.0 for x in rewards)
                if len(set(rewards)) == 1:
                    out.dropped_flat_groups += 1
                    continue
                out.groups += 1
                for r, reward, adv in zip(group, rewards, group_advantages(rewards), strict=True):
                    out.sequences.append(
                        Sequence(
                            items[i]["prompt_ids"],
                            r.result["output_ids"],
                            r.result["logprobs"],
                            experts_array(r.result["experts"]),
                            c.temperature,
                            1.0,
                            reward=reward,
                            version=self.weights_of(job),
                            key=f"offline:{self.source.name}",
                            weight=c.weight,
                        )
                    )
                    out.advantages.append(adv)
        out.pass_rate = passed / max(1, scored)
        return out

    def _shard_items(self, job_id: str, shard: int) -> list[dict]:
        return self.queue.shard_items(job_id, shard)
