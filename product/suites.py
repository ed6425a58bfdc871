"""Offline eval suites: versioned data (prompts, each with its task family) plus a verifier.

The gate (`gating.gate`, through `gating.evals.evaluate_offline`) scores a candidate and the incumbent on
a suite; the product that owns the tasks supplies both halves (the demo: `demo.suite.demo_suite`), so
gating holds no product code. A suite is:

- `EvalSuite(name, version, items, verifier)`: `items` are `SuiteItem(prompt, family)`, at least two per
  family (the gate tests every family on its own); `verifier` any `Verifier`. `stop` (stop strings for
  sampling), `in_distribution` (True while the prompts are the product's own training prompts, so every
  report can say so) and `well_formed` (a product's check that a completion parses; None: non-empty) are
  optional.
- `suite_version`: `"<name>@<version>#<first 12 hex of sha256>"`, the SHA-256 of the suite's JSON
  (`to_json`: items, stop, in_distribution, name, version). It goes into the offline verdict, so a
  verdict names the exact prompts it was reached on even if someone edits a suite and forgets to bump
  `version`.
- A suite file is that JSON (`save`, `load(path, verifier)`); the verifier is code and is passed in.

`Verifier` is the protocol every scorer of completions implements: the gate's evals here and the
learner's offline group rollouts (`learner.offline`) both call it; the demo's is
`demo.checker.DemoVerifier`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from core.files import atomic_write

SUITE_FORMAT = "flywheel-eval-suite"
SUITE_FORMAT_VERSION = 1


@runtime_checkable
class Verifier(Protocol):
    def verify(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Score `completions[i]` as the completion of `prompts[i]`, one score per pair, in order:
        1.0 passes every check, 0.0 fails, a value in between is partial credit. Raises ValueError
        for a prompt the verifier cannot check, or when the two lengths differ."""
        ...


@dataclass(frozen=True)
class SuiteItem:
    prompt: str
    family: str


@dataclass(frozen=True)
class EvalSuite:
    """A named, versioned list of prompts with families, and the verifier that scores completions."""

    name: str
    version: str
    items: tuple[SuiteItem, ...]
    verifier: Verifier = field(compare=False)
    stop: tuple[str, ...] = ()
    in_distribution: bool = False
    """True: the prompts are ones the product serves (and the learner trains on), not a held-out split."""
    well_formed: Callable[[str, str], bool] | None = field(default=None, compare=False)
    """`well_formed(prompt, completion)`: the completion parses as the product expects (None: non-empty)."""

    def __post_init__(self) -> None:
        for what in ("name", "version"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value or any(c in value for c in "@#\n"):
                raise ValueError(f"suite {what} must be a non-empty string without '@', '#' or newlines, got {value!r}")
        items = tuple(it if isinstance(it, SuiteItem) else SuiteItem(*it) for it in self.items)
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "stop", tuple(self.stop))
        for i, it in enumerate(items):
            if not isinstance(it.prompt, str) or not it.prompt:
                raise ValueError(f"suite {self.name!r} item {i}: the prompt must be a non-empty string")
            if not isinstance(it.family, str) or not it.family:
                raise ValueError(f"suite {self.name!r} item {i}: the family must be a non-empty string")
        prompts = [it.prompt for it in items]
        dupes = sorted({p for p in prompts if prompts.count(p) > 1})
        if dupes:
            raise ValueError(f"suite {self.name!r} lists the prompt {dupes[0]!r} more than once")
        small = {f: n for f, n in self.family_sizes.items() if n < 2}
        if not items or small:
            raise ValueError(
                f"suite {self.name!r} needs at least two prompts per family (each family is tested on its "
                f"own), got {small or 'no items'}"
            )
        if not isinstance(self.verifier, Verifier):
            raise ValueError(f"suite {self.name!r}: {self.verifier!r} has no verify(prompts, completions)")

    @classmethod
    def of(
        cls, name: str, version: str, items: Iterable[tuple[str, str] | SuiteItem], verifier: Verifier, **kw: Any
    ) -> EvalSuite:
        """Build from (prompt, family) pairs."""
        return cls(
            name, version, tuple(it if isinstance(it, SuiteItem) else SuiteItem(*it) for it in items), verifier, **kw
        )

    @property
    def prompts(self) -> list[str]:
        return [it.prompt for it in self.items]

    @property
    def family_sizes(self) -> dict[str, int]:
        """Prompts per family, families sorted by name."""
        out: dict[str, int] = {}
        for it in self.items:
            out[it.family] = out.get(it.family, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SUITE_FORMAT,
            "format_version": SUITE_FORMAT_VERSION,
            "name": self.name,
            "version": self.version,
            "in_distribution": self.in_distribution,
            "stop": list(self.stop),
            "items": [{"prompt": it.prompt, "family": it.family} for it in self.items],
        }

    @property
    def sha256(self) -> str:
        """SHA-256 of the canonical JSON (sorted keys, no spaces) of `to_json`."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def suite_version(self) -> str:
        """What the offline verdict stores: name, version and the content hash."""
        return f"{self.name}@{self.version}#{self.sha256[:12]}"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write(path, json.dumps(self.to_json(), indent=1, ensure_ascii=False))
        return path

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], verifier: Verifier, well_formed: Callable[[str, str], bool] | None = None
    ) -> EvalSuite:
        if data.get("format") != SUITE_FORMAT or data.get("format_version") != SUITE_FORMAT_VERSION:
            raise ValueError(
                f"not a {SUITE_FORMAT} file of format_version {SUITE_FORMAT_VERSION}: "
                f"format {data.get('format')!r}, format_version {data.get('format_version')!r}"
            )
        try:
            items = tuple(SuiteItem(str(it["prompt"]), str(it["family"])) for it in data["items"])
            return cls(
                data["name"],
                data["version"],
                items,
                verifier,
                stop=tuple(data.get("stop", ())),
                in_distribution=bool(data.get("in_distribution", False)),
                well_formed=well_formed,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed eval suite: {e!r}") from None

    @classmethod
    def load(
        cls, path: str | Path, verifier: Verifier, well_formed: Callable[[str, str], bool] | None = None
    ) -> EvalSuite:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read the eval suite ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: an eval suite file holds a JSON object")
        return cls.from_json(data, verifier, well_formed)


@dataclass(frozen=True)
class OfflinePrompts:
    """Where the learner's offline group rollouts (`learner.offline`) draw prompts from: the product's
    prompts that may be trained on (never its eval suite's), and the verifier that scores them. Named
    in the config file as `learner.offline_prompts` ("module:attr"); lending's rollouts use it."""

    name: str
    prompts: tuple[str, ...]
    verifier: Verifier = field(compare=False)
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"offline prompts need a non-empty name, got {self.name!r}")
        prompts = tuple(self.prompts)
        object.__setattr__(self, "prompts", prompts)
        object.__setattr__(self, "stop", tuple(self.stop))
        if not prompts:
            raise ValueError(f"offline prompts {self.name!r}: no prompts")
        bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str) or not p), None)
        if bad is not None:
            raise ValueError(f"offline prompts {self.name!r} item {bad}: a prompt must be a non-empty string")
        if not isinstance(self.verifier, Verifier):
            raise ValueError(f"offline prompts {self.name!r}: {self.verifier!r} has no verify(prompts, completions)")
