"""The learner's offline group rollouts through lent replicas: `LentRollouts` queues a job on the
learner's weights, a lent replica's worker runs it, and the finished job comes back as GRPO groups whose
sequences carry the log-probs and routed experts they were sampled with (equal to a full forward of
the model), group-relative advantages, and flat groups dropped and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.config import LentRolloutConfig
from learner.lent_rollouts import LentRollouts
from product.suites import OfflinePrompts
from registry.job_worker import LendingWorker
from registry.jobs import JobQueue
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.scoring import score
from serving.tokenizer import Tokenizer

PROMPTS = ("# add 3 to x\ndef f(x):\n", "# count 'a' in s\n", "def", "# items of xs greater than 7\ndef f(xs):\n")


class EvenLength:
    """A toy verifier: a completion passes when its text has an even number of characters."""

    def verify(self, prompts, completions):
        return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]


class Flat:
    def verify(self, prompts, completions):
        return [0.0] * len(completions)


@pytest.fixture
def parts(tiny_checkpoint, tmp_path):
    eng = EmbeddedEngine(max_batch=8, max_model_len=128, seed=0)
    eng.add_version("v1", tiny_checkpoint, default=True)
    q = JobQueue(f"sqlite:///{tmp_path / 'registry.db'}")
    yield eng, q, Tokenizer.from_file(tiny_checkpoint)
    q.close()
    eng.shutdown()


def v1() -> tuple[str, str]:
    return "v1", "v1"


def always(weights_of: str) -> bool:
    return True


def drive(lent: LentRollouts, worker: LendingWorker):
    assert lent.tick(v1, always) is None  # queued
    while worker.run_shard() is not None:
        pass
    return lent.tick(v1, always)  # done: its groups, and the next job queued


def test_a_job_run_on_a_lent_replica_comes_back_as_trainable_groups(parts, tiny_checkpoint):
    eng, q, tok = parts
    cfg = LentRolloutConfig(enabled=True, prompts_per_job=4, group_size=4, shard_size=2, max_tokens=12, seed=5)
    lent = LentRollouts(q, OfflinePrompts("toy", PROMPTS, EvenLength()), tok, cfg)
    batch = drive(lent, LendingWorker(eng, q, "r1", max_concurrency=4))
    assert batch is not None and batch.groups + batch.dropped_flat_groups == 4
    assert len(batch.sequences) == len(batch.advantages) == 4 * batch.groups > 0
    assert lent.counters["jobs_submitted"] == 2 and lent.job is not None  # the next one is waiting
    model = load_checkpoint(tiny_checkpoint)
    for s in batch.sequences:
        assert s.version == "v1" and s.key == "offline:toy" and s.temperature == 1.0
        lp, experts = score(model, s.prompt_ids, s.output_ids, _params(cfg), n_vocab=tok.vocab_size)
        assert torch.equal(lp, torch.tensor(s.logprobs))  # what the lent replica sampled with, exactly
        assert np.array_equal(s.routed_experts, experts.numpy())
    for g in range(batch.groups):  # group-relative: each group's advantages sum to zero
        assert abs(sum(batch.advantages[4 * g : 4 * g + 4])) < 1e-9


def test_groups_that_all_score_the_same_are_dropped_and_counted(parts):
    eng, q, tok = parts
    cfg = LentRolloutConfig(enabled=True, prompts_per_job=2, group_size=2, shard_size=2, max_tokens=4)
    lent = LentRollouts(q, OfflinePrompts("flat", PROMPTS, Flat()), tok, cfg)
    batch = drive(lent, LendingWorker(eng, q, "r1"))
    assert batch.groups == 0 and batch.dropped_flat_groups == 2 and batch.sequences == []
    assert lent.counters["dropped_flat_groups"] == 2


def _params(cfg):
    from serving.sampling import SamplingParams

    return SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens)


def test_samples_carry_the_learners_id_of_their_weights_and_a_stale_job_is_replaced(parts):
    # The job samples registered version "v1" holding the learner's "v7" (as a `rollout` version would):
    # its sequences say v7, what the learner's staleness bounds know. A job whose weights went stale
    # while open is cancelled, counted, and the next is queued on the weights of the moment.
    eng, q, tok = parts
    cfg = LentRolloutConfig(enabled=True, prompts_per_job=4, group_size=4, shard_size=2, max_tokens=12, seed=5)
    lent = LentRollouts(q, OfflinePrompts("toy", PROMPTS, EvenLength()), tok, cfg)
    assert lent.tick(lambda: ("v1", "v7"), always) is None
    first = lent.job
    assert q.job(first).spec["weights_of"] == "v7" and q.job(first).version_id == "v1"
    assert lent.tick(lambda: ("v1", "v8"), lambda w: w != "v7") is None  # v7 went stale while open
    assert q.job(first).status == "cancelled" and lent.counters["jobs_dropped"] == 1
    assert lent.job != first and q.job(lent.job).spec["weights_of"] == "v8"
    worker = LendingWorker(eng, q, "r1")
    while worker.run_shard() is not None:
        pass
    batch = lent.tick(lambda: ("v1", "v9"), always)
    assert batch is not None and batch.groups > 0 and {s.version for s in batch.sequences} == {"v8"}
