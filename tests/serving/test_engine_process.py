"""The engine in its own process: same results as a full forward pass, streaming, cancel, failures, hot swap."""

import asyncio
import os
import signal

import numpy as np
import pytest
import torch

from core.harness import wait_until
from serving.checkpoint import load_checkpoint, save_checkpoint
from serving.engine_process import ProcessEngine
from serving.requests import EngineError
from serving.sampling import SamplingParams
from serving.scoring import score
from serving.swap import hot_swap
from serving.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = ProcessEngine(max_batch=4, max_model_len=128, threads=1)
    eng.add_version("v1", tiny_checkpoint, default=True)
    yield eng
    eng.shutdown()


def test_results_match_a_full_forward(engine, tiny_checkpoint):
    tok = engine.tokenizer()
    model = load_checkpoint(tiny_checkpoint)
    prompts = [tok.encode_prompt(t) for t in ["# add 3 to x\ndef f(x):\n", "def", "# count 'a' in s\n"] * 3]
    params = [SamplingParams(max_tokens=12, seed=i, temperature=0.8, top_p=0.9) for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    for c in outs:
        lp, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
        assert torch.equal(lp, torch.tensor(c.logprobs))  # batch-invariant numerics (the default): exact
        assert np.array_equal(c.routed_experts, experts.numpy())
    again = engine.generate(prompts[:1], params[:1])[0]
    assert again.output_ids == outs[0].output_ids
    assert engine.weights_dtype() == "float32"  # as the child serves it (lent eval shards compare it)


def test_streaming_cancel_and_bad_input(engine):
    tok = engine.tokenizer()
    events = list(engine.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=10, seed=1)))
    assert "".join(e.text for e in events) == events[-1].completion.text
    h = engine.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=100, temperature=1.0))
    it = iter(h)
    next(it)
    h.cancel()
    assert h.cancelled and list(it)[-1].completion.finish_reason in ("abort", "length", "stop")
    with pytest.raises(ValueError, match="context"):
        engine.submit(tok.encode_prompt("x"), SamplingParams(max_tokens=500))
    with pytest.raises(KeyError):
        engine.submit([1, 2], SamplingParams(), version="nope")


def test_a_dead_engine_process_fails_loudly(tiny_checkpoint):
    eng = ProcessEngine(max_batch=2, max_model_len=128, threads=1)
    eng.add_version("v1", tiny_checkpoint)
    tok = eng.tokenizer()
    h = eng.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=100, ignore_eos=True))
    os.kill(eng._proc.pid, signal.SIGKILL)
    with pytest.raises(EngineError):
        h.result()
    wait_until(lambda: not eng.alive, 10, what="the engine proxy noticing its process died")
    with pytest.raises(EngineError):
        eng.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=4))
    eng.shutdown()


@pytest.fixture(scope="module")
def checkpoint_v2(tiny_checkpoint, tmp_path_factory):
    """Other weights of the same shapes, in a folder: version v2."""
    m = load_checkpoint(tiny_checkpoint)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-v2"
    save_checkpoint(m, folder, tokenizer=Tokenizer.from_file(tiny_checkpoint))
    return folder


def test_hot_swap_over_the_pipe_keeps_every_completion_on_its_version(tiny_checkpoint, checkpoint_v2):
    eng = ProcessEngine(max_batch=4, max_model_len=128, threads=1)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        ps = [tok.encode_prompt(t) for t in ["# add 3 to x\ndef f(x):\n", "def", "# count 'a' in s\n"]]
        long = [
            SamplingParams(max_tokens=128 - len(p), temperature=1.0, seed=i, ignore_eos=True) for i, p in enumerate(ps)
        ]
        old = [eng.submit(p, sp) for p, sp in zip(ps, long)]
        for h in old:
            next(iter(h))  # decoding on v1
        swap = hot_swap(eng, "v2", checkpoint_v2, wait=False)  # v2 loads beside v1, takes the new requests
        in_flight = sum(h.request_id in eng._handles for h in old)
        new = [eng.submit(p, SamplingParams(max_tokens=12, seed=10 + i)) for i, p in enumerate(ps)]
        with pytest.raises(KeyError, match="retired"):
            eng.submit(ps[0], SamplingParams(max_tokens=4), version="v1")
        assert swap.old == "v1" and eng.default_version == "v2" and in_flight > 0
        eng.retire_version("v1")  # already retiring: waits until the child has unloaded it
        assert eng.versions == ["v2"]
        assert not any(h.request_id in eng._handles for h in old)  # their last events came first
        v1, v2 = load_checkpoint(tiny_checkpoint), load_checkpoint(checkpoint_v2)
        for model, name, handles in ((v1, "v1", old), (v2, "v2", new)):
            done = [h.result() for h in handles]
            assert {c.version for c in done} == {name}
            if name == "v1":  # they ran on across the swap
                assert [len(c.output_ids) for c in done] == [sp.max_tokens for sp in long]
            for c in done:
                lp, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
                assert torch.equal(lp, torch.tensor(c.logprobs)), (lp - torch.tensor(c.logprobs)).abs().max()
                assert np.array_equal(c.routed_experts, experts.numpy())
        with pytest.raises(KeyError, match="not loaded"):
            eng.submit(ps[0], SamplingParams(max_tokens=4), version="v1")
        with pytest.raises(ValueError, match="default"):
            eng.retire_version("v2")
    finally:
        eng.shutdown()


def test_background_requests_pass_through_and_a_reclaim_preempts_them(engine):
    tok = engine.tokenizer()
    p = tok.encode_prompt("def")

    async def main():
        bg = engine.submit(p, SamplingParams(max_tokens=120, ignore_eos=True), background=True)
        first = None
        async for ev in bg:
            first = first or ev.token_ids
            if first:
                break  # it runs
        n = await asyncio.to_thread(engine.preempt_background)
        last = None
        async for ev in bg:
            last = ev
        return n, last.completion

    n, done = asyncio.run(main())
    assert n == 1 and done.finish_reason == "preempted" and 0 < len(done.output_ids) < 120
    assert engine.preempt_background() == 0


def test_submits_of_one_loop_round_go_together_and_a_cancel_never_overtakes_them(engine):
    """On an event loop, submits wait for the end of the loop's round and go out as one message; a
    cancel made in the same round is sent after them, so it reaches a request the child knows."""
    tok = engine.tokenizer()
    p = tok.encode_prompt("def")
    long = SamplingParams(max_tokens=120, ignore_eos=True)

    async def main():
        handles = [engine.submit(p, SamplingParams(max_tokens=6, seed=i)) for i in range(3)]
        assert len(engine._outbox) == 3  # not sent yet: the round is not over
        doomed = engine.submit(p, long)
        doomed.cancel()  # in the same round: the outbox goes first
        assert not engine._outbox
        kept = [await h.aresult() for h in handles]
        return kept, await doomed.aresult()

    kept, cancelled = asyncio.run(main())
    assert [len(c.output_ids) > 0 for c in kept] == [True] * 3
    assert cancelled.finish_reason == "abort" and len(cancelled.output_ids) < 120
    assert engine.generate([p], SamplingParams(max_tokens=4, seed=1))[0].output_ids  # no loop: sent at once


def test_an_engine_process_runs_at_the_niceness_asked_for(tiny_checkpoint):
    """`[gateway] engine_nice`: the engine process, not its parent, gives the CPU to the processes beside it."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    eng = ProcessEngine(max_batch=2, max_model_len=128, threads=1, nice=5)
    try:
        eng.add_version("v1", tiny_checkpoint, default=True)  # answered: the child is past its start
        assert eng.pid is not None
        assert os.getpriority(os.PRIO_PROCESS, eng.pid) == min(mine + 5, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="nice=20"):
        ProcessEngine(nice=20)
