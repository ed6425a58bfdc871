"""The offline eval (`gating.evals`) and its suites (`product.suites`, `demo.suite`), on the tiny checkpoint.

The outcomes are controlled: the test verifier scores a completion "GOOD" 1, "BAD" 0 and anything else
0.5, and `Rewrite` wraps the real engine to change one version's completions (texts, token ids), so each
test moves exactly the numbers it is about. Tiny sizes: 16 prompts in 4 families, G=2, 8 tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

from demo.split import split_tasks
from demo.suite import GATE_PROMPTS, demo_suite, python_parses
from demo.tasks import completions_for
from gating.evals import Guardrails, ModelScorer, evaluate_offline, has_loop, sample_seed
from product.suites import EvalSuite, SuiteItem, Verifier
from registry.models import OfflineVerdict
from serving.checkpoint import save_checkpoint
from serving.engine import EmbeddedEngine
from serving.model import ModelArgs, Transformer
from serving.tokenizer import Tokenizer
from tests.conftest import approx_ulps

FAMILIES = ("add", "mul", "count", "max_default")


class Marks:
    """GOOD 1, BAD 0, anything else 0.5: only a rewritten completion moves a score."""

    def verify(self, prompts, completions):
        if len(prompts) != len(completions):
            raise ValueError("lengths differ")
        return [1.0 if c == "GOOD" else 0.0 if c == "BAD" else 0.5 for c in completions]


def make_suite(**kw) -> EvalSuite:
    items = [SuiteItem(t.prompt, t.family) for t in split_tasks("gate", 4 * len(FAMILIES), FAMILIES)]
    return EvalSuite("test-suite", "1", tuple(items), Marks(), **kw)


SUITE = make_suite()
FAMILY_OF = {it.prompt: it.family for it in SUITE.items}


class Rewrite:
    """The engine, with `version`'s completions passed through `fn(completion, family, index)`."""

    def __init__(self, engine, version, fn):
        self.engine, self.version, self.fn = engine, version, fn

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, params, version=None):
        outs = self.engine.generate(prompt_ids, params, version)
        if version != self.version:
            return outs
        tok = self.engine.tokenizer(version)
        family = {tuple(tok.encode_prompt(p)): f for p, f in FAMILY_OF.items()}
        return [self.fn(c, family[tuple(c.prompt_ids)], i) for i, c in enumerate(outs)]


def text(value):
    return lambda c, family, i: dataclasses.replace(c, text=value(family, i) if callable(value) else value)


@pytest.fixture(scope="module")
def other_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny architecture with other random weights (same tokenizer)."""
    folder = tmp_path_factory.mktemp("other") / "tiny-other"
    tok = Tokenizer.from_file(tiny_checkpoint)
    args = ModelArgs.from_name(
        "tiny", dim=64, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=tok.vocab_size,
        bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, max_seq_len=128,
    )  # fmt: skip
    save_checkpoint(Transformer(args).init_weights(seed=1, std=0.05), folder, tokenizer=tok)
    return folder


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, other_checkpoint):
    eng = EmbeddedEngine(max_batch=64, max_model_len=128)
    eng.add_version("inc", tiny_checkpoint)
    eng.add_version("cand", tiny_checkpoint)  # the same weights under another name
    eng.add_version("other", other_checkpoint)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return ModelScorer({"inc": tiny_checkpoint})


def run(engine, scorer, candidate="cand", suite=SUITE, **kw):
    kw = {"G": 2, "max_tokens": 8, "seed": 3, **kw}
    return evaluate_offline(engine, candidate, "inc", suite, scorer=scorer, **kw)


@pytest.mark.slow  # a whole offline evaluation, as the next one
def test_an_identical_candidate_passes_with_every_number(engine, scorer):
    r = run(engine, scorer)
    n = r.numbers
    assert r.passed and r.failed == [] and all(n["checks"].values())
    assert n["non_inferiority"]["mean_diff"] == 0.0 and n["non_inferiority"]["n_prompts"] == 16
    assert n["guardrails"]["kl"]["per_token"] == 0.0 and n["guardrails"]["kl"]["n_tokens"] > 16
    assert n["guardrails"]["length"]["ratio"] == 1.0
    assert set(n["families"]) == set(FAMILIES) and all(f["passed"] for f in n["families"].values())
    assert n["bootstrap"]["method"] == "paired_bootstrap" and n["in_distribution"] is False
    assert n["suite"]["sha256"] == SUITE.sha256 and r.suite_version == SUITE.suite_version
    payload = r.verdict("a" * 64, "base")
    v = OfflineVerdict.model_validate(json.loads(json.dumps(payload, allow_nan=False)))
    assert (v.passed, v.incumbent_id, v.suite_version) == (True, "base", SUITE.suite_version)
    again = run(engine, scorer)  # seeded per sample: the same numbers, whatever the batching
    assert {k: x for k, x in again.numbers.items() if k != "timing_s"} == {
        k: x for k, x in n.items() if k != "timing_s"
    }
    assert "passed" in r.summary()


@pytest.mark.slow
def test_a_clearly_worse_candidate_is_rejected(engine, scorer):
    worse = Rewrite(engine, "cand", text(lambda family, i: "BAD" if i % 4 else "x"))  # 3 of 4 prompts fail
    r = run(worse, scorer)
    ni = r.numbers["non_inferiority"]
    assert not r.passed and "non_inferiority" in r.failed
    assert ni["mean_diff"] == approx_ulps(-0.375) and ni["lower_bound"] < -0.03 and not ni["passed"]
    assert r.numbers["reward"] == {"candidate": 0.125, "incumbent": 0.5}
    assert r.numbers["bootstrap"]["lower_bound"] < -0.03
    assert "failed (non_inferiority, families)" in r.summary()


def test_one_family_regressing_fails_holm_while_overall_passes(engine, scorer):
    shifted = Rewrite(engine, "cand", text(lambda family, i: {"add": "BAD", "mul": "GOOD"}.get(family, "x")))
    r = run(shifted, scorer, margin=0.2)
    n = r.numbers
    assert n["non_inferiority"]["mean_diff"] == 0.0 and n["non_inferiority"]["passed"]  # overall: equal
    assert r.failed == ["families"] and not r.passed
    fam = n["families"]
    assert not fam["add"]["passed"] and fam["add"]["mean_diff"] == -0.5
    assert all(fam[f]["passed"] for f in ("mul", "count", "max_default"))
    examples = n["examples"]  # the prompts where the versions differ most, side by side
    assert len(examples) == 6 and {e["family"] for e in examples} <= {"add", "mul"}
    bad = next(e for e in examples if e["family"] == "add")
    assert bad["candidate"]["text"] == "BAD" and bad["candidate"]["mean"] < bad["incumbent"]["mean"]


def test_guardrail_empty_outputs(engine, scorer):
    def empty(c, family, i):  # stop at once: one token, no text
        return dataclasses.replace(c, text="", output_ids=c.output_ids[:1], logprobs=c.logprobs[:1])

    r = run(Rewrite(engine, "cand", empty), scorer)
    g = r.numbers["guardrails"]
    assert r.failed == ["length", "malformed"]  # the verifier is fooled (0.5 each): the guardrails are not
    assert g["malformed"]["candidate_empty_share"] == 1.0 and g["malformed"]["incumbent_empty_share"] < 0.1
    assert g["length"]["ratio"] < 0.5


def test_guardrail_longer_outputs(engine, scorer):
    def short(c, family, i):  # the incumbent stopped after 2 tokens: the candidate is ~4 times longer
        return dataclasses.replace(c, output_ids=c.output_ids[:2], logprobs=c.logprobs[:2])

    r = run(Rewrite(engine, "inc", short), scorer)
    assert r.failed == ["length"] and r.numbers["guardrails"]["length"]["ratio"] > 2.0


def test_guardrail_unparsable_outputs(engine, scorer):
    suite = make_suite(well_formed=lambda prompt, completion: completion == "ok")
    ok_inc = Rewrite(engine, "inc", text("ok"))
    r = run(ok_inc, scorer, suite=suite)  # the candidate's random text never parses, the incumbent's does
    m = r.numbers["guardrails"]["malformed"]
    assert r.failed == ["malformed"] and m["checked_with"] == "well_formed"
    assert (m["candidate_share"], m["incumbent_share"]) == (1.0, 0.0)


def test_guardrail_repetition(engine, scorer):
    def loop(c, family, i):
        ids = ([c.output_ids[0], (c.output_ids[0] + 1) % 300] * 8)[: len(c.output_ids)]
        return dataclasses.replace(c, output_ids=ids, logprobs=c.logprobs[: len(ids)])

    r = run(Rewrite(engine, "cand", loop), scorer, guardrails=Guardrails(loop_min_span=6, max_kl=100.0))
    rep = r.numbers["guardrails"]["repetition"]
    assert r.failed == ["repetition"] and rep["candidate_share"] > 0.5 and rep["incumbent_share"] == 0.0


def test_guardrail_kl_on_other_weights(engine, scorer):
    rails = Guardrails(max_kl=0.05, max_malformed_increase=0.5)
    r = run(engine, scorer, candidate="other", guardrails=rails)
    kl = r.numbers["guardrails"]["kl"]
    assert r.failed == ["kl"] and kl["per_token"] > 0.05  # the verifier cannot tell them apart; KL can
    assert run(engine, scorer, candidate="other", guardrails=rails.model_copy(update={"max_kl": 1.0})).passed


def test_bad_arguments_and_verifiers(engine, scorer):
    with pytest.raises(ValueError, match="both 'inc'"):
        evaluate_offline(engine, "inc", "inc", SUITE, scorer=scorer)
    with pytest.raises(ValueError, match="temperature"):
        run(engine, scorer, temperature=0.0)

    class Wild:
        def verify(self, prompts, completions):
            return [2.0] * len(prompts)

    with pytest.raises(ValueError, match="scores are in"):
        run(engine, scorer, suite=dataclasses.replace(SUITE, verifier=Wild()))


def test_loops_and_seeds():
    assert has_loop([1, 2, 3] * 4, min_span=12) and not has_loop([1, 2, 3] * 4, min_span=13)
    assert has_loop([5] * 12) and not has_loop(list(range(40)))
    assert not has_loop([1, 2] * 2 + [3], min_repeats=3, min_span=2) and has_loop([7, 1, 2] * 3, min_span=2)
    assert sample_seed(0, "p", 1) == sample_seed(0, "p", 1) != sample_seed(0, "p", 2) != sample_seed(1, "p", 1)
    assert 0 <= sample_seed(0, "p", 0) < 2**63


def test_suites_are_checked_versioned_and_round_trip(tmp_path):
    assert isinstance(Marks(), Verifier)
    with pytest.raises(ValueError, match="more than once"):
        EvalSuite.of("s", "1", [("a", "f"), ("a", "f")], Marks())
    with pytest.raises(ValueError, match="two prompts per family"):
        EvalSuite.of("s", "1", [("a", "f"), ("b", "f"), ("c", "g")], Marks())
    with pytest.raises(ValueError, match="verify"):
        EvalSuite.of("s", "1", [("a", "f"), ("b", "f")], object())  # type: ignore[arg-type]
    loaded = EvalSuite.load(SUITE.save(tmp_path / "suite.json"), Marks())
    assert loaded == SUITE and loaded.suite_version == SUITE.suite_version
    assert SUITE.suite_version.startswith("test-suite@1#")
    edited = EvalSuite.of("test-suite", "1", [*SUITE.items[:-1], ("# other\n", "max_default")], Marks())
    assert edited.suite_version != SUITE.suite_version  # same name and version, other prompts: another hash
    with pytest.raises(ValueError, match="format"):
        EvalSuite.from_json({"items": []}, Marks())


def test_demo_suite_is_the_held_out_gate_split_and_checks_python():
    suite = demo_suite()
    gate = split_tasks("gate", GATE_PROMPTS)
    assert [it.prompt for it in suite.items] == [t.prompt for t in gate] and len(gate) == 504
    assert not suite.in_distribution and suite.well_formed is python_parses
    assert suite.suite_version.startswith("demo-gate@3#") and suite.suite_version == demo_suite().suite_version
    assert demo_suite(split_tasks("train", 4, ("add", "mul"))).in_distribution  # train prompts: labelled so
    task = gate[0]
    good, bad = completions_for(task)["correct_preferred"][0], completions_for(task)["incorrect_preferred"][0]
    assert suite.verifier.verify([task.prompt] * 2, [good, bad]) == [1.0, 0.0]
    assert (
        python_parses(task.prompt, good)
        and not python_parses(task.prompt, "")
        and not python_parses(task.prompt, "    return (")
    )
