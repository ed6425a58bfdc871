"""What a request is to every engine: the records it returns, its stream, its handle, its checks.

Owns `Completion` (the per-completion record the learner trains on), `StreamEvent`, `RequestHandle`
(what `submit` returns: sync or async iteration, or a wait for the result), `EngineError`, the
request checks every backend applies (`check_request`), `caller_loop` and `GenerateMixin`
(blocking `generate` over `submit`). Shared by the three engines (`serving/engine.py`,
`serving/engine_process.py`, `serving/vllm_engine.py`) and used by the gateway (`api/`) and the
tests; knows nothing about models or scheduling.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from serving.sampling import SamplingParams


class EngineError(RuntimeError):
    """The engine stopped or failed while the request was in flight."""


@dataclass
class Completion:
    request_id: str
    version: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    routed_experts: np.ndarray  # [P + N - 1, L, K] uint8
    text: str
    finish_reason: str  # "stop" | "length"
    params: SamplingParams
    top_logprobs: list[dict[int, float]] | None = None
    queued_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0


@dataclass
class StreamEvent:
    text: str  # new text since the previous event
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    completion: Completion | None = None  # set on the last event
    error: BaseException | None = None


_END_LOCK = threading.Lock()  # `when_ended` against the engine's last `_post`: brief, so one lock for all


class RequestHandle:
    """What `submit` returns: iterate (sync or async) for stream events, or wait for the result."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop | None,
        stream: bool = True,
        sink: Callable[[StreamEvent], None] | None = None,
        on_cancel: Callable[[], object] | None = None,
    ):
        self.request_id = request_id
        self._sink = sink  # takes each StreamEvent instead of the queues (the engine process)
        self._on_cancel = on_cancel  # tells a backend that generates elsewhere (a process, vLLM's loop)
        self.stream = stream  # False: only the final event (the whole completion) is delivered
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self._on_end: Callable[[], object] | None = None  # `when_ended`
        self._ended_at_engine = False

    def cancel(self) -> None:
        """Stop generating at the next step; the stream then ends with finish_reason "abort"."""
        self.cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()

    def when_ended(self, fn: Callable[[], object]) -> None:
        """Call `fn()` once the engine has posted the request's last event (its completion or an error),
        whether or not anyone reads it; at once if it already has. Thread-safe."""
        with _END_LOCK:
            ended = self._ended_at_engine
            if not ended:
                self._on_end = fn
        if ended:
            fn()

    def _post(self, ev: StreamEvent) -> None:
        if ev.completion is not None or ev.error is not None:
            with _END_LOCK:
                self._ended_at_engine = True
                fn, self._on_end = self._on_end, None
            if fn is not None:
                fn()
        if self._sink is not None:
            self._sink(ev)
        elif self._loop is not None and self._aq is not None:  # both set, or neither
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the caller's loop is gone; nobody is listening any more
                pass
        else:
            self._q.put(ev)

    def poll(self) -> StreamEvent | None:
        """The next event if one has arrived, else None, without waiting (a handle submitted outside an
        event loop, like `for`)."""
        if self._aq is not None:
            raise RuntimeError("this handle was submitted from an event loop: use `async for`")
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def __iter__(self):
        if self._aq is not None:
            raise RuntimeError("this handle was submitted from an event loop: use `async for`")
        while True:
            ev = self._q.get()
            if ev.error is not None:
                raise ev.error
            yield ev
            if ev.completion is not None:
                return

    async def __aiter__(self):
        if self._aq is None:
            raise RuntimeError("this handle was submitted without an event loop: use `for`")
        while True:
            ev = await self._aq.get()
            if ev.error is not None:
                raise ev.error
            yield ev
            if ev.completion is not None:
                return

    def result(self) -> Completion:
        for ev in self:
            if ev.completion is not None:
                return ev.completion
        raise EngineError("stream ended without a completion")

    async def aresult(self) -> Completion:
        async for ev in self:
            if ev.completion is not None:
                return ev.completion
        raise EngineError("stream ended without a completion")


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, context: int) -> None:
    """The checks every backend applies before accepting a request (ValueError naming the problem)."""
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt_ids) + params.max_tokens > context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the model's context of {context} tokens"
        )


def caller_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop of the caller, if any (its handle is then async-iterable)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class GenerateMixin:
    if TYPE_CHECKING:  # provided by the class this is mixed into

        def submit(
            self,
            prompt_ids: list[int],
            params: SamplingParams,
            version: str | None = None,
            request_id: str | None = None,
            stream: bool = True,
        ) -> RequestHandle: ...

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams], version: str | None = None
    ) -> list[Completion]:
        """Blocking convenience: submit all, wait for all (they are batched together)."""
        plist = params if isinstance(params, list) else [params] * len(prompt_ids)
        handles = [self.submit(p, sp, version, stream=False) for p, sp in zip(prompt_ids, plist)]
        return [h.result() for h in handles]
