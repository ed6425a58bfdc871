"""The learner's weights for its lent rollouts (`learner.lent_rollouts`, docs/lending.md), mixed into
`learner.service.LearnerService`: the registered version that holds its current weights (a `rollout`
version, `<version>.rollout`, when they are held back), whether an open job's weights are still fresh
enough to sample, and the withdrawal of `rollout` versions no open job samples any more."""

from __future__ import annotations

import logging
from typing import Any

from learner.checkpoints import store_entry
from learner.lineage import anchor, staleness
from registry.publish import SHIPPING_DTYPE
from registry.registry import UnknownVersion
from serving.weight_store import shipping_state

log = logging.getLogger(__name__)


class RolloutWeights:
    """Uses the service's `registry`, `store`, `state`, `model`, `trainer`, `cfg`, `counters`, `lent`,
    `models_dir` and `_rollout_ids`."""

    registry: Any
    store: Any
    state: dict
    model: Any
    trainer: Any
    cfg: Any
    counters: Any
    lent: Any
    models_dir: Any
    _rollout_ids: set[str]

    def _rollout_weights(self) -> tuple[str, str]:
        """(a registered version holding the learner's current weights, the learner's id of them), for
        a lent rollout job: the current version when it is registered, else `<current>.rollout`,
        registered now as a `rollout` version (its weights into the store as a delta on the anchor's;
        hash-checked like any version, never gated, no user routed to it)."""
        vid = self.state["current"]
        try:
            self.registry.get(vid)
            return vid, vid
        except UnknownVersion:
            pass
        rid = f"{vid}.rollout"
        try:
            self.registry.get(rid)
        except UnknownVersion:
            parent = anchor(self.state)
            if self.store.path(rid) is None:
                self.store.put(rid, shipping_state(self.model, SHIPPING_DTYPE), parent=parent)
            entry = store_entry(self.store, self.models_dir, rid)
            self.registry.register(
                version_id=rid,
                parent_id=parent,
                metrics={"rollout_of": vid, "shipping": {"kind": entry["kind"], "bytes": entry["bytes"]}},
                files=[entry],
                delta_base_id=parent if entry["kind"] == "delta" else None,
                status="rollout",
                reason=f"learner update {self.trainer.updates}: {vid}'s weights for lent rollouts",
            )
            self.counters["rollout_versions"] += 1
        self._rollout_ids.add(rid)
        return rid, vid

    def _fresh_for_rollouts(self, weights_of: str) -> bool:
        """Whether rollouts sampled on the learner's `weights_of` would still be trained on: within the
        lag bound in updates, and in the current lineage (a rebase leaves them behind)."""
        lag = staleness(self.state, "updates").get(weights_of)
        bound = self.cfg.max_lag_updates
        return lag is not None and (bound is None or lag <= bound) and self._in_lineage(weights_of)

    def _in_lineage(self, vid: str) -> bool:
        parents, u = self.state["parents"], anchor(self.state)
        if vid in self.state["held"] or vid == self.state["current"]:
            return True
        while True:
            if u == vid:
                return True
            if u not in parents:
                return False
            u = parents[u]

    def _retire_rollout_versions(self) -> None:
        """Withdraw the `rollout` versions this learner registered that no open job samples any more."""
        job = self.queue_job_version()
        for rid in sorted(self._rollout_ids - {job}):
            try:
                if self.registry.get(rid).status == "rollout":
                    self.registry.transition(rid, "withdrawn", "learner", "its rollout jobs are over")
            except Exception:  # tried again at the next tick
                log.exception("learner: withdrawing rollout version %s failed", rid)
                continue
            self._rollout_ids.discard(rid)

    def queue_job_version(self) -> str | None:
        """The registered version the open rollout job samples, or None."""
        if self.lent is None or self.lent.job is None:
            return None
        return self.lent.queue.job(self.lent.job).version_id
