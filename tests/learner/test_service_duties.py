"""The learner service's newer duties: every sample on the topic scored into the poisoning tally by its
scout (those an update drops, and those dropped while it buffers on, too), tenants opted out of
training, and its held-back weights lent to rollouts as a `rollout` version. Helpers and fixtures from
tests/learner/test_service.py."""

import uuid

import torch

from feedback.bus_embedded import EmbeddedBus
from learner.service import LearnerConfig, LearnerService
from learner.trainer import TrainerConfig
from registry.registry import Registry
from tests.learner.test_service import ParityVerifier, drain, publish, samples  # noqa: F401 (a fixture)


def test_samples_an_update_drops_still_add_to_the_verified_tally(tmp_path, tiny_checkpoint, samples):
    # 10 of the 40 samples come from a version the learner never made (dropped: unknown_version): they
    # train nothing, but the scout scores them into the tally as evidence on their users.
    from serving.tokenizer import Tokenizer

    decode = Tokenizer.from_file(tiny_checkpoint).decode
    foreign = decode(samples[0].completion.prompt_ids)
    batch = [
        ev.model_copy(
            update={
                "reward": 0.5,
                "completion": ev.completion.model_copy(
                    update={
                        "user_id": f"user-{i % 5}",
                        "model_version": "elsewhere" if i >= 30 else ev.completion.model_version,
                    }
                ),
            }
        )
        for i, ev in enumerate(samples[:40])
    ]
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, batch)
    cfg = LearnerConfig(
        update_every_samples=40, update_every_s=1e-6, min_samples=1, trainer=TrainerConfig(lr=1e-3), max_staleness=10
    )
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    svc = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg, verifier=ParityVerifier(foreign))
    assert drain(svc, rounds=5) == ["v0001"]
    m = reg.get("v0001").metrics
    verifiable = sum(decode(ev.completion.prompt_ids) != foreign for ev in batch)
    assert m["dropped_unknown_version"] == 10 and m["samples"] == 30
    assert m["poisoning_verified_samples"] == verifiable and m["poisoning_unverifiable_samples"] == 40 - verifiable
    assert sum(decode(ev.completion.prompt_ids) != foreign for ev in batch[30:]) >= 1  # dropped ones among them
    assert sum(n_pass + n_fail for n_pass, _, n_fail, _ in svc.tally.users.values()) == verifiable
    svc.close()
    bus.close()


def test_a_held_back_tip_is_lent_as_a_rollout_version_never_gated_and_withdrawn_once_unused(
    tmp_path, tiny_checkpoint, samples
):
    # The learner's current weights, unregistered while the gate is busy, go to lent replicas as
    # `<tip>.rollout`: hash-checked in the store, a `rollout` version the gate never takes and no user is
    # routed to; the rollout samples say the tip's id (ahead of the anchor: 0 versions behind). Once the
    # learner's open job samples other weights, the rollout version is withdrawn.
    from learner.config import LentRolloutConfig
    from learner.lent_rollouts import LentRollouts
    from learner.lineage import staleness
    from product.suites import OfflinePrompts
    from registry.jobs import JobQueue
    from serving.checkpoint import load_checkpoint
    from serving.tokenizer import Tokenizer
    from serving.weight_store import WeightStore, shipping_state

    class Any:
        def verify(self, prompts, completions):
            return [float(len(c) % 2 == 0) for c in completions]

    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    url = f"sqlite:///{tmp_path}/registry.db"
    tok = Tokenizer.from_file(tiny_checkpoint)
    offline = LentRolloutConfig(enabled=True, prompts_per_job=2, group_size=2, shard_size=2, max_tokens=4)
    queue = JobQueue(url)
    lent = LentRollouts(queue, OfflinePrompts("toy", ("def", "# x"), Any()), tok, offline)
    cfg = LearnerConfig(update_every_samples=5, min_samples=1, hold_check_s=0.0)
    svc = LearnerService(bus, Registry(url), tmp_path / "models", tiny_checkpoint, cfg, lent=lent)
    reg = svc.registry
    publish(bus, samples[:5])
    assert drain(svc, rounds=3) == ["v0001"]
    first = queue.job(lent.job)  # queued at the first tick, on the base: registered, so its own id
    assert (first.version_id, first.spec["weights_of"]) == (tiny_checkpoint.name, tiny_checkpoint.name)
    reg.transition("v0001", "evaluating", "gate", "offline eval")  # in flight: the next update is held back
    publish(bus, samples[5:10])
    assert drain(svc, rounds=3) == ["v0002"] and "v0002" in svc.state["held"]
    queue.cancel(lent.job)  # say its job went stale: the next tick queues one on the current weights
    svc.run_once(timeout_s=0.05)
    job = queue.job(lent.job)
    assert (job.version_id, job.spec["weights_of"]) == ("v0002.rollout", "v0002")
    rv = reg.get("v0002.rollout")
    assert rv.status == "rollout" and rv.parent_id == "v0001" and rv.metrics["rollout_of"] == "v0002"
    assert reg.in_flight().id == "v0001" and [v.id for v in reg.list("candidate")] == []  # nothing new to gate
    shipped = WeightStore(tmp_path / "models" / "store").get("v0002.rollout")
    expected = shipping_state(load_checkpoint(tmp_path / "models" / "v0002"), torch.float32)
    assert all(torch.equal(shipped[k], expected[k]) for k in expected)
    assert staleness(svc.state, "versions")["v0002"] == 0  # its samples are kept by the offline bound
    queue.cancel(lent.job)
    svc.run_once(timeout_s=0.05)  # a new job on the same weights: the rollout version stays
    assert reg.get("v0002.rollout").status == "rollout" and svc.counters["rollout_versions"] == 1
    publish(bus, samples[10:15])
    drain(svc, rounds=3)  # v0003, held back too
    queue.cancel(lent.job)
    svc.run_once(timeout_s=0.05)
    assert queue.job(lent.job).version_id == "v0003.rollout"
    assert reg.get("v0002.rollout").status == "withdrawn"  # no open job samples it any more
    queue.close()
    bus.close()


def test_an_opted_out_tenants_samples_never_train_and_are_counted(tmp_path, tiny_checkpoint, samples):
    # `learner.untrained_tenants`: tenant "acme"'s samples are dropped before training (dropped_opted_out),
    # and the others train as usual.
    batch = [ev.model_copy(update={"tenant": "acme"}) if i % 4 == 0 else ev for i, ev in enumerate(samples[:40])]
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, batch)
    cfg = LearnerConfig(
        update_every_samples=40, update_every_s=1e-6, min_samples=1, max_staleness=10, untrained_tenants=["acme"]
    )
    svc = LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "models", tiny_checkpoint, cfg)
    assert drain(svc, rounds=5) == ["v0001"]
    m = svc.registry.get("v0001").metrics
    assert (m["dropped_opted_out"], m["samples"]) == (10, 30) and svc.counters["dropped_opted_out"] == 10
    bus.close()


def test_samples_dropped_while_buffering_on_still_add_to_the_verified_tally(tmp_path, tiny_checkpoint, samples):
    # 30 of 40 samples are dropped (unknown_version), leaving too few for an update: the learner buffers
    # on (set_aside). The scout has scored all 40 into the tally as they arrived; the next update reports
    # them with its own.
    from serving.tokenizer import Tokenizer

    decode = Tokenizer.from_file(tiny_checkpoint).decode
    foreign = decode(samples[0].completion.prompt_ids)

    def user(ev, i, version=None):
        c = ev.completion.model_copy(
            update={"user_id": f"user-{i % 5}", "model_version": version or ev.completion.model_version}
        )
        return ev.model_copy(update={"reward": 0.5, "completion": c})

    batch = [user(ev, i, "elsewhere" if i >= 10 else None) for i, ev in enumerate(samples[:40])]
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, batch)
    cfg = LearnerConfig(update_every_samples=40, min_samples=40, trainer=TrainerConfig(lr=1e-3), max_staleness=10)
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    svc = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg, verifier=ParityVerifier(foreign))
    assert drain(svc, rounds=5) == [] and svc.counters["set_aside_updates"] >= 1
    verifiable = sum(decode(ev.completion.prompt_ids) != foreign for ev in batch)
    assert sum(decode(ev.completion.prompt_ids) != foreign for ev in batch[10:]) >= 1  # dropped ones among them
    assert sum(n_pass + n_fail for n_pass, _, n_fail, _ in svc.tally.users.values()) == verifiable
    more = [user(ev, i).model_copy(update={"event_id": uuid.uuid4().hex}) for i, ev in enumerate(samples[10:40])]
    publish(bus, more)  # 30 more to train, with the 10 buffered: an update
    assert drain(svc, rounds=5) == ["v0001"]
    verifiable += sum(decode(ev.completion.prompt_ids) != foreign for ev in more)
    assert reg.get("v0001").metrics["poisoning_verified_samples"] == verifiable  # reported with the update
    svc.close()
    bus.close()
