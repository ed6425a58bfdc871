"""Lent work inside one engine (`submit(..., background=True)`): live requests go ahead of background
ones, a live request that finds every slot held by background work takes one at the next step
boundary (so it never waits longer than one engine step), the preempted requests end with
"preempted", and `preempt_background` (a reclaim) ends them all."""

from __future__ import annotations

import threading

from core.harness import wait_until
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

LONG = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True, seed=1)


def test_a_live_request_takes_a_background_slot_within_one_step(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=2, max_model_len=128, seed=0)
    eng.add_version("v1", tiny_checkpoint, default=True)
    tok = Tokenizer.from_file(tiny_checkpoint)
    p = tok.encode_prompt("# add 3 to x\ndef f(x):\n")
    try:
        emitted: dict[str, int] = {"b0": 0, "b1": 0}
        ends: dict[str, str] = {}
        at_submit: dict[str, int] = {}
        live_handle: list = []
        lock = threading.Lock()

        def counter(name):
            def sink(ev):  # on the engine's loop thread, as each step emits
                with lock:
                    emitted[name] += len(ev.token_ids)
                    if ev.completion is not None:
                        ends[name] = ev.completion.finish_reason
                    if name == "b0" and emitted["b0"] >= 5 and not live_handle:
                        # The live request arrives during a step, with both slots held by background work.
                        at_submit.update(emitted)
                        live_handle.append(eng.submit(p, SamplingParams(max_tokens=4, ignore_eos=True)))

            return sink

        for name in emitted:
            eng.submit(p, LONG, request_id=name, sink=counter(name), background=True)
        wait_until(lambda: live_handle, 60, what="the live request submitted")
        live = [ev for ev in live_handle[0]][-1].completion
        wait_until(lambda: len(ends) == 1, 30, what="one background request preempted")
        (gone,) = ends
        assert ends[gone] == "preempted"
        # It made at most one more token after the live request was submitted: the step under way.
        assert emitted[gone] - at_submit[gone] <= 1, (emitted, at_submit)
        assert len(live.output_ids) == 4 and live.finish_reason == "length"
        other = next(n for n in emitted if n != gone)
        assert eng.preempt_background() == 1  # the reclaim ends the other one
        wait_until(lambda: len(ends) == 2, 30, what="the other background request preempted")
        assert ends[other] == "preempted" and emitted[other] < LONG.max_tokens
        assert eng.preempt_background() == 0
    finally:
        eng.shutdown()


def test_live_requests_are_admitted_ahead_of_waiting_background_ones(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=1, max_model_len=128, seed=0)
    eng.add_version("v1", tiny_checkpoint, default=True)
    tok = Tokenizer.from_file(tiny_checkpoint)
    p = tok.encode_prompt("def")
    order: list[str] = []
    lock = threading.Lock()

    def done(name):
        def sink(ev):
            if ev.completion is not None:
                with lock:
                    order.append(f"{name}:{ev.completion.finish_reason}")

        return sink

    short = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=2)
    try:
        eng.call_in_loop(lambda: None)  # the loop is up
        # Queued together between two steps: the background ones first, the live one last.
        eng.submit(p, short, request_id="bg1", sink=done("bg1"), background=True)
        eng.submit(p, short, request_id="bg2", sink=done("bg2"), background=True)
        eng.submit(p, short, request_id="live", sink=done("live"))
        wait_until(lambda: len(order) == 3, 60, what="all three finished")
        # bg1 may have been admitted before the live request arrived (then it is preempted at once);
        # either way the live request is the first to complete.
        assert [o for o in order if o.endswith(":length")][0] == "live:length", order
        assert order in (["live:length", "bg1:length", "bg2:length"], ["bg1:preempted", "live:length", "bg2:length"])
    finally:
        eng.shutdown()
