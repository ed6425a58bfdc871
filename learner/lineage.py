"""The learner's lineage in `learner.json`: which versions it trained, which it registered, how stale a sample is.

The state (a JSON object the service replaces atomically) holds `versions` (every version of the
lineage in order, a rebase listing its base again), `published` (those registered in the registry:
the base and every candidate), `held` (versions trained while the gate was busy and not registered
yet: id -> the bus positions it covers and its update's statistics), `parents` (registered
candidate -> the version it was registered as a child of) and `current` (the tip).

- **Anchor.** The lineage's last registered version (`anchor`): the tip itself unless updates are
  held back. The next candidate is registered as its child, its weights shipped as a delta on it,
  and whether the lineage goes on or rebases is asked about it (`Registry.base_for_next_candidate`).
- **Staleness** (`staleness`: version -> how many versions behind the trainer a sample it served
  is) counts either registered versions ("versions") or every update ("updates").
    * "versions": steps along the registry's parent links (`parents`: a registered candidate's parent
      is the anchor it was registered on) from the sample's version to the anchor, through their
      last common ancestor when the version is on an abandoned branch (a candidate that was rejected
      and rebased away from). A sample served by the anchor is 0 behind, by its parent 1, ... The
      gate sees at most one candidate of the lineage at a time, so with held-back updates registered
      versions are gate cycles, and a bound in them fits the gate's cadence (`learner.service`'s
      docstring has the argument, bench/staleness.py the measurement).
    * "updates": positions in `versions` (every update, held back or not; a version listed twice, a
      rebase, counts from its last position): the tip's own samples are 0 behind.
- **Covered data.** A candidate registered after held-back updates covers their samples too:
  `merge_covered` joins [start, end) bus ranges per partition (consecutive updates' ranges meet).

Pure functions over that state; called by `learner.service`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

StalenessUnit = Literal["versions", "updates"]


def anchor(state: dict) -> str:
    """The lineage's last registered version."""
    published = set(state["published"])
    return next(v for v in reversed(state["versions"]) if v in published)


def staleness(state: dict, unit: StalenessUnit) -> dict[str, int]:
    """How many versions (`unit`) behind the trainer a sample served by each known version is."""
    versions = state["versions"]
    if unit == "updates":
        return {v: len(versions) - 1 - i for i, v in enumerate(versions)}  # later positions overwrite
    parents: dict[str, str] = state["parents"]
    tip = anchor(state)
    behind: dict[str, int] = {}
    while True:  # the anchor's ancestry: distance from the anchor
        behind[tip] = len(behind)
        if tip not in parents:
            break
        tip = parents[tip]
    out = {}
    for v in set(state["published"]):
        steps, u = 0, v
        while u not in behind and u in parents:  # up to the last common ancestor
            u, steps = parents[u], steps + 1
        if u in behind:
            out[v] = steps + behind[u]
    versions = state["versions"]
    for v in versions[len(versions) - versions[::-1].index(anchor(state)) :]:
        out[v] = 0  # held back past the anchor: ahead of it (only lent rollouts sample these)
    return out


def staleness_stats(state: dict, served_by: list[str]) -> dict[str, float]:
    """Mean and max staleness of samples served by `served_by`, in registered versions and in updates."""
    out: dict[str, float] = {}
    for unit in ("versions", "updates"):
        behind = staleness(state, unit)
        lags = [behind[v] for v in served_by if v in behind]
        out[f"staleness_{unit}_mean"] = sum(lags) / len(lags) if lags else 0.0
        out[f"staleness_{unit}_max"] = float(max(lags, default=0))
    return out


def merge_covered(ranges: Iterable[dict[str, tuple[int, int] | list[int]]]) -> dict[str, tuple[int, int]]:
    """Per partition, the [start, end) spanning every range given."""
    out: dict[str, tuple[int, int]] = {}
    for covered in ranges:
        for p, (start, end) in covered.items():
            s0, e0 = out.get(p, (start, end))
            out[p] = (min(s0, start), max(e0, end))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
