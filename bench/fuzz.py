"""Keyed fuzzing of every route, at length: tests/api/test_fuzz_keys.py with more cases per operation.

`python -m bench.fuzz [--examples 500]`. It runs that test module under pytest with `FUZZ_EXAMPLES`
cases per operation and `FUZZ_REPORT` set, so the checks are the test's own, not a copy: no 5xx, no
read answered 409, and no caller allowed an operation its key's scope (or its dashboard session) does
not grant; every operation of the app's schema and of the dashboard's is covered, each case sent as
every caller (no key, a wrong key, an env key, a key-store key of each scope; no session, a viewer and
an admin session with their CSRF tokens). The suite runs the same module with 10 cases per operation.
The result: whether every check held, the requests by caller and answer, and pytest's last lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

NAME = "fuzz"
MODULE = "tests/api/test_fuzz_keys.py"


def fuzz(examples: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="flywheel-fuzz-") as tmp:
        report = Path(tmp) / "report.json"
        env = os.environ | {"FUZZ_EXAMPLES": str(examples), "FUZZ_REPORT": str(report)}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                               MODULE], cwd=common.ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.monotonic() - t0
        tallies = json.loads(report.read_text()) if report.is_file() else {}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"examples": examples, "passed": proc.returncode == 0, "returncode": proc.returncode,
            "seconds": round(seconds, 1), "parts": tallies, "pytest_tail": lines[-15:]}  # fmt: skip


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--examples", type=int, default=500, help="cases generated per operation")
    a = ap.parse_args()
    st = common.stamp()
    result = fuzz(a.examples) | {"template": NAME}
    common.save(NAME, result, st, a.out)
    if not result["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
