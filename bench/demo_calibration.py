"""Calibrates the base model of the richer demo product (`demo.tasks`, split by `demo.split`).

The issue asks for a base that is "good already, but improvable": a verifiable pass rate of
25-60% on the report split and at least 50 points of satisfaction headroom (the mean satisfaction
of always answering the known correct, house-style completion, minus the base's). One attempt:

1. pre-train a base with `demo.bootstrap.bootstrap`, its default recipe with the given
   `BootstrapConfig` fields: the train split's corpus (`demo.bootstrap.corpus_of`, i.e.
   `demo.corpus.make_corpus` with the given correct / house-style shares) and a tokenizer that spells
   quoted strings letter by letter (`demo.bootstrap.make_tokenizer`);
2. sample one completion per prompt at temperature 1 (as the product serves; one seed per prompt)
   on fixed sets of distinct prompts, check each with its tests and score it with the simulated
   users' satisfaction (`demo.users.satisfaction`, default preferences):
   - "train": train prompts, labelled in-distribution (the corpus is drawn from the same prompts);
   - "gate": the gate split, the held-out phrasing with gate values;
   - two diagnostics of what carries over, built from gate values so that report stays untouched:
     "held-out values" (train phrasings, gate values) and "held-out phrasing" (the held-out
     phrasing, train values); these prompts belong to no split;
   - "report" is not measured by an attempt. `--report --tag T` measures it once, on attempt T's
     cached base, the chosen one: no attempt is tuned on report (attempts are compared on gate,
     which shares report's phrasing and is drawn the same way from disjoint values).
3. append the attempt to bench/results/demo_calibration.json and rewrite demo_calibration.md.

Usage: python bench/demo_calibration.py --tag a1 [--p-correct 0.5] [--p-preferred 0.3]
       [--steps 1500] [--corpus-size 96000] [--n 1000] [--threads N] [--note "why"]
(the defaults are `BootstrapConfig`'s, the shipped recipe: attempt a3, chosen, made it; attempts a1
and a2 ran with --p-correct 0.6)
       python bench/demo_calibration.py --tag a1 --report [--n 1000]   # once, for the chosen base
The base is cached in var/models/product-<tag> (delete it, or pass --force, to retrain).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo.bootstrap import BootstrapConfig, bootstrap  # noqa: E402
from demo.checker import check_batch  # noqa: E402
from demo.split import HELD_OUT_PHRASING, TRAIN_PHRASINGS, draw_value, split_tasks  # noqa: E402
from demo.tasks import FAMILIES, Task, completions_for, is_preferred_style, make_task  # noqa: E402
from demo.users import satisfaction  # noqa: E402
from serving.checkpoint import load_checkpoint  # noqa: E402
from serving.engine import EmbeddedEngine  # noqa: E402
from serving.interface import Engine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402
from serving.tokenizer import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results"


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


SEEDS = {"train": 1, "gate": 2, "held-out values": 3, "held-out phrasing": 4, "report": 5}  # x 1e6: sampling seeds


def eval_sets(n: int) -> dict[str, list[Task]]:
    """The sets every attempt is measured on (report is not among them: see `measure_report`)."""
    return {
        "train": split_tasks("train", n),
        "gate": split_tasks("gate", n),
        "held-out values": probe_tasks(n // 2, TRAIN_PHRASINGS, "gate", seed=1),
        "held-out phrasing": probe_tasks(n // 2, (HELD_OUT_PHRASING,), "train", seed=2),
    }


def _evaluate_sets(engine: Engine, version: str, sets: dict[str, list[Task]]) -> dict:
    out = {}
    for name, tasks in sets.items():
        t0 = time.perf_counter()
        out[name] = evaluate_tasks(engine, version, tasks, seed=1_000_000 * SEEDS[name])
        out[name]["seconds"] = time.perf_counter() - t0
        print(f"  {name}: pass {out[name]['pass_rate']:.3f} sat {out[name]['satisfaction']:.3f}", flush=True)
    return out


def measure_report(attempt: dict, n: int, threads: int | None) -> dict:
    """The report split, measured once on an attempt's cached base (the chosen one)."""
    if threads:
        torch.set_num_threads(threads)
    model_dir = ROOT / attempt["checkpoint"]
    model = load_checkpoint(model_dir)
    engine = EmbeddedEngine(max_batch=64, max_model_len=model.args.max_seq_len, seed=attempt["config"]["seed"])
    load_before = os.getloadavg()
    try:
        engine.add_version("base", model, Tokenizer.from_file(model_dir))
        ev = _evaluate_sets(engine, "base", {"report": split_tasks("report", n)})["report"]
    finally:
        engine.shutdown()
    ev["measured"] = time.strftime("%Y-%m-%d %H:%M:%S")
    ev["loadavg"] = [load_before, os.getloadavg()]
    return ev


def run_attempt(args: argparse.Namespace) -> dict:
    cfg = BootstrapConfig(
        seed=args.seed,
        steps=args.steps,
        corpus_size=args.corpus_size,
        p_correct=args.p_correct,
        p_preferred=args.p_preferred,
        time_budget_s=args.time_budget_s,
        threads=args.threads,
        eval_tasks=1,  # unused: `evaluation` below replaces the default evaluation
    )
    sets = eval_sets(args.n)

    load_before = os.getloadavg()
    t0 = time.time()
    # The corpus is the recipe's own (`demo.bootstrap.corpus_of(cfg)`: seed, corpus_size, p_correct,
    # p_preferred above), as is the tokenizer (quoted strings spelled letter by letter).
    out_dir = ROOT / "var" / "models" / f"product-{args.tag}"
    boot = bootstrap(
        out_dir,
        cfg,
        force=args.force,
        evaluation=lambda engine, version: _evaluate_sets(engine, version, sets),
    )
    return {
        "tag": args.tag,
        "note": args.note,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, shared with other jobs",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "config": boot["config"],
        "parameters": boot["parameters"],
        "corpus_tokens": boot["corpus_tokens"],
        "steps": boot["steps"],
        "stopped_early": boot["stopped_early"],
        "final_loss": boot["final_loss"],
        "train_seconds": boot["train_seconds"],
        "total_seconds": boot["total_seconds"],
        "torch_threads": boot["torch_threads"],
        "eval": boot["eval"],
        "checkpoint": str(out_dir.relative_to(ROOT)),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def write_md(attempts: list[dict], path: Path) -> None:
    lines = [
        "# Demo product: base-model calibration",
        "",
        "Made by `bench/demo_calibration.py` (its docstring says how). Target (issue 17): verifiable pass rate",
        "25-60% on the report split and at least 50 points of satisfaction headroom (satisfaction per",
        "`demo/users.py`, default preferences: 0.9 correct + house style, 0.3 correct otherwise, 0.05 wrong;",
        "headroom = the mean satisfaction of the known correct, house-style completion (90) minus the base's).",
        "Attempts are compared on **gate** (same phrasing and drawing as report, disjoint values); report is",
        "measured once, for the chosen attempt. One completion per prompt at temperature 1; pass rates in %",
        "with a 95% interval (normal approximation); n distinct prompts per set.",
        "",
        "Sets: **train** = train prompts (in-distribution: the corpus is drawn from them); **gate**; **report**;",
        "diagnostics (prompts of no split, built from gate values): **held-out values** = train phrasings with",
        "gate values, **held-out phrasing** = the held-out phrasing with train values.",
        "",
        "The split (`demo/split.py`): phrasings 0-2 of every family are train's, phrasing 3 is held out and",
        "shared by gate and report; integers >= 10 and 2-3 letter strings go to gate / report / train by",
        "sha256 of their twin class (about 10% / 10% / 80%), smaller values are train. The corpus is one",
        "pass over `make_corpus(corpus_size)` train examples; its tokenizer spells quoted strings letter by",
        "letter, as digits always are, so held-out values are new sequences of seen tokens.",
        "",
    ]
    for a in attempts:
        if "report" not in a["eval"]:
            continue
        r, t, ev = a["eval"]["report"], a["eval"]["train"], a["eval"]
        band = "met" if 0.25 <= r["pass_rate"] <= 0.60 else "missed"
        room = "met" if r["headroom_points"] >= 50 else "missed"
        carry = ", ".join(f"{name} {_pct(ev[name]['pass_rate'])}%" for name in ev if name != "train")
        lines += [
            f"**Chosen base: attempt {a['tag']}.** Report split ({r['n']} prompts, measured once, "
            f"{r['measured']}): pass rate {_pct(r['pass_rate'])}% ± {_pct(r['pass_rate_ci95'])} (target 25-60%: "
            f"{band}), satisfaction {_pct(r['satisfaction'])}%, headroom {r['headroom_points']:.1f} points "
            f"(target >= 50: {room}). What carries over to prompts never seen: against {_pct(t['pass_rate'])}% "
            f"on train prompts (in-distribution), {carry}. (Issue 17, on the 8-family product: two-digit "
            "constants, unseen letters and paraphrased comments passed about 0%.)",
            "",
        ]
    for a in attempts:
        c = a["config"]
        early = ", stopped early" if a["stopped_early"] else ""
        lines += [
            f"## Attempt {a['tag']}: p_correct {c['p_correct']}, p_preferred {c['p_preferred']}, "
            f"{c['corpus_size']} examples, {a['steps']} steps",
            "",
            *([a["note"], ""] if a.get("note") else []),
            f"Run {a['started']} on {a['machine']}; load average before "
            f"{' / '.join(f'{x:.2f}' for x in a['loadavg_before'])}, after "
            f"{' / '.join(f'{x:.2f}' for x in a['loadavg_after'])}; {a['torch_threads']} torch threads. "
            f"Training {a['train_seconds']:.0f} s ({a['steps']} steps{early}, "
            f"final loss {a['final_loss']:.3f}), total {a['total_seconds']:.0f} s; {a['parameters']:,} parameters, "
            f"{a['corpus_tokens']:,} corpus tokens. Checkpoint `{a['checkpoint']}` (not committed), "
            f"product and split as of commit {a.get('commit', '?')}.",
            "",
            "| set | n | pass rate % | satisfaction % | ceiling % | headroom (points) | house style % |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, ev in a["eval"].items():
            lines.append(
                f"| {name} | {ev['n']} | {_pct(ev['pass_rate'])} ± {_pct(ev['pass_rate_ci95'])} | "
                f"{_pct(ev['satisfaction'])} | {_pct(ev['satisfaction_ceiling'])} | {ev['headroom_points']:.1f} | "
                f"{_pct(ev['house_style_share'])} |"
            )
        fams = list(next(iter(a["eval"].values()))["pass_rate_by_family"])
        lines += ["", "Pass rate % by family:", "", "| family | " + " | ".join(a["eval"]) + " |"]
        lines.append("|---" * (len(a["eval"]) + 1) + "|")
        for f in fams:
            cells = [_pct(ev["pass_rate_by_family"].get(f, float("nan"))) for ev in a["eval"].values()]
            lines.append(f"| {f} | " + " | ".join(cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    recipe = BootstrapConfig()  # the defaults are the shipped recipe's
    ap.add_argument("--tag", required=True)
    ap.add_argument("--note", default="", help="One line on why this attempt, for the md.")
    ap.add_argument("--seed", type=int, default=recipe.seed)
    ap.add_argument("--p-correct", type=float, default=recipe.p_correct)
    ap.add_argument("--p-preferred", type=float, default=recipe.p_preferred)
    ap.add_argument("--steps", type=int, default=recipe.steps)
    ap.add_argument("--corpus-size", type=int, default=recipe.corpus_size)
    ap.add_argument("--n", type=int, default=1000, help="Distinct prompts per set (the diagnostics get n/2).")
    ap.add_argument("--report", action="store_true", help="Measure report on attempt --tag's base (the chosen one).")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=recipe.time_budget_s)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / "demo_calibration.json"
    attempts = json.loads(json_path.read_text())["attempts"] if json_path.is_file() else []
    if args.report:
        attempt = next((a for a in attempts if a["tag"] == args.tag), None)
        if attempt is None:
            raise SystemExit(f"no attempt {args.tag!r} in {json_path}; run it first (without --report)")
        if "report" in attempt["eval"] and not args.force:
            raise SystemExit(f"attempt {args.tag!r} already has its report numbers (measured once)")
        attempt["eval"]["report"] = measure_report(attempt, args.n, args.threads)
    else:
        attempt = run_attempt(args)
        attempts = [a for a in attempts if a["tag"] != args.tag] + [attempt]
    json_path.write_text(json.dumps({"attempts": attempts}, indent=2) + "\n")
    write_md(attempts, RESULTS / "demo_calibration.md")
    print(json.dumps({k: attempt["eval"][k]["pass_rate"] for k in attempt["eval"]}))


if __name__ == "__main__":
    main()
