"""The counters every update records with its statistics, and their totals over a candidate's updates.

Counted, never silent: samples dropped by reason (`learner.samples.drop_reason`: empty, greedy,
unknown version, stale in `staleness_unit`, beyond the lag bound in updates), offline samples
dropped for the same bounds, users and samples the poisoning screen flagged (`learner.poisoning`)
and the samples its verifier scored or could not check (every sample on the topic, as it arrives),
and, from the trainer, masked, truncated and clipped tokens, tokens cut by the trainer's own top-p,
sequences without recorded routing and the micro-batches trained without replay. Each update's
statistics hold them (registered with the version's metrics, or kept with a held-back update); a
registered version also holds their sums over itself and the held-back updates since its parent
(`since_parent`), so a candidate built from 8 updates shows what all 8 dropped, masked and flagged.
Every update, registered or held back, is also one line of `updates.jsonl` in the learner's models
folder (`append_update`): the only record of a held-back update's own flags once its candidate merges it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from learner.poisoning import Screening

DROP_REASONS = ("opted_out", "empty", "greedy", "unknown_version", "stale", "lag")
"""Why a sample is not trained on (`learner.samples.drop_reason`): each a count in every update's stats."""

SUMMED = (
    "samples",
    "tokens",
    "masked_tokens",
    "masked_top_p_tokens",
    "truncated_tokens",
    "clipped_tokens",
    "missing_routing_sequences",
    "replay_off_micro_batches",
    "poisoning_flagged_users",
    "poisoning_flagged_samples",
    "poisoning_verified_samples",
    "poisoning_unverifiable_samples",
    "dropped_offline",
    *(f"dropped_{why}" for why in DROP_REASONS),
)
"""Counters that a registered version sums over its held-back updates (`since_parent`)."""


def counters(
    dropped: Counter[str], screening: Screening, offline_dropped: int, scouted: Counter[str] | None = None
) -> dict[str, Any]:
    """The service's part of an update's statistics: drops by reason, poisoning flags, and what the
    poisoning screen's scout (`learner.poisoning.Scout`, None without a verifier) scored and could not
    score since the last update."""
    out: dict[str, Any] = {"dropped": dict(dropped)}
    for why in DROP_REASONS:
        out[f"dropped_{why}"] = float(dropped.get(why, 0))
    out["dropped_offline"] = float(offline_dropped)
    out["poisoning"] = screening.summary()
    out["poisoning_flagged_users"] = float(len(screening.flags))
    out["poisoning_flagged_samples"] = float(sum(f.samples for f in screening.flags))
    scouted = scouted or Counter()
    out["poisoning_verified_samples"] = float(scouted["verified"])
    out["poisoning_unverifiable_samples"] = float(scouted["unverifiable"])
    return out


def since_parent(updates: list[dict[str, Any]]) -> dict[str, float]:
    """`SUMMED` over the statistics of a candidate's updates (held back, then its own)."""
    return {k: sum(float(st.get(k, 0.0)) for st in updates) for k in SUMMED}


def append_update(path: Path, version: str, parent: str, update: int, stats: dict[str, Any]) -> None:
    """One JSON line per update in `path`: its version, parent, update number, time and statistics."""
    line = {"version": version, "parent": parent, "update": update, "at": round(time.time(), 3), "stats": stats}
    with path.open("a") as f:
        f.write(json.dumps(line, default=float) + "\n")
