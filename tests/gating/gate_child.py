"""A real gate process for test_gate_lease.py: `run_gate` on test_gate.py's tiny setup (an embedded
engine, every version loaded from one checkpoint folder, test_evals.py's suite), a one-step canary at
`SHARE` (as test_canary.py's `gate_for`) and a short lease, reading samples from an embedded bus.

    python -m tests.gating.gate_child HOME DB_URL CHECKPOINT BEAT_S
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from core.supervisor import child_setup
from feedback.bus_embedded import EmbeddedBus
from gating.canary import CanaryConfig
from gating.gate_process import run_gate
from tests.gating.test_evals import SUITE
from tests.gating.test_gate import CFG, engines, folders

SHARE = 0.5
PARTITIONS = 2


def bus_at(home: Path) -> EmbeddedBus:
    return EmbeddedBus(home / "bus", partitions=PARTITIONS, fsync=False)


def main(argv: list[str]) -> None:
    child_setup()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    home, db_url, checkpoint, beat_s = Path(argv[0]), argv[1], Path(argv[2]), float(argv[3])
    settings = SimpleNamespace(db_url=db_url, home=home, served_model_dir=checkpoint)
    canary = CanaryConfig(steps=(SHARE,), min_step_s=0, max_step_s=3600, route_lag_s=0.0)
    cfg = CFG.model_copy(update={"lease_beat_s": beat_s, "canary": canary})
    bus = bus_at(home)
    try:
        run_gate(settings, threading.Event(), SUITE, cfg, engine_factory=engines(), load_version=folders(checkpoint),
                 bus=bus)  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        bus.close()


if __name__ == "__main__":
    main(sys.argv[1:])
