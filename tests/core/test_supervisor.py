"""The process supervisor: children die with their parent, SIGINT/SIGTERM stop the whole tree, a
dead child is reported by name and code and stops everything. Checked on real process trees:
`flywheel up` and `flywheel demo` get SIGTERM and, in another run, SIGKILL; ten seconds later
nothing of their trees is alive (gateway replicas' engines, gate, learner, joiner, sandbox workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from core.harness import free_port, wait_until
from core.settings import Settings
from core.supervisor import ChildDied, Supervisor
from registry.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 10.0  # what the contract promises: every child gone within 10 s of the parent's signal


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _cpu_ticks(pid: int) -> int:
    """User CPU time of a process, in clock ticks (0 once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0
    return int(raw[raw.rindex(")") + 2 :].split()[11])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time (so a reused pid is not mistaken for it)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents.setdefault(st[0], []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            st = _stat(child)
            if st is not None:
                out[child] = st[1]
                todo.append(child)
    return out


def _at_least(tree: dict[int, int], n: int) -> dict[int, int] | None:
    return tree if len(tree) >= n else None


def alive_of(tree: dict[int, int]) -> list[int]:
    return [pid for pid, start in tree.items() if (st := _stat(pid)) is not None and st[1] == start]


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except FileNotFoundError:
            pass
    return out


@contextmanager
def _reaped(proc: subprocess.Popen) -> Iterator[None]:
    """A test's own process (and what it started) never outlives the test, whatever it asserts."""
    try:
        yield
    finally:
        for pid in descendants(proc.pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def assert_tree_ends(parent: subprocess.Popen, tree: dict[int, int], sig: int) -> None:
    parent.send_signal(sig)
    t0 = time.monotonic()
    try:
        wait_until(lambda: not alive_of(tree), GRACE_S, what="the whole process tree ending", interval_s=0.1)
    except TimeoutError:
        left = alive_of(tree)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"alive {GRACE_S} s after signal {sig}: {_cmdlines(left)}") from None
    print(f"signal {sig}: {len(tree)} processes gone in {time.monotonic() - t0:.2f} s")
    parent.wait(timeout=GRACE_S)


# ---- the supervisor itself -------------------------------------------------------------------------

SLEEPER = [sys.executable, "-c", "from core.supervisor import child_setup; child_setup(); import time; time.sleep(600)"]


def test_stop_ends_every_child_and_a_dead_child_is_reported_by_name(tmp_path):
    with Supervisor("t") as sup:
        a = sup.start("sleeper", SLEEPER, cwd=ROOT, log_path=tmp_path / "a.log")
        sup.start(
            "crasher",
            [sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"],
            log_path=tmp_path / "c.log",
        )
        with pytest.raises(ChildDied) as died:
            wait_until(lambda: False, 30, what="never", check=sup.check)
        assert (died.value.name, died.value.code) == ("crasher", 3)
        assert "bad config" in str(died.value)
        assert sup.exit_code() == 1
    assert a.returncode is not None


def test_a_dead_childs_report_leads_with_its_first_error_when_its_shutdown_log_buried_it(tmp_path):
    script = (
        "import sys\n"
        "print('starting')\n"
        "print('2026-12-02 21:16:09,100 ERROR api: the index could not be created: relation exists')\n"
        "for i in range(200): print(f'2026-12-02 21:16:09,400 INFO kafka: closing connection {i}')\n"
        "sys.exit(3)\n"
    )
    with Supervisor("t") as sup:
        sup.start("gateway", [sys.executable, "-c", script], log_path=tmp_path / "g.log")
        with pytest.raises(ChildDied) as died:
            wait_until(lambda: False, 30, what="never", check=sup.check)
    message = str(died.value)
    assert "the index could not be created" in message  # the cause, from the start of the log
    assert "closing connection 199" in message  # and the end
    assert "starting" not in message


def test_the_watcher_stops_everything_when_a_child_dies(tmp_path):
    sup = Supervisor("t")
    sleeper = sup.start("sleeper", SLEEPER, cwd=ROOT)
    crasher = sup.start("crasher", [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(7)"])
    deaths = []
    sup.watch(on_death=lambda child: (deaths.append((child.name, child.returncode)), sup.stop()))
    wait_until(lambda: sleeper.returncode is not None, 15, what="the sleeper stopped by the watcher")
    assert deaths == [("crasher", 7)] and crasher.returncode == 7


def test_a_child_killed_on_purpose_is_no_unasked_death_while_it_is_down(tmp_path):
    """The fault harness SIGKILLs a child and starts it again later; meanwhile another restart polls
    `check` (found in a fault run: the gate, killed on purpose, was taken for an unasked death by the
    broker's restart, which checked the supervisor while the gate was down)."""
    sup = Supervisor("t")
    deaths = []
    sup.watch(on_death=lambda child: deaths.append(child.name))
    try:
        first = sup.start("gate", SLEEPER, cwd=ROOT, log_path=tmp_path / "g.log")
        other = sup.start("broker", SLEEPER, cwd=ROOT, log_path=tmp_path / "b.log")
        assert sup.kill_child("gate") == -signal.SIGKILL and first.returncode == -signal.SIGKILL
        assert sup.kill_child("gate") is None  # already forgotten
        sup.check()  # the dead gate is not an unasked death
        time.sleep(0.5)  # the watcher has looked (every 0.1 s)
        assert deaths == [] and sup.died is None
        again = sup.start("gate", SLEEPER, cwd=ROOT, log_path=tmp_path / "g.log")
        assert again.alive() and sup.children["gate"] is again and other.alive()
        os.kill(other.pid, signal.SIGKILL)  # a death nobody asked for is still one
        wait_until(lambda: deaths == ["broker"], 15, what="the broker's death reported")
        with pytest.raises(ChildDied):
            sup.check()
    finally:
        sup.stop()


PARENT = textwrap.dedent("""
    import sys, time
    from core.supervisor import Supervisor, interrupt_on_sigterm
    interrupt_on_sigterm()
    sup = Supervisor("parent")
    for i in range(2):
        sup.start(f"s{i}", sys.argv[1:])
    print("ready", flush=True)
    try:
        time.sleep(600)
    finally:
        sup.stop()
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_children_and_grandchildren_die_with_a_signalled_parent(sig):
    # each child starts a grandchild of its own that also dies with its parent (a sandbox-like worker)
    grandparent = textwrap.dedent("""
        import os, subprocess, sys, time
        from core.supervisor import PARENT_ENV, child_setup
        child_setup()
        code = "from core.supervisor import die_with_parent; die_with_parent(); import time; time.sleep(600)"
        # Its parent's pid goes with it: a signal in the middle of this Popen ends this process before the
        # grandchild asks for the death signal, and it must still end.
        g = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, PARENT_ENV: str(os.getpid())})
        try:
            time.sleep(600)
        finally:
            g.terminate()
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sys.executable, "-c", grandparent], cwd=ROOT, env=env, stdout=subprocess.PIPE
    )
    assert parent.stdout is not None and parent.stdout.readline().strip() == b"ready"
    with _reaped(parent):
        tree = wait_until(lambda: _at_least(descendants(parent.pid), 4), 30, what="4 descendants")
        assert_tree_ends(parent, tree, sig)


def test_an_engine_process_dies_with_its_owner_killed(tiny_checkpoint):
    owner = textwrap.dedent(f"""
        from serving.engine_process import ProcessEngine
        import time
        if __name__ == "__main__":
            e = ProcessEngine(max_batch=2, max_model_len=64, threads=1)
            e.add_version("v", {str(tiny_checkpoint)!r})
            print("ready", flush=True)
            time.sleep(600)
    """)
    script = Path(tiny_checkpoint).parent / "owner.py"
    script.write_text(owner)
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    with _reaped(proc):
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        tree = descendants(proc.pid)
        assert tree, "the engine runs in a child process"
        assert_tree_ends(proc, tree, signal.SIGKILL)


def test_a_sandbox_worker_dies_with_its_caller_killed():
    caller = textwrap.dedent("""
        from demo.sandbox import run_functions
        print("ready", flush=True)
        run_functions([("def f(x):\\n    while True:\\n        x += 1\\n", [(1,)])], timeout_s=300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", caller], cwd=ROOT, stdout=subprocess.PIPE)
    with _reaped(proc):
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        # the worker is the descendant that burns CPU (the isolation probe before it is short-lived)
        wait_until(lambda: any(_cpu_ticks(p) >= 20 for p in descendants(proc.pid)), 30, what="the worker in the loop")
        tree = descendants(proc.pid)
        assert_tree_ends(proc, tree, signal.SIGKILL)


# ---- whole commands ----------------------------------------------------------------------------------


def _start(command: list[str], home: Path, model_dir: Path, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "FLYWHEEL_HOME": str(home),
        "FLYWHEEL_MODEL_DIR": str(model_dir),
        "FLYWHEEL_PORT": str(port),
        "FLYWHEEL_REPLICAS": "1",
        "FLYWHEEL_TORCH_THREADS": "1",
    }
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "command.log", "wb")  # noqa: SIM115 (kept for the child's life)
    proc = subprocess.Popen([sys.executable, "-m", "cli", *command], cwd=ROOT, env=env, stdout=log, stderr=log)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,sig",
    [
        pytest.param("up", signal.SIGTERM, id="up-SIGTERM"),
        pytest.param("up", signal.SIGKILL, id="up-SIGKILL"),
        pytest.param("demo", signal.SIGTERM, id="demo-SIGTERM", marks=pytest.mark.long),  # 33 s
        pytest.param("demo", signal.SIGKILL, id="demo-SIGKILL"),
    ],
)
def test_nothing_of_a_command_outlives_it(command, sig, tiny_checkpoint, tmp_path):
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    argv = ["up"] if command == "up" else ["demo", "--quick", "--users", "4", "--minutes", "2", "--exit"]
    proc = _start(argv, home, tiny_checkpoint, port)
    try:
        _wait_running(proc, home, home / "demo" / "seed0" if command == "demo" else None)
        if command == "up":  # the base was published before any service started, and each is in its loop
            with Registry(Settings(home=home, model_dir=tiny_checkpoint).db_url) as reg:
                assert reg.promoted().id == tiny_checkpoint.name
        tree = descendants(proc.pid)
        assert_tree_ends(proc, tree, sig)
        if sig == signal.SIGTERM:
            log = (home / "command.log").read_text()
            assert proc.returncode in (0, 130), (proc.returncode, log[-3000:])
            assert "did not stop" not in log, log[-3000:]  # every child stopped on its SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_running(proc: subprocess.Popen, home: Path, services_home: Path | None = None) -> None:
    """Until the joiner, the learner and the gate each wrote its first metrics (each is in its loop)
    and the gateway said it is ready. `home` holds the command's log; `services_home` is where its
    services run (a demo run's own home under `home`)."""
    where = services_home or home
    metrics = [where / "metrics" / f"{name}.prom" for name in ("joiner", "learner", "gate")]
    logs = [where / "up.log", home / "command.log"]
    wait_until(
        lambda: all(m.is_file() for m in metrics) and any("gateway ready" in _read(p) for p in logs),
        180,
        what="every service in its loop and the gateway ready",
        interval_s=0.3,
        check=lambda: _alive_or_fail(proc, home),
    )


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _alive_or_fail(proc: subprocess.Popen, home: Path) -> None:
    if proc.poll() is not None:
        raise AssertionError(f"exited with {proc.returncode}:\n{(home / 'command.log').read_text()[-3000:]}")


@pytest.mark.slow
def test_up_stops_everything_and_exits_non_zero_when_a_service_dies(tiny_checkpoint, tmp_path):
    port = free_port()
    proc = _start(["up"], tmp_path, tiny_checkpoint, port)
    try:
        _wait_running(proc, tmp_path)
        tree = descendants(proc.pid)
        learner = [pid for pid in tree if "cli learner" in " ".join(_cmdlines([pid]))]
        assert len(learner) == 1, _cmdlines(list(tree))
        os.kill(learner[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        wait_until(lambda: not alive_of(tree), GRACE_S, what="the rest of the tree ending")
        log = (tmp_path / "command.log").read_text()
        assert "learner" in log and "exited with code -9" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
