"""The embedded inference engine: continuous batching over a slot KV cache, on one background thread.

Owns request scheduling, prefill/decode steps, sampling, stop handling and the per-completion
record (output token ids, the sampled log-probabilities, the experts every token was routed to).
Several model versions are held at once, each with its own weights and cache; a request names
the version it wants (or gets the default) and is bound to it when submitted. Called by the gateway
(`api/`), bootstrap's evaluation, the benchmark and the tests. Knows nothing about HTTP or Kafka.

Hot swap (rules in `serving/versions.py`, the sequence in `serving/swap.py`): `add_version` loads a
new version beside the served one while the loop goes on serving; `set_default` sends new requests
to it; `retire_version` refuses new requests for the old one and unloads it (its model and cache
freed) once its last request in flight has ended. `update_weights` changes a version in place only
while nothing is in flight on it (otherwise `VersionBusy`), so one completion never mixes weights.

Scheduling, one loop iteration: on every version with waiting requests, admit them into free slots
(one batched prefill per version, the oldest request's version first); then, on every version, one
decode step for every running sequence. New requests join the
batch between decode steps; finished ones leave it and free their slot at once. Weight updates
queued with `update_weights` are applied between steps, never inside one; retired versions with
nothing in flight are unloaded there too.

Routed experts are recorded for every token fed through the model: the prompt's P tokens and
the first N-1 generated ones (the last generated token is never fed), so `routed_experts` has
shape [P + N - 1, L, K], dtype uint8.

Threads: the loop runs torch on its own thread with `threads` intra-op threads (default 1): once
another thread of the process has run an OpenMP-parallel torch op, a second thread's parallel
regions become slow (torch's libgomp), while a 1-thread loop is as fast whatever the rest of the
process does. Pass `threads=None` to keep torch's default.

Numerics: `batch_invariant=True` (the default, from `FLYWHEEL_BATCH_INVARIANT`; float32 versions
only) runs the model's batch-invariant kernels (`serving/batch_invariant.py`), so a token's recorded
log-probability is bit-identical to what the trainer recomputes in one full forward at the same
weights, whatever the decode batch held. Off: torch's default kernels, a faster decode step, and
recorded log-probs a few 1e-6 from the trainer's.
"""

from __future__ import annotations

import codecs
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serving.checkpoint import load_checkpoint
from serving.kv_cache import CacheStep
from serving.model import ModelArgs, Transformer
from serving.requests import (
    Completion,
    EngineError,
    GenerateMixin,
    RequestHandle,
    StreamEvent,
    caller_loop,
    check_request,
)
from serving.sampling import SamplingParams, sample_rows, sampling_logprobs
from serving.tokenizer import Tokenizer
from serving.versions import ServedVersion, VersionTable

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    request_id: str
    version: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    gen: torch.Generator | None
    t_submit: float
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)  # [tokens, L, K] uint8 per step
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    t_start: float = 0.0
    t_first: float = 0.0
    background: bool = False  # lent work (a rollout): behind every live request, preempted for one

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)


class _Done(threading.Event):
    """Set once a command has run on the engine's loop thread, holding what it returned or raised."""

    result: Any = None
    error: BaseException | None = None


class EmbeddedEngine(GenerateMixin):
    def __init__(
        self,
        max_batch: int = 64,
        max_model_len: int = 256,
        threads: int | None = 1,
        max_prefill_tokens: int = 2048,
        seed: int = 0,
        start_thread: bool = True,
        batch_invariant: bool | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.threads = threads
        if batch_invariant is None:  # the deployment's choice (FLYWHEEL_BATCH_INVARIANT, default on)
            from core.settings import get_settings

            batch_invariant = get_settings().batch_invariant
        self.batch_invariant = batch_invariant
        self._table: VersionTable[ServedVersion[_Seq]] = VersionTable()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self.failure: BaseException | None = None
        self.on_unload: Callable[[str], object] | None = None  # called with each retired version once it is gone
        # Called on the loop's thread after each of its iterations (a pass, or none): the engine process
        # sends the events of the iteration then, as one message.
        self.after_iteration: Callable[[], object] | None = None
        # start_thread=False: the caller runs `run_loop()` on a thread of its own (the engine process runs
        # it on its main thread, where torch's 2-thread parallel regions cost what they should).
        self._thread = threading.Thread(target=self._run, name="flywheel-engine", daemon=True)
        self._own_thread = start_thread
        if start_thread:
            self._thread.start()

    # ---- versions -------------------------------------------------------------------------
    def add_version(
        self, name: str, source: str | Path | Transformer, tokenizer: Tokenizer | None = None, default: bool = False
    ) -> None:
        """Load another model version beside those held (a checkpoint folder, or a model plus its tokenizer),
        on the caller's thread while the loop goes on serving. A model object is served as it is: do not
        change its weights while it is loaded (`update_weights` does that safely)."""
        if isinstance(source, Transformer):
            if tokenizer is None:
                raise ValueError("add_version with a model object needs its tokenizer")
            model = source.eval()
        else:
            # Normal tensors even when loaded on the loop thread (inside its inference mode, as the engine
            # process does): an inference tensor has no version counter, so the experts' kept transposes
            # (`serving.batch_invariant.row_major_t`) could not tell an `update_weights` and would be
            # copied afresh in every pass (10 % of an engine's time under load, measured).
            with torch.inference_mode(False):
                model = load_checkpoint(source)
            tokenizer = tokenizer or Tokenizer.from_file(Path(source) / "tokenizer.json")
        max_len = min(self.max_model_len, model.args.max_seq_len)
        self._table.add(name, ServedVersion(name, model, tokenizer, self.max_batch, max_len), default)

    @property
    def default_version(self) -> str | None:
        """The version a request that names none is served by."""
        return self._table.default

    def set_default(self, name: str) -> None:
        """Send new requests that name no version to `name`; requests in flight finish where they are."""
        self._table.set_default(name)

    def retire_version(self, name: str, wait: bool = True) -> None:
        """Refuse new requests for `name` at once and unload it once its requests in flight have ended
        (never under a running one); `wait=True` returns once it is unloaded. Not the default version."""
        unloaded = self._table.retire(name)
        self._wake.set()
        while wait and not unloaded.wait(timeout=0.1):
            if not self.alive:  # no loop to unload it: its requests have failed already
                self._unload_retired(name)

    def call_in_loop(self, fn):
        """Run `fn()` on the engine's loop thread between two steps; returns its result (or raises)."""
        if not self.alive:
            raise EngineError(f"engine is not running: {self.failure!r}")
        done = _Done()
        self._commands.put((fn, done))
        self._wake.set()
        done.wait()
        if isinstance(done.error, BaseException):
            raise done.error
        return done.result

    def update_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Replace a version's weights in place (a state dict of our model's names) between two decode steps;
        returns once applied. Refused with `VersionBusy` while requests are in flight on it: serve new weights
        to live traffic as a new version beside it instead (`serving.swap.hot_swap`)."""

        def load() -> None:
            with self._table.exclusive(name) as v:
                v.model.load_state_dict(weights, strict=True)

        self.call_in_loop(load)

    @property
    def versions(self) -> list[str]:
        """Loaded versions; a retired one stays listed until it is unloaded."""
        return self._table.names()

    def tokenizer(self, version: str | None = None) -> Tokenizer:
        return self._get(version).tokenizer

    def context_length(self, version: str | None = None) -> int:
        """Longest prompt + completion (tokens) the version accepts."""
        return self._get(version).cache.max_len

    def weights_dtype(self, version: str | None = None) -> str:
        """The dtype the version's weights are served in ("float32", "bfloat16", ...)."""
        return str(next(self._get(version).model.parameters()).dtype).removeprefix("torch.")

    def model_args(self, version: str | None = None) -> ModelArgs:
        return self._get(version).model.args

    def _get(self, version: str | None) -> ServedVersion[_Seq]:
        return self._table.get(version)

    # ---- requests -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        running = self._thread.is_alive() if self._own_thread else not self._stop.is_set()
        return running and self.failure is None

    def run_loop(self) -> None:
        """Run the scheduling loop on the calling thread until `shutdown()` (with start_thread=False)."""
        if self._own_thread:
            raise RuntimeError("the engine loop already runs on its own thread")
        self._run()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        version: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        sink=None,
        background: bool = False,
    ) -> RequestHandle:
        """Queue a request; thread-safe. From inside an event loop the handle is async-iterable.
        `stream=False` delivers only the final event: no per-token wake-ups of the caller.
        `background=True` (lent work): admitted only when no live request waits, and preempted at the
        next step boundary (finish_reason "preempted", to be redone) when a live one needs its slot."""
        if not self.alive:
            raise EngineError(f"engine is not running: {self.failure!r}")
        name, v = self._table.acquire(version)  # bound to this version from here to its last event
        try:
            check_request(prompt_ids, params, v.model.args.vocab_size, v.cache.max_len)
        except ValueError:
            self._table.release(name)
            self._wake.set()  # it may have been the last request of a retired version
            raise
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        handle = RequestHandle(rid, None if sink else caller_loop(), stream, sink)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = _Seq(rid, name, list(prompt_ids), params, handle, gen, time.perf_counter(), background=background)
        self._inbox.put(seq)
        self._wake.set()
        return handle

    def preempt_background(self) -> int:
        """End every background request, waiting or running, at the next step boundary (a reclaim):
        each finishes with "preempted"; how many there were."""

        def preempt() -> int:
            self._drain_inbox()  # those submitted before the call too
            return sum(self._preempt(v, len(v.running), waiting=True) for v in self._table.values())

        return self.call_in_loop(preempt)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ---- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._apply_commands()
                    self._unload_retired()
                    self._drain_inbox()
                    worked = self._step()
                    self._iteration_done()
                    if not worked:
                        self._wake.wait(timeout=0.5)
                        self._wake.clear()
        except BaseException as e:  # a dead engine fails loudly: every waiter gets the error
            self.failure = e
            log.exception("engine loop died")
            self._fail_all(EngineError(f"engine failed: {e!r}"))
            self._iteration_done()
            raise
        self._fail_all(EngineError("engine shut down"))
        self._iteration_done()

    def _iteration_done(self) -> None:
        if self.after_iteration is not None:
            self.after_iteration()

    def _step(self) -> bool:
        """One engine step. With one version loaded (the usual case), one pass of the model: the prompts
        admitted now are prefilled together with the running sequences' decode step (`_fused_step`).
        With several, every version with waiting requests admits (the one whose oldest request came
        first goes first), then every version with work decodes: whether a version is busy never picks
        the kind of step, so a canary's arms on one engine get the same kind (a first token comes sooner
        after a prefill alone than after a pass that also decodes). Admitting all before decoding any
        keeps a request's time to first token from depending on which version it asked for: admitted
        version by version, a second version's new requests waited behind the first version's whole
        decode step, and a canary's arm on shared engines measured 1.6-1.8x the incumbent's time to
        first token, with the same time per output token (docs/gate.md). A method: no version outlives
        it in a local."""
        versions = list(self._table.values())
        if len(versions) == 1:
            return self._fused_step(versions[0])
        worked = False
        for v in sorted((v for v in versions if v.waiting), key=lambda v: v.waiting[0].t_submit):
            worked |= self._admit(v)
        for v in versions:
            worked |= self._decode(v)
        return worked

    def _unload_retired(self, *names: str) -> None:
        for name in names or self._table.idle_retired():  # the model and cache go with the table's reference
            if self._table.drop(name) is not None and self.on_unload is not None:
                self.on_unload(name)

    def _post_error(self, seq: _Seq, err: BaseException) -> None:
        self._table.release(seq.version)
        seq.handle._post(StreamEvent("", [], [], error=err))

    def _fail_all(self, err: BaseException) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._post_error(seq, err)
        for v in self._table.values():
            for seq in list(v.waiting) + v.running:
                self._post_error(seq, err)
            v.waiting.clear()
            v.running.clear()
        self._unload_retired()
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                break
            done.error = err
            done.set()

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                done.result = fn()
            except Exception as e:  # reported to the caller (of update_weights, say), the engine goes on
                done.error = e
            self._iteration_done()  # the events it emitted (a preemption's) go out before its answer
            done.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:  # a request in the inbox counts as in flight: its version is still here
                waiting = self._table.get(seq.version).waiting
                at = len(waiting)  # a live request goes ahead of every background one
                if not seq.background:
                    at = next((i for i, w in enumerate(waiting) if w.background), at)
                waiting.insert(at, seq)
            except KeyError:
                self._post_error(seq, EngineError(f"model version {seq.version!r} was unloaded"))

    def _uniforms(self, seqs: list[_Seq]) -> torch.Tensor:
        """One uniform per row: seeded requests draw from their own generator, the rest from the engine's."""
        u = torch.rand(len(seqs), generator=self._rng)
        for i, s in enumerate(seqs):
            if s.gen is not None:
                u[i] = torch.rand(1, generator=s.gen)[0]
        return u

    def _preempt(self, v: ServedVersion[_Seq], n: int, waiting: bool = False) -> int:
        """End up to `n` running background requests of `v` (and, `waiting`, every waiting one): each
        finishes with "preempted"."""
        now = time.perf_counter()
        ended = [s for s in v.running if s.background][:n] + ([s for s in v.waiting if s.background] if waiting else [])
        for s in ended:
            if s.slot < 0:
                v.waiting.remove(s)
            s.handle._post(StreamEvent("", [], [], completion=self._finish(v, s, "preempted", now)))
        return len(ended)

    def _take_admits(self, v: ServedVersion[_Seq]) -> list[_Seq]:
        """The waiting requests that get a slot now (live ones first, background work preempted for them),
        up to `max_prefill_tokens` of prompt."""
        live = sum(1 for s in v.waiting if not s.background)
        if live > len(v.free):  # live requests wait for slots that background work holds: free them now
            self._preempt(v, live - len(v.free))
        batch: list[_Seq] = []
        tokens = 0
        while v.waiting and v.free and (not batch or tokens + len(v.waiting[0].prompt_ids) <= self.max_prefill_tokens):
            seq = v.waiting.popleft()
            seq.slot = v.free.pop()
            seq.t_start = time.perf_counter()
            tokens += len(seq.prompt_ids)
            batch.append(seq)
        return batch

    @staticmethod
    def _prefill_step(v: ServedVersion[_Seq], batch: list[_Seq]) -> CacheStep:
        lengths_B = torch.tensor([len(s.prompt_ids) for s in batch])
        T = int(lengths_B.max())
        pad = v.model.args.pad_id
        return CacheStep(
            tokens_BT=torch.tensor([s.prompt_ids + [pad] * (T - len(s.prompt_ids)) for s in batch]),
            positions_BT=torch.arange(T).expand(len(batch), T),
            slots_B=torch.tensor([s.slot for s in batch]),
            logits_at_B=lengths_B - 1,
            # the pads go through attention's grid only, not the row-wise layers (`CacheStep`)
            valid_BT=None if int(lengths_B.min()) == T else torch.arange(T)[None, :] < lengths_B[:, None],
        )

    @staticmethod
    def _decode_step(seqs: list[_Seq]) -> CacheStep:
        return CacheStep(
            tokens_BT=torch.tensor([[s.out_ids[-1]] for s in seqs]),
            positions_BT=torch.tensor([[s.length - 1] for s in seqs]),
            slots_B=torch.tensor([s.slot for s in seqs]),
            logits_at_B=torch.zeros(len(seqs), dtype=torch.int64),
        )

    def _admit(self, v: ServedVersion[_Seq]) -> bool:
        return self._pass(v, self._take_admits(v), [])

    def _fused_step(self, v: ServedVersion[_Seq]) -> bool:
        """Admit and decode on one version in a single pass of the model. A sequence admitted now gets
        its first token from this step, its second from the next."""
        self._reap_cancelled(v)
        batch = self._take_admits(v)
        return self._pass(v, batch, [s for s in v.running if s.out_ids and s.slot >= 0])

    def _pass(self, v: ServedVersion[_Seq], batch: list[_Seq], decoding: list[_Seq]) -> bool:
        """One pass of the model: the prefill of the newly admitted `batch` and the next token of the
        running `decoding`, either may be empty (each token's logits are those of its own forward: the
        model's `forward_steps`); then every row is sampled and emitted."""
        if not batch and not decoding:
            return False
        steps = ([self._prefill_step(v, batch)] if batch else []) + ([self._decode_step(decoding)] if decoding else [])
        outs = v.model.forward_steps(steps, v.cache, batch_invariant=self.batch_invariant)
        if batch:
            experts = outs[0].experts.to(torch.uint8).numpy()
            for i, s in enumerate(batch):
                s.experts.append(experts[i, : len(s.prompt_ids)])
            v.running.extend(batch)
        if decoding:
            experts = outs[-1].experts.to(torch.uint8).numpy()
            for i, s in enumerate(decoding):
                s.experts.append(experts[i])
        logits = torch.cat([o.logits for o in outs]) if len(outs) > 1 else outs[0].logits
        self._sample_and_emit(v, batch + decoding, logits)
        return True

    def _reap_cancelled(self, v: ServedVersion[_Seq]) -> None:
        now = time.perf_counter()
        for s in [s for s in v.waiting if s.handle.cancelled]:
            v.waiting.remove(s)
            s.handle._post(StreamEvent("", [], [], completion=self._finish(v, s, "abort", now)))
        for s in [s for s in v.running if s.handle.cancelled]:
            s.handle._post(StreamEvent("", [], [], completion=self._finish(v, s, "abort", now)))

    def _decode(self, v: ServedVersion[_Seq]) -> bool:
        self._reap_cancelled(v)
        return self._pass(v, [], [s for s in v.running if s.out_ids and s.slot >= 0])

    def _sample_and_emit(self, v: ServedVersion[_Seq], seqs: list[_Seq], logits_NV: torch.Tensor) -> None:
        temps = torch.tensor([s.params.temperature for s in seqs])
        top_ps = torch.tensor([s.params.top_p for s in seqs])
        logp = sampling_logprobs(logits_NV[:, : v.n_vocab], temps, top_ps)
        tokens, chosen = sample_rows(logp, temps == 0, self._uniforms(seqs))
        want_top = max(s.params.logprobs for s in seqs)
        if want_top:
            vals, idx = logp.topk(want_top, dim=-1)
            top_vals, top_idx = vals.tolist(), idx.tolist()
        now = time.perf_counter()
        eos = v.model.args.eos_id
        token_bytes = v.tokenizer.token_bytes
        for s, t, lp, i in zip(seqs, tokens.tolist(), chosen.tolist(), range(len(seqs))):
            s.out_ids.append(t)
            s.logprobs.append(lp)
            top = None
            if s.params.logprobs:
                k = s.params.logprobs
                top = dict(zip(top_idx[i][:k], top_vals[i][:k]))
                s.top.append(top)
            if len(s.out_ids) == 1:
                s.t_first = now
            finish = None
            if t == eos and not s.params.ignore_eos:
                finish = "stop"
            else:
                s.text += s.decoder.decode(token_bytes[t])
            stop_at = _find_stop(s.text, s.params.stop) if s.params.stop else None
            if stop_at is not None:
                s.text = s.text[:stop_at]
                finish = "stop"
            if finish is None and (len(s.out_ids) >= s.params.max_tokens or s.length >= v.cache.max_len):
                finish = "length"
            if finish is not None:
                if stop_at is None:
                    s.text += s.decoder.decode(b"", final=True)
                delta = s.text[s.emitted :]
                s.emitted = len(s.text)
                done = self._finish(v, s, finish, now)
                if s.handle.stream:
                    s.handle._post(StreamEvent(delta, [t], [lp], [top] if top else None, completion=done))
                else:
                    s.handle._post(
                        StreamEvent(
                            done.text, list(done.output_ids), list(done.logprobs), done.top_logprobs, completion=done
                        )
                    )
            elif s.handle.stream:
                hold = max((len(x) for x in s.params.stop), default=1) - 1
                upto = max(s.emitted, len(s.text) - hold)
                delta = s.text[s.emitted : upto]
                s.emitted = upto
                s.handle._post(StreamEvent(delta, [t], [lp], [top] if top else None))

    def _finish(self, v: ServedVersion[_Seq], s: _Seq, reason: str, now: float) -> Completion:
        if s.slot >= 0:
            v.running.remove(s)
            v.free.append(s.slot)
            s.slot = -1
        self._table.release(v.name)  # a retired version is unloaded at the top of the next iteration
        args = v.model.args
        experts = (
            np.concatenate(s.experts, axis=0) if s.experts else np.zeros((0, args.n_layers, args.top_k), dtype=np.uint8)
        )
        if s.experts and not s.out_ids:
            experts = experts[:0]
        elif s.out_ids:
            experts = experts[: s.length - 1]
        return Completion(
            request_id=s.request_id,
            version=v.name,
            prompt_ids=s.prompt_ids,
            output_ids=s.out_ids,
            logprobs=s.logprobs,
            routed_experts=experts,
            text=s.text,
            finish_reason=reason,
            params=s.params,
            top_logprobs=s.top or None,
            queued_s=(s.t_start or now) - s.t_submit,
            first_token_s=(s.t_first or now) - s.t_submit,
            total_s=now - s.t_submit,
        )


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(x) for x in stops) if i >= 0]
    return min(hits) if hits else None
