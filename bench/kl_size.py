"""The size of the demo's KL penalty, chosen on the gate split with the in-process loop (`demo.loop`).

For each `--kl` (the learner's `kl_coef`; 0 is the peer, KL off) and each `--seeds` seed: the shipped base,
`--rounds` rounds of `--samples` train-split completions through the real joiner and learner, evaluated every
`--eval-every` rounds on `--eval-tasks` **gate**-split prompts (the report split is never used). The loop has
no gate, so its KL reference is the base throughout, where `flywheel demo`'s is the promoted version, a few
candidates behind; `kl_k3` here is the last update's estimate of KL(π_θ || base) per token. The demo takes the
largest size whose pass rate, averaged over the seeds, is no lower than KL off's beyond the seeds' spread
(docs/demo.md). Runs go two at a time, one torch thread each.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import common
from demo.bootstrap import SHIPPED_BASE

NAME = "kl_size"


def one(
    model: str, kl: float, seed: int, rounds: int, samples: int, eval_tasks: int, eval_every: int
) -> dict[str, Any]:
    import torch

    from demo.loop import DemoLoopConfig, run_demo_loop
    from learner.objective import LossConfig
    from learner.trainer import TrainerConfig

    torch.set_num_threads(1)
    cfg = DemoLoopConfig(
        rounds=rounds,
        samples_per_round=samples,
        users=100,
        eval_tasks=eval_tasks,
        eval_every=eval_every,
        seed=seed,
        trainer=TrainerConfig(lr=3e-4, loss=LossConfig(kl_coef=kl)),
    )
    rep = run_demo_loop(model, cfg)
    rounds_ = [h for h in rep["history"] if h["round"] > 0]
    return {
        "kl_coef": kl,
        "seed": seed,
        "seconds": rep["seconds"],
        "evaluations": [
            {"round": h["round"], "pass_rate": h["pass_rate"], "satisfaction": h["satisfaction"]}
            for h in rep["history"]
            if "pass_rate" in h
        ],
        "entropy_first": rounds_[0].get("entropy"),
        "entropy_last": rounds_[-1].get("entropy"),
        "kl_k3_last": rounds_[-1].get("kl_k3"),
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE)
    ap.add_argument("--kl", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--samples", type=int, default=256, help="completions per round (the demo's update size)")
    ap.add_argument("--eval-tasks", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=8)
    a = ap.parse_args()
    st = common.stamp()
    jobs = [(str(a.model), k, s, a.rounds, a.samples, a.eval_tasks, a.eval_every) for k in a.kl for s in a.seeds]
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(one, *zip(*jobs)))
    summary = []
    for k in a.kl:
        mine = [r for r in runs if r["kl_coef"] == k]
        final = [r["evaluations"][-1] for r in mine]
        summary.append(
            {
                "kl_coef": k,
                "pass_rate": sum(f["pass_rate"] for f in final) / len(final),
                "pass_rates": [f["pass_rate"] for f in final],
                "satisfaction": sum(f["satisfaction"] for f in final) / len(final),
                "entropy_last": sum(r["entropy_last"] for r in mine) / len(mine),
                "kl_k3_last": sum(r["kl_k3_last"] for r in mine) / len(mine),
            }
        )
    base = runs[0]["evaluations"][0]
    result = {
        "model": common.shown(a.model),
        "config": {k: getattr(a, k) for k in ("kl", "seeds", "rounds", "samples", "eval_tasks", "eval_every")},
        "base": base,
        "summary": summary,
        "runs": runs,
    }
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
