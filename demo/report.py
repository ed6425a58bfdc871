"""The demo's report: runs of `demo.system.run_system` become `docs/demo/report.{md,json}` and a plot.

Runs: one per seed (the main result), plus two controls on seed 0 — shuffled rewards (users react to
another completion's outcome, so feedback carries no information about the completion) and 5%
adversarial users. Every number is on the report split, which neither pre-training, user traffic nor
the gate ever saw, and is paired: the same report prompts, sampled with the same seeds, for every
version, so a gain is the mean of per-prompt differences.

- `satisfaction_gain_points`: last promoted version minus the base, in points (x 100), per seed; the
  headline is their mean, with a 95% t-interval over seeds (and each seed's paired interval).
- `pass_rate_gain_points`: the same for the verifiable pass rate (co-primary).
- `shuffled_control.satisfaction_gain_points`: the shuffled run's gain (should be about 0).
- `adversarial_5pct.satisfaction_cost_points`: seed 0's gain minus the adversarial run's, paired by
  prompt between the two final versions.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from scipy import stats

from core.files import atomic_write


def _paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """Mean of b - a in points with a normal 95% interval (a, b: per-prompt values, same prompts)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need equal, non-empty lengths, got {len(a)} and {len(b)}")
    d = [100.0 * (y - x) for x, y in zip(a, b, strict=True)]
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return {"points": round(mean, 2), "ci95": [round(mean - half, 2), round(mean + half, 2)], "n": n}


def _over_seeds(values: list[float]) -> dict[str, Any]:
    n, mean = len(values), sum(values) / len(values)
    if n < 2:
        return {"points": round(mean, 2), "ci95": None, "seeds": n}
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"points": round(mean, 2), "ci95": [round(mean - half, 2), round(mean + half, 2)], "seeds": n}


def run_gain(run: dict[str, Any]) -> dict[str, Any]:
    """Base vs the last promoted version of one run, paired per report prompt."""
    evals = run["evaluations"]
    base_id, final_id = run["promotions"][0], run["promotions"][-1]
    base, final = evals[base_id]["per_task"], evals[final_id]["per_task"]
    return {
        "base": base_id,
        "final": final_id,
        "promotions": len(run["promotions"]) - 1,
        "satisfaction": _paired(base["satisfaction"], final["satisfaction"]),
        "pass_rate": _paired(base["passed"], final["passed"]),
    }


def summarize(seeds: list[dict], shuffled: dict | None, adversarial: dict | None) -> dict[str, Any]:
    """The report's JSON (module docstring)."""
    if not seeds:
        raise ValueError("the report needs at least one seed's run")
    gains = [run_gain(r) for r in seeds]
    sat = _over_seeds([g["satisfaction"]["points"] for g in gains])
    out: dict[str, Any] = {
        "report_split": {
            "satisfaction_gain_points": sat["points"],
            "satisfaction_gain_ci95": sat["ci95"],
            "pass_rate_gain_points": _over_seeds([g["pass_rate"]["points"] for g in gains])["points"],
            "pass_rate_gain_ci95": _over_seeds([g["pass_rate"]["points"] for g in gains])["ci95"],
            "per_seed": [{"seed": r["config"]["seed"], **g} for r, g in zip(seeds, gains, strict=True)],
            "prompts": seeds[0]["evaluations"][gains[0]["base"]]["n"],
        },
        "runs": [_run_summary(r) for r in [*seeds, *(x for x in (shuffled, adversarial) if x is not None)]],
    }
    if shuffled is not None:
        g = run_gain(shuffled)
        out["shuffled_control"] = {"satisfaction_gain_points": g["satisfaction"]["points"], **g}
    if adversarial is not None:
        clean, adv = seeds[0], adversarial
        a = clean["evaluations"][clean["promotions"][-1]]["per_task"]["satisfaction"]
        b = adv["evaluations"][adv["promotions"][-1]]["per_task"]["satisfaction"]
        cost = _paired(b, a)  # how much better the clean run's final is than the adversarial run's
        out["adversarial_5pct"] = {
            "satisfaction_cost_points": cost["points"],
            "satisfaction_cost_ci95": cost["ci95"],
            "share": adv["config"]["adversarial_share"],
            **run_gain(adv),
        }
    return out


def _run_summary(run: dict[str, Any]) -> dict[str, Any]:
    evals = {
        vid: {k: e[k] for k in ("satisfaction", "satisfaction_ci95", "pass_rate", "pass_rate_ci95", "n")}
        for vid, e in run["evaluations"].items()
    }
    return {
        "seed": run["config"]["seed"],
        "adversarial_share": run["config"]["adversarial_share"],
        "shuffle_rewards": run["config"]["shuffle_rewards"],
        "wall_s": run["wall_s"],
        "evaluation_s": run.get("evaluation_s"),
        "traffic": run["traffic"],
        "logged": run.get("logged_prompts"),
        "evaluations": evals,
        "versions": run["versions"],
    }


def write(summary: dict[str, Any], out_dir: Path, command: str) -> list[Path]:
    """`report.json`, `report.md` and `report.png` in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.png"]
    atomic_write(paths[0], json.dumps({**summary, "command": command}, indent=2) + "\n")
    atomic_write(paths[1], markdown(summary, command))
    plot(summary, paths[2])
    return paths


def markdown(s: dict[str, Any], command: str) -> str:
    r = s["report_split"]
    lines = [
        "# The demo, through the running system",
        "",
        f"Made by `{command}`. Every number is on the report split ({r['prompts']} prompts per evaluation, "
        "never seen by pre-training, user traffic or the gate), paired per prompt against the base.",
        "",
        "| | satisfaction gain (points) | 95% CI | pass-rate gain (points) | 95% CI |",
        "|---|---:|---|---:|---|",
        f"| mean over {len(r['per_seed'])} seed(s) | {r['satisfaction_gain_points']} | "
        f"{r['satisfaction_gain_ci95']} | {r['pass_rate_gain_points']} | {r['pass_rate_gain_ci95']} |",
    ]
    for g in r["per_seed"]:
        lines.append(
            f"| seed {g['seed']} ({g['base']} → {g['final']}, {g['promotions']} promotions) | "
            f"{g['satisfaction']['points']} | {g['satisfaction']['ci95']} | {g['pass_rate']['points']} | "
            f"{g['pass_rate']['ci95']} |"
        )
    if "shuffled_control" in s:
        c = s["shuffled_control"]
        lines.append(
            f"| control: shuffled rewards (seed 0) | {c['satisfaction']['points']} | {c['satisfaction']['ci95']} | "
            f"{c['pass_rate']['points']} | {c['pass_rate']['ci95']} |"
        )
    if "adversarial_5pct" in s:
        a = s["adversarial_5pct"]
        lines.append(
            f"| 5% adversarial users (seed 0) | {a['satisfaction']['points']} | {a['satisfaction']['ci95']} | "
            f"{a['pass_rate']['points']} | {a['pass_rate']['ci95']} |"
        )
        lines += ["", f"Cost of 5% adversarial users: {a['satisfaction_cost_points']} points "
                  f"(95% CI {a['satisfaction_cost_ci95']}), paired against seed 0's final version."]  # fmt: skip
    lines += ["", "![satisfaction per version](report.png)", "", "## Runs", ""]
    for run in s["runs"]:
        lines += _run_section(run)
    return "\n".join(lines) + "\n"


def _at(t: str) -> datetime:
    return datetime.fromisoformat(t)


def _first(v: dict[str, Any], to: str) -> dict[str, Any] | None:
    return next((t for t in v["transitions"] if t["to"] == to), None)


def _run_section(run: dict[str, Any]) -> list[str]:
    what = "shuffled-reward control" if run["shuffle_rewards"] else f"{run['adversarial_share']:.0%} adversarial users"
    t = run["traffic"]
    lines = [
        f"### seed {run['seed']}, {what}",
        "",
        f"{run['wall_s']:.0f} s of running system ({t['completions']} completions, {t.get('errors', 0)} failed, "
        f"{t['feedback']} feedback events), then the report-split evaluation. "
        + (
            f"Logged completions checked for gate or report content: {run['logged']['completions_logged']} "
            f"({run['logged']['distinct_prompts']} distinct prompts), leaks found: {len(run['logged']['leaks'])}."
            if run.get("logged")
            else ""
        ),
        "",
    ]
    versions = run["versions"]
    base = next((v for v in versions if v["parent"] is None), None)
    start = _at(base["transitions"][0]["at"]) if base and base["transitions"] else None
    lines += [
        "| version | fate | learner updates | offline gate | canary | promoted after | report satisfaction "
        "| report pass rate |",
        "|---|---|---:|---|---|---:|---|---|",
    ]
    for v in versions:
        e = run["evaluations"].get(v["id"])
        sat = _pct(e["satisfaction"], e["satisfaction_ci95"]) if e else ""
        pr = _pct(e["pass_rate"], e["pass_rate_ci95"]) if e else ""
        cand, canary, waiting, promoted = (
            _first(v, k) for k in ("candidate", "canary", "awaiting_approval", "promoted")
        )
        ended = next((x for x in v["transitions"] if x["to"] in ("rejected", "aborted")), None)
        m = re.search(r"learner update (\d+)", cand["reason"]) if cand else None
        offline = canary["reason"] if canary else (ended["reason"] if ended and not canary else "")
        online = waiting["reason"] if waiting else (ended["reason"] if ended and canary else "")
        after = f"{(_at(promoted['at']) - start).total_seconds():.0f} s" if promoted and start and v["parent"] else ""
        fate = v["status"] if v["parent"] else "base"
        cells = [v["id"], fate, m[1] if m else "", _short(offline), _short(online), after, sat, pr]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Off-policy statistics of each candidate's last update (importance ratio against the behaviour "
        "log-probs the gateway recorded; staleness in registered versions and in updates):",
        "",
        "| version | ratio mean | ratio max | mean abs log ratio | clipped tokens | staleness (versions) "
        "| staleness (updates) | dropped | held-back updates |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for v in versions:
        le = v.get("learner") or {}
        if not le:
            continue
        cells = [v["id"]] + [_num(le.get(k)) for k in ("ratio_mean", "ratio_max", "abs_log_ratio_mean")]
        cells.append(f"{100 * le['clip_frac']:.2f} %" if "clip_frac" in le else "")
        cells += [_num(le.get("staleness_versions_mean")), _num(le.get("staleness_updates_mean"))]
        cells += [str(le.get("dropped", "")), str(le.get("held_back_updates", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _pct(x: float, ci: list[float]) -> str:
    return f"{100 * x:.1f} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _num(x: Any) -> str:
    return "" if x is None else f"{x:.3g}"


def _short(reason: str, n: int = 110) -> str:
    reason = reason.replace("|", "/").split(" on demo-gate@")[0]
    return reason if len(reason) <= n else reason[: n - 1] + "…"


def plot(s: dict[str, Any], path: Path) -> None:
    """Satisfaction per promoted version of every run, with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for run in s["runs"]:
        evals = run["evaluations"]
        ids = list(evals)
        y = [evals[i]["satisfaction"] for i in ids]
        lo = [evals[i]["satisfaction"] - evals[i]["satisfaction_ci95"][0] for i in ids]
        hi = [evals[i]["satisfaction_ci95"][1] - evals[i]["satisfaction"] for i in ids]
        what = "shuffled" if run["shuffle_rewards"] else f"seed {run['seed']}"
        if run["adversarial_share"]:
            what += f", {run['adversarial_share']:.0%} adversarial"
        ax.errorbar(range(len(ids)), y, yerr=[lo, hi], marker="o", capsize=3, label=what)
    ax.set_xlabel("promotion (0 = base)")
    ax.set_ylabel("satisfaction on the report split")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
