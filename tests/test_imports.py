"""The layer contract (`[tool.importlinter]` in pyproject.toml) holds, and it covers every package.

import-linter reads every import statement, lazy ones inside functions included, so a layering
violation fails here even where it would not yet form a cycle at import time. CI runs it too."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layer_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_every_package_is_in_a_layer():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layered = {
        p.strip() for layer in config["tool"]["importlinter"]["contracts"][0]["layers"] for p in layer.split("|")
    }
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == layered, packages ^ layered
    assert set(config["tool"]["importlinter"]["root_packages"]) == packages
