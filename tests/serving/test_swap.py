"""Hot swap (`serving.swap`) under live traffic, and the version table's rules (`serving.versions`)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.scoring import score
from serving.swap import hot_swap
from serving.versions import VersionBusy, VersionTable


def test_a_swap_under_traffic_loses_no_request_and_mixes_no_weights(tiny_checkpoint):
    """Submitters that name no version keep going while the default is swapped twice: every request
    completes, on the version it names, with exactly that version's log-probs."""
    v1 = load_checkpoint(tiny_checkpoint)
    v2, v3 = load_checkpoint(tiny_checkpoint), load_checkpoint(tiny_checkpoint)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in (v2, v3):
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    eng = EmbeddedEngine(max_batch=4, max_model_len=128)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        prompt = tok.encode_prompt("# add 3 to x\ndef f(x):\n")
        done: list = []
        errors: list = []
        stop = threading.Event()

        def traffic(k: int) -> None:
            for i in itertools.count():
                last = stop.is_set()  # one more request once the swaps are over: it goes to v3
                try:
                    done.append(eng.submit(prompt, SamplingParams(max_tokens=16, seed=k * 1000 + i)).result())
                except Exception as e:  # any failure is what this test looks for
                    errors.append(e)
                if last:
                    return

        threads = [threading.Thread(target=traffic, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        swaps = [hot_swap(eng, "v2", v2, tok), hot_swap(eng, "v3", v3, tok)]
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors
        assert [(s.old, s.new) for s in swaps] == [("v1", "v2"), ("v2", "v3")]
        assert all(s.swap_s > 0 and s.drain_s >= 0 for s in swaps)
        assert eng.versions == ["v3"]
        weights = {"v1": v1, "v2": v2, "v3": v3}
        assert "v3" in {c.version for c in done}
        for c in done:
            lp, _ = score(weights[c.version], c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
            assert torch.equal(lp, torch.tensor(c.logprobs)), c.version
        with pytest.raises(ValueError, match="already the default"):
            hot_swap(eng, "v3", v3, tok)
    finally:
        eng.shutdown()


def test_the_version_table_rules():
    t: VersionTable[str] = VersionTable()
    with pytest.raises(KeyError, match="not loaded"):
        t.acquire(None)
    t.add("a", "weights-a")
    t.add("b", "weights-b")
    assert t.default == "a" and t.names() == ["a", "b"]
    with pytest.raises(ValueError, match="already loaded"):
        t.add("a", "again")
    assert t.acquire(None) == ("a", "weights-a")  # bound to the default of that moment
    t.set_default("b")
    assert t.acquire(None)[0] == "b" and t.in_flight("a") == 1
    with pytest.raises(VersionBusy, match="in flight"):
        with t.exclusive("a"):
            pass
    with pytest.raises(ValueError, match="is the default"):
        t.retire("b")
    unloaded = t.retire("a")
    assert t.retire("a") is unloaded  # again: the same wait
    with pytest.raises(KeyError, match="retired"):
        t.acquire("a")
    with pytest.raises(KeyError, match="retired"):
        t.set_default("a")
    with pytest.raises(ValueError, match="retiring"):
        t.add("a", "again")
    assert t.get("a") == "weights-a" and t.idle_retired() == []  # still loaded: one request in flight
    assert t.release("a") and t.idle_retired() == ["a"]
    assert t.drop("a") == "weights-a" and unloaded.is_set() and t.names() == ["b"]
    t.release("b")
    with t.exclusive("b") as w:  # idle: an in-place change is allowed, new requests wait for it
        assert w == "weights-b"
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(t.acquire("b")))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not got
    waiter.join(5)
    assert got == [("b", "weights-b")]
