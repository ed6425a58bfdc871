"""Imports point one way: cli > api, demo > learner, gating > serving, feedback > core.

Read from the source (every import statement, lazy ones included), so a layering violation fails
here even where it would not yet form a cycle at import time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"cli": 4, "core": 0, "serving": 1, "feedback": 1, "learner": 2, "gating": 2, "api": 3, "demo": 3}
TOP = "cli"  # the entry point may import anything (lazily, inside each command)
ALLOWED_SAME_LAYER = {("learner", "gating")}  # the learner registers its versions


def imports() -> list[tuple[str, str, int]]:
    """(module, imported package, line) for every import of a first-party package."""
    out = []
    for pkg in LAYER:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    else []
                )
                out += [(module, n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in LAYER]
    return out


def test_packages_import_only_lower_layers():
    bad = []
    for module, target, line in imports():
        source = module.split(".")[0]
        if target == source or (source, target) in ALLOWED_SAME_LAYER:
            continue
        if LAYER[target] >= LAYER[source]:
            bad.append(f"{module}:{line} imports {target}")
    assert not bad, bad


def test_the_rule_sees_lazy_imports():
    assert ("learner.service", "gating") in {(m, t) for m, t, _ in imports()}
    assert any(m == "serving.engine" and t == "core" for m, t, _ in imports())  # inside a function
