"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Thin: validate, resolve the model version, hand prompts to the engine, record every completion
(durably, before answering or before `data: [DONE]`), shape the response. A stream whose client
goes away is cancelled in the engine and what was generated is still recorded.

No request can hold the event loop: sizes are checked before any work that grows with them (the
body by `api.errors.BodyLimit`; a prompt, the chat messages and the stop strings by their length
in characters, which bounds their tokens from below: `Tokenizer.max_token_chars`); encoding a text
prompt longer than `INLINE_CHARS` runs on a worker thread (the tokenizer releases the GIL), and so does
shaping a response with logprobs or more than `INLINE_TOKENS` tokens (decoding every token); smaller
ones run inline, where a thread hop would cost more than the work. A streamed chunk decodes only the
tokens of one engine event inline.

Resolving and submitting across a swap (`_submit`): the model name is resolved to a concrete version
(`Gateway.resolve_model`), then the prompt is encoded with that version's tokenizer and submitted. A
swap may retire (or unload) that version in between; the engine then refuses with a `KeyError`. A
request for the alias asked for whatever is promoted: it is resolved again (the canary's share
re-read, not cached) and resubmitted, so no request is lost across a swap. An explicitly named
version is never replaced by another: the caller gets 404 `model_not_found` saying it retired.
Once submitted, a request is bound to its version until its last event (`serving.versions`); the
tokenizer it was encoded with is kept for the response, so a version unloaded right after the
request ended does not fail the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import cast

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from api.deps import ALIAS, CompletionsCaller, GatewayDep, JSONRoute
from api.errors import APIError, error_body
from api.schemas import MAX_CHOICES, PROMPT_KINDS, ChatRequest, CompletionRequest, chat_prompt
from feedback.events import CompletionEvent
from registry.models import ROLLOUT_SUFFIX
from serving.requests import Completion, EngineError
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", route_class=JSONRoute)
VERSION_HEADER = "X-Flywheel-Model-Version"
INLINE_CHARS = 1024  # text prompts up to this many characters in all are encoded on the loop
INLINE_TOKENS = 1024  # responses without logprobs up to this many tokens in all are shaped on the loop


@dataclass(frozen=True)
class _Prompts:
    """A request's prompts: texts to encode, or token ids as given."""

    texts: list[str] | None = None
    ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.ids or ())


@router.get("/models")
async def list_models(gw: GatewayDep, caller: CompletionsCaller):
    now = int(time.time())
    default = gw.engine.default_version
    names = [
        v
        for v in gw.engine.versions
        if v == default or (caller.allows("eval") and not v.endswith(ROLLOUT_SUFFIX))  # lent work's: nobody's
    ] + ([ALIAS] if default else [])
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "flywheel"} for n in names],
    }


@router.post("/completions")
async def completions(req: CompletionRequest, gw: GatewayDep, caller: CompletionsCaller):
    prompt = req.prompt
    # The schema admits a string, or a list of only strings, only token ids or only lists of token ids.
    if isinstance(prompt, str):
        prompts = _Prompts(texts=[prompt])
    elif isinstance(prompt[0], int):
        prompts = _Prompts(ids=[cast(list[int], prompt)])
    elif isinstance(prompt[0], list):
        prompts = _Prompts(ids=cast(list[list[int]], prompt))
    else:
        texts = cast(list[str], prompt)
        if not all(texts):
            raise APIError(400, f"prompt must be {PROMPT_KINDS}", "prompt", "invalid_value")
        prompts = _Prompts(texts=texts)
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(
            400,
            f"This request asks for {len(prompts) * req.n} completions ({len(prompts)} prompts x n={req.n}); "
            f"at most {MAX_CHOICES} per request.",
            "prompt",
            "invalid_value",
        )
    params = _params(req, req.max_tokens, req.logprobs or 0)
    return await _serve(
        gw, caller, "completions", prompts, params, req, "prompt", want_logprobs=req.logprobs is not None
    )


@router.post("/chat/completions")
async def chat_completions(req: ChatRequest, gw: GatewayDep, caller: CompletionsCaller):
    top = (req.top_logprobs or 0) if req.logprobs else 0
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs", "invalid_value")
    params = _params(req, req.token_limit, top)
    prompts = _Prompts(texts=[chat_prompt(req.messages)])
    return await _serve(gw, caller, "chat.completions", prompts, params, req, "messages", want_logprobs=req.logprobs)


def _params(req, max_tokens: int, logprobs: int) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            max_tokens=max_tokens,
            stop=tuple(req.stop or ()),
            seed=req.seed,
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:
        raise APIError(400, str(e), None, "invalid_value") from None


RESOLVES = 3  # resolve + submit attempts of an alias request whose version keeps retiring under it


def _jobs(prompts: list[list[int]], params: SamplingParams, n: int, base_id: str) -> list:
    """(completion id, prompt ids, sampling) per choice: each choice is sampled on its own, and a
    request seed gives every choice its own derived seed."""
    ids = [base_id if len(prompts) * n == 1 else f"{base_id}-{i}" for i in range(len(prompts) * n)]
    return [
        (cid, prompts[i // n], params if params.seed is None or i == 0 else replace(params, seed=params.seed + i))
        for i, cid in enumerate(ids)
    ]


def _check_context(prompts: list[list[int]], params: SamplingParams, limit: int, prompt_param: str) -> None:
    for p in prompts:
        if len(p) + params.max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(p) + params.max_tokens} tokens ({len(p)} in the prompt, {params.max_tokens} "
                f"for the completion).",
                prompt_param,
                "context_length_exceeded",
            )


def _check_sizes(prompts: _Prompts, params: SamplingParams, tok, limit: int, prompt_param: str) -> None:
    """The refusals that lengths alone decide, made before anything is tokenized: a text of C
    characters needs at least C / `max_token_chars` tokens (plus the BOS token), so a prompt too long
    for the context in characters is too long in tokens; a stop string longer than any completion
    the context can hold can never be generated."""
    if prompts.ids is not None:
        _check_context(prompts.ids, params, limit, prompt_param)
    per = tok.max_token_chars
    bos = 0 if tok.bos_id is None else 1
    room = limit - params.max_tokens - bos  # tokens left for a prompt's text
    for text in prompts.texts or ():
        if len(text) > per * room:
            need = -(-len(text) // per) + bos
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested at least "
                f"{need + params.max_tokens} tokens ({need} or more in the prompt: {len(text)} characters, "
                f"and a token holds at most {per}; {params.max_tokens} for the completion).",
                prompt_param,
                "context_length_exceeded",
            )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > per * limit:
        raise APIError(
            400,
            f"A stop sequence has {longest} characters; this model's completions hold at most {per * limit} "
            f"({limit} tokens of at most {per} characters), so it could never be generated.",
            "stop",
            "invalid_value",
        )


def _encode(tok, prompts: _Prompts) -> list[list[int]]:
    """The prompts as model input (on a worker thread: it takes time that grows with their length)."""
    if prompts.ids is None:
        return tok.encode_prompts(prompts.texts or [])
    vocab = tok.vocab_size
    if any(not 0 <= t < vocab for p in prompts.ids for t in p):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
    return prompts.ids


async def _submit(gw, caller, req, prompts: _Prompts, params, prompt_param, base_id):
    """Resolve the model and submit every choice: (version, arm, tokenizer, handles). A version that
    retires between the two is resolved again for the alias, never for a named version (see the
    module's docstring)."""
    for attempt in range(RESOLVES):
        version, arm = gw.resolve_model(req.model, caller, req.user, fresh=attempt > 0)
        handles: list = []
        try:  # a KeyError below: the engine no longer takes `version` (retired or unloaded since resolved)
            tok = gw.engine.tokenizer(version)
            limit = gw.engine.context_length(version)
            _check_sizes(prompts, params, tok, limit, prompt_param)
            small = prompts.texts is None or sum(map(len, prompts.texts)) <= INLINE_CHARS
            ids = _encode(tok, prompts) if small else await asyncio.to_thread(_encode, tok, prompts)
            _check_context(ids, params, limit, prompt_param)
            if not gw.engine.alive:
                raise APIError(503, "The inference engine is not running.", None, "engine_unavailable")
            for cid, p, sp in _jobs(ids, params, req.n, base_id):
                handles.append(gw.engine.submit(p, sp, version, request_id=cid, stream=req.stream))
            return version, arm, tok, handles
        except KeyError as e:
            for h in handles:  # choices already bound to the retired version: nothing was generated for them
                h.cancel()
            if req.model != ALIAS:
                why = e.args[0] if e.args else e
                raise APIError(
                    404,
                    f"The model version '{version}' is retired: it takes no new requests ({why}). "
                    f"Use '{ALIAS}' for the promoted version.",
                    "model",
                    "model_not_found",
                ) from None
            log.info(
                "version %s retired under a request for %s (attempt %d): resolving again", version, ALIAS, attempt + 1
            )
        except ValueError as e:
            for h in handles:
                h.cancel()
            raise APIError(400, str(e), prompt_param, "invalid_value") from None
        except EngineError as e:
            for h in handles:
                h.cancel()
            raise APIError(503, str(e), None, "engine_unavailable") from None
    raise APIError(
        503,
        f"The served version changed {RESOLVES} times while this request was submitted; retry.",
        None,
        "engine_unavailable",
    )


async def _serve(gw, caller, endpoint, prompts: _Prompts, params, req, prompt_param, want_logprobs: bool):
    # Each completion asked for (prompts x n) counts against the key's rate, before any tokenizing.
    gw.limit("completions", caller, f"/v1/{endpoint.replace('.', '/')}", len(prompts) * req.n)
    base_id = ("chatcmpl-" if endpoint == "chat.completions" else "cmpl-") + uuid.uuid4().hex
    version, arm, tok, handles = await _submit(gw, caller, req, prompts, params, prompt_param, base_id)
    ctx = _Ctx(
        gw,
        caller.tenant,
        version,
        tok,
        endpoint,
        base_id,
        req.user,
        time.perf_counter(),
        int(time.time()),
        req.n,
        want_logprobs,
    )
    ctx.arm = arm
    ctx.context = req.metadata.context if req.metadata else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(ctx, handles, include_usage),
            media_type="text/event-stream",
            headers={VERSION_HEADER: version, "Cache-Control": "no-cache"},
        )
    try:
        results = await asyncio.gather(*(h.aresult() for h in handles))
    except EngineError as e:
        raise APIError(503, str(e), None, "engine_unavailable") from None
    await asyncio.gather(*(ctx.record(c) for c in results))
    ctx.observe(results)
    shape = _completion_body if endpoint == "completions" else _chat_body
    # Decoding every token of the logprobs and rendering the JSON grow with n x max_tokens: off the loop,
    # unless the response is small.
    render = lambda: JSONResponse(shape(ctx, results), headers={VERSION_HEADER: version})  # noqa: E731
    if not want_logprobs and sum(len(c.output_ids) for c in results) <= INLINE_TOKENS:
        return render()
    return await asyncio.to_thread(render)


class _Ctx:
    def __init__(self, gw, tenant, version, tok, endpoint, base_id, user, t0, created, n, want_logprobs):
        self.gw, self.tenant, self.version, self.endpoint = gw, tenant, version, endpoint
        self.tok = tok  # the version's tokenizer, kept: the version may be unloaded once the request ended
        self.base_id, self.user, self.t0, self.created = base_id, user, t0, created
        self.n, self.want_logprobs = n, want_logprobs
        self.arm: str | None = None  # experiment arm (`Gateway.resolve_model`)
        self.context: str | None = None  # the request's `metadata.context`

    async def record(self, c: Completion) -> None:
        if not c.output_ids:
            return  # cancelled before anything was generated: nothing was served
        arm = self.arm
        ev = CompletionEvent.from_completion(c, self.tenant, self.user, self.endpoint, arm=arm, context=self.context)
        try:
            # On the bus and in the index (grouped with concurrent requests' records) before the
            # response is sent, so feedback on this id can never be refused as unknown.
            await self.gw.sink.record(ev)
        except Exception as e:  # not durable: the caller must not be served
            raise APIError(
                503, f"The completion could not be recorded ({type(e).__name__}); not served.", None, "record_failed"
            ) from e
        self.gw.metrics.records.labels(c.version).inc()

    def observe(self, results: list[Completion]) -> None:
        m = self.gw.metrics
        for c in results:
            m.prompt_tokens.labels(self.version).inc(len(c.prompt_ids))
            m.completion_tokens.labels(self.version).inc(len(c.output_ids))
            m.ttft.labels(self.version).observe(c.first_token_s)
        m.latency.labels(self.endpoint, self.version).observe(time.perf_counter() - self.t0)

    def usage(self, results: list[Completion]) -> dict:
        p = sum(len(c.prompt_ids) for c in results[:: self.n])  # each prompt counts once, whatever n
        g = sum(len(c.output_ids) for c in results)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _token_strs(tok, ids: list[int]) -> list[str]:
    return [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids]


def _legacy_logprobs(tok, c: Completion) -> dict:
    strs = _token_strs(tok, c.output_ids)
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    top = None
    if c.top_logprobs:
        top = [{_token_strs(tok, [k])[0]: v for k, v in d.items()} for d in c.top_logprobs]
    return {"tokens": strs, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(tok, ids, lps, tops) -> dict:
    content = []
    for j, (t, lp) in enumerate(zip(ids, lps)):
        s = _token_strs(tok, [t])[0]
        top = [
            {"token": _token_strs(tok, [k])[0], "logprob": v, "bytes": list(tok.decode_bytes([k]))}
            for k, v in (tops[j] if tops else {}).items()
        ]
        content.append({"token": s, "logprob": lp, "bytes": list(tok.decode_bytes([t])), "top_logprobs": top})
    return {"content": content}


def _finish(reason: str) -> str:
    return "stop" if reason == "abort" else reason


def _completion_body(ctx: _Ctx, results: list[Completion]) -> dict:
    tok = ctx.tok
    choices = [
        {
            "index": i,
            "text": c.text,
            "logprobs": _legacy_logprobs(tok, c) if ctx.want_logprobs else None,
            "finish_reason": _finish(c.finish_reason),
            "completion_id": c.request_id,
        }
        for i, c in enumerate(results)
    ]
    return {
        "id": ctx.base_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.version,
        "system_fingerprint": ctx.version,
        "choices": choices,
        "usage": ctx.usage(results),
    }


def _chat_body(ctx: _Ctx, results: list[Completion]) -> dict:
    tok = ctx.tok
    choices = []
    for i, c in enumerate(results):
        lp = _chat_logprobs(tok, c.output_ids, c.logprobs, c.top_logprobs) if ctx.want_logprobs else None
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": lp,
                "finish_reason": _finish(c.finish_reason),
                "completion_id": c.request_id,
            }
        )
    return {
        "id": ctx.base_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.version,
        "system_fingerprint": ctx.version,
        "choices": choices,
        "usage": ctx.usage(results),
    }


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _stream_choice(ctx: _Ctx, tok, chat: bool, i: int, ev, finish: str | None) -> dict:
    """One streamed event of choice `i` as its chunk's choice (chat delta or text)."""
    want_lp = ctx.want_logprobs and bool(ev.token_ids)
    if chat:
        lp = _chat_logprobs(tok, ev.token_ids, ev.logprobs, ev.top_logprobs) if want_lp else None
        delta = {"content": ev.text} if ev.text or finish is None else {}
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
    text_lp = None
    if want_lp:
        tops = (
            [{_token_strs(tok, [k])[0]: v for k, v in d.items()} for d in ev.top_logprobs] if ev.top_logprobs else None
        )
        text_lp = {"tokens": _token_strs(tok, ev.token_ids), "token_logprobs": ev.logprobs, "top_logprobs": tops}
    return {"index": i, "text": ev.text, "logprobs": text_lp, "finish_reason": finish}


async def _record_the_rest(ctx: _Ctx, handles, pumps, results, recorded) -> None:
    """The client went away (or recording failed): stop generating, still record what was served."""
    for h in handles:
        h.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    for i, r in enumerate(results):
        if r is not None and not recorded[i]:
            try:
                await ctx.record(r)
            except APIError:
                log.exception("completion %s was served but could not be recorded", r.request_id)


async def _stream(ctx: _Ctx, handles, include_usage: bool) -> AsyncIterator[bytes]:
    tok = ctx.tok
    chat = ctx.endpoint == "chat.completions"
    obj = "chat.completion.chunk" if chat else "text_completion"
    results: list[Completion | None] = [None] * len(handles)
    recorded = [False] * len(handles)
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        try:
            async for ev in h:
                if ev.completion is not None:
                    results[i] = ev.completion
                await q.put((i, ev, None))
        except Exception as e:  # the engine failed this request: tell the consumer
            await q.put((i, None, e))

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        body = {"id": ctx.base_id, "object": obj, "created": ctx.created, "model": ctx.version,
                "system_fingerprint": ctx.version, "choices": choices}  # fmt: skip
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    try:
        if chat:
            role = {"role": "assistant", "content": ""}
            yield chunk(
                [{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(len(handles))]
            )
        done = 0
        while done < len(handles):
            i, ev, err = await q.get()
            if err is not None:
                yield _sse(error_body(503, f"generation failed: {err}", None, "engine_unavailable"))
                return
            finish = None
            if ev.completion is not None:
                done += 1
                await ctx.record(ev.completion)
                recorded[i] = True
                finish = _finish(ev.completion.finish_reason)
            yield chunk([_stream_choice(ctx, tok, chat, i, ev, finish)])
        final = [r for r in results if r is not None]
        ctx.observe(final)
        if include_usage:
            yield chunk([], ctx.usage(final))
        yield b"data: [DONE]\n\n"
    except APIError as e:
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    finally:
        if not all(recorded):
            ctx.gw.spawn(_record_the_rest(ctx, handles, pumps, results, recorded))
