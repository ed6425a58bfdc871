"""Where a request's time goes: py-spy on `flywheel serve` under the race's load.

Starts Flywheel as the race does (`bench.http_race.Server`, the race's settings), drives it with `wrk`
(natural length, 64 clients, the race's prompts as ids) and samples every process of the server with
`py-spy record --subprocesses` for the length of the load (py-spy samples a thread only while it
runs). The collapsed stacks are then summed per process (the HTTP front end, the engine process) and
per stage of the request path (`STAGES`: the innermost frame that names a stage decides). The same
load runs once without py-spy first, to show what its sampling costs.

    python -m bench.profile_serving --seconds 20

Writes bench/results/profile_serving.{json,md} and keeps the raw collapsed stacks beside them
(`profile_serving.stacks.txt`). Needs py-spy (PyPI) and wrk (Debian) on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench import common
from bench.http_race import Server, check_prompts, lua_script, wrk
from core.supervisor import Supervisor

# (stage, substrings of a frame that put a sample in it): the innermost frame that matches decides (in
# this order where one frame matches several).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("durable record: fsync", ("fsync",)),
    ("durable record: write + serialise", ("feedback/log.py", "feedback/bus_embedded.py", "append_batch")),
    ("completion index", ("completion_index.py",)),
    ("completion sink (other)", ("feedback/sink.py",)),
    ("tokenize / detokenize", ("serving/tokenizer.py", "tokenizers")),
    ("pydantic validation / dump", ("pydantic",)),
    ("JSON encode / decode", ("json/encoder", "json/decoder", "orjson", "render")),
    ("metrics", ("api/metrics.py", "prometheus")),
    ("limits", ("api/limits.py",)),
    ("engine IPC (pipe, pickle)", ("connection.py", "engine_process.py")),
    ("model forward", ("serving/model.py", "torch/nn")),
    ("sampling", ("serving/sampling.py",)),
    ("engine scheduling", ("serving/engine.py",)),
    ("openai route", ("api/routes/openai.py",)),
    ("HTTP: uvicorn / starlette / fastapi", ("uvicorn", "starlette", "fastapi", "h11", "httptools")),
    ("asyncio event loop", ("asyncio",)),
]


def stage_of(frames: list[str]) -> str:
    for f in reversed(frames):  # leaf first: the innermost frame that names a stage decides
        for name, needles in STAGES:
            if any(n in f for n in needles):
                return name
    return "other"


def summarise(stacks: Path, pids: dict[int, str]) -> dict:
    """Per process (by role): its samples (py-spy records a thread only while it is not idle) and their
    shares per stage and per leaf frame."""
    per: dict[str, Counter] = defaultdict(Counter)
    funcs: dict[str, Counter] = defaultdict(Counter)
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]  # nested: parent, then child
        role = "other process"
        if procs:
            pid = int(frames[procs[-1]].removeprefix("process ").split(":", 1)[0])
            role = pids.get(pid, "other process")
            frames = frames[procs[-1] + 1 :]
        leaf = frames[-1] if frames else ""
        per[role]["on_cpu"] += n
        per[role][stage_of(frames)] += n
        funcs[role][leaf] += n
    out = {}
    for role, c in per.items():
        on = c["on_cpu"] or 1
        stages = {k: v for k, v in c.items() if k != "on_cpu"}
        out[role] = {
            "on_cpu": c["on_cpu"],
            "stages": {k: round(v / on, 4) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])},
            "top_leaves": [[f, round(v / on, 4)] for f, v in funcs[role].most_common(15)],
        }
    return out


def main() -> None:
    from demo.bootstrap import SHIPPED_BASE
    from demo.split import sample_tasks
    from serving.tokenizer import Tokenizer

    ap = common.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--length", choices=("natural", "fixed"), default="natural")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    a = ap.parse_args()
    for tool in ("py-spy", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench.profile_serving needs {tool} on PATH (py-spy: PyPI; wrk: Debian)")
    st = common.stamp()
    model_dir = Path(SHIPPED_BASE)
    tok = Tokenizer.from_file(model_dir)
    prompts = [tok.encode_prompt(t.prompt) for t in sample_tasks(64, seed=12345)]  # the race's
    scratch = Path(tempfile.mkdtemp(prefix="profile-"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    stacks = Path(a.out) / "profile_serving.stacks.txt"
    try:
        with Supervisor("bench-profile") as sup:
            server = Server("flywheel", model_dir, scratch, sup)
            server.start()
            check_prompts(server, prompts)
            script = lua_script(prompts, a.length == "fixed", scratch)
            wrk(server.url, script, 4, 2)  # warm-up
            unprofiled = wrk(server.url, script, a.clients, a.seconds)  # what py-spy's sampling costs
            pids = {server.pid: "front end (HTTP process)"} | {
                pid: "engine process" for pid in common.process_tree(server.pid) if _is_engine(pid)
            }
            argv = ["py-spy", "record", "--pid", str(server.pid), "--subprocesses", "--format", "raw"]
            argv += ["--rate", str(a.rate), "--duration", str(int(a.seconds) + 2), "--output", str(stacks)]
            argv.append("--nonblocking")
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(1.0)
            before = server.cpu()
            row = wrk(server.url, script, a.clients, a.seconds)
            after = server.cpu()
            _, err = spy.communicate(timeout=120)
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err}")
            server.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    n = max(row["requests"], 1)
    row["front_cpu_ms_per_request"] = (after[0] - before[0]) * 1e3 / n
    row["cpu_ms_per_request"] = (after[1] - before[1]) * 1e3 / n
    result = {
        "load": {"length": a.length, "clients": a.clients, **row},
        "unprofiled": unprofiled,
        "py_spy_rate": a.rate,
        "processes": {str(k): v for k, v in pids.items()},
        "profile": summarise(stacks, pids),
    }
    common.save("profile_serving", result, st, a.out)


def _is_engine(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return "spawn_main" in cmd


if __name__ == "__main__":
    main()
