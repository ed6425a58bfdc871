"""The learner service: cadence, staleness, and crash-and-resume with exact sample accounting."""

import json
import random
import uuid

import pytest
import torch

from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS
from learner.service import LearnerConfig, LearnerService
from learner.trainer import TrainerConfig
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.conftest import served_samples

N = 40


@pytest.fixture(scope="module")
def samples(tiny_checkpoint):
    rng = random.Random(0)
    return served_samples(tiny_checkpoint, [rng.choice([-0.25, 0.75]) for _ in range(N)])


def publish(bus, events):
    for ev in events:
        bus.publish(TOPICS["sample"], ev.completion.completion_id, ev.model_dump_json().encode())


def make(tmp_path, tiny_checkpoint, bus, max_staleness=10, **kw):
    cfg = LearnerConfig(
        update_every_samples=10, min_samples=1, trainer=TrainerConfig(lr=1e-3), max_staleness=max_staleness, **kw
    )
    return LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "models", tiny_checkpoint, cfg)


def drain(svc, rounds=20):
    new = []
    for _ in range(rounds):
        v = svc.run_once(timeout_s=0.05)
        if v:
            new.append(v)
    return new


def test_updates_on_cadence_and_registers_candidates(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples)
    svc = make(tmp_path, tiny_checkpoint, bus)
    got = drain(svc)
    assert got == ["v0001", "v0002", "v0003", "v0004"], (got, svc.counters, len(svc.buffer))
    assert svc.counters["trained"] == N
    reg = svc.registry
    v4 = reg.get("v0004")
    assert v4.status == "candidate" and v4.parent_id == "v0003"
    assert {v.id for v in reg.lineage("v0004")} >= {tiny_checkpoint.name, "v0001", "v0002", "v0003"}
    paths = {(f["path"] if isinstance(f, dict) else f.path): f for f in v4.files}
    assert "v0004/model.safetensors" in paths
    # the shipping artifact: a lossless delta on v0003 in the weight store, rebuilt bit-exactly
    kinds = {p: (f["kind"] if isinstance(f, dict) else f.kind) for p, f in paths.items()}
    assert kinds.get("store/v0004.delta") == "delta" or any(k == "delta" for k in kinds.values()), kinds
    assert v4.delta_base_id == "v0003"
    from serving.checkpoint import load_checkpoint
    from serving.weight_store import WeightStore, shipping_state

    rebuilt = WeightStore(tmp_path / "models" / "store").get("v0004")  # a fresh reader: from the files
    expected = shipping_state(load_checkpoint(tmp_path / "models" / "v0004"), torch.float32)  # as shipped
    assert rebuilt.keys() == expected.keys() and all(torch.equal(rebuilt[k], expected[k]) for k in expected)
    assert (tmp_path / "models" / "v0004" / "model.safetensors").is_file()
    assert "ratio_mean" in v4.metrics and "abs_dlogp_max" not in v4.metrics  # served by the base, not v0003
    v1 = reg.get("v0001")  # trained on samples its parent served: serving-vs-trainer mismatch measured
    # Batch-invariant numerics in the engine and the trainer (the defaults): bit for bit.
    assert v1.metrics["abs_dlogp_max"] == 0.0 and v1.metrics["routing_disagreement"] == 0.0
    ranges = v1.data_range["flywheel.samples"]
    assert sum(end - start for start, end in ranges.values()) == 10
    svc.close()
    bus.close()


def test_a_candidate_holds_at_least_min_updates_per_candidate(tmp_path, tiny_checkpoint, samples):
    """With no gate about, 4 updates of 10 samples and min 3: one candidate after update 3 (its
    parent the base, covering 30 samples); update 4 is the next tip, held until it has 3 of its own."""
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples)
    svc = make(tmp_path, tiny_checkpoint, bus, min_updates_per_candidate=3)
    assert drain(svc) == ["v0001", "v0002", "v0003", "v0004"]  # every update makes a version...
    registered = [v.id for v in svc.registry.list() if v.parent_id is not None]
    assert registered == ["v0003"], (registered, svc.counters)  # ...and only the third is a candidate
    assert svc.trainer.updates == 4 and svc.counters["held_back"] == 3, svc.counters
    v3 = svc.registry.get("v0003")
    assert v3.status == "candidate" and v3.parent_id == tiny_checkpoint.name
    assert sum(end - start for start, end in v3.data_range["flywheel.samples"].values()) == 30
    assert svc.current == "v0004" and list(svc.state["held"]) == ["v0004"]
    svc.publish_held()  # the gate is free, but v0004 is one update past v0003: still held
    assert svc.registry.get("v0003").status == "candidate" and "v0004" in svc.state["held"]
    svc.close()
    bus.close()


def test_held_back_tips_never_reuse_an_id(tmp_path, tiny_checkpoint, samples):
    """An id taken elsewhere (here v0001, registered by someone else) leaves a gap; the held-back tips
    after it must still get new ids (never all v0002, each its own parent)."""
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples)
    svc = make(tmp_path, tiny_checkpoint, bus, min_updates_per_candidate=5)
    svc.registry.register(version_id="v0001", parent_id=tiny_checkpoint.name, files=[])
    assert drain(svc) == ["v0002", "v0003", "v0004", "v0005"]
    assert svc.state["versions"][1:] == ["v0002", "v0003", "v0004", "v0005"] and svc.current == "v0005"
    svc.close()
    bus.close()


def test_stale_samples_are_dropped_and_counted(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    svc = make(tmp_path, tiny_checkpoint, bus, max_staleness=1)
    publish(bus, samples[:30])
    drain(svc)  # every sample was served by the base version
    # samples 0-9 trained at the base (fresh), 10-19 at v0001 (1 behind: kept), 20-29 at v0002 (2 behind:
    # all dropped, so no new version)
    assert svc.current == "v0002"
    assert svc.counters["trained"] == 20 and svc.counters["dropped_stale"] == 10
    svc.close()
    bus.close()


def test_the_learner_waits_at_the_lag_bound_and_drops_only_what_is_beyond_it(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    # Staleness in versions: 10, not binding; the lag bound: 2 updates; recheck at once (no gate clock).
    svc = make(tmp_path, tiny_checkpoint, bus, max_lag_updates=2, hold_check_s=0.0)
    publish(bus, samples[:30])
    # Every sample served by the base. After v0002 the base is 2 updates behind the tip: one more update
    # would leave all it serves beyond the bound, so the learner waits, buffering (up to 2 updates' worth).
    assert drain(svc) == ["v0001", "v0002"]
    assert svc.counters["trained"] == 20 and svc.counters["dropped_lag"] == 0
    assert svc.counters["lag_bound_waits"] == 1 and len(svc.buffer) == 10
    promote(svc.registry, "v0001")  # the gate moves on: the buffered samples, 2 behind, train
    assert drain(svc) == ["v0003"]
    assert svc.counters["trained"] == 30 and svc.counters["dropped_lag"] == 0
    m = svc.registry.get("v0003").metrics
    assert (m["lag_updates_max"], m["dropped_lag"], m["dropped_stale"], m["samples"]) == (2.0, 0.0, 0.0, 10.0)
    for k in ("masked_frac", "truncated_frac", "abs_log_ratio_mean", "ratio_max", "missing_routing_sequences"):
        assert k in m, k
    assert m["since_parent"]["samples"] == 10.0 and m["poisoning_flagged_users"] == 0.0
    log = [json.loads(line) for line in (tmp_path / "models" / "updates.jsonl").read_text().splitlines()]
    assert [(u["version"], u["parent"], u["update"]) for u in log] == [
        ("v0001", "tiny-v1", 1),
        ("v0002", "v0001", 2),
        ("v0003", "v0002", 3),
    ]
    assert log[2]["stats"]["poisoning"]["flags"] == [] and log[2]["stats"]["samples"] == 10
    promote(svc.registry, "v0002")
    publish(bus, samples[30:40])  # late samples of the base, now 3 updates behind: dropped (counted below)
    assert drain(svc) == [] and svc.counters["dropped_lag"] == 10 and svc.counters["trained"] == 30
    assert svc.counters["set_aside_updates"] >= 1

    # Drops that leave too few samples for an update: no optimizer step on a handful. The dropped are set
    # aside (counted with the next update), the rest stay buffered until an update's worth is trainable.
    def served_by(ev, version, n):
        c = ev.completion.model_copy(update={"completion_id": f"again-{n}", "model_version": version})
        return ev.model_copy(update={"event_id": uuid.uuid4().hex, "completion": c})

    publish(bus, [served_by(ev, tiny_checkpoint.name, i) for i, ev in enumerate(samples[:8])])  # 3 behind: dropped
    publish(bus, [served_by(ev, "v0003", 8 + i) for i, ev in enumerate(samples[8:12])])  # the tip's: kept
    assert drain(svc) == [] and svc.counters["trained"] == 30 and svc.counters["set_aside_updates"] >= 2
    publish(bus, [served_by(ev, "v0003", 12 + i) for i, ev in enumerate(samples[12:18])])
    assert drain(svc) == ["v0004"] and svc.counters["trained"] == 40 and svc.counters["dropped_lag"] == 18
    stats = svc.last_stats
    assert (stats["samples"], stats["dropped_lag"]) == (10, 18.0)  # the set-aside drops are in its statistics
    committed = bus.committed(TOPICS["sample"], "learner")
    assert sum(committed.values()) == 58  # every record read, trained or dropped, is behind the positions
    svc.close()
    bus.close()


def test_waiting_at_the_lag_bound_buffers_the_bounds_worth_and_looks_again_every_hold_check(
    tmp_path, tiny_checkpoint, samples
):
    bus = EmbeddedBus(tmp_path / "bus")
    now = [0.0]
    cfg = LearnerConfig(
        update_every_samples=5, min_samples=1, max_staleness=10, max_lag_updates=2, hold_check_s=60.0,
        trainer=TrainerConfig(lr=1e-3),
    )  # fmt: skip
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    svc = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg, clock=lambda: now[0])
    publish(bus, samples[:40])
    assert drain(svc) == ["v0001", "v0002"] and svc._lag_wait
    assert len(svc.buffer) == 10  # 2 updates' worth; the other 20 samples wait on the bus
    promote(svc.registry, "v0001")
    assert drain(svc) == []  # within hold_check_s of the last look: not looked at again
    now[0] += 60.0
    assert drain(svc) == ["v0003"] and svc.registry.get("v0003").metrics["samples"] == 10.0
    svc.close()
    bus.close()


def test_lag_wait_updates_bounds_what_the_wait_buffers(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    cfg = LearnerConfig(
        update_every_samples=5, min_samples=1, max_staleness=10, max_lag_updates=2, lag_wait_updates=1,
        hold_check_s=0.0, trainer=TrainerConfig(lr=1e-3),
    )  # fmt: skip
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    svc = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg)
    publish(bus, samples[:40])
    assert drain(svc) == ["v0001", "v0002"] and svc._lag_wait
    assert len(svc.buffer) == 5  # one update's worth, not the bound's (10): the other 25 wait on the bus
    promote(svc.registry, "v0001")
    assert drain(svc) == ["v0003"] and svc.registry.get("v0003").metrics["samples"] == 5.0
    assert svc.counters["trained"] == 15 and svc.counters["dropped_lag"] == 0  # v0001 is 2 behind: waiting
    svc.close()
    bus.close()


def test_settings_that_would_wait_forever_are_refused():
    with pytest.raises(ValueError, match="min_updates_per_candidate=9 exceeds max_lag_updates=8"):
        LearnerConfig(min_updates_per_candidate=9)
    with pytest.raises(ValueError, match="max_lag_updates"):
        LearnerConfig(max_lag_updates=0)
    assert LearnerConfig(min_updates_per_candidate=9, max_lag_updates=None).max_lag_updates is None


def test_a_rejected_tip_releases_the_wait_at_the_lag_bound(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    svc = make(tmp_path, tiny_checkpoint, bus, max_lag_updates=1, hold_check_s=0.0)
    publish(bus, samples[:20])
    assert drain(svc) == ["v0001"] and svc._lag_wait
    svc.registry.transition("v0001", "evaluating", "gate", "offline eval")
    svc.registry.reject("v0001", "gate", "worse")
    # The lineage rebases onto the base, which is then 0 behind: the 10 buffered samples train.
    assert drain(svc) == ["v0002"] and svc.counters["rebased"] == 1 and svc.counters["trained"] == 20
    assert svc.registry.get("v0002").parent_id == tiny_checkpoint.name
    svc.close()
    bus.close()


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["before_state", "before_commit"])
def test_crash_and_resume_trains_every_sample_exactly_once(tmp_path, tiny_checkpoint, samples, where):
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples)
    svc = make(tmp_path, tiny_checkpoint, bus)
    assert svc.run_once(0.05) == "v0001"
    # The second update dies at the chosen point (the process is gone: nothing closed, nothing committed).
    if where == "before_commit":
        svc.consumer.commit = lambda records: (_ for _ in ()).throw(Crash("killed before the bus commit"))
    else:

        def die(*a, **k):
            raise Crash("killed before learner.json")

        svc._publish = lambda stats, covered: (LearnerService._publish(svc, stats, covered), die())[0]
    with pytest.raises(Crash):
        svc.run_once(0.05)
    bus.close()
    bus = EmbeddedBus(tmp_path / "bus")
    again = make(tmp_path, tiny_checkpoint, bus)
    drain(again)
    state = json.loads((tmp_path / "models" / "learner.json").read_text())
    trained = state["trained_ids"]
    assert len(trained) == N and len(set(trained)) == N  # every sample once, none lost, none twice
    assert {s.event_id for s in samples} == set(trained)
    # before_state: the crashed update never became current, so its 10 samples are trained again (once);
    # before_commit: it did, so the bus redelivers them and they are skipped by offset.
    redone = 10 if where == "before_state" else 0
    assert again.counters["trained"] == N - 20 + redone, again.counters
    if where == "before_commit":
        assert again.counters["skipped_already_trained_offset"] == 10
    assert len(state["versions"]) == 5  # base + 4 updates
    again.close()
    bus.close()


def test_offline_groups_are_mixed_into_the_next_update(tmp_path, tiny_checkpoint, samples):
    from demo.split import sample_tasks
    from learner.offline import rollout_groups

    class Parity:  # a verifier the untrained test model can pass
        def verify(self, prompts, completions):
            return [float(len(text) % 2) for text in completions]

    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples[:10])
    svc = make(tmp_path, tiny_checkpoint, bus)
    eng = EmbeddedEngine(max_batch=32, max_model_len=128)
    try:
        eng.add_version(tiny_checkpoint.name, tiny_checkpoint)
        batch = rollout_groups(
            eng,
            tiny_checkpoint.name,
            [t.prompt for t in sample_tasks(8, seed=3)],
            Parity(),
            group_size=4,
            weight=0.5,
            temperature=1.5,
        )
    finally:
        eng.shutdown()
    assert batch.sequences
    svc.add_offline(batch)
    assert svc.run_once(0.05) == "v0001"
    assert svc.counters["trained"] == 10 and svc.counters["trained_offline"] == len(batch.sequences)
    assert svc.registry.get("v0001").metrics["offline_samples"] == len(batch.sequences)
    svc.close()
    bus.close()


def test_a_rejected_lineage_rebases_onto_the_promoted_version(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples[:20])
    svc = make(tmp_path, tiny_checkpoint, bus)
    assert drain(svc) == ["v0001", "v0002"]
    reg, base = svc.registry, tiny_checkpoint.name
    assert reg.promoted().id == base  # the learner published and promoted the base at its start
    reg.transition("v0001", "evaluating", "gate", "offline eval")
    reg.reject("v0001", "gate", "worse")  # its descendant v0002 is withdrawn with it
    assert reg.get("v0002").status == "withdrawn"
    publish(bus, samples[20:30])
    assert drain(svc) == ["v0003"]
    assert reg.get("v0003").parent_id == base and svc.counters["rebased"] == 1
    from serving.checkpoint import load_checkpoint

    moved = load_checkpoint(tmp_path / "models" / "v0003").state_dict()
    v2 = load_checkpoint(tmp_path / "models" / "v0002").state_dict()
    b = load_checkpoint(tiny_checkpoint).state_dict()
    # v0003 is one update away from the base, not from the withdrawn v0002
    assert sum((moved[k] - b[k]).abs().sum() for k in b) < sum((moved[k] - v2[k]).abs().sum() for k in b)
    bus.close()


def dead_letters(bus):
    from feedback.dead_letter import DEAD_LETTER_TOPIC, DeadLetter

    consumer, out = bus.consumer(DEAD_LETTER_TOPIC, "inspect"), []
    while records := consumer.poll(100, timeout_s=0.1):
        out += [DeadLetter.model_validate_json(r.value) for r in records]
    consumer.close()
    return out


def test_malformed_records_are_dead_lettered_and_the_learner_carries_on(tmp_path, tiny_checkpoint, samples):
    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    publish(bus, samples[:5])
    bus.publish(TOPICS["sample"], "bad-json", b'{"type": "sample", ')  # offset 5
    bus.publish(TOPICS["sample"], "bad-schema", json.dumps({"type": "sample", "reward": "high"}).encode())
    bus.publish(TOPICS["sample"], "bad-bytes", b"\xff\xfe")
    publish(bus, samples[5:12])
    svc = make(tmp_path, tiny_checkpoint, bus)
    assert drain(svc) == ["v0001"]  # the 10 good samples, past the 3 bad records
    assert svc.counters["dead_lettered_malformed"] == 3 and svc.counters["trained"] == 10
    letters = sorted(dead_letters(bus), key=lambda d: d.offset)
    assert [(d.key, d.offset, d.stage) for d in letters] == [
        ("bad-json", 5, "learner.decode"),
        ("bad-schema", 6, "learner.decode"),
        ("bad-bytes", 7, "learner.decode"),
    ]
    assert letters[0].raw() == b'{"type": "sample", ' and letters[2].encoding == "base64"
    assert "json" in letters[0].reason.lower() and "reward" in letters[1].reason
    svc.close()
    again = make(tmp_path, tiny_checkpoint, bus)  # committed: the bad records are not read again
    drain(again, rounds=3)
    assert again.counters["dead_lettered_malformed"] == 0
    bus.close()


def test_a_non_finite_batch_is_quarantined_and_not_retried(tmp_path, tiny_checkpoint, samples):
    from serving.checkpoint import load_checkpoint

    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    poisoned = [s.model_copy(update={"reward": 3e38}) if i == 4 else s for i, s in enumerate(samples[:10])]
    publish(bus, poisoned)
    svc = make(tmp_path, tiny_checkpoint, bus)
    base = {k: v.clone() for k, v in svc.model.state_dict().items()}
    assert drain(svc, rounds=3) == []
    assert svc.counters["quarantined_batches"] == 1 and svc.counters["quarantined_samples"] == 10
    assert svc.counters["trained"] == 0 and svc.current == tiny_checkpoint.name
    assert all(torch.equal(v, base[k]) for k, v in svc.model.state_dict().items())
    assert svc.trainer.opt.state_dict()["state"] == {}  # no step was taken
    letters = dead_letters(bus)
    assert sorted(d.offset for d in letters) == list(range(10)) and {d.stage for d in letters} == {"learner.quarantine"}
    assert any("non-finite" in d.reason for d in letters)
    publish(bus, samples[10:20])
    assert drain(svc, rounds=3) == ["v0001"]  # the next batch trains; the quarantined one is not retried
    assert svc.counters["trained"] == 10
    svc.close()
    again = make(tmp_path, tiny_checkpoint, bus)
    assert drain(again, rounds=3) == [] and again.counters["quarantined_batches"] == 0
    moved = load_checkpoint(tmp_path / "models" / "v0001").state_dict()
    assert any(not torch.equal(moved[k], base[k]) for k in base)
    bus.close()


def promote(reg, vid):
    """The gate's happy path and a person's approval."""
    reg.transition(vid, "evaluating", "gate", "offline eval")
    promote_from_evaluating(reg, vid)


def test_the_kl_reference_is_the_promoted_version(tmp_path, tiny_checkpoint, samples):
    from learner.objective import LossConfig

    bus = EmbeddedBus(tmp_path / "bus")
    # One pass per update: the KL of v0001's update is then the reference's own, 0 (a second pass would
    # measure it after the first step).
    trainer = TrainerConfig(lr=1e-2, steps_per_update=1, loss=LossConfig(kl_coef=0.5))
    cfg = LearnerConfig(update_every_samples=10, min_samples=1, max_staleness=10, trainer=trainer)
    svc = LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "models", tiny_checkpoint, cfg)
    assert svc.reference_id == tiny_checkpoint.name
    publish(bus, samples[:20])
    assert drain(svc) == ["v0001", "v0002"]
    m1, m2 = svc.registry.get("v0001").metrics, svc.registry.get("v0002").metrics
    assert m1["kl_k3"] == 0.0 and m2["kl_k3"] > 0  # v0001 was trained from the reference itself
    promote(svc.registry, "v0001")
    publish(bus, samples[20:30])
    assert drain(svc) == ["v0003"]
    assert svc.reference_id == "v0001" and svc.counters["reference_reloads"] == 1
    ref = svc.trainer.reference.state_dict()
    from serving.checkpoint import load_checkpoint

    v1 = load_checkpoint(tmp_path / "models" / "v0001").state_dict()
    assert all(torch.equal(ref[k], v1[k]) for k in v1)
    svc.close()
    bus.close()


def test_learner_state_names_folders_relative_to_the_models_folder(tmp_path, tiny_checkpoint, samples):
    import shutil

    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, samples[:20])
    svc = make(tmp_path, tiny_checkpoint, bus)
    assert drain(svc) == ["v0001", "v0002"]
    svc.close()
    dirs = json.loads((tmp_path / "models" / "learner.json").read_text())["dirs"]
    assert dirs == {tiny_checkpoint.name: tiny_checkpoint.name, "v0001": "v0001", "v0002": "v0002"}
    shutil.move(tmp_path / "models", tmp_path / "elsewhere")  # FLYWHEEL_HOME moved
    cfg = LearnerConfig(update_every_samples=10, min_samples=1, trainer=TrainerConfig(lr=1e-3), max_staleness=10)
    moved = LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "elsewhere", "/nowhere", cfg)
    assert moved.current == "v0002"
    publish(bus, samples[20:30])
    assert drain(moved) == ["v0003"] and (tmp_path / "elsewhere" / "v0003" / "model.safetensors").is_file()
    moved.close()
    bus.close()


def test_while_a_version_is_in_flight_updates_are_held_back_and_the_tip_registered_after(
    tmp_path, tiny_checkpoint, samples
):
    from registry.registry import UnknownVersion
    from serving.checkpoint import load_checkpoint
    from serving.weight_store import WeightStore, shipping_state

    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    cfg = LearnerConfig(update_every_samples=5, min_samples=1, hold_check_s=0.0)  # max_staleness 2 versions
    svc = LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "models", tiny_checkpoint, cfg)
    reg, base = svc.registry, tiny_checkpoint.name
    publish(bus, samples[:5])
    assert drain(svc, rounds=3) == ["v0001"] and reg.get("v0001").status == "candidate"
    reg.transition("v0001", "evaluating", "gate", "offline eval")  # in flight: the learner holds back
    publish(bus, samples[5:15])
    assert drain(svc, rounds=4) == ["v0002", "v0003"]
    for vid in ("v0002", "v0003"):
        with pytest.raises(UnknownVersion):
            reg.get(vid)
    # The base's samples are 1 registered version behind (v0001) but 2 updates behind at v0003: kept.
    assert svc.counters["dropped_stale"] == 0 and svc.counters["held_back"] == 2
    assert (svc.last_stats["staleness_versions_max"], svc.last_stats["staleness_updates_max"]) == (1, 2)
    promote_from_evaluating(reg, "v0001")
    assert drain(svc, rounds=1) == [] and svc.counters["published_held"] == 1  # the gate is free: the tip goes
    v3 = reg.get("v0003")
    assert v3.status == "candidate" and v3.parent_id == "v0001" and v3.delta_base_id == "v0001"
    assert v3.metrics["held_back_updates"] == 1 and v3.metrics["samples_since_parent"] == 10
    covered = {int(p): tuple(r) for p, r in v3.data_range["flywheel.samples"].items()}
    assert covered == {0: (5, 15)}  # both updates' samples
    shipped = WeightStore(tmp_path / "models" / "store").get("v0003")
    expected = shipping_state(load_checkpoint(tmp_path / "models" / "v0003"), torch.float32)
    assert all(torch.equal(shipped[k], expected[k]) for k in expected)
    # v0003 waits for the gate, which has been seen at work: the next update is held back too (one
    # candidate of the lineage at a time, so the gate, oldest first, gets the newest weights).
    publish(bus, samples[15:20])
    assert drain(svc, rounds=3) == ["v0004"] and svc.state["held"].keys() == {"v0004"}
    # A held-back tip on a candidate that fails goes with it: the lineage rebases onto the promoted version.
    reg.transition("v0003", "evaluating", "gate", "offline eval")
    assert svc.last_stats["staleness_versions_max"] == 2  # the base's samples: v0001 and v0003 since
    reg.reject("v0003", "gate", "worse")
    assert drain(svc, rounds=1) == []  # not registered: its anchor was rejected
    publish(bus, samples[20:25])
    assert drain(svc, rounds=3) == ["v0005"]
    assert svc.counters["rebased"] == 1 and svc.counters["dropped_held_versions"] == 1
    assert reg.get("v0005").parent_id == "v0001" and reg.get("v0005").status == "candidate"
    assert reg.promoted().id == "v0001" and base in svc.state["published"]
    svc.close()
    bus.close()


def promote_from_evaluating(reg, vid):
    verdict = {
        "passed": True,
        "incumbent_id": reg.incumbent().id,
        "artifact_sha256": reg.get(vid).artifact_sha256,
        "suite_version": "suite-1",
    }
    reg.record_gate(vid, "offline", verdict, "gate")
    reg.transition(vid, "canary", "gate", "passed")
    reg.transition(vid, "awaiting_approval", "gate", "canary passed")
    reg.approve(vid, "alice", "ship it")


def test_a_user_dominating_an_update_is_flagged_in_the_versions_metrics(tmp_path, tiny_checkpoint, samples):
    def as_user(ev, user):
        return ev.model_copy(update={"completion": ev.completion.model_copy(update={"user_id": user})})

    batch = [as_user(ev, f"user-{i}") for i, ev in enumerate(samples[:25])]
    batch += [as_user(ev, "spammer") for ev in samples[25:40]]  # 15 of 40 samples
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, batch)
    cfg = LearnerConfig(update_every_samples=40, min_samples=1, trainer=TrainerConfig(lr=1e-3), max_staleness=10)
    svc = LearnerService(bus, Registry(f"sqlite:///{tmp_path}/registry.db"), tmp_path / "models", tiny_checkpoint, cfg)
    assert drain(svc, rounds=5) == ["v0001"]
    p = svc.registry.get("v0001").metrics["poisoning"]
    assert (p["users"], p["flagged_users"], p["flagged_samples"]) == (26, 1, 15)
    [flag] = p["flags"]
    assert flag["user"] == "spammer" and 0 < flag["weight"] < 1 and svc.counters["flagged_users"] == 1
    assert svc.metrics.consumed == {TOPICS["sample"]: 40} and svc.metrics.stats["flagged_samples"] == 15
    svc.close()
    bus.close()


class ParityVerifier:
    """A product's verifier in miniature: a completion passes when its text has an even length; the one
    prompt it was not built for is refused, as `product.suites.Verifier` says."""

    def __init__(self, foreign: str):
        self.foreign = foreign

    def verify(self, prompts, completions):
        if self.foreign in prompts:
            raise ValueError(f"not a task of mine: {self.foreign!r}")
        return [float(len(c) % 2 == 0) for c in completions]


def test_with_a_verifier_a_user_rewarding_against_correctness_is_flagged_and_the_tally_survives_a_restart(
    tmp_path, tiny_checkpoint, samples
):
    from serving.tokenizer import Tokenizer

    def as_user(ev, user, reward):
        return ev.model_copy(
            update={"reward": reward, "completion": ev.completion.model_copy(update={"user_id": user})}
        )

    decode = Tokenizer.from_file(tiny_checkpoint).decode
    foreign = decode(samples[0].completion.prompt_ids)
    passes = [len(ev.completion.text) % 2 == 0 for ev in samples]
    assert 3 <= sum(passes[30:]) <= 7  # the inverted user sees code of both kinds
    batch = [
        as_user(ev, f"user-{i % 10}", 0.75 if ok else -0.25) for i, (ev, ok) in enumerate(zip(samples[:30], passes))
    ]
    batch += [as_user(ev, "inverted", -0.25 if ok else 0.75) for ev, ok in zip(samples[30:], passes[30:])]
    bus = EmbeddedBus(tmp_path / "bus")
    publish(bus, batch)
    cfg = LearnerConfig(update_every_samples=40, min_samples=1, trainer=TrainerConfig(lr=1e-3), max_staleness=10)
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    verifier = ParityVerifier(foreign)
    svc = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg, verifier=verifier)
    assert drain(svc, rounds=5) == ["v0001"]
    m = reg.get("v0001").metrics
    unverifiable = sum(decode(ev.completion.prompt_ids) == foreign for ev in batch)
    assert m["poisoning_unverifiable_samples"] == unverifiable >= 1
    assert m["poisoning_verified_samples"] == 40 - unverifiable
    [flag] = m["poisoning"]["flags"]
    assert flag["user"] == "inverted" and "against the verifier" in flag["reasons"][0] and 0 < flag["weight"] < 1
    inverted = [ev for ev in batch[30:] if decode(ev.completion.prompt_ids) != foreign]
    n_pass, _, n_fail, _ = svc.tally.users[("t", "inverted")]
    assert (n_pass, n_pass + n_fail) == (sum(len(ev.completion.text) % 2 == 0 for ev in inverted), len(inverted))
    svc.close()
    again = LearnerService(bus, reg, tmp_path / "models", tiny_checkpoint, cfg, verifier=verifier)
    assert again.tally.users == svc.tally.users and again.tally.kinds == svc.tally.kinds
    assert drain(again, rounds=2) == [] and again.tally.users == svc.tally.users  # its scout counts nothing twice
    again.close()
    bus.close()
