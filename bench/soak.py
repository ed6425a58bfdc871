"""The gateway under sustained load: completions and their feedback from concurrent clients, for 10
minutes, on loopback; its memory, errors and per-minute latency.

`python -m bench.soak [--minutes 10] [--clients 16]`. One gateway (`flywheel serve` as its own
process: the shipped demo base on the embedded engine, two replicas, the embedded bus, local mode)
and, in this process, `--clients` closed-loop clients (each: one request at a time, so the load is
bounded by the client count): a completion of 8 to 32 tokens for one of its users (temperature 1),
then one feedback event about it (thumbs, a rating, accepted, copied, edited or dwell time), again
and again. Every request's start, latency and status is kept.

Figures:
- **errors**: requests that did not get 200 (the gateway's limits are not set in local mode; a 429
  would count as an error here too);
- **latency per minute**: p50 and p99 of completions and of feedback requests, and their counts;
- **memory**: the resident set (VmRSS) of the gateway's process tree (the gateway and its engine
  processes), sampled every 5 s; the growth is the last sample over the mean of the samples in the
  minute after warm-up (`--warmup-min`, default 2), minus one. Target: below 5%.
`tests/test_soak.py` runs the same code for 20 seconds in the suite; the 10-minute run is this job.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import common
from core.supervisor import Supervisor

NAME = "soak"
PROMPTS = [
    "# add 3 to x\ndef f(x):\n",
    "# count 'a' in s\ndef f(s):\n",
    "# items of xs greater than 7\ndef f(xs):\n",
    "# reverse the string s\ndef f(s):\n",
]
FEEDBACK: list[tuple[str, float | None]] = [("thumb_up", None), ("thumb_down", None), ("rating", 4.0)]
FEEDBACK += [("accepted", None), ("copied", None), ("edited", 0.5), ("dwell", 12.0)]
SAMPLE_S = 5.0


def tree_rss_kb(root: int) -> int:
    """VmRSS of `root` and every process below it (`bench.common.process_tree`), in KiB (0 for one
    that ended meanwhile)."""
    total = 0
    for pid in common.process_tree(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


async def _client(i: int, url: str, t0: float, until: float, seed: int, out: list[dict]) -> None:
    rng = random.Random(seed * 1000 + i)
    async with httpx.AsyncClient(timeout=120) as c:
        k = 0
        while time.monotonic() < until:
            user = f"soak-{i}-{k % 20}"
            k += 1
            body = {
                "model": "flywheel",
                "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.randint(8, 32),
                "temperature": 1.0,
                "user": user,
            }
            cid = await _post(c, url + "/v1/completions", body, "completions", t0, out)
            if cid is None:
                continue
            kind, value = rng.choice(FEEDBACK)
            event: dict[str, Any] = {"completion_id": cid, "kind": kind, "user": user}
            if value is not None:
                event["value"] = value
            await _post(c, url + "/v1/feedback", event, "feedback", t0, out)


async def _post(c: httpx.AsyncClient, url: str, body: dict, route: str, t0: float, out: list[dict]) -> str | None:
    start = time.monotonic()
    status: int | str
    try:
        r = await c.post(url, json=body)
        status, cid = r.status_code, (r.json().get("id") if r.status_code == 200 and route == "completions" else None)
    except httpx.HTTPError as e:
        status, cid = type(e).__name__, None
    out.append({"t": start - t0, "route": route, "status": status, "s": time.monotonic() - start})
    return cid if status == 200 else None


def per_minute(records: list[dict], seconds: float, window_s: float = 60.0) -> list[dict]:
    """Per window of `window_s` (by request start): counts, errors, p50/p99 latency (ms) per route."""
    rows = []
    for w in range(max(1, int(-(-seconds // window_s)))):
        lo, hi = w * window_s, (w + 1) * window_s
        row: dict[str, Any] = {"minute": w + 1}
        for route in ("completions", "feedback"):
            got = [r for r in records if r["route"] == route and lo <= r["t"] < hi]
            ok = [r["s"] * 1000 for r in got if r["status"] == 200]
            row[route] = {
                "requests": len(got),
                "errors": len(got) - len(ok),
                "p50_ms": common.pct(ok, 50),
                "p99_ms": common.pct(ok, 99),
            }
        rows.append(row)
    return rows


def growth(rss: list[tuple[float, int]], warmup_s: float) -> dict[str, Any]:
    """The last RSS sample over the mean of those in the minute after `warmup_s`, minus one."""
    after = [kb for t, kb in rss if warmup_s <= t < warmup_s + 60.0] or [kb for _, kb in rss[-1:]]
    base = sum(after) / len(after)
    return {
        "warm_kib": round(base),
        "last_kib": rss[-1][1],
        "max_kib": max(kb for _, kb in rss),
        "growth": rss[-1][1] / base - 1.0,
    }


def soak(url: str, pid: int, seconds: float, clients: int, warmup_s: float, seed: int = 0) -> dict[str, Any]:
    """Run the load against the gateway at `url` (process `pid`) for `seconds`; the figures."""
    records: list[dict] = []
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()
    stop = threading.Event()

    def sample() -> None:
        while True:
            rss.append((time.monotonic() - t0, tree_rss_kb(pid)))
            if stop.wait(SAMPLE_S):
                break

    sampler = threading.Thread(target=sample, name="rss", daemon=True)
    sampler.start()

    async def run() -> None:
        until = t0 + seconds
        await asyncio.gather(*(_client(i, url, t0, until, seed, records) for i in range(clients)))

    try:
        asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
    rss.append((time.monotonic() - t0, tree_rss_kb(pid)))
    errors: dict[str, int] = {}
    for r in records:
        if r["status"] != 200:
            key = f"{r['route']} {r['status']}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "seconds": seconds,
        "clients": clients,
        "requests": {route: sum(r["route"] == route for r in records) for route in ("completions", "feedback")},
        "errors": errors,
        "per_minute": per_minute(records, seconds),
        "rss_kib": [(round(t, 1), kb) for t, kb in rss],
        "memory": growth(rss, warmup_s),
        "warmup_s": warmup_s,
    }


def gateway_env(home: Path) -> dict[str, str]:
    return {
        "FLYWHEEL_MODEL_DIR": str(common.ROOT / "models" / "demo-base"),
        "FLYWHEEL_ENGINE": "embedded",
        "FLYWHEEL_REPLICAS": "2",
        "FLYWHEEL_BUS": "embedded",
        "FLYWHEEL_HOME": str(home),
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--warmup-min", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    st = common.stamp()
    with tempfile.TemporaryDirectory(prefix="flywheel-soak-") as tmp, Supervisor("bench-soak") as sup:
        home = Path(tmp) / "home"
        gw = common.gateway(home, gateway_env(home), sup)  # stopped with the supervisor
        result = soak(gw.url, gw.child.pid, a.minutes * 60, a.clients, a.warmup_min * 60, a.seed)
    result |= {"template": NAME, "target_growth": 0.05}
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
