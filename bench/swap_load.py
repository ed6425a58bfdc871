"""Swap under load: a promotion and a rollback while 64 streaming clients run, against the same load without.

Setup (everything real, nothing in-process that production runs apart):
- Registry: PostgreSQL at 127.0.0.1:5432 (db `test`, a fresh schema per run of this script; replicas
  LISTEN for its NOTIFY), or `--db sqlite` (a file; replicas poll it once a second).
- Weight server: `flywheel serve` on the "learner's machine" (its own home, 1 embedded replica, the
  learner's models folder); the base is published there (`registry.publish.publish_base`) and each
  candidate is shipped the way `learner.service` ships one: a checkpoint folder plus a lossless delta
  on its parent in the weight store (float32), registered with both files.
- Gateway under test: `flywheel serve` (uvicorn) in its own process, 2 replicas (the machine has 2
  cores), each the embedded engine in its own process with 1 torch thread; replicas fetch versions
  over HTTP from the weight server's `/v1/weights` (a `weights:read` key), verify them against the
  registry's hashes, load them beside the served one and heartbeat every 5 s (and right after a sync).
- Load: `bench.stream_load`, a process of its own: 64 streaming clients of the alias `flywheel` with no
  `user` (the canary routes none of them: every request is served by the promoted version).
- Candidate: the promoted version after one optimizer step of the learner's defaults (AdamW lr 1e-4,
  betas (0.9, 0.95), clip 1.0) on the demo LM loss (a fresh demo-corpus batch of 64), shipped as a delta.

One run: a baseline phase (`--seconds` of that load, no registry change), then a swap phase of the
same length and load during which the gate puts the candidate in canary at +3 s (share 0.1: the
replicas fetch, verify and load it beside the promoted one), a person approves it over HTTP (admin
key) at +12 s (replicas switch: new requests go to it, those in flight finish on the old one, which
is then unloaded), and rolls it back over HTTP at +21 s (replicas rebuild the previous version from
their local store, load it and switch back). `--runs` runs (default 3); medians are reported.

Definitions (failed or dropped, inter-token gap: `bench.stream_load`; the embedded engine streams one token
per chunk). Baseline gaps: the baseline phase less
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

The peer, in the same run: the same load without a swap (the baseline phase just before). The vLLM
engine's swap is `bench.swap_vllm`.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import common, stream_load
from bench.stream_load import failures, gaps, outside, ttfts
from core.harness import LiveGateway
from core.supervisor import Supervisor

NAME = "swap_load"
PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
EVENTS = (("canary", 3.0), ("approve", 12.0), ("rollback", 21.0))


def q_ms(xs: list[float], q: float) -> float | None:
    """The q-th percentile of `xs` (seconds) in ms; None for no values."""
    return stream_load.ms(common.pct(xs, q))


def max_ms(xs: list[float]) -> float | None:
    return max(xs) * 1e3 if xs else None


def syncs(log: Path, since: float) -> list[dict]:
    """The replicas' sync timelines (`serving.replica.SyncResult.timeline`) a gateway logged since `since`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"replica (\S+): sync (\{.*\})$", line)
        if m:
            rec = json.loads(m.group(2))
            if rec["started_at"] >= since:
                out.append({"replica": m.group(1), **rec})
    return out


def gateway_log(gw: LiveGateway) -> Path:
    assert gw.log_path is not None
    return gw.log_path


# -- the candidate, shipped as the learner ships one ------------------------------------------------


def publish_candidate(reg: Any, models: Path, parent: str, vid: str, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from demo.bootstrap import encode_example
    from demo.corpus import make_corpus
    from registry.publish import SHIPPING_DTYPE, STORE, file_entry
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


def gate_to_canary(reg: Any, vid: str, share: float) -> None:
    reg.transition(vid, "evaluating", "gate", "offline eval (benchmark)")
    verdict = {"passed": True, "incumbent_id": reg.incumbent().id, "artifact_sha256": reg.get(vid).artifact_sha256,
               "suite_version": "bench", "numbers": {}}  # fmt: skip
    reg.record_gate(vid, "offline", verdict, "gate")
    reg.transition(vid, "canary", "gate", "offline passed")
    reg.record_gate(vid, "canary", {"step": 0, "share": share, "started_at": datetime.now(UTC)}, "gate")


class BeatWatch:
    """Polls the registry's heartbeat rows every 20 ms, keeping each distinct report of each replica."""

    def __init__(self, reg: Any):
        self.reg, self._stop = reg, threading.Event()
        self.seen: dict[tuple, tuple[float, str, dict, dict]] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from registry.fleet_state import read

        while not self._stop.wait(0.02):
            for b in read(self.reg.engine)[0]:
                key = (b.replica_id, b.reported_at)
                if key not in self.seen:
                    self.seen[key] = (b.reported_at.timestamp(), b.replica_id, dict(b.holds), dict(b.serves))

    def reported(self, replicas: list[str], since: float, ok: Callable[[dict, dict], bool]) -> float | None:
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

    def wait(
        self, replicas: list[str], since: float, ok: Callable[[dict, dict], bool], timeout_s: float
    ) -> float | None:
        """`reported`, once it is known or after `timeout_s` (then None)."""
        return common.within(lambda: self.reported(replicas, since, ok), timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def ok_checks(vid: str, sha: str, base: str, base_sha: str) -> dict[str, Callable[[dict, dict], bool]]:
    """What a replica's report must show after each event (holds: version -> hash; serves: version -> share)."""
    return {
        "canary": lambda h, s: h.get(vid) == sha,
        "approve": lambda h, s: h.get(vid) == sha and s.get(vid) == 1.0 and len(s) == 1,
        "rollback": lambda h, s: h.get(base) == base_sha and s.get(base) == 1.0 and len(s) == 1,
    }


def swap_event(reg: Any, url: str, admin: dict[str, str], name: str, vid: str) -> None:
    """The registry change of one event: canary start by the gate, approval and rollback by a person (HTTP)."""
    import httpx

    if name == "canary":
        gate_to_canary(reg, vid, share=0.1)
        return
    if name == "approve":
        reg.transition(vid, "awaiting_approval", "gate", "canary passed (benchmark)")
    r = httpx.post(url + f"/admin/versions/{vid}/{name}", json={"reason": "benchmark"}, headers=admin)
    assert r.status_code == 200, r.text


# -- one run --------------------------------------------------------------------------------------


def one_run(
    i: int, a: Any, sup: Supervisor, reg: Any, models: Path, gw: LiveGateway, beats: BeatWatch, work: Path
) -> dict:
    replicas = [f"serve-r{k}" for k in range(a.replicas)]
    base = reg.promoted().id
    t0 = time.time()
    base_recs = stream_load.collect(stream_load.start(sup, gw.url, a.seconds, a.clients, work))
    baseline_window = [(t0 + 2.0, t0 + a.seconds - 1.0)]
    vid = f"cand-{uuid.uuid4().hex[:6]}"
    cand = publish_candidate(reg, models, base, vid, seed=i)
    sha = reg.get(vid).artifact_sha256
    base_sha = reg.get(base).artifact_sha256

    t_start = time.time()
    load = stream_load.start(sup, gw.url, a.seconds, a.clients, work)
    times: dict[str, float] = {}
    ok = ok_checks(vid, sha, base, base_sha)
    reported: dict[str, float | None] = {}
    for name, at in EVENTS:
        time.sleep(max(0.0, t_start + at - time.time()))
        times[name + "_called"] = time.time()
        swap_event(reg, gw.url, a.admin, name, vid)
        want = {"canary": "canary", "approve": "promoted", "rollback": "promoted"}[name]
        target = base if name == "rollback" else vid
        times[name] = next(
            e.at.timestamp() for e in reversed(reg.audit(target)) if e.to_status == want and e.at.timestamp() >= t_start
        )
        reported[name] = beats.wait(replicas, times[name], ok[name], 8.5)
    swap_recs = stream_load.collect(load)
    logged = syncs(gateway_log(gw), t_start)

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
        for s in logged:
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
            "p99_gap_ms": q_ms(g_event, 99),
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
    g_out = gaps(swap_recs, outside((t_start + 2.0, t_start + a.seconds - 1.0), windows))
    assert reg.promoted().id == base
    fails_b, fails_s = failures(base_recs), failures(swap_recs)
    return {
        "run": i,
        "candidate": cand,
        "baseline": {
            "requests": len(base_recs),
            "failed": len(fails_b),
            "gaps": len(g_base),
            "p50_gap_ms": q_ms(g_base, 50),
            "p99_gap_ms": q_ms(g_base, 99),
            "max_gap_ms": max_ms(g_base),
            "p50_ttft_ms": q_ms(f_base, 50),
            "p99_ttft_ms": q_ms(f_base, 99),
            "tokens_per_s": sum(r["tokens"] for r in base_recs) / a.seconds,
        },  # fmt: skip
        "swap": {
            "requests": len(swap_recs),
            "failed": len(fails_s),
            "gaps_in_windows": len(g_swap),
            "p50_gap_ms": q_ms(g_swap, 50),
            "p99_gap_ms": q_ms(g_swap, 99),
            "max_gap_ms": max_ms(g_swap),
            "p50_ttft_ms": q_ms(f_swap, 50),
            "p99_ttft_ms": q_ms(f_swap, 99),
            "p99_gap_whole_phase_ms": q_ms(g_all, 99),
            "p99_gap_outside_windows_ms": q_ms(g_out, 99),
            "max_gap_whole_phase_ms": max_ms(g_all),
            "tokens_per_s": sum(r["tokens"] for r in swap_recs) / a.seconds,
            "served_by": {m: sum(r["model"] == m for r in swap_recs) for m in {r["model"] for r in swap_recs}},
        },  # fmt: skip
        "added_p99_stall_ms": (q_ms(g_swap, 99) or 0.0) - (q_ms(g_base, 99) or 0.0),
        "failures": [{k: r[k] for k in ("status", "error", "done", "model", "tokens", "n")} for r in fails_b + fails_s][
            :20
        ],  # fmt: skip
        "events": events,
    }


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
        return float(common.med(times) or 0.0)
    finally:
        eng.shutdown()


def summary(runs: list[dict]) -> dict:
    med = common.med
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


def spread(runs: list[dict]) -> float | None:
    """The no-swap spread of the p99 gap: |swap phase outside its windows - baseline|, median of runs."""
    return common.med([abs(r["swap"]["p99_gap_outside_windows_ms"] - r["baseline"]["p99_gap_ms"]) for r in runs])


@contextlib.contextmanager
def registry_url(db: str, work: Path) -> Iterator[str]:
    """A fresh registry: a schema of the PostgreSQL database `test` (dropped after), or a SQLite file."""
    if db == "sqlite":
        yield f"sqlite:///{work / 'registry.db'}"
        return
    from sqlalchemy import text

    from registry.db import make_engine

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


def weight_server(sup: Supervisor, work: Path, common_env: dict[str, str]) -> tuple[LiveGateway, str]:
    """The learner's machine: a gateway with 1 embedded replica serving `/v1/weights`; it and a
    `weights:read` token for the replicas."""
    from registry.keys import KeyStore

    home = work / "learner-box"
    home.mkdir()
    token = KeyStore(f"sqlite:///{home / 'registry.db'}").create(["weights:read"], label="replicas")[0]
    env = {**common_env, "FLYWHEEL_ENGINE": "embedded", "FLYWHEEL_REPLICAS": "1", "FLYWHEEL_GATEWAY_ID": "learner-box"}
    return common.gateway(home, env, sup, name="weight-server"), token


def serve_env(common_env: dict[str, str], weights: LiveGateway, token: str, **extra: str) -> dict[str, str]:
    """The gateway under test's settings: replicas that fetch from the weight server."""
    return {
        **common_env,
        "FLYWHEEL_GATEWAY_ID": "serve",
        "FLYWHEEL_WEIGHTS_URL": f"{weights.url}/v1/weights",
        "FLYWHEEL_WEIGHTS_TOKEN": token,
        **extra,
    }


def admin_header(home: Path) -> dict[str, str]:
    from registry.keys import KeyStore

    home.mkdir(parents=True, exist_ok=True)
    token = KeyStore(f"sqlite:///{home / 'registry.db'}").create(["admin"])[0]
    return {"Authorization": f"Bearer {token}"}


def measure(a: Any, model: Path, work: Path, db_url: str) -> dict:
    """The weight server, the gateway under test, the runs: the results' record."""
    from registry.publish import STORE
    from registry.registry import Registry

    load_alone_s = idle_load_s(model)
    common_env = {
        "FLYWHEEL_DATABASE_URL": db_url,
        "FLYWHEEL_MODEL_DIR": str(model.resolve()),
        "FLYWHEEL_MAX_BATCH": "64",
    }
    serve_home = work / "gateway"
    a.admin = admin_header(serve_home)
    reg = Registry(db_url)
    beats = BeatWatch(reg)
    runs: list[dict] = []
    try:
        with Supervisor("bench-swap-load") as sup:
            wgw, token = weight_server(sup, work, common_env)
            env = serve_env(common_env, wgw, token, FLYWHEEL_ENGINE=a.engine, FLYWHEEL_REPLICAS=str(a.replicas),
                            FLYWHEEL_TORCH_THREADS="1")  # fmt: skip
            models = work / "learner-box" / "models" / "learner"
            gw = common.gateway(serve_home, env, sup)
            warm = stream_load.collect(stream_load.start(sup, gw.url, 5.0, a.clients, work))
            print(f"warm-up: {len(warm)} requests, {len(failures(warm))} failed", flush=True)
            for i in range(1, a.runs + 1):
                load1 = common.loadavg()[0]
                print(f"run {i}: load average {common.loadavg()}", flush=True)
                res = one_run(i, a, sup, reg, models, gw, beats, work)
                res["loadavg_1min"] = load1
                runs.append(res)
                print(json.dumps({k: res[k] for k in ("baseline", "swap", "added_p99_stall_ms")}), flush=True)
    finally:
        beats.stop()
        reg.close()
    snapshot = next((work / "learner-box" / "models" / "learner" / STORE).glob("*.snapshot.fws"))
    s = summary(runs)
    s["no_swap_spread_ms"] = spread(runs)
    return {
        "config": {
            "db": "PostgreSQL (NOTIFY)" if a.db == "postgres" else "SQLite (1 s poll)",
            "replicas": a.replicas,
            "engine": a.engine,
            "clients": a.clients,
            "seconds": a.seconds,
            "max_tokens": stream_load.MAX_TOKENS,
            "events_at_s": dict(EVENTS),
            "heartbeat_s": 5.0,
            "canary_share": 0.1,
            "model": common.shown(model),
            "snapshot_MB": snapshot.stat().st_size / 1e6,
            "add_version_idle_s": load_alone_s,
        },
        "summary": s,
        "runs": runs,
        "events": [name for name, _ in EVENTS],
    }


def main() -> None:
    from demo.bootstrap import SHIPPED_BASE

    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--engine", default="process")
    ap.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, homes)")
    a = ap.parse_args()
    if a.seconds < max(at for _, at in EVENTS) + 6:
        ap.error(f"--seconds must leave time after the rollback (>= {max(at for _, at in EVENTS) + 6})")
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {a.model}: pass --model, a bootstrapped base (`flywheel bootstrap`)")
    st = common.stamp()
    work = Path(tempfile.mkdtemp(prefix="swap-load-"))
    with registry_url(a.db, work) as db_url:
        result = measure(a, a.model, work, db_url)
    common.save(NAME, result, st, a.out)
    if a.keep:
        print("work folder:", work)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
