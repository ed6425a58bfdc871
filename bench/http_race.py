"""The HTTP race: `flywheel serve` against vLLM's OpenAI server (its CPU build) on the same checkpoint.

Run as `python -m bench.serving --race` (see `bench/serving.py`); the result is
bench/results/serving_race.{json,md}. What makes it a fair race:
- **Same prompt ids.** Both servers get the prompts as token ids (Flywheel's `encode_prompt`: BOS, then
  the text's tokens), and each answers one request per prompt first whose `usage.prompt_tokens` must
  equal the ids' length. The run also asks vLLM's `/tokenize` how *it* would tokenize the texts and
  records whether that matches (`text_ids_match`): a checkpoint whose tokenizer does not add BOS gives
  the two servers different inputs when they are sent text, hence different natural lengths.
- **One cheap client for every row**: `wrk` (Debian's package) with a generated Lua script that cycles
  through the request bodies and counts answers and generated tokens. TTFT is measured apart, by a
  streaming httpx client at 16 connections, the same for both servers.
- **One server up at a time**, so an idle server's threads never compete with the measured one.
  Repetitions are interleaved (A, B, A, B, ...) and the whole race runs in both start orders; every
  figure is the median over the 3 x 2 runs of a server.
- **Same engine settings**: float32, at most 64 sequences at once, 256-token context, one compute
  thread per engine. vLLM with its own default for the machine: `VLLM_CPU_OMP_THREADS_BIND=auto`
  reserves a core for its API server and scheduler and binds its OpenMP threads to the others (one
  here; the race reads the binding back from vLLM's log); its engine process keeps polling on the
  reserved core, so it uses both cores. Flywheel with what uses this machine best: one engine process
  per core (`FLYWHEEL_REPLICAS=2`, each with `FLYWHEEL_TORCH_THREADS=1` and half of the 64 sequences,
  `FLYWHEEL_MAX_BATCH=32`), the gateway routing each request to the engine with fewer in flight. One
  engine of two threads is slower than one of one thread here (parallel regions on these small
  matrices cost more than they save), and a second thread in one process shares its interpreter lock;
  one engine of one thread left half a core idle (docs/benchmarks.md). Flywheel otherwise with its
  defaults (batch-invariant kernels on, the bus's fsync on, the engines in their own processes); vLLM
  with its documented CPU settings (`VLLM_CPU_KVCACHE_SPACE`, the binding above), eager mode. Both
  configurations are `FLYWHEEL_ENV` and `VLLM_ARGS`/`VLLM_ENV` below, and are written into the result,
  with the cores each server used per row.
- **CPU per request**: the server's processes' user+system time over a row, divided by the requests it
  answered, for its front end (the HTTP process) and in all (front end plus engine processes).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from core.harness import free_port, wait_until
from core.supervisor import Supervisor

CLIENTS = (1, 16, 64)
LENGTHS = {"natural": False, "fixed": True}  # ignore_eos
MAX_TOKENS = 48
TTFT_CLIENTS = 16
MODEL = "flywheel"  # the name both serve it under (Flywheel's alias for the promoted version)
COMPUTE_THREADS = max(1, (os.cpu_count() or 2) - 1)  # vLLM's `auto` binding on x86: one core kept for its front end
MAX_SEQS = 64  # sequences in flight at most, each server
FLYWHEEL_ENGINES = 2  # one engine process per core of this machine (module docstring)
FLYWHEEL_ENV = {
    "FLYWHEEL_TORCH_THREADS": "1",
    "FLYWHEEL_ENGINE": "process",
    "FLYWHEEL_REPLICAS": str(FLYWHEEL_ENGINES),
    "FLYWHEEL_MAX_BATCH": str(MAX_SEQS // FLYWHEEL_ENGINES),
    "FLYWHEEL_MAX_MODEL_LEN": "256",
    "FLYWHEEL_BATCH_INVARIANT": "1",
}
LIMITS_ENV = {  # `--limits`: every request pays the token bucket; none is refused at these rates
    "FLYWHEEL_LIMIT_COMPLETIONS_PER_S": "100000",
    "FLYWHEEL_LIMIT_COMPLETIONS_BURST": "100000",
    "FLYWHEEL_LIMIT_FEEDBACK_EVENTS_PER_S": "100000",
    "FLYWHEEL_LIMIT_FEEDBACK_BURST": "100000",
}
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", str(MAX_SEQS)]
VLLM_ARGS += ["--enforce-eager", "--seed", "0"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto"}

LUA = r"""
local bodies = {BODIES}
local i = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) ok = 0; bad = 0; tokens = 0 end
function request()
  i = i % #bodies + 1
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, bodies[i])
end
function response(status, headers, body)
  if status == 200 then
    ok = ok + 1
    local n = string.match(body, '"completion_tokens"%s*:%s*(%d+)')
    tokens = tokens + (tonumber(n) or 0)
  else
    bad = bad + 1
  end
end
function done(summary, latency, requests)
  local o, b, t = 0, 0, 0
  for _, th in ipairs(threads) do o = o + th:get("ok"); b = b + th:get("bad"); t = t + th:get("tokens") end
  io.write(string.format('RACE {"ok": %d, "bad": %d, "tokens": %d, "duration_us": %d, "errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n', o, b, t, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def body(ids: list[int], fixed: bool, stream: bool = False) -> dict:
    b: dict[str, Any] = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0}
    if fixed:
        b["ignore_eos"] = True
    if stream:
        b["stream"] = True
    return b


def lua_script(prompts: list[list[int]], fixed: bool, folder: Path) -> Path:
    quoted = ", ".join("[==[" + json.dumps(body(p, fixed)) + "]==]" for p in prompts)
    path = folder / f"race-{'fixed' if fixed else 'natural'}.lua"
    path.write_text(LUA.replace("{BODIES}", "{" + quoted + "}"))
    return path


def wrk(url: str, script: Path, clients: int, seconds: float) -> dict:
    """One wrk run: `clients` connections on one client thread for `seconds`."""
    argv = ["wrk", "-t1", f"-c{clients}", f"-d{seconds:.0f}s", "--timeout", "60s", "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("RACE ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    r = json.loads(line.removeprefix("RACE "))
    s = r["duration_us"] / 1e6
    return {
        "requests": r["ok"],
        "failed": r["bad"] + r["errors"],
        "seconds": s,
        "requests_per_s": r["ok"] / s,
        "tokens_per_s": r["tokens"] / s,
        "tokens_per_request": r["tokens"] / r["ok"] if r["ok"] else None,
        "p50_latency_s": r["p50_us"] / 1e6,
        "p99_latency_s": r["p99_us"] / 1e6,
    }


async def _ttft(url: str, prompts: list[list[int]], clients: int, n: int) -> list[float]:
    import httpx

    firsts: list[float] = []
    todo = iter(range(n))

    async with httpx.AsyncClient(timeout=120) as client:

        async def worker() -> None:
            for i in todo:
                t0 = time.perf_counter()
                b = body(prompts[i % len(prompts)], fixed=True, stream=True)
                async with client.stream("POST", url + "/v1/completions", json=b) as r:
                    r.raise_for_status()
                    first = None
                    async for line in r.aiter_lines():  # read to the end: the connection is reused
                        if first is None and line.startswith("data: ") and '"text"' in line:
                            first = time.perf_counter() - t0
                    if first is not None:
                        firsts.append(first)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return firsts


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _post(url: str, path: str, payload: dict) -> dict:
    import httpx

    r = httpx.post(url + path, json=payload, timeout=120)
    r.raise_for_status()
    return r.json()


class Server:
    """One of the two racers, started and stopped under the race's supervisor."""

    def __init__(self, name: str, model_dir: Path, scratch: Path, sup: Supervisor, env: dict[str, str] | None = None):
        self.name, self.model_dir, self.scratch, self.sup = name, model_dir, scratch, sup
        self.env = env or {}
        self.url = ""
        self.pid = 0

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = self.scratch / f"{self.name}.log"
        if self.name == "flywheel":
            home = self.scratch / "flywheel-home"
            shutil.rmtree(home, ignore_errors=True)
            env = {**FLYWHEEL_ENV, **self.env, "FLYWHEEL_HOME": str(home), "FLYWHEEL_MODEL_DIR": str(self.model_dir)}
            env |= {"FLYWHEEL_HOST": "127.0.0.1", "FLYWHEEL_PORT": str(port)}
            child = common.start(self.sup, self.name, common.module_argv("cli", "serve"), env=env, log_path=log)
        else:
            argv = common.module_argv("vllm.entrypoints.openai.api_server", "--model", str(self.model_dir))
            argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS]
            child = common.start(self.sup, self.name, argv, env=VLLM_ENV | self.env, log_path=log)
        self.pid = child.pid

        def ready() -> bool:
            if not child.alive():
                raise RuntimeError(f"{self.name} exited before serving:\n{child.tail()}")
            return common.port_open(port) and _health(self.url)

        wait_until(ready, 600, what=f"{self.name} at {self.url}", interval_s=0.5)

    def stop(self) -> None:
        self.sup.stop_child(self.name)

    def cpu(self) -> tuple[float, float]:
        """(front end, all) CPU seconds so far: the HTTP process, and it with its descendants."""
        return _cpu_s([self.pid]), _cpu_s(common.process_tree(self.pid))


def _health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def omp_binding(log: Path) -> dict[str, str]:
    """The cores vLLM bound its OpenMP threads to and those it reserved, as its engine logged them."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        for key, tag in (("cores", "local_rank=0, core ids="), ("reserved", "reserved_cpus=")):
            if tag in line:
                found[key] = line.split(tag, 1)[1].strip()
    if set(found) != {"cores", "reserved"}:
        raise RuntimeError(f"vLLM logged no OpenMP binding in {log}: the race cannot say what it ran with")
    return found


def check_prompts(server: Server, prompts: list[list[int]]) -> None:
    """Each prompt, sent as ids, is read as exactly those ids (their count, in the usage)."""
    for p in prompts:
        got = _post(server.url, "/v1/completions", {**body(p, fixed=False), "max_tokens": 1})["usage"]["prompt_tokens"]
        if got != len(p):
            raise RuntimeError(f"{server.name} read {got} prompt tokens where {len(p)} ids were sent: another input")


def text_ids_match(server: Server, texts: list[str], prompts: list[list[int]]) -> bool:
    """Would vLLM, sent the texts, see the ids Flywheel sees? (`/tokenize`, vLLM's own route.)"""
    return all(
        _post(server.url, "/tokenize", {"model": MODEL, "prompt": t})["tokens"] == p
        for t, p in zip(texts, prompts, strict=True)
    )


def measure(server: Server, scripts: dict[str, Path], prompts: list[list[int]], seconds: float, ttft_n: int) -> list:
    rows = []
    wrk(server.url, scripts["fixed"], 4, 2)  # warm-up
    for length, script in scripts.items():
        for c in CLIENTS:
            before = server.cpu()
            row = wrk(server.url, script, c, seconds)
            after = server.cpu()
            n = max(row["requests"], 1)
            row |= {"server": server.name, "length": length, "clients": c}
            row["front_cpu_ms_per_request"] = (after[0] - before[0]) * 1e3 / n
            row["cpu_ms_per_request"] = (after[1] - before[1]) * 1e3 / n
            row["cores_used"] = (after[1] - before[1]) / row["seconds"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    firsts = asyncio.run(_ttft(server.url, prompts, TTFT_CLIENTS, ttft_n))
    rows.append(
        {"server": server.name, "length": "ttft", "clients": TTFT_CLIENTS, "p50_ttft_s": statistics.median(firsts)}
    )
    print(json.dumps(rows[-1]), flush=True)
    return rows


def medians(runs: list[dict]) -> list[dict]:
    """Per (server, length, clients): the median of every figure over the runs."""
    keys = sorted({(r["server"], r["length"], r["clients"]) for r in runs})
    out = []
    for k in keys:
        group = [r for r in runs if (r["server"], r["length"], r["clients"]) == k]
        row: dict[str, Any] = {"server": k[0], "length": k[1], "clients": k[2], "runs": len(group)}
        for f in group[0]:
            if f not in row and isinstance(group[0][f], int | float):
                row[f] = common.med([g.get(f) for g in group])
        out.append(row)
    return out


def ratios(rows: list[dict]) -> dict[str, float | None]:
    """Flywheel over vLLM for the issue's figures (TTFT: lower is better, so Flywheel / vLLM ≤ 1 wins)."""
    by = {(r["server"], r["length"], r["clients"]): r for r in rows}

    def ratio(length: str, c: int, field: str) -> float | None:
        f, v = by.get(("flywheel", length, c)), by.get(("vllm", length, c))
        return f[field] / v[field] if f and v and v.get(field) else None

    return {
        "requests_per_s_natural_64": ratio("natural", 64, "requests_per_s"),
        "tokens_per_s_fixed_64": ratio("fixed", 64, "tokens_per_s"),
        "p50_ttft_16": ratio("ttft", TTFT_CLIENTS, "p50_ttft_s"),
    }


def race(model_dir: Path, texts: list[str], prompts: list[list[int]], a) -> dict:
    if shutil.which("wrk") is None:
        raise SystemExit("bench.serving --race needs wrk on PATH (Debian: apt-get install wrk)")
    scratch = Path(tempfile.mkdtemp(prefix="race-"))
    scripts = {name: lua_script(prompts, fixed, scratch) for name, fixed in LENGTHS.items()}
    runs: list[dict] = []
    found: dict[str, Any] = {}
    orders = [["flywheel", "vllm"], ["vllm", "flywheel"]][: a.orders]
    try:
        with Supervisor("bench-race") as sup:
            for o, order in enumerate(orders):
                for rep in range(a.reps):
                    for name in order:
                        extra = LIMITS_ENV if name == "flywheel" and getattr(a, "limits", False) else {}
                        server = Server(name, model_dir, scratch, sup, extra)
                        t0 = time.perf_counter()
                        server.start()
                        print(f"race: order {o} rep {rep}: {name} up in {time.perf_counter() - t0:.0f} s", flush=True)
                        try:
                            check_prompts(server, prompts)
                            if name == "vllm" and "text_ids_match" not in found:
                                found["text_ids_match"] = text_ids_match(server, texts, prompts)
                                found["vllm_omp_binding"] = omp_binding(scratch / "vllm.log")
                            for row in measure(server, scripts, prompts, a.seconds, a.ttft_requests):
                                runs.append(row | {"order": o, "rep": rep})
                        finally:
                            server.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = medians(runs)
    return {
        "model": common.shown(model_dir),
        "cpus": os.cpu_count(),
        "compute_threads": COMPUTE_THREADS,
        "flywheel_engines": FLYWHEEL_ENGINES,
        "max_seqs": MAX_SEQS,
        "max_tokens": MAX_TOKENS,
        "seconds_per_row": a.seconds,
        "reps": a.reps,
        "orders": [" then ".join(o) for o in orders],
        "prompts": len(prompts),
        "same_prompt_ids": True,  # check_prompts raised otherwise
        **found,
        "config": {
            "flywheel_env": FLYWHEEL_ENV | (LIMITS_ENV if getattr(a, "limits", False) else {}),
            "vllm_args": VLLM_ARGS,
            "vllm_env": VLLM_ENV,
        },
        "rows": rows,
        "ratios": ratios(rows),
        "runs": runs,
    }
