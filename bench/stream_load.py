"""The streaming load of the swap benchmarks, in a process of its own, and what is read from it.

`python -m bench.stream_load URL SECONDS CLIENTS OUT`: CLIENTS clients, each posting `/v1/completions` with
`stream=true` (SSE) to URL, the alias `flywheel`, no `user` (the canary routes none of them), temperature 1,
32 to 96 tokens (uniform, EOS ignored; mean 64), one request after another, for SECONDS; the clients start
spread over the first second so they do not run in lockstep. Each request's record (status, the version
that answered, the arrival time of every chunk, tokens from the usage chunk, an error) goes to OUT as JSON.
The generator parses only what it must and runs at nice -5: on a shared machine its own wait for a core
would otherwise show up as inter-token gaps.

Definitions used by the swap benchmarks:
- failed or dropped: a request that did not get 200, whose stream carried an error or ended without
  `data: [DONE]`, or that got another number of tokens than it asked for;
- inter-token gap: the time between two consecutive SSE chunks of one stream at the client.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common
from core.supervisor import Child, Supervisor, child_setup

MAX_TOKENS = 64


async def _read_sse(r: Any, rec: dict) -> None:
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
            await asyncio.sleep(i / clients)
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


def main() -> None:
    child_setup()
    _, url, seconds, clients, out = sys.argv
    from demo.split import sample_tasks

    os.nice(-5)  # the instrument runs ahead of the other jobs: a token is seen when it arrives
    prompts = [t.prompt for t in sample_tasks(256, seed=777)]
    recs = asyncio.run(_load(url, float(seconds), int(clients), prompts))
    for r in recs:  # compact: milliseconds after the start, 0.1 ms resolution
        r["t"] = [round((t - r["start"]) * 1e3, 1) for t in r["t"]]
    Path(out).write_text(json.dumps(recs))


@dataclass
class Load:
    """A running load generator: its supervised child and where its records will be."""

    child: Child
    name: str
    out: Path
    supervisor: Supervisor


def start(sup: Supervisor, url: str, seconds: float, clients: int, work: Path) -> Load:
    name = f"load-{uuid.uuid4().hex[:8]}"
    out = work / f"{name}.json"
    argv = common.module_argv("bench.stream_load", url, str(seconds), str(clients), str(out))
    return Load(common.start(sup, name, argv), name, out, sup)


def collect(load: Load, timeout_s: float = 600.0) -> list[dict]:
    """The records of a load that ran to its end (chunk times back in absolute seconds)."""
    code = load.child.proc.wait(timeout=timeout_s)
    load.supervisor.stop_child(load.name)
    if code != 0:
        raise RuntimeError(f"the load generator exited with code {code}")
    recs: list[dict] = json.loads(load.out.read_text())
    for r in recs:
        r["t"] = [r["start"] + ms / 1e3 for ms in r["t"]]
    return recs


def failures(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["status"] != 200 or r["error"] or not r["done"] or r["tokens"] != r["n"]]


def ttfts(recs: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Time to first token (s) of the requests that started inside one of `windows`."""
    return [r["t"][0] - r["start"] for r in recs if r["t"] and any(lo <= r["start"] <= hi for lo, hi in windows)]


def outside(span: tuple[float, float], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `span` that no window covers."""
    (lo, hi), out = span, []
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


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


if __name__ == "__main__":
    main()
