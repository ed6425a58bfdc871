"""The config file, `flywheel.toml`: where it is, how it is read, and errors that name the key and line.

The file is TOML, at `--config PATH` (which sets `FLYWHEEL_CONFIG`, so every service a command starts
reads the same file) or else `flywheel.toml` in the home (`FLYWHEEL_HOME`, default `var`). A missing
default file is no error (every value has a default); a missing `--config` file is. Its sections are
validated by the models that own them (`core.settings.Settings` for `gateway`, `bus`, `database` and `limits`;
`cli.config` for the rest); any error is a `ConfigError` naming the file, the dotted key and, where the
key is written in the file, its line.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILE_NAME = "flywheel.toml"
ENV_PATH = "FLYWHEEL_CONFIG"


class ConfigError(ValueError):
    """A config file that cannot be used: the message names the file, the key and its line."""


def config_path(environ: Mapping[str, str] | None = None) -> tuple[Path | None, bool]:
    """(the config file to read, whether it was asked for explicitly); (None, False) when the default
    file does not exist."""
    env = os.environ if environ is None else environ
    if env.get(ENV_PATH):
        return Path(env[ENV_PATH]), True
    default = Path(env.get("FLYWHEEL_HOME") or "var") / FILE_NAME
    return (default, False) if default.is_file() else (None, False)


def read_config(environ: Mapping[str, str] | None = None) -> tuple[Path | None, dict[str, Any], str]:
    """(path, parsed tables, text) of the config file; (None, {}, "") when there is none."""
    path, explicit = config_path(environ)
    if path is None:
        return None, {}, ""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file ({ENV_PATH} or --config)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return path, data, text


_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\s\"']+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


def line_of(text: str, dotted: str) -> int | None:
    """The 1-based line where `dotted` ("learner.trainer.lr") is written in the TOML `text`: a key under
    its table header, or a table header itself; None when it is not written there (a default)."""
    want = dotted.split(".")
    table: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header and not line.lstrip().startswith("[["):
            table = [p.strip().strip("\"'") for p in header.group(1).split(".")]
            if table == want:
                return n
            continue
        key = _KEY.match(line)
        if key and table + [key.group(1)] == want[: len(table) + 1] and len(table) + 1 <= len(want):
            return n
    return None


def where(path: Path | None, text: str, dotted: str) -> str:
    """ "<file>:<line>: <dotted>" (without the line when the key is not written in the file)."""
    line = line_of(text, dotted) if text else None
    place = f"{path}:{line}" if line is not None else f"{path}" if path is not None else "config"
    return f"{place}: {dotted}"


def loc_key(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted key (list indices kept as numbers)."""
    return ".".join(str(p) for p in loc)


def _toml_value(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}: {value!r} has no TOML form here")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    raise ValueError(f"{key}: {type(value).__name__} {value!r} has no TOML form here")


def dump_toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """`tables` (section -> keys; a nested mapping under a `*_kwargs` key stays inline, any other becomes
    a sub-table) as the text of a config file: what `read_config` reads back equal."""
    lines: list[str] = []

    def table(name: str, body: Mapping[str, Any]) -> None:
        subs = {k: v for k, v in body.items() if isinstance(v, Mapping) and not k.endswith("_kwargs")}
        lines.append(f"[{name}]")
        lines.extend(
            f"{k} = {_toml_value(v, f'{name}.{k}')}" for k, v in body.items() if k not in subs and v is not None
        )
        lines.append("")
        for k, v in subs.items():
            table(f"{name}.{k}", v)

    for name, body in tables.items():
        table(name, body)
    return "\n".join(lines)
