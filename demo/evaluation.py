"""Evaluation of a served version on fixed demo tasks: pass rate and users' satisfaction.

One completion per task, sampled as the product serves it, checked by the task's tests and scored
by the simulated users. The published numbers use the report split (`demo.split.split_tasks
("report", n)`); called by `flywheel bootstrap` (the base model's report) and by `flywheel demo`.
"""

from __future__ import annotations

from collections.abc import Sequence

from demo.checker import check_batch
from demo.tasks import Task, completions_for, is_preferred_style
from demo.users import satisfaction
from serving.interface import Engine
from serving.sampling import SamplingParams


def evaluate(
    engine: Engine, version: str, tasks: Sequence[Task], seed: int, temperature: float = 1.0, max_tokens: int = 48
) -> dict:
    """Sample one completion per task as the product would; check it; ask the simulated users."""
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    tok = engine.tokenizer(version)
    tasks = list(tasks)
    # One seed per task: the evaluation does not depend on how the engine happens to batch.
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(len(tasks))]
    outs = engine.generate([tok.encode_prompt(t.prompt) for t in tasks], params, version=version)
    texts = [o.text for o in outs]
    checks = check_batch(tasks, texts)
    sats = [satisfaction(t, c, r) for t, c, r in zip(tasks, texts, checks)]
    per_family: dict[str, list[int]] = {}
    for t, r in zip(tasks, checks):
        per_family.setdefault(t.family, []).append(int(r.passed))
    # The ceiling feedback could reach: the same users scoring a correct, house-style completion.
    best = [completions_for(t)["correct_preferred"][0] for t in tasks]
    best_checks = check_batch(tasks, best)
    ceiling = sum(satisfaction(t, c, r) for t, c, r in zip(tasks, best, best_checks)) / len(tasks)
    return {
        "n": len(tasks),
        "satisfaction_ceiling": ceiling,
        "pass_rate": sum(r.passed for r in checks) / len(checks),
        "satisfaction": sum(sats) / len(sats),
        "pass_rate_by_family": {f: sum(v) / len(v) for f, v in sorted(per_family.items())},
        "mean_output_tokens": sum(len(o.output_ids) for o in outs) / len(outs),
        "per_task": {  # paired comparisons
            "satisfaction": sats,
            "passed": [int(r.passed) for r in checks],
            "styled": [int(r.passed and is_preferred_style(c)) for c, r in zip(texts, checks)],  # correct, house style
        },
    }
