"""The embedded engine: continuous batching, exact logprobs and routing, seeds, stops, versions, hot swaps."""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import weakref

import numpy as np
import pytest
import torch

from core.harness import wait_until
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.scoring import score, score_many
from serving.tokenizer import Tokenizer
from serving.versions import VersionBusy
from tests.conftest import assert_close_ulps


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=4, max_model_len=128, seed=0)
    eng.add_version("v1", tiny_checkpoint, default=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    texts = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\n", "def", "# items of xs greater than 7\ndef f(xs):\n"]
    return [tok.encode_prompt(texts[i % len(texts)] * (1 + i % 3)) for i in range(n)]


def assert_matches_full_forward(model, tok, c):
    lp, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
    # Batch-invariant numerics (the default): exact, whatever shared the decode steps.
    assert torch.equal(lp, torch.tensor(c.logprobs)), (lp - torch.tensor(c.logprobs)).abs().max()
    assert c.routed_experts.dtype == np.uint8
    assert c.routed_experts.shape == (len(c.prompt_ids) + len(c.output_ids) - 1, model.args.n_layers, model.args.top_k)
    assert np.array_equal(c.routed_experts, experts.numpy())


def test_continuous_batching_from_many_threads_matches_full_forward(engine, model):
    tok = engine.tokenizer()
    ps = prompts(tok, 10)  # more requests than the 4 slots: they queue and join as slots free up
    variants = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=15),
        SamplingParams(temperature=1.3, max_tokens=30),
    ]
    results = [None] * len(ps)

    def worker(i):
        results[i] = engine.submit(ps[i], variants[i % 4]).result()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    assert len({r.request_id for r in results}) == len(ps)
    for r in results:
        assert r.finish_reason in ("stop", "length") and r.version == "v1"
        assert 1 <= len(r.output_ids) <= r.params.max_tokens
        assert_matches_full_forward(model, tok, r)
        if r.params.greedy:  # the model's own log-probabilities, as OpenAI and vLLM report them at temperature 0
            assert all(lp <= 0.0 for lp in r.logprobs) and any(lp < 0.0 for lp in r.logprobs)


def test_recorded_logprobs_are_bit_identical_to_a_full_forward(engine, model):
    """Batch-invariant numerics (the default): whatever shared the decode steps, a completion's recorded
    log-probabilities equal a lone full forward's bit for bit (mixed temperatures and top-p in one batch)."""
    tok = engine.tokenizer()
    ps = prompts(tok, 9)
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, seed=i)
        if i % 3
        else SamplingParams(temperature=0.8, top_p=0.7, max_tokens=30, seed=i)
        for i in range(len(ps))
    ]
    for c in engine.generate(ps, params):
        lp, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
        assert torch.equal(lp, torch.tensor(c.logprobs)), (lp - torch.tensor(c.logprobs)).abs().max()
        assert np.array_equal(c.routed_experts, experts.numpy())


def test_scoring_many_at_once_equals_scoring_each_alone(engine, model):
    """`score_many` (padded batches, as the gate's scorer runs) gives every completion its lone `score`
    bit for bit, whatever the lengths and sampling settings of its batch mates, and the recorded values."""
    tok = engine.tokenizer()
    ps = prompts(tok, 7)
    params = [
        SamplingParams(temperature=1.0 if i % 2 else 0.7, top_p=1.0 if i % 3 else 0.8, max_tokens=4 + 5 * i, seed=i)
        for i in range(len(ps))
    ]
    outs = engine.generate(ps, params)
    many = score_many(
        model, [(c.prompt_ids, c.output_ids, c.params) for c in outs], n_vocab=tok.vocab_size, micro_batch=3
    )
    for c, lp in zip(outs, many, strict=True):
        alone, _ = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
        assert torch.equal(lp, alone) and torch.equal(lp, torch.tensor(c.logprobs))
    with pytest.raises(ValueError, match="micro_batch"):
        score_many(model, [], micro_batch=0)


def test_default_kernels_are_still_available(tiny_checkpoint, model):
    eng = EmbeddedEngine(max_batch=4, max_model_len=128, batch_invariant=False)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        for c in eng.generate(prompts(tok, 5), SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3)):
            lp, _ = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size, batch_invariant=False)
            # The default kernels reduce in an order that depends on the batch: rounding only (1 ulp seen).
            assert_close_ulps(lp, torch.tensor(c.logprobs), 16, "logprobs")
    finally:
        eng.shutdown()


def test_a_rows_sampling_logprobs_do_not_depend_on_its_batch_mates():
    from serving.sampling import sampling_logprobs

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.0, 1.0])
    top_ps = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.95])
    together = sampling_logprobs(logits, temps, top_ps)
    for i in range(6):
        alone = sampling_logprobs(logits[i : i + 1], temps[i : i + 1], top_ps[i : i + 1])
        assert torch.equal(alone[0], together[i]), i


def test_seed_gives_same_tokens_whatever_the_batch(engine):
    tok = engine.tokenizer()
    p = prompts(tok, 1)[0]
    alone = engine.generate([p], SamplingParams(max_tokens=25, seed=11))[0]
    crowd = engine.generate(
        [p] + prompts(tok, 5), [SamplingParams(max_tokens=25, seed=11)] + [SamplingParams(max_tokens=25)] * 5
    )[0]
    assert alone.output_ids == crowd.output_ids and alone.logprobs == crowd.logprobs  # batch-invariant: exact
    other = engine.generate([p], SamplingParams(max_tokens=25, seed=12))[0]
    assert other.output_ids != alone.output_ids


def test_stop_strings_cut_the_text(engine):
    tok = engine.tokenizer()
    p = prompts(tok, 1)[0]
    full = engine.generate([p], SamplingParams(temperature=0, max_tokens=30))[0]
    assert len(full.text) > 6
    stop = full.text[3:5]
    cut = engine.generate([p], SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]


def test_streaming_deltas_add_up_and_async_works(engine):
    tok = engine.tokenizer()
    p = prompts(tok, 1)[0]
    events = list(engine.submit(p, SamplingParams(max_tokens=20, seed=2)))
    final = events[-1].completion
    assert "".join(e.text for e in events) == final.text
    assert sum(len(e.token_ids) for e in events) == len(final.output_ids)

    async def many():
        hs = [engine.submit(q, SamplingParams(max_tokens=10, seed=2)) for q in prompts(tok, 6)]
        return await asyncio.gather(*(h.aresult() for h in hs))

    outs = asyncio.run(many())
    assert len(outs) == 6 and outs[0].output_ids == final.output_ids[:10]


def test_cancel_aborts_and_frees_the_slot(engine):
    tok = engine.tokenizer()
    h = engine.submit(prompts(tok, 1)[0], SamplingParams(max_tokens=100, temperature=1.0))
    it = iter(h)
    next(it)
    h.cancel()
    last = list(it)[-1].completion
    assert last.finish_reason == "abort" and len(last.output_ids) < 100
    # all slots usable again
    assert len(engine.generate(prompts(tok, 4), SamplingParams(max_tokens=3))) == 4


def test_versions_and_weight_updates(tiny_checkpoint, model):
    eng = EmbeddedEngine(max_batch=2, max_model_len=128)
    try:
        eng.add_version("a", tiny_checkpoint, default=True)
        other = load_checkpoint(tiny_checkpoint)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        eng.add_version("b", other, tokenizer=eng.tokenizer("a"))
        p = prompts(eng.tokenizer(), 1)[0]
        sp = SamplingParams(max_tokens=20, seed=4)
        a, b = eng.generate([p], sp, "a")[0], eng.generate([p], sp, "b")[0]
        assert a.version == "a" and b.version == "b" and a.logprobs != b.logprobs
        with pytest.raises(KeyError, match="not loaded"):
            eng.submit(p, sp, "c")
        with pytest.raises(ValueError, match="already loaded"):
            eng.add_version("a", tiny_checkpoint)
        eng.update_weights("a", other.state_dict())
        assert eng.generate([p], sp, "a")[0].logprobs == b.logprobs  # the same weights and kernels: exact
        with pytest.raises(RuntimeError):
            eng.update_weights("a", {"bogus": torch.zeros(1)})
        assert eng.alive  # a refused update does not kill the engine
        eng.retire_version("b")
        assert eng.versions == ["a"]
    finally:
        eng.shutdown()


def test_a_version_loaded_on_the_loop_thread_keeps_its_expert_transposes_across_weight_updates(tiny_checkpoint):
    """The engine process loads versions on the loop thread, inside its inference mode: the weights must
    still be normal tensors, so that the experts' kept transposes are used (not made afresh in every
    pass, `fresh_transposes`) and are made again after an in-place `update_weights`."""
    from serving import batch_invariant

    eng = EmbeddedEngine(max_batch=2, max_model_len=128)
    try:
        eng.call_in_loop(lambda: eng.add_version("a", tiny_checkpoint, default=True))
        other = load_checkpoint(tiny_checkpoint)
        with torch.no_grad():
            for w in other.parameters():
                w.add_(torch.randn_like(w) * 0.05)
        eng.add_version("b", other, tokenizer=eng.tokenizer("a"))
        before = batch_invariant.fresh_transposes
        p = prompts(eng.tokenizer(), 1)[0]
        sp = SamplingParams(max_tokens=20, seed=4)
        a = eng.generate([p], sp, "a")[0]
        eng.update_weights("a", other.state_dict())
        updated, b = eng.generate([p], sp, "a")[0], eng.generate([p], sp, "b")[0]
        assert updated.logprobs == b.logprobs and updated.logprobs != a.logprobs
        assert batch_invariant.fresh_transposes == before
    finally:
        eng.shutdown()


def test_both_backends_implement_the_interface(engine):
    from serving.interface import Engine
    from serving.vllm_engine import VLLMEngine

    assert isinstance(engine, Engine)
    missing = [
        m
        for m in (
            "add_version",
            "retire_version",
            "update_weights",
            "submit",
            "generate",
            "tokenizer",
            "context_length",
            "shutdown",
            "versions",
            "alive",
        )
        if not hasattr(VLLMEngine, m)
    ]
    assert not missing


def test_bad_requests_raise_value_errors(engine):
    tok = engine.tokenizer()
    with pytest.raises(ValueError, match="context"):
        engine.submit(tok.encode_prompt("x" * 10), SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([10**6], SamplingParams())
    for bad in [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(stop=("",)), dict(logprobs=50)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- hot swap -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_v2(tiny_checkpoint):
    """Other weights of the same shapes: version v2."""
    m = load_checkpoint(tiny_checkpoint)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def delivered(h) -> list:
    """The events already posted to a (sync) handle, without waiting for more."""
    events = []
    while True:
        try:
            events.append(h._q.get_nowait())
        except queue.Empty:
            return events


class Paused:
    """Holds the engine's loop between two steps (a call on its loop thread that waits)."""

    def __init__(self, eng):
        self.entered, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=eng.call_in_loop, args=(self._hold,))

    def _hold(self):
        self.entered.set()
        self.release.wait(30)

    def __enter__(self):
        self.thread.start()
        assert self.entered.wait(10)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(10)


def assert_exactly_from(model, tok, c):
    lp, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
    assert torch.equal(lp, torch.tensor(c.logprobs)), (lp - torch.tensor(c.logprobs)).abs().max()
    assert np.array_equal(c.routed_experts, experts.numpy())


def test_swapping_the_default_mid_stream_keeps_every_completion_on_its_version(tiny_checkpoint, model, model_v2):
    eng = EmbeddedEngine(max_batch=4, max_model_len=128)
    try:
        eng.add_version("v1", tiny_checkpoint, default=True)
        tok = eng.tokenizer()
        v1_weights = weakref.ref(eng._table.get("v1").model)
        ps = prompts(tok, 3)
        long = [
            SamplingParams(max_tokens=128 - len(p), temperature=1.0, seed=i, ignore_eos=True) for i, p in enumerate(ps)
        ]
        old = [eng.submit(p, sp) for p, sp in zip(ps, long)]
        seen = [[next(iter(h))] for h in old]  # all three admitted and decoding on v1
        with Paused(eng):  # between two decode steps, the v1 requests mid-stream
            for h, evs in zip(old, seen):
                evs += delivered(h)
                assert evs[-1].completion is None
            eng.add_version("v2", model_v2, tokenizer=tok)  # beside v1
            eng.set_default("v2")
            eng.retire_version("v1", wait=False)
            new = [eng.submit(p, SamplingParams(max_tokens=12, seed=10 + i)) for i, p in enumerate(ps)]
            with pytest.raises(KeyError, match="retired"):
                eng.submit(ps[0], SamplingParams(max_tokens=4), version="v1")
            assert eng.versions == ["v1", "v2"] and eng._table.in_flight("v1") == 3
            before = [sum(len(e.token_ids) for e in evs) for evs in seen]
        eng.retire_version("v1")  # returns once v1's last request has ended and v1 is unloaded
        assert eng.versions == ["v2"] and eng.default_version == "v2"
        for h, evs, n, sp in zip(old, seen, before, long):
            evs += delivered(h)  # already there: delivered before v1 went
            c = evs[-1].completion
            assert c is not None and c.version == "v1" and len(c.output_ids) == sp.max_tokens > n
            assert [t for e in evs for t in e.token_ids] == c.output_ids
            assert_exactly_from(model, tok, c)
        for c in (h.result() for h in new):
            assert c.version == "v2"
            assert_exactly_from(model_v2, tok, c)
            assert not torch.equal(
                score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)[0], torch.tensor(c.logprobs)
            )
        gc.collect()
        assert v1_weights() is None  # its model (and cache) released
        with pytest.raises(KeyError, match="not loaded"):
            eng.submit(ps[0], SamplingParams(max_tokens=4), version="v1")
    finally:
        eng.shutdown()


def test_no_in_place_update_under_running_requests(tiny_checkpoint, model, model_v2):
    eng = EmbeddedEngine(max_batch=2, max_model_len=128)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        errors = []

        def update():
            try:
                eng.update_weights("v1", model_v2.state_dict())
            except VersionBusy as e:
                errors.append(e)

        with Paused(eng):  # the update runs before the request's first step: it is in flight then
            h = eng.submit(prompts(tok, 1)[0], SamplingParams(max_tokens=40, seed=1))
            updater = threading.Thread(target=update)
            updater.start()
            wait_until(
                lambda: eng._commands.qsize() > 0, 10, what="the update queued behind the pause", interval_s=0.001
            )
        updater.join(10)
        assert len(errors) == 1 and "in flight" in str(errors[0]) and "add_version" in str(errors[0])
        assert_exactly_from(model, tok, h.result())  # served by v1's weights throughout
        eng.update_weights("v1", model_v2.state_dict())  # idle now: allowed
        assert_exactly_from(model_v2, tok, eng.generate(prompts(tok, 1), SamplingParams(max_tokens=8, seed=1))[0])
        with pytest.raises(ValueError, match="default"):
            eng.retire_version("v1")
        with pytest.raises(KeyError, match="not loaded"):
            eng.set_default("v9")
    finally:
        eng.shutdown()


def test_every_version_admits_before_any_decodes(tiny_checkpoint, model_v2):
    """A new request's first token waits for no other version's decode step: requests for two versions
    that arrive together are both prefilled before either version decodes (a canary's arm would
    otherwise wait behind the incumbent's decode, a latency 'harm' of scheduling, not of its model)."""
    eng = EmbeddedEngine(max_batch=4, max_model_len=128)
    calls: list[tuple[str, str]] = []
    passes: list[int] = []  # steps per pass of a model: two versions loaded never fuse, busy or not
    patched = []
    try:
        eng.add_version("a", tiny_checkpoint, default=True)
        tok = eng.tokenizer()
        eng.add_version("b", model_v2, tokenizer=tok)
        for name in ("a", "b"):
            m = eng._table.get(name).model
            fwd = m.forward_steps

            def recorded(steps, *args, _fwd=fwd, _name=name, **kw):
                passes.append(len(steps))
                calls.extend((_name, "prefill" if st.tokens_BT.shape[1] > 1 else "decode") for st in steps)
                return _fwd(steps, *args, **kw)

            m.forward_steps = recorded
            patched.append(m)
        ps = prompts(tok, 2)
        assert min(len(p) for p in ps) > 1  # a prefill is told from a decode step by its length
        running = eng.submit(ps[0], SamplingParams(max_tokens=100, ignore_eos=True, seed=1), "a")
        next(iter(running))  # admitted, decoding on a
        with Paused(eng):
            calls.clear()
            new_b = eng.submit(ps[1], SamplingParams(max_tokens=4, seed=2), "b")
            new_a = eng.submit(ps[1], SamplingParams(max_tokens=4, seed=3), "a")
        assert new_b.result().version == "b" and new_a.result().version == "a"
        assert calls[:4] == [("b", "prefill"), ("a", "prefill"), ("a", "decode"), ("b", "decode")], calls[:6]
        assert passes and set(passes) == {1}, passes
        running.cancel()
    finally:
        for m in patched:
            del m.forward_steps  # the module's own again (model_v2 is shared by the module's tests)
        eng.shutdown()


def test_one_version_prefills_new_prompts_in_the_pass_that_decodes_the_running_ones(tiny_checkpoint):
    """With one version loaded, an engine step is one pass of the model: the prompts admitted now and
    the running sequences' next tokens together; every token is still exactly the full forward's."""
    eng = EmbeddedEngine(max_batch=4, max_model_len=128)
    passes: list[list[str]] = []
    try:
        eng.add_version("a", tiny_checkpoint, default=True)
        tok = eng.tokenizer()
        m = eng._table.get("a").model
        fwd = m.forward_steps

        def recorded(steps, *args, **kw):
            passes.append(["prefill" if st.tokens_BT.shape[1] > 1 else "decode" for st in steps])
            return fwd(steps, *args, **kw)

        m.forward_steps = recorded
        ps = prompts(tok, 2)
        running = eng.submit(ps[0], SamplingParams(max_tokens=20, ignore_eos=True, seed=1), "a")
        stream = iter(running)
        next(stream)  # admitted: decoding from now on
        with Paused(eng):
            passes.clear()
            new = eng.submit(ps[1], SamplingParams(max_tokens=6, ignore_eos=True, seed=2), "a")
        done = new.result()
        assert passes[0] == ["prefill", "decode"], passes[:3]
        assert all(p == ["decode"] for p in passes[1:3]), passes[:3]
        assert_exactly_from(m, tok, done)
        assert_exactly_from(m, tok, running.result())
    finally:
        eng.shutdown()
