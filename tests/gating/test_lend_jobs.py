"""The lending job queue (`registry.jobs`) on SQLite and PostgreSQL: shards under leases no two
workers hold at once, a shard cut short resumes with only what is missing, every rollout counts once
however often it is written, and done shards and jobs; bad input is refused by name."""

from __future__ import annotations

import threading

import pytest

from registry.jobs import JobQueue, LeaseLost
from tests.gating.test_registry import pg_database, url  # noqa: F401

G = 3  # samples per item


@pytest.fixture
def q(url):  # noqa: F811
    jobs = JobQueue(url)
    yield jobs
    jobs.close()


def rollouts(lease, pairs):
    return [(i, k, {"text": f"{lease.items[i]}#{k}"}) for i, k in pairs]


def test_a_shard_cut_short_resumes_elsewhere_and_every_rollout_counts_once(q):
    job = q.submit("eval", "v0007", [f"p{i}" for i in range(5)], samples_per_item=G, shard_size=2)
    assert q.progress(job) == {"rollouts": 0, "wanted": 15, "shards_done": 0, "shards": 3}
    a = q.lease("replica-a", lease_s=30, now=100)
    assert (a.job_id, a.shard, a.items, a.version_id, a.kind) == (job, 0, ["p0", "p1"], "v0007", "eval")
    assert len(a.todo) == 2 * G
    assert q.record(a, rollouts(a, a.todo[:4]), now=101) == 4
    q.release(a, now=102)  # reclaimed mid-shard
    b = q.lease("replica-b", lease_s=30, now=103)
    assert (b.shard, b.todo) == (0, a.todo[4:])  # only what is missing
    # replica-a finishes its copy anyway: nothing it wrote twice counts twice
    assert q.record(a, rollouts(a, a.todo), now=104) == 2
    assert q.record(b, rollouts(b, b.todo), now=105) == 0
    assert q.finish(b, now=106) is True
    with pytest.raises(LeaseLost):
        q.finish(a, now=106)
    for worker in ("c", "d"):
        lease = q.lease(worker, lease_s=30, now=107)
        q.record(lease, rollouts(lease, lease.todo), now=108)
        assert q.finish(lease, now=109)
    assert q.lease("e", lease_s=30, now=110) is None and q.job(job).status == "done"
    got = q.results(job)
    assert [(r.shard, r.item, r.sample) for r in got] == [
        (s, i, k) for s, n in ((0, 2), (1, 2), (2, 1)) for i in range(n) for k in range(G)
    ]
    assert {r.version_id for r in got} == {"v0007"}
    assert q.progress(job) == {"rollouts": 15, "wanted": 15, "shards_done": 3, "shards": 3}


def test_a_lease_is_held_by_one_worker_until_it_runs_out(q):
    job = q.submit("rollout", "v0008", ["only"], samples_per_item=2, shard_size=8, spec={"prompts": "demo"})
    a = q.lease("a", lease_s=10, now=0)
    assert a.spec == {"prompts": "demo"}
    assert q.lease("b", lease_s=10, now=5) is None  # held
    a = q.renew(a, lease_s=10, now=9)
    assert q.lease("b", lease_s=10, now=15) is None  # renewed to 19
    b = q.lease("b", lease_s=10, now=20)  # a's lease ran out (a dead replica)
    assert b is not None and b.job_id == job
    with pytest.raises(LeaseLost, match="a no longer holds shard 0"):
        q.renew(a, lease_s=10, now=21)
    assert q.finish(b, now=22) is False  # nothing recorded yet: not done


def test_racing_workers_never_share_a_shard(q):
    q.submit("eval", "v1", list(range(8)), samples_per_item=1, shard_size=1)
    got: list = []
    lock = threading.Lock()

    def work(name):
        while (lease := q.lease(name, lease_s=60)) is not None:
            with lock:
                got.append(lease.shard)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(8))


def test_kinds_cancelled_jobs_and_bad_input(q):
    ev = q.submit("eval", "v1", ["x"], samples_per_item=1, shard_size=1)
    ro = q.submit("rollout", "v1", ["y"], samples_per_item=1, shard_size=1)
    assert q.lease("w", 10, kinds=("rollout",), now=0).job_id == ro
    q.cancel(ev)
    assert q.lease("w", 10, now=0) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        q.submit("train", "v1", ["x"], 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one item"):
        q.submit("eval", "v1", [], 1, 1)
    with pytest.raises(ValueError, match="must be >= 1, got 0, 1"):
        q.submit("eval", "v1", ["x"], 0, 1)
    assert q.lease("w", 10, now=5) is None  # one shard held, the other's job cancelled
    assert q.lease("w2", 10, now=1000).job_id == ro  # the held one, once its lease ran out
    with pytest.raises(ValueError, match="no lending job 'nope'"):
        q.job("nope")
