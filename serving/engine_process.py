"""The embedded engine in a process of its own: the gateway talks to it through typed messages.

Why: in one process the HTTP event loop and the engine share the interpreter lock, and torch's
parallel regions on a second thread are slow once another thread has used them (see
serving/engine.py). Here the engine's scheduling loop runs on the *main thread* of a spawned
process with its own torch threads; a reader thread of that process takes requests off a pipe.
The gateway side (`ProcessEngine`) implements the same interface as `EmbeddedEngine`
(`serving.interface.Engine`): it validates requests locally (context length, vocabulary) so bad
input fails at once with a `ValueError`, and a reader thread dispatches the engine's stream events
to the right `RequestHandle`.

Hot swap as in the embedded engine (`serving/versions.py`): both sides keep a version table. A
request is bound to a version by the proxy (the default resolved there) and sent with its name;
`retire_version` refuses new requests for the version on this side at once, then in the child,
whose loop unloads it once its last request has ended and says so ("unloaded"): `versions` lists
it until then, and `retire_version(wait=True)` returns then. The child's pipe reader never waits
for a drain, so submits and cancels keep flowing meanwhile. A new version loads on the child's
loop thread (see `_child_main`), so serving pauses for the load itself.

Messages, parent → child: ("call", id, op, args) for add_version / set_default / retire_version /
update_weights / shutdown; ("submits", [(request_id, prompt_ids, params, version, stream, background),
...]): the submits an event loop made in one round of its callbacks (`ProcessEngine._queue_submit`);
("cancel", request_id). Child → parent: ("reply", id, ok, value_or_error);
("events", [(request_id, StreamEvent), ...]) once per iteration of the engine's loop (a pass emits
the events of all its sequences in one message: one write and one wake-up of the gateway's reader,
not one per sequence); ("unloaded", version) once a retired version is gone;
("dead", repr(error)) when the engine loop fails.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.checkpoint import read_config
from serving.model import ModelArgs
from serving.requests import EngineError, GenerateMixin, RequestHandle, StreamEvent, caller_loop, check_request
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer
from serving.versions import VersionTable

log = logging.getLogger(__name__)


def _child_main(conn, cfg: dict) -> None:
    from core.supervisor import die_with_parent

    # A gateway or gate that dies, even by SIGKILL, takes its engines with it; asked for first, and with
    # the parent's pid from the parent: one that died before this line still ends this process.
    die_with_parent(parent_pid=cfg.pop("parent_pid"))
    if nice := cfg.pop("nice"):
        os.nice(nice)  # the processes beside it (a learner, a gate) get the CPU first
    import torch

    # Ctrl-C reaches the whole process group: the parent stops this process, after its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from serving.engine import EmbeddedEngine

    torch.set_num_threads(cfg.pop("threads"))
    send_lock = threading.Lock()
    handles: dict[str, RequestHandle] = {}

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    engine = EmbeddedEngine(**cfg, threads=None, start_thread=False)
    engine.on_unload = lambda name: send(("unloaded", name))
    pending: list[tuple[str, StreamEvent]] = []  # this loop iteration's events, sent together after it
    pending_lock = threading.Lock()

    def flush() -> None:
        with pending_lock:
            batch = pending[:]
            pending.clear()
        if batch:
            send(("events", batch))

    engine.after_iteration = flush

    def submit(rid: str, prompt_ids, params, version, stream: bool, background: bool) -> None:
        def sink(ev: StreamEvent) -> None:
            if ev.completion is not None or ev.error is not None:
                handles.pop(rid, None)
            with pending_lock:
                pending.append((rid, ev))

        try:
            handles[rid] = engine.submit(
                prompt_ids, params, version, request_id=rid, stream=stream, sink=sink, background=background
            )
        except Exception as e:  # refused by the engine: the request fails, the engine goes on
            send(("events", [(rid, StreamEvent("", [], [], error=e))]))

    def reader() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone: stop serving
                engine.shutdown()
                return
            kind = msg[0]
            if kind == "submits":
                for rid, prompt_ids, params, version, stream, background in msg[1]:
                    submit(rid, prompt_ids, params, version, stream, background)
            elif kind == "cancel":
                h = handles.get(msg[1])
                if h is not None:
                    h.cancel()
            elif kind == "call":
                _, cid, op, args = msg
                value: Any
                try:
                    if op == "add_version":
                        name, folder, default = args
                        # Loaded on the loop's (main) thread: torch work on a second thread of this
                        # process would make the loop's parallel regions slow (see serving/engine.py).
                        engine.call_in_loop(lambda n=name, f=folder, d=default: engine.add_version(n, f, default=d))
                        value = (engine.context_length(name), engine.weights_dtype(name))
                    elif op == "set_default":
                        engine.set_default(*args)
                        value = None
                    elif op == "retire_version":  # scheduled: the loop unloads it, on_unload reports it
                        engine.retire_version(args[0], wait=False)
                        value = None
                    elif op == "update_weights":
                        engine.update_weights(*args)
                        value = None
                    elif op == "preempt_background":
                        value = engine.preempt_background()
                    elif op == "shutdown":
                        send(("reply", cid, True, None))
                        engine.shutdown()
                        return
                    else:
                        raise ValueError(f"unknown engine operation {op!r}")
                    send(("reply", cid, True, value))
                except Exception as e:
                    send(("reply", cid, False, e))

    threading.Thread(target=reader, name="engine-pipe", daemon=True).start()
    try:
        engine.run_loop()
    except BaseException as e:
        send(("dead", repr(e)))
        raise


@dataclass(frozen=True)
class _Held:
    """What the proxy knows of a version the child holds."""

    tokenizer: Tokenizer
    args: ModelArgs
    context: int
    dtype: str


class ProcessEngine(GenerateMixin):
    def __init__(
        self,
        max_batch: int = 64,
        max_model_len: int = 256,
        threads: int = 2,
        seed: int = 0,
        max_prefill_tokens: int = 2048,
        nice: int = 0,
    ):
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice}: an engine process's niceness is 0-19")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        cfg = dict(
            max_batch=max_batch,
            max_model_len=max_model_len,
            threads=threads,
            seed=seed,
            max_prefill_tokens=max_prefill_tokens,
            parent_pid=os.getpid(),
            nice=nice,
        )
        self._proc = ctx.Process(target=_child_main, args=(child, cfg), name="flywheel-engine", daemon=True)
        self._proc.start()
        child.close()
        self.max_model_len = max_model_len
        from core.settings import get_settings

        self.batch_invariant = get_settings().batch_invariant  # the child's engine reads the same setting
        self._send_lock = threading.Lock()
        self._outbox: list[tuple] = []  # submits waiting for the end of their event loop's round (`_queue_submit`)
        self._flush_on: set = set()  # the event loops that will send the outbox at the end of their round
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._table: VersionTable[_Held] = VersionTable()
        self._bound: dict[str, str] = {}  # request id -> its version, until its last event
        self.failure: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="engine-proxy", daemon=True)
        self._reader.start()

    # ---- plumbing -------------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self._send_lock:
            self._send_submits()  # never ahead of a submit made before it (a cancel, a retire)
            self._conn.send(msg)

    def _queue_submit(self, msg: tuple, loop) -> None:
        """A submit made on an event loop goes out once the loop has run the callbacks ready now, with
        every other submit they made, as one message: one write and one wake-up of the child's reader
        for a burst of requests instead of one each (a write that wakes a sleeping reader costs the
        writer 40-120 us of CPU on this VM, docs/benchmarks.md)."""
        with self._send_lock:
            self._outbox.append(msg)
            if loop in self._flush_on:
                return  # this loop sends the outbox at the end of its round (if nothing sent it before)
            self._flush_on.add(loop)
        loop.call_soon(self._flush_submits, loop)

    def _flush_submits(self, loop) -> None:
        try:
            with self._send_lock:
                self._flush_on.discard(loop)
                self._send_submits()
        except OSError as e:  # the child is gone: its reader's last sweep may have missed these handles
            self.failure = self.failure or f"engine process unreachable ({e!r})"
            self._fail_handles(EngineError(f"engine process is gone: {self.failure}"))

    def _fail_handles(self, err: EngineError) -> None:
        """Every request still waiting gets `err`, once (the reader's last sweep and a failed send may both
        call this)."""
        for rid in list(self._handles):
            h = self._handles.pop(rid, None)
            if h is not None:
                self._table.release(self._bound.pop(rid, ""))
                h._post(StreamEvent("", [], [], error=err))

    def _send_submits(self) -> None:  # holding `_send_lock`
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._conn.send(("submits", batch))

    def _call(self, op: str, *args, timeout: float = 300.0):
        if not self._reader.is_alive():  # nobody would read the reply
            raise EngineError(f"engine process is gone: {self.failure}")
        cid = next(self._ids)
        fut: Future = Future()
        self._calls[cid] = fut
        self._send(("call", cid, op, args))
        return fut.result(timeout)

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=2.0)  # its exit code says how (a negative one: the signal)
                self.failure = self.failure or f"engine process exited (code {self._proc.exitcode})"
                break
            if msg[0] == "events":
                for rid, ev in msg[1]:
                    h = self._handles.get(rid)
                    if h is not None:
                        if ev.completion is not None or ev.error is not None:
                            self._handles.pop(rid, None)
                            self._table.release(self._bound.pop(rid, ""))
                        h._post(ev)
            elif msg[0] == "unloaded":
                self._table.drop(msg[1])
            elif msg[0] == "reply":
                _, cid, ok, value = msg
                fut = self._calls.pop(cid)
                fut.set_result(value) if ok else fut.set_exception(value)
            elif msg[0] == "dead":
                self.failure = msg[1]
                log.error("engine process failed: %s", msg[1])
        err = EngineError(f"engine process is gone: {self.failure}")
        self._fail_handles(err)
        for fut in list(self._calls.values()):
            fut.set_exception(err)
        for name in self._table.idle_retired():  # nobody is left to unload them: wake who waits
            self._table.drop(name)

    # ---- the Engine interface ---------------------------------------------------------------
    def add_version(
        self, name: str, source: str | Path, tokenizer: Tokenizer | None = None, default: bool = False
    ) -> None:
        """Load a version beside those held, in the child (serving pauses there for the load itself)."""
        if not isinstance(source, (str, Path)):
            raise ValueError("the engine process loads versions from checkpoint folders only")
        args, _ = read_config(source)
        tok = tokenizer or Tokenizer.from_file(Path(source))
        context, dtype = self._call("add_version", name, str(source), default)
        self._table.add(name, _Held(tok, args, context, dtype), default)

    @property
    def default_version(self) -> str | None:
        return self._table.default

    def set_default(self, name: str) -> None:
        self._table.get(name)  # the same errors as the embedded engine's, before any message
        self._call("set_default", name)
        self._table.set_default(name)

    def retire_version(self, name: str, wait: bool = True) -> None:
        unloaded = self._table.retire(name)  # refused here from now on; requests already sent are the child's
        self._call("retire_version", name)
        while wait and not unloaded.wait(timeout=0.1):
            if not self.alive:
                self._table.drop(name)

    def update_weights(self, name: str, weights) -> None:
        """In place, in the child: refused (`VersionBusy`) while requests are in flight on `name`."""
        self._call("update_weights", name, weights)

    @property
    def versions(self) -> list[str]:
        return self._table.names()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and self._reader.is_alive() and self.failure is None

    @property
    def pid(self) -> int | None:
        """The engine process's pid (what an operator, or `bench/faults.py`, signals)."""
        return self._proc.pid

    def tokenizer(self, version: str | None = None) -> Tokenizer:
        return self._table.get(version).tokenizer

    def model_args(self, version: str | None = None) -> ModelArgs:
        return self._table.get(version).args

    def context_length(self, version: str | None = None) -> int:
        return self._table.get(version).context

    def weights_dtype(self, version: str | None = None) -> str:
        """The dtype the child serves the version's weights in."""
        return self._table.get(version).dtype

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        version: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        background: bool = False,
    ) -> RequestHandle:
        """As `EmbeddedEngine.submit` (`background`: lent work, behind every live request)."""
        if not self.alive:
            raise EngineError(f"engine process is not running: {self.failure}")
        name, held = self._table.acquire(version)  # bound here: the child gets the name
        try:
            check_request(prompt_ids, params, held.args.vocab_size, held.context)
        except ValueError:
            self._table.release(name)
            raise
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        loop = caller_loop()
        handle = RequestHandle(rid, loop, stream, on_cancel=lambda: self._send(("cancel", rid)))
        self._bound[rid] = name
        self._handles[rid] = handle
        msg = (rid, list(prompt_ids), params, name, stream, background)
        if loop is None:
            with self._send_lock:
                self._outbox.append(msg)
                self._send_submits()
        else:
            self._queue_submit(msg, loop)
        return handle

    def preempt_background(self) -> int:
        """End every background request in the engine at its next step (a reclaim); how many."""
        return self._call("preempt_background")

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._call("shutdown", timeout=30)
            except Exception as e:  # already dying: make sure it is gone below
                log.warning("engine process shutdown: %r", e)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
