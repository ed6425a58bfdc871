"""What the HTTP gateway costs beside its engine: `flywheel serve` against the same engine driven directly.

The race's settings (`bench/http_race.py`: the demo base, its 64 prompts as ids, at most 48 tokens at
temperature 1, natural and fixed length, one compute thread fewer than the cores, batch-invariant
kernels) with one engine of batch 64 on both sides (`ONE_ENGINE_ENV`; the race runs two engines of 32
on this machine), and the same load, 64 closed-loop clients, each sending its next request as soon as
its last one is answered:
- **engine alone**: a `ProcessEngine` (the engine in its own process, as the gateway runs it) with
  64 client threads in this process calling `submit(...).result()`;
- **gateway**: `flywheel serve` with that engine, 64 `wrk` connections posting /v1/completions (every
  completion durably recorded before its answer, as in production).
Repetitions alternate the two sides (engine first in even ones). Every figure is the median over the
repetitions; the ratio is gateway / engine alone (the issue's floor: at least 0.85x at batch 64).

    python -m bench.gateway_cost --reps 3 --seconds 30

Writes bench/results/gateway_cost.{json,md}. Needs wrk (Debian) on PATH.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import common
from bench import http_race as hr
from core.supervisor import Supervisor
from demo.bootstrap import SHIPPED_BASE
from demo.split import sample_tasks
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

CLIENTS = 64
# One engine of batch 64 on both sides (the figure), whatever engines the race gives the gateway.
ONE_ENGINE_ENV = {
    "FLYWHEEL_REPLICAS": "1",
    "FLYWHEEL_MAX_BATCH": str(CLIENTS),
    "FLYWHEEL_TORCH_THREADS": str(hr.COMPUTE_THREADS),
}
FIGURES = ("requests_per_s", "tokens_per_s", "tokens_per_request")


def engine_alone(prompts: list[list[int]], seconds: float) -> list[dict]:
    """64 closed-loop clients on a `ProcessEngine` with the race's settings, per length."""
    from serving.engine_process import ProcessEngine

    eng = ProcessEngine(max_batch=CLIENTS, max_model_len=256, threads=hr.COMPUTE_THREADS)
    rows = []
    try:
        eng.add_version(hr.MODEL, SHIPPED_BASE, default=True)
        for length, fixed in hr.LENGTHS.items():
            sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=hr.MAX_TOKENS, ignore_eos=fixed)
            eng.generate(prompts[:4], sp)  # warm-up
            done, tokens, lock = [0], [0], threading.Lock()
            deadline = time.perf_counter() + seconds
            order = itertools.count()  # the next request takes the next prompt, whichever client sends it (as wrk)

            def client(sp=sp, done=done, tokens=tokens, lock=lock, deadline=deadline, order=order) -> None:
                while time.perf_counter() < deadline:
                    c = eng.submit(prompts[next(order) % len(prompts)], sp, stream=False).result()
                    if time.perf_counter() <= deadline:
                        with lock:
                            done[0] += 1
                            tokens[0] += len(c.output_ids)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = min(time.perf_counter(), deadline) - t0
            rows.append(
                {
                    "side": "engine alone",
                    "length": length,
                    "requests_per_s": done[0] / wall,
                    "tokens_per_s": tokens[0] / wall,
                    "tokens_per_request": tokens[0] / max(done[0], 1),
                }
            )
            print(rows[-1], flush=True)
    finally:
        eng.shutdown()
    return rows


def gateway(prompts: list[list[int]], seconds: float, scratch: Path, sup: Supervisor) -> list[dict]:
    server = hr.Server("flywheel", SHIPPED_BASE, scratch, sup, env=ONE_ENGINE_ENV)
    server.start()
    rows = []
    try:
        hr.check_prompts(server, prompts)
        scripts = {length: hr.lua_script(prompts, fixed, scratch) for length, fixed in hr.LENGTHS.items()}
        hr.wrk(server.url, scripts["fixed"], 4, 2)  # warm-up
        for length, script in scripts.items():
            r = hr.wrk(server.url, script, CLIENTS, seconds)
            rows.append({"side": "gateway", "length": length, "failed": r["failed"]} | {k: r[k] for k in FIGURES})
            print(rows[-1], flush=True)
    finally:
        server.stop()
    return rows


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    x, y = a["requests_per_s"], b["requests_per_s"]
    return x / y if x is not None and y else None


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    a = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("bench.gateway_cost needs wrk on PATH (Debian: apt-get install wrk)")
    st = common.stamp()
    tok = Tokenizer.from_file(SHIPPED_BASE)
    prompts = [tok.encode_prompt(t.prompt) for t in sample_tasks(64, seed=12345)]
    scratch = Path(tempfile.mkdtemp(prefix="gateway-cost-"))
    runs: list[dict] = []
    try:
        with Supervisor("bench-gateway-cost") as sup:
            for rep in range(a.reps):
                sides = ["engine", "gateway"] if rep % 2 == 0 else ["gateway", "engine"]
                for side in sides:
                    got = (
                        engine_alone(prompts, a.seconds)
                        if side == "engine"
                        else gateway(prompts, a.seconds, scratch, sup)
                    )
                    runs += [r | {"rep": rep} for r in got]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for side in ("engine alone", "gateway"):
        for length in hr.LENGTHS:
            group = [r for r in runs if r["side"] == side and r["length"] == length]
            rows.append(
                {"side": side, "length": length, "runs": len(group)}
                | {f: common.med([g[f] for g in group]) for f in FIGURES}
            )
    by = {(r["side"], r["length"]): r for r in rows}
    ratios = {length: _ratio(by[("gateway", length)], by[("engine alone", length)]) for length in hr.LENGTHS}
    result = {
        "model": common.shown(SHIPPED_BASE),
        "clients": CLIENTS,
        "compute_threads": hr.COMPUTE_THREADS,
        "flywheel_env": hr.FLYWHEEL_ENV | ONE_ENGINE_ENV,
        "max_tokens": hr.MAX_TOKENS,
        "seconds_per_row": a.seconds,
        "reps": a.reps,
        "rows": rows,
        "ratios": ratios,
        "runs": runs,
        "failed": sum(r.get("failed", 0) for r in runs),
    }
    common.save("gateway_cost", result, st, a.out)


if __name__ == "__main__":
    main()
