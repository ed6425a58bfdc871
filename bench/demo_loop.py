"""The in-process loop (`demo.loop.run_demo_loop`, the fast twin of `flywheel demo` that tests and benchmarks
train candidates with): how much an honest loop of on-policy updates lifts the shipped base.

The shipped base (`models/demo-base`), `--rounds` rounds of `--samples` train-split completions each, served
by the embedded engine, judged by the simulated users, joined into rewards and trained on (one policy-gradient
update per round, lr `--lr`), evaluated every `--eval-every` rounds on `--eval-tasks` gate-split prompts
(one completion each at temperature 1; the report split is never used). The peer, in the same run: the base
on the same evaluation prompts (round 0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench import common
from demo.bootstrap import SHIPPED_BASE
from demo.loop import DemoLoopConfig, run_demo_loop
from learner.trainer import TrainerConfig

NAME = "demo_loop"


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--samples", type=int, default=128, help="completions per round")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-tasks", type=int, default=300, help="gate-split prompts per evaluation")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    st = common.stamp()
    torch.set_num_threads(a.threads)
    cfg = DemoLoopConfig(
        rounds=a.rounds,
        samples_per_round=a.samples,
        eval_tasks=a.eval_tasks,
        eval_every=a.eval_every,
        seed=a.seed,
        trainer=TrainerConfig(lr=a.lr),
    )
    report = run_demo_loop(a.model, cfg)
    evals = [h for h in report["history"] if "satisfaction" in h]
    base = evals[0]
    result = {
        "model": common.shown(a.model),
        "config": report["config"],
        "seconds": report["seconds"],
        "evaluations": [
            {
                "round": h["round"],
                "pass_rate": h["pass_rate"],
                "satisfaction": h["satisfaction"],
                "satisfaction_ceiling": h.get("satisfaction_ceiling"),
                "gain_points": 100 * (h["satisfaction"] - base["satisfaction"]),
            }
            for h in evals
        ],
        "joiner": report["joiner"],
        "rounds": report["history"][1:],
    }
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
