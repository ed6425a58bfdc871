"""The README's configuration table names every deployment setting, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from core.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_configuration_table_is_complete_and_true():
    text = README.read_text()
    listed = set(re.findall(r"^\| `(FLYWHEEL_[A-Z_]+)`", text, flags=re.M))
    settings = {f"FLYWHEEL_{name.upper()}" for name in Settings.model_fields}
    assert listed == settings, (sorted(settings - listed), sorted(listed - settings))
