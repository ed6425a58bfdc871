"""The gate's eval sampling through the lending job queue (`gating.lent_eval.QueueEngine`): with a
lent replica taking shards and with none, the completions are those of the gate's engine generating
alone, bit for bit (seeded requests, batch-invariant kernels), in request order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gating.evals import sample_seed
from gating.lent_eval import QueueEngine
from registry.job_worker import LendingWorker
from registry.jobs import JobQueue
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams

TEXTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\n", "def", "# items of xs greater than 7\ndef f(xs):\n"]


@pytest.fixture
def parts(tiny_checkpoint, tmp_path):
    engines = []
    for _ in range(2):
        e = EmbeddedEngine(max_batch=8, max_model_len=128, seed=0)
        e.add_version("v1", tiny_checkpoint, default=True)
        engines.append(e)
    q = JobQueue(f"sqlite:///{tmp_path / 'registry.db'}")
    yield engines, q
    q.close()
    for e in engines:
        e.shutdown()


def requests(tok, n: int):
    ids = [tok.encode_prompt(TEXTS[i % len(TEXTS)]) for i in range(n)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=10, stop=("\n\n",), seed=sample_seed(0, TEXTS[i % 4], i))
        for i in range(n)
    ]
    return ids, params


def fields(cs) -> list:
    return [(c.version, c.prompt_ids, c.output_ids, c.logprobs, c.text, c.finish_reason, c.params) for c in cs]


@pytest.mark.parametrize(
    "gate_threads, lent", [(2, False), (0, True), (2, True)], ids=["gate-alone", "lent-replica-alone", "both"]
)
def test_queued_eval_samples_equal_the_gate_engine_alone(parts, gate_threads, lent):
    (gate_engine, replica), q = parts
    ids, params = requests(gate_engine.tokenizer(), 40)
    alone = gate_engine.generate(ids, params, "v1")
    stop = threading.Event()
    done_by_replica: list = []

    def lent_replica() -> None:
        w = LendingWorker(replica, q, "r1", kinds=("eval",))
        while not stop.is_set():
            run = w.run_shard()
            if run is not None and run.finished:
                done_by_replica.append(run.shard)
            elif run is None:
                stop.wait(0.01)

    t = threading.Thread(target=lent_replica, daemon=True)
    if lent:
        t.start()
    qe = QueueEngine(gate_engine, q, shard_size=4, threads=gate_threads)
    try:
        got = qe.generate(ids, params, "v1")
    finally:
        stop.set()
        if lent:
            t.join(30)
    assert fields(got) == fields(alone)  # bit for bit, whoever sampled it
    for c, a in zip(got, alone, strict=True):
        assert np.array_equal(c.routed_experts, a.routed_experts)
    assert qe.tokenizer() is gate_engine.tokenizer()
    assert qe.counters["shards_here"] + len(done_by_replica) == 10
    if not lent:
        assert qe.counters["shards_here"] == 10
    if gate_threads == 0:
        assert len(done_by_replica) == 10  # the lent replica did them all


def test_unseeded_requests_are_refused(parts):
    (gate_engine, _), q = parts
    with pytest.raises(ValueError, match="needs a seed on every request"):
        QueueEngine(gate_engine, q).generate([[1, 2]], [SamplingParams()], "v1")


def test_a_replica_serving_the_version_in_another_dtype_gives_eval_shards_back(parts, tiny_checkpoint):
    """The job records the dtype and kernels the gate samples with; a lent replica that serves the
    version otherwise (bfloat16 here) releases every eval shard it leases, counted, and the gate's own
    workers do them: the samples stay bit-identical to the gate's engine alone."""
    from serving.checkpoint import load_checkpoint

    (gate_engine, _), q = parts
    odd = EmbeddedEngine(max_batch=8, max_model_len=128, seed=0)
    try:
        odd.add_version(
            "v1", load_checkpoint(tiny_checkpoint).to(torch.bfloat16), gate_engine.tokenizer(), default=True
        )
        assert (odd.weights_dtype("v1"), gate_engine.weights_dtype("v1")) == ("bfloat16", "float32")
        ids, params = requests(gate_engine.tokenizer(), 8)
        alone = gate_engine.generate(ids, params, "v1")
        w = LendingWorker(odd, q, "r-bf16", kinds=("eval",))
        refused: list = []
        stop = threading.Event()

        def lent_replica() -> None:
            while not stop.is_set():
                run = w.run_shard()
                if run is not None:
                    refused.append(run.why)
                stop.wait(0.005)

        t = threading.Thread(target=lent_replica, daemon=True)
        t.start()
        qe = QueueEngine(gate_engine, q, shard_size=2, threads=1)
        try:
            got = qe.generate(ids, params, "v1")
        finally:
            stop.set()
            t.join(30)
        assert fields(got) == fields(alone) and qe.counters["shards_here"] == 4
        assert refused and set(refused) == {"numerics differ"} and w.counters["numerics_differ"] == len(refused)
        assert w.counters["rollouts"] == 0
    finally:
        odd.shutdown()
