"""Calibrates the demo product's base model: how good it is already, and how much room it leaves.

The target is a base that is good already but improvable: a verifiable pass rate of 25-60% on the
report split and at least 50 points of satisfaction headroom (the mean satisfaction of always answering the
known correct, house-style completion, minus the base's). This measures a base on fixed sets of distinct
prompts, one completion per prompt at temperature 1 (as the product serves; one seed per prompt), each
checked by its tests and scored with the simulated users' satisfaction (`demo.users.satisfaction`):
- "train": train prompts, in-distribution (the pre-training corpus is drawn from the same prompts);
- "gate": the gate split, the held-out phrasing with gate values;
- "report": the report split, the held-out phrasing with values of its own;
- two diagnostics of what carries over, built from gate values so that report stays untouched:
  "held-out values" (train phrasings, gate values) and "held-out phrasing" (the held-out phrasing, train
  values); these prompts belong to no split.
The peers, in the same run: the train set (in-distribution) for every held-out set, and the satisfaction of
the known best completion on the same prompts (the ceiling).

By default the base is the shipped one (`models/demo-base`, the default `BootstrapConfig` recipe), measured
as it is. `--train TAG` first pre-trains an attempt with the given recipe fields (`demo.bootstrap.bootstrap`,
cached in var/models/product-TAG) and measures it without the report split: attempts are compared on gate,
which shares report's phrasing, and report is measured once, on the chosen base. Every run replaces its
attempt (by tag) in bench/results/demo_calibration.json.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import common
from demo.bootstrap import REPORT, SHIPPED_BASE, BootstrapConfig, bootstrap
from demo.checker import check_batch
from demo.split import HELD_OUT_PHRASING, TRAIN_PHRASINGS, draw_value, split_tasks
from demo.tasks import FAMILIES, Task, completions_for, is_preferred_style, make_task
from demo.users import satisfaction
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.interface import Engine
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

NAME = "demo_calibration"
SEEDS = {"train": 1, "gate": 2, "held-out values": 3, "held-out phrasing": 4, "report": 5}  # x 1e6: sampling seeds


def probe_tasks(n: int, phrasings: Sequence[int], values_from: str, seed: int) -> list[Task]:
    """`n` distinct prompts outside the split: `phrasings` with values of split `values_from`."""
    rng = random.Random(f"probe:{seed}")
    seen: set[str] = set()
    out: list[Task] = []
    while len(out) < n:
        family = FAMILIES[len(out) % len(FAMILIES)]
        task = make_task(family, rng, rng.choice(phrasings), lambda d, r: draw_value(d, values_from, r))
        if task.prompt not in seen:
            seen.add(task.prompt)
            out.append(task)
    return out


def _ci95(p: float, n: int) -> float:
    return 1.96 * math.sqrt(max(p * (1 - p), 1e-12) / n)


def evaluate_tasks(engine: Engine, version: str, tasks: Sequence[Task], seed: int, max_tokens: int = 48) -> dict:
    """One completion per task at temperature 1, checked by its tests and scored by the users."""
    tok = engine.tokenizer(version)
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i) for i in range(len(tasks))]
    outs = engine.generate([tok.encode_prompt(t.prompt) for t in tasks], params, version=version)
    texts = [o.text for o in outs]
    checks = check_batch(tasks, texts)
    sats = [satisfaction(t, c, r) for t, c, r in zip(tasks, texts, checks)]
    best = [completions_for(t)["correct_preferred"][0] for t in tasks]
    ceiling = [satisfaction(t, c, r) for t, c, r in zip(tasks, best, check_batch(tasks, best))]
    by_family: dict[str, list[int]] = {}
    for t, r in zip(tasks, checks):
        by_family.setdefault(t.family, []).append(int(r.passed))
    n = len(tasks)
    pass_rate = sum(r.passed for r in checks) / n
    mean_sat = sum(sats) / n
    return {
        "n": n,
        "pass_rate": pass_rate,
        "pass_rate_ci95": _ci95(pass_rate, n),
        "satisfaction": mean_sat,
        "satisfaction_ceiling": sum(ceiling) / n,
        "headroom_points": 100 * (sum(ceiling) / n - mean_sat),
        "house_style_share": sum(is_preferred_style(c) for c in texts) / n,
        "house_style_share_of_passing": sum(is_preferred_style(c) for c, r in zip(texts, checks) if r.passed)
        / max(1, sum(r.passed for r in checks)),
        "pass_rate_by_family": {f: sum(v) / len(v) for f, v in sorted(by_family.items())},
        "mean_output_tokens": sum(len(o.output_ids) for o in outs) / n,
        "samples": [
            {"prompt": t.prompt, "completion": c, "passed": r.passed} for t, c, r in list(zip(tasks, texts, checks))[:6]
        ],
    }


def eval_sets(n: int, report: bool) -> dict[str, list[Task]]:
    """The sets a base is measured on (report only for the chosen base)."""
    sets = {
        "train": split_tasks("train", n),
        "gate": split_tasks("gate", n),
        "held-out values": probe_tasks(n // 2, TRAIN_PHRASINGS, "gate", seed=1),
        "held-out phrasing": probe_tasks(n // 2, (HELD_OUT_PHRASING,), "train", seed=2),
    }
    if report:
        sets["report"] = split_tasks("report", n)
    return sets


def _evaluate_sets(engine: Engine, version: str, sets: dict[str, list[Task]]) -> dict:
    out = {}
    for name, tasks in sets.items():
        t0 = time.perf_counter()
        out[name] = evaluate_tasks(engine, version, tasks, seed=1_000_000 * SEEDS[name])
        out[name]["seconds"] = time.perf_counter() - t0
        print(f"  {name}: pass {out[name]['pass_rate']:.3f} sat {out[name]['satisfaction']:.3f}", flush=True)
    return out


def measure_base(model_dir: Path, n: int, seed: int) -> dict[str, Any]:
    """Every set, report included, on an existing base."""
    model = load_checkpoint(model_dir)
    engine = EmbeddedEngine(max_batch=64, max_model_len=model.args.max_seq_len, seed=seed)
    try:
        engine.add_version("base", model, Tokenizer.from_file(model_dir))
        return _evaluate_sets(engine, "base", eval_sets(n, report=True))
    finally:
        engine.shutdown()


def train_attempt(a: Any) -> tuple[Path, dict[str, Any]]:
    """Pre-train attempt `a.train` with the given recipe fields; its folder and the bootstrap's report,
    whose "eval" holds every set but report."""
    cfg = BootstrapConfig(
        seed=a.seed,
        steps=a.steps,
        corpus_size=a.corpus_size,
        p_correct=a.p_correct,
        p_preferred=a.p_preferred,
        time_budget_s=a.time_budget_s,
        threads=a.threads,
        eval_tasks=1,  # unused: the evaluation below replaces the default one
    )
    sets = eval_sets(a.n, report=False)
    out_dir = common.ROOT / "var" / "models" / f"product-{a.train}"
    boot = bootstrap(
        out_dir, cfg, force=a.force, evaluation=lambda engine, version: _evaluate_sets(engine, version, sets)
    )
    return out_dir, boot


def main() -> None:
    recipe = BootstrapConfig()  # the defaults are the shipped recipe's
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base to measure (default: models/demo-base)")
    ap.add_argument("--train", metavar="TAG", default=None, help="pre-train attempt TAG first (recipe fields below)")
    ap.add_argument("--note", default="", help="one line on why this attempt")
    ap.add_argument("--seed", type=int, default=recipe.seed)
    ap.add_argument("--p-correct", type=float, default=recipe.p_correct)
    ap.add_argument("--p-preferred", type=float, default=recipe.p_preferred)
    ap.add_argument("--steps", type=int, default=recipe.steps)
    ap.add_argument("--corpus-size", type=int, default=recipe.corpus_size)
    ap.add_argument("--time-budget-s", type=float, default=recipe.time_budget_s)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--force", action="store_true", help="retrain a cached attempt")
    ap.add_argument("--n", type=int, default=1000, help="distinct prompts per set (the diagnostics get n/2)")
    a = ap.parse_args()
    st = common.stamp()
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.train:
        folder, boot = train_attempt(a)
        tag, evals = a.train, boot["eval"]
    else:
        folder = a.model
        boot = json.loads((folder / REPORT).read_text())
        tag, evals = "shipped", measure_base(folder, a.n, boot["config"]["seed"])
    keep = ("config", "parameters", "corpus_tokens", "steps", "stopped_early", "final_loss", "train_seconds")
    attempt = {"tag": tag, "note": a.note, "checkpoint": common.shown(folder), **{k: boot.get(k) for k in keep}}
    attempt |= {"eval": evals, "stamp": common.finish(st)}
    path = common.result_path(NAME, a.out)
    old = json.loads(path.read_text()).get("attempts", []) if path.is_file() else []
    attempts = [x for x in old if x["tag"] != tag and "stamp" in x] + [attempt]
    common.save(NAME, {"n": a.n, "attempts": attempts}, st, a.out)


if __name__ == "__main__":
    main()
