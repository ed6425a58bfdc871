"""The engine in its own process: same results as a full forward pass, streaming, cancel, failures."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from serving.checkpoint import load_checkpoint
from serving.engine import EngineError, score
from serving.engine_process import ProcessEngine
from serving.sampling import SamplingParams


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
        assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-5)
        assert np.array_equal(c.routed_experts, experts.numpy())
    again = engine.generate(prompts[:1], params[:1])[0]
    assert again.output_ids == outs[0].output_ids


def test_streaming_cancel_and_bad_input(engine):
    tok = engine.tokenizer()
    events = list(engine.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=10, seed=1)))
    assert "".join(e.text for e in events) == events[-1].completion.text
    h = engine.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=100, temperature=1.0))
    it = iter(h)
    next(it)
    h.cancel()
    assert list(it)[-1].completion.finish_reason in ("abort", "length", "stop")
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
    deadline = time.time() + 10
    while eng.alive and time.time() < deadline:
        time.sleep(0.05)
    assert not eng.alive
    with pytest.raises(EngineError):
        eng.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=4))
    eng.shutdown()
