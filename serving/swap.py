"""Hot swap: a new version loads beside the served one, takes the new requests, and the old one goes.

`hot_swap(engine, name, source)` on any `serving.interface.Engine`:
1. `add_version(name, source)`: the new weights load beside the old (the old one goes on serving);
2. `set_default(name)`: every request submitted from then on that names no version is bound to the
   new one; requests already submitted finish on the version they were bound to, so every
   completion's tokens, log-probs and routed experts come from the one version it names;
3. `retire_version(old)`: requests naming the old version are refused from then on, and it is
   unloaded once its last request in flight has ended (`wait=False` returns at once instead).

No request is dropped and no completion mixes two policies. Called by whatever follows the
registry (replicas, to come) and by the tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.interface import Engine
from serving.tokenizer import Tokenizer


@dataclass(frozen=True)
class Swap:
    old: str | None  # the previous default (retired), None when there was none
    new: str
    load_s: float  # loading the new version beside the old
    switch_s: float  # making it the default
    drain_s: float  # until the old one was unloaded (0 with wait=False: it goes later)

    @property
    def swap_s(self) -> float:
        """Load beside + switch: from the call until new requests go to the new version."""
        return self.load_s + self.switch_s


def hot_swap(
    engine: Engine, name: str, source: str | Path | Any, tokenizer: Tokenizer | None = None, wait: bool = True
) -> Swap:
    """Serve `source` as version `name` in place of the current default (see the module's docstring)."""
    old = engine.default_version
    if old == name:
        raise ValueError(f"model version {name!r} is already the default")
    t0 = time.perf_counter()
    engine.add_version(name, source, tokenizer)
    t1 = time.perf_counter()
    engine.set_default(name)
    t2 = time.perf_counter()
    if old is not None:
        engine.retire_version(old, wait=wait)
    t3 = time.perf_counter()
    return Swap(old, name, t1 - t0, t2 - t1, t3 - t2 if wait else 0.0)
