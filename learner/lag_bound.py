"""The learner's wait at its policy-lag bound, mixed into `learner.service.LearnerService`: while the
promoted version (most of the traffic) is `max_lag_updates` behind the tip, the learner makes no update
(its samples stay buffered) and looks again every `hold_check_s`."""

from __future__ import annotations

import logging
from typing import Any

from learner.distributed import from_rank0
from learner.lineage import staleness

log = logging.getLogger(__name__)


class LagBound:
    """Uses the service's `cfg`, `state`, `counters`, `rank`, `world_size`, `clock`, `_lag_wait`,
    `_lag_checked` and `_promoted_id()`."""

    cfg: Any
    state: dict
    counters: Any
    rank: int
    world_size: int
    clock: Any
    _lag_wait: bool
    _lag_checked: float

    def _promoted_id(self) -> str:
        raise NotImplementedError

    def _at_lag_bound(self) -> bool:
        """While the promoted version (most of the traffic) is `max_lag_updates` behind the tip, another
        update would put all it serves beyond the bound: wait (counted) for a promotion or a rebase,
        buffering up to `lag_wait_updates` updates' worth (`poll`), then train them in one update."""
        bound = self.cfg.max_lag_updates
        lag = staleness(self.state, "updates").get(self._promoted_id()) if bound is not None else None
        wait = lag is not None and bound is not None and lag >= bound
        if wait and not self._lag_wait:
            self.counters["lag_bound_waits"] += 1
            log.info("learner: the promoted version is %s updates behind the tip: waiting for the gate", lag)
        self._lag_wait = wait
        return wait

    def _recheck_due(self) -> bool:  # waiting at the lag bound: look again every `hold_check_s` (a collective)
        due = self.rank == 0 and self.clock() - self._lag_checked >= self.cfg.hold_check_s
        if due:
            self._lag_checked = self.clock()
        return bool(from_rank0(due, self.world_size))
