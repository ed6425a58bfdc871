"""A run's provenance: the source hash follows every file a run executes and nothing else."""

from __future__ import annotations

from demo.provenance import PACKAGES, provenance, source_sha256


def _tree(root):
    for pkg in PACKAGES:
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"# {pkg}\n")
    (root / "models" / "demo-base").mkdir(parents=True)
    (root / "models" / "demo-base" / "config.json").write_text("{}")
    (root / "requirements.txt").write_text("torch==2\n")
    return root


def test_the_source_hash_changes_with_any_source_and_only_then(tmp_path):
    root = _tree(tmp_path / "repo")
    h = source_sha256(root)
    assert source_sha256(root) == h and len(h) == 64
    (root / "README.md").write_text("docs do not change a run")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("x = 1")
    assert source_sha256(root) == h
    for changed in ("learner/__init__.py", "models/demo-base/config.json", "requirements.txt"):
        before = (root / changed).read_text()
        (root / changed).write_text(before + " ")
        assert source_sha256(root) != h, changed
        (root / changed).write_text(before)
    assert source_sha256(root) == h
    (root / "gating" / "__init__.py").rename(root / "gating" / "moved.py")  # a rename is a change
    assert source_sha256(root) != h


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    p = provenance(_tree(tmp_path / "repo"))
    assert p["source_sha256"] == source_sha256(tmp_path / "repo")
    assert p["commit"] is None and p["dirty"] is None  # tmp_path is no git checkout
