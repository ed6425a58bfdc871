"""Lent work end to end on a real engine and job queue: a worker runs a shard's samples as background
requests and records them, bit-identical to the same seeded requests served live; a traffic spike
makes the fleet manager reclaim the replica mid-shard, the live requests are all served, and the job
resumes later (on another worker) with every rollout counted exactly once."""

from __future__ import annotations

import threading

import pytest

from core.harness import wait_until
from registry.job_worker import LendingWorker
from registry.jobs import JobQueue
from serving.engine import EmbeddedEngine
from serving.lending import FleetManager, LendingConfig
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

PARAMS = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
TEXTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\n", "def", "# items of xs greater than 7\ndef f(xs):\n"]


@pytest.fixture
def world(tiny_checkpoint, tmp_path):
    eng = EmbeddedEngine(max_batch=4, max_model_len=128, seed=0)
    eng.add_version("v1", tiny_checkpoint, default=True)
    q = JobQueue(f"sqlite:///{tmp_path / 'registry.db'}")
    tok = Tokenizer.from_file(tiny_checkpoint)
    yield eng, q, tok
    q.close()
    eng.shutdown()


def items(tok, n: int, G: int) -> list[dict]:
    return [
        {
            "prompt_ids": tok.encode_prompt(TEXTS[i % len(TEXTS)]),
            "params": PARAMS,
            "seeds": [1000 * i + g for g in range(G)],
        }
        for i in range(n)
    ]


def served_live(eng, its) -> dict[tuple[int, int], list[int]]:
    """The same samples as plain (live) requests: what lent work must reproduce."""
    reqs = [
        (i, g, it["prompt_ids"], SamplingParams(**PARAMS, seed=s))
        for i, it in enumerate(its)
        for g, s in enumerate(it["seeds"])
    ]
    outs = eng.generate([r[2] for r in reqs], [r[3] for r in reqs])
    return {(i, g): (c.output_ids, c.logprobs) for (i, g, _, _), c in zip(reqs, outs, strict=True)}


def test_a_worker_runs_a_job_and_its_samples_equal_live_ones(world):
    eng, q, tok = world
    its = items(tok, 3, G=2)
    job = q.submit("eval", "v1", its, samples_per_item=2, shard_size=2)
    w = LendingWorker(eng, q, "replica-a", lease_s=30, max_concurrency=3)
    runs = [w.run_shard(), w.run_shard()]
    assert [(r.shard, r.recorded, r.finished, r.why) for r in runs] == [(0, 4, True, "done"), (1, 2, True, "done")]
    assert w.run_shard() is None and q.job(job).status == "done"
    want = served_live(eng, its)
    got = {(r.shard * 2 + r.item, r.sample): (r.result["output_ids"], r.result["logprobs"]) for r in q.results(job)}
    assert got == want  # bit-identical: same seeds, batch-invariant kernels


def test_a_spike_reclaims_the_replica_mid_shard_and_the_job_resumes_with_every_rollout_once(world):
    eng, q, tok = world
    its = items(tok, 4, G=8)  # 32 samples in one shard: long enough to be cut short
    job = q.submit("rollout", "v1", its, samples_per_item=8, shard_size=4)
    cfg = LendingConfig(enabled=True, target_concurrency=2, lend_after_s=10, reclaim_after_s=1)
    fleet = FleetManager(cfg, ["r0", "r1"])
    for t in range(12):  # quiet: r1 is lent (chosen at 10, lent at the next look)
        fleet.observe(t, 0, {"r0": 0, "r1": 0})
        fleet.decide(t)
    assert fleet.states["r1"] == "lent"
    w = LendingWorker(eng, q, "r1", lease_s=30, max_concurrency=2)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(w.run_shard()))
    runner.start()
    wait_until(lambda: q.progress(job)["rollouts"] >= 4, 60, what="some rollouts recorded")
    # The spike: 8 live requests at once, four times one replica's target: panic, reclaim at once.
    fleet.observe(12, 8, {"r0": 8, "r1": 0})
    decisions = fleet.decide(12)
    assert [(d.action, d.replica) for d in decisions] == [("reclaim", "r1")]
    live = [SamplingParams(max_tokens=6, ignore_eos=True)] * 8
    w.preempt()
    outs = eng.generate([tok.encode_prompt("def")] * 8, live)
    assert all(len(c.output_ids) == 6 and c.finish_reason == "length" for c in outs)  # no live request failed
    runner.join(60)
    (cut,) = result
    assert cut.why == "preempted" and not cut.finished and 4 <= cut.recorded < 32
    # Later, on another worker: only what is missing is done, each rollout once.
    later = LendingWorker(eng, q, "r0", lease_s=30, max_concurrency=4).run_shard()
    assert later.finished and cut.recorded + later.recorded == 32
    got = {(r.item, r.sample): (r.result["output_ids"], r.result["logprobs"]) for r in q.results(job)}
    assert got == served_live(eng, its)
    assert q.progress(job) == {"rollouts": 32, "wanted": 32, "shards_done": 1, "shards": 1}


def test_the_gateway_loop_lends_an_idle_replica_reclaims_it_for_a_spike_and_lends_it_again(world, tiny_checkpoint):
    from api.lending import LendingLoop
    from serving.fleet import Fleet

    eng0, q, tok = world
    eng1 = EmbeddedEngine(max_batch=4, max_model_len=128, seed=0)
    eng1.add_version("v1", tiny_checkpoint, default=True)
    engines = {"r0": eng0, "r1": eng1}
    fleet = Fleet([eng0, eng1])
    its = items(tok, 4, G=8)
    job = q.submit("rollout", "v1", its, samples_per_item=8, shard_size=4)
    cfg = LendingConfig(enabled=True, target_concurrency=2, lend_after_s=10, reclaim_after_s=1)
    loop = LendingLoop(fleet, lambda: engines, cfg, q)
    try:
        acts = [(d.action, d.replica) for t in range(12) for d in loop.step(t)]
        assert acts == [("lend", "r1"), ("lent", "r1")]  # the highest-named replica goes
        wait_until(lambda: q.progress(job)["rollouts"] >= 4, 60, what="the lent replica working")
        # A spike: 8 live requests in flight on the one serving replica (4x its target: panic).
        live = [
            fleet.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(8)
        ]
        assert fleet.live_in_flight(eng0) == 8 and fleet.live_in_flight(eng1) == 0  # none went to the lent one
        assert fleet.oldest_live_s(eng0) > 0 and fleet.oldest_live_s(eng1) == 0.0
        assert [(d.action, d.replica) for d in loop.step(12)] == [("reclaim", "r1")]
        more = [fleet.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(4)]
        done = [h.result() for h in live + more]  # every live request served
        assert all(c.finish_reason == "length" for c in done)
        assert fleet.live_in_flight(eng0) == fleet.live_in_flight(eng1) == 0
        assert fleet.oldest_live_s(eng0) == 0.0
        cut = q.progress(job)["rollouts"]
        assert cut < 32 and loop.counters()["preempted"] == 1
        # Quiet again: lent again after lend_after_s, and the job finishes, each rollout once.
        acts = [(d.action, d.replica) for t in range(13, 40) for d in loop.step(t)]
        assert acts == [("lend", "r1"), ("lent", "r1")]
        wait_until(lambda: q.job(job).status == "done", 120, what="the job done")
        got = {(r.item, r.sample): (r.result["output_ids"], r.result["logprobs"]) for r in q.results(job)}
        assert got == served_live(eng0, its)
        c = loop.counters()
        assert (c["lends"], c["reclaims"], c["panics"]) == (2, 1, 1) and c["lent_seconds"] > 0
    finally:
        loop.close()
        eng1.shutdown()


def test_a_lent_replica_is_asked_to_hold_the_version_an_open_job_needs_and_to_drop_it_when_reclaimed(
    world, tiny_checkpoint
):
    from api.lending import LendingLoop
    from serving.fleet import Fleet

    eng0, q, tok = world
    eng1 = EmbeddedEngine(max_batch=4, max_model_len=128, seed=0)
    eng1.add_version("v1", tiny_checkpoint, default=True)
    engines = {"r0": eng0, "r1": eng1}
    q.submit("eval", "v1", items(tok, 1, G=1), samples_per_item=1, shard_size=1)  # on a version it holds
    q.submit("eval", "v9", items(tok, 1, G=1), samples_per_item=1, shard_size=1)  # a candidate it lacks
    asked: list = []
    cfg = LendingConfig(enabled=True, target_concurrency=1, lend_after_s=3, reclaim_after_s=1)
    loop = LendingLoop(Fleet([eng0, eng1]), lambda: engines, cfg, q, prepare=lambda n, v, st: asked.append((n, v)))
    try:
        for t in range(5):
            loop.step(t)
        assert loop.manager.states["r1"] == "lent" and asked[-1] == ("r1", "v9")
        for _ in range(6):  # 6 long live requests on one serving replica of target 1: panic, reclaimed
            loop.fleet.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=100, ignore_eos=True))
        loop.step(5)
        assert loop.manager.states["r1"] == "serving" and asked[-1] == ("r1", None)
    finally:
        loop.close()
        eng1.shutdown()


def test_an_engine_that_does_not_preempt_for_live_work_needs_rollouts_capped_below_its_batch(world):
    # vLLM keeps a running rollout when a live request waits: the loop refuses, at start, a cap that
    # could fill such an engine's batch with lent work. Engines that preempt (embedded) take any cap.
    from api.lending import LendingLoop
    from serving.fleet import Fleet

    eng, q, _ = world

    class NoPreemption:
        max_batch, preempts_for_live = 16, False

    cfg = LendingConfig(enabled=True, max_rollout_concurrency=16)
    with pytest.raises(ValueError, match="max_rollout_concurrency=16 must be below replica r1's max_batch=16"):
        LendingLoop(Fleet([eng]), lambda: {"r0": eng, "r1": NoPreemption()}, cfg, q)
    LendingLoop(Fleet([eng]), lambda: {"r0": eng}, cfg.model_copy(update={"max_rollout_concurrency": 64}), q)
    LendingLoop(Fleet([eng]), lambda: {"r1": NoPreemption()}, cfg.model_copy(update={"max_rollout_concurrency": 8}), q)
    co = cfg.model_copy(update={"max_rollout_concurrency": 8, "co_serve": True})  # target 32: co-serving could fill 16
    with pytest.raises(
        ValueError, match="co_serve needs lending.target_concurrency=32 below replica r1's max_batch=16"
    ):
        LendingLoop(Fleet([eng]), lambda: {"r1": NoPreemption()}, co, q)
    LendingLoop(Fleet([eng]), lambda: {"r1": NoPreemption()}, co.model_copy(update={"target_concurrency": 8}), q)


def test_a_co_serving_worker_gives_way_to_live_requests_and_counts_every_rollout_once(world):
    """A serving replica's co-serving worker (`max_concurrency` a function: the slots live traffic
    leaves): when the room shrinks mid-shard its newest requests are cut and done again later; with no
    room the shard goes back; the job ends with every rollout once, equal to the live samples."""
    eng, q, tok = world
    its = items(tok, 8, G=4)  # 32 samples in one shard: long enough to change the room mid-shard
    job = q.submit("rollout", "v1", its, samples_per_item=4, shard_size=8)
    room = [3]  # start up to 3; cut down to 3 (a serving replica's fill and target, as one here)
    w = LendingWorker(eng, q, "r0", lease_s=30, max_concurrency=lambda: room[0], keep_at_most=lambda: room[0])
    result: list = []
    runner = threading.Thread(target=lambda: result.append(w.run_shard()))
    runner.start()
    wait_until(lambda: q.progress(job)["rollouts"] >= 2, 60, what="some co-served rollouts", interval_s=0.005)
    room[0] = 1  # live requests arrived: two of the three slots go back to them
    wait_until(
        lambda: w.counters["cut_for_live"] >= 1, 30, what="co-served requests cut for live ones", interval_s=0.005
    )
    room[0] = 0  # no room at all: the shard goes back
    runner.join(60)
    (first,) = result
    assert first.why == "no room" and not first.finished and first.recorded >= 2
    assert w.run_shard() is None  # no room: not even a lease
    room[0] = 2
    rest = w.run_shard()
    assert rest.finished and first.recorded + rest.recorded == 32
    got = {(r.item, r.sample): (r.result["output_ids"], r.result["logprobs"]) for r in q.results(job)}
    assert got == served_live(eng, its)
    assert q.progress(job) == {"rollouts": 32, "wanted": 32, "shards_done": 1, "shards": 1}


def test_the_gateway_loop_co_serves_in_the_slots_live_traffic_leaves(world):
    """`co_serve`: the serving replica works on the job beside its live requests, never past the target
    concurrency in all, and live requests are all served."""
    from api.lending import LendingLoop
    from serving.fleet import Fleet

    eng, q, tok = world
    fleet = Fleet([eng])
    its = items(tok, 4, G=8)
    job = q.submit("rollout", "v1", its, samples_per_item=8, shard_size=4)
    cfg = LendingConfig(
        enabled=True, target_concurrency=3, lend_after_s=10, reclaim_after_s=1, co_serve=True, co_serve_fill=1.0
    )
    loop = LendingLoop(fleet, lambda: {"r0": eng}, cfg, q)
    try:
        loop.step(0)  # one replica, min_serving 1: never lent, but it co-serves
        wait_until(lambda: q.progress(job)["rollouts"] >= 4, 60, what="co-served rollouts")
        live = [
            fleet.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=30, ignore_eos=True)) for _ in range(3)
        ]
        # Three live requests fill the target: the worker cuts its own within a few of its 5 ms looks.
        wait_until(lambda: loop.counters().get("cut_for_live", 0) >= 1, 30, what="co-served work cut for live work")
        assert all(h.result().finish_reason == "length" for h in live)
        wait_until(lambda: q.job(job).status == "done", 120, what="the job done once the live requests ended")
        assert q.progress(job)["rollouts"] == 32 and loop.manager.states == {"r0": "serving"}
        got = {(r.item, r.sample): (r.result["output_ids"], r.result["logprobs"]) for r in q.results(job)}
        assert got == served_live(eng, its)
    finally:
        loop.close()
