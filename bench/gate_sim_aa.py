"""The canary's A/A false-abort rate with the current gating code: a reduced re-run of `bench/gate_sim.py`'s
'aa' scenario (default CanaryConfig, a look every simulated minute, traffic and user model as there).

    python bench/gate_sim_aa.py [REPS]   # writes bench/results/gate_sim_aa.json

Uses the per-prompt pass rate and satisfaction measured by `bench/gate_sim.py` (its JSON).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gate_sim import Traffic, clopper_pearson, machine, simulate_online  # noqa: E402
from gating.canary import CanaryConfig  # noqa: E402


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    measured = json.loads((ROOT / "bench" / "results" / "gate_sim.json").read_text())["measured"]
    t0, cfg = time.time(), CanaryConfig()
    traffic = Traffic(pass_rate=measured["mean_pass_rate"])
    runs = simulate_online({"aa": (0.0, cfg)}, traffic, measured["mean_satisfaction"], reps, seed=7)["aa"]
    actions = Counter(r.action for r in runs)
    aborted = reps - actions["awaiting_approval"]
    out = {
        "reps": reps,
        "seed": 7,
        "actions": dict(actions),
        "aborted_rate": aborted / reps,
        "aborted_ci95": clopper_pearson(aborted, reps),
        "harm_alpha": cfg.harm_alpha,
        "seconds": round(time.time() - t0, 1),
        "machine": machine(),
    }
    (ROOT / "bench" / "results" / "gate_sim_aa.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
