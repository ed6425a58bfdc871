"""The demo's report: runs of `demo.system.run_system` become `docs/demo/report.{md,json}` and a plot.

Runs: one per seed (the main result), and the two controls on as many seeds: shuffled rewards (users
react to another completion's outcome, so feedback carries no information about the completion) and
5% adversarial users. Every number is on the report split, which neither pre-training, user traffic
nor the gate ever saw, and is paired: the same report prompts, sampled with the same seeds, for every
version, so one run's gain is the mean of per-prompt differences. Across seeds the interval is a
t-interval over the seeds' gains (seed-level: what another run would give), `None` with one seed.

- `pass_rate_gain_points` (the headline: correctness, what a user would call better code): last
  promoted version minus the base, in points (x 100), mean over seeds with its seed-level interval.
- `satisfaction_gain_points`: the same for the simulated users' satisfaction, and
  `style_share_of_satisfaction_gain`: how much of it is house style rather than correctness
  (`style_split`).
- `controls.shuffled`: the shuffled runs' gains over seeds, and `promotions_worse_than_base`: promoted
  versions whose report pass rate is below the base's with the paired 95% interval wholly below 0.
- `controls.adversarial_5pct`: per seed, the clean run's final version minus the adversarial run's
  (satisfaction, paired by prompt), over seeds.
- `candidates.collapses`: candidates whose offline pass rate fell more than 5 points below their
  verdict's incumbent, over the seeds' runs (the learner on real feedback); each control lists its own
  (`controls.<name>.collapses`): a shuffled-reward run's learner follows noise by design, and what
  matters there is that the gate rejects what it makes (`promotions_worse_than_base`).
- `candidates.offline_evaluation_s`: how long each offline evaluation of a candidate took, over every
  run (seeds and controls): median, range, and how many within 90 s (`offline_seconds`).
- `poisoning`: over the clean runs' learner updates, the share that flagged no honest user; over the
  adversarial runs', the share that flagged at least one adversarial user (`demo.system.poisoning_by_update`).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

from scipy import stats

from core.files import atomic_write
from demo.users import UserPrefs

COLLAPSE_POINTS = 5.0
CONTROL_NAMES = (("shuffled", "shuffled-reward"), ("adversarial_5pct", "5% adversarial"))


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


def style_split(base: dict[str, list[int]], final: dict[str, list[int]], prefs: UserPrefs | None = None) -> dict:
    """The satisfaction gain in points, split into correctness and house style (exactly).

    Per prompt, satisfaction is a_inc + passed (a_other - a_inc) + styled (a_pref - a_other) (`demo.users.
    satisfaction`; styled = correct and in the house style). With P the pass rate and s = styled / passed
    the style share among correct completions, the mean is a_inc + P (c1 + s c2); the change splits at
    the midpoints: ΔP (c1 + s̄ c2) is correctness, P̄ Δs c2 is style, and they add up to the gain."""
    prefs = prefs or UserPrefs()
    c1 = prefs.p_accept_correct_other - prefs.p_accept_incorrect
    c2 = prefs.p_accept_correct_preferred - prefs.p_accept_correct_other

    def rates(pt: dict[str, list[int]]) -> tuple[float, float]:
        p = sum(pt["passed"]) / len(pt["passed"])
        return p, (sum(pt["styled"]) / sum(pt["passed"]) if sum(pt["passed"]) else 0.0)

    (p0, s0), (p1, s1) = rates(base), rates(final)
    correctness = 100 * (p1 - p0) * (c1 + (s0 + s1) / 2 * c2)
    style = 100 * (p0 + p1) / 2 * (s1 - s0) * c2
    total = correctness + style
    return {
        "correctness_points": round(correctness, 2),
        "style_points": round(style, 2),
        "style_share": round(style / total, 3) if abs(total) > 1e-9 else None,
    }


def run_gain(run: dict[str, Any]) -> dict[str, Any]:
    """Base vs the last promoted version of one run, paired per report prompt."""
    evals = run["evaluations"]
    base_id, final_id = run["promotions"][0], run["promotions"][-1]
    base, final = evals[base_id]["per_task"], evals[final_id]["per_task"]
    out = {
        "base": base_id,
        "final": final_id,
        "promotions": len(run["promotions"]) - 1,
        "pass_rate": _paired(base["passed"], final["passed"]),
        "satisfaction": _paired(base["satisfaction"], final["satisfaction"]),
    }
    if "styled" in base and "styled" in final:
        out["satisfaction_split"] = style_split(base, final)
    return out


def _unsplit_gain(run: dict[str, Any]) -> dict[str, Any] | None:
    """Base vs the last promoted version on the prompts of no split (`demo.split.unsplit_tasks`), paired
    per prompt; None for a run evaluated without them."""
    evals = run["evaluations"]
    base, final = evals[run["promotions"][0]].get("unsplit"), evals[run["promotions"][-1]].get("unsplit")
    if base is None or final is None:
        return None
    return _paired(base["per_task"]["passed"], final["per_task"]["passed"])


def worse_than_base(run: dict[str, Any]) -> list[str]:
    """Promoted versions whose report pass rate is below the base's, the paired 95% interval below 0."""
    evals, base = run["evaluations"], run["promotions"][0]
    return [
        v
        for v in run["promotions"][1:]
        if _paired(evals[base]["per_task"]["passed"], evals[v]["per_task"]["passed"])["ci95"][1] < 0
    ]


def collapses(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Candidates whose offline pass rate fell more than `COLLAPSE_POINTS` below their verdict's incumbent."""
    out = []
    for run in runs:
        for v in run["versions"]:
            off = v.get("offline") or {}
            if off.get("candidate") is None or off.get("incumbent") is None:
                continue
            drop = 100 * (off["incumbent"] - off["candidate"])
            if drop > COLLAPSE_POINTS:
                out.append({"seed": run["config"]["seed"], "version": v["id"], "drop_points": round(drop, 1)})
    return out


OFFLINE_TARGET_S = 90.0


def offline_seconds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How long the gate's offline evaluations of the runs' candidates took (the verdict's own timing:
    sampling the candidate, verifying, the KL guardrail's scoring): count, median, range, and how many
    took at most `OFFLINE_TARGET_S`."""
    timed = [(v.get("offline") or {}).get("seconds") for run in runs for v in run["versions"]]
    xs: list[float] = sorted(float(x) for x in timed if x is not None)
    if not xs:
        return {"evaluations": 0}
    return {
        "evaluations": len(xs),
        "median": round(statistics.median(xs), 1),
        "min": xs[0],
        "max": xs[-1],
        f"within_{OFFLINE_TARGET_S:g}_s": sum(x <= OFFLINE_TARGET_S for x in xs),
    }


def _seeds_of(gains: list[dict], key: str) -> dict[str, Any]:
    return _over_seeds([g[key]["points"] for g in gains])


def lending_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's lending figures: gate cycles (versions the gate took to evaluation) and promotions per
    hour of traffic, the report split's pass-rate gain, and what lending did (`demo.system.lending_numbers`)."""
    hours = run["config"]["traffic_s"] / 3600
    cycles = sum(any(t["to"] == "evaluating" for t in v["transitions"]) for v in run["versions"])
    promotions = len(run["promotions"]) - 1
    gain = run_gain(run)["pass_rate"] if promotions else {"points": 0.0, "ci95": [0.0, 0.0], "n": 0}
    return {
        "gate_cycles_per_hour": round(cycles / hours, 1),
        "promotions_per_hour": round(promotions / hours, 1),
        "pass_rate_gain": gain,
        "lending": run.get("lending") or {},
        "completions": run["traffic"]["completions"],
        "errors": run["traffic"]["errors"],
    }


def summarize(
    seeds: list[dict],
    shuffled: list[dict] | None = None,
    adversarial: list[dict] | None = None,
    lending: tuple[dict, dict] | None = None,
) -> dict[str, Any]:
    """The report's JSON (module docstring). `adversarial[k]` is paired with `seeds[k]` (same seed).
    `lending`: a diurnal run with lending on, and the same traffic with it off."""
    if not seeds:
        raise ValueError("the report needs at least one seed's run")
    shuffled, adversarial = shuffled or [], adversarial or []
    gains = [run_gain(r) for r in seeds]
    sat, pr = _seeds_of(gains, "satisfaction"), _seeds_of(gains, "pass_rate")
    splits = [g["satisfaction_split"] for g in gains if "satisfaction_split" in g]
    style = sum(x["style_points"] for x in splits)
    total = style + sum(x["correctness_points"] for x in splits)
    out: dict[str, Any] = {
        "report_split": {
            "pass_rate_gain_points": pr["points"],
            "pass_rate_gain_ci95": pr["ci95"],
            "satisfaction_gain_points": sat["points"],
            "satisfaction_gain_ci95": sat["ci95"],
            "style_share_of_satisfaction_gain": round(style / total, 3) if splits and abs(total) > 1e-9 else None,
            "seeds": len(seeds),
            "per_seed": [{"seed": r["config"]["seed"], **g} for r, g in zip(seeds, gains, strict=True)],
            "prompts": seeds[0]["evaluations"][gains[0]["base"]]["n"],
        },
        "candidates": {
            "collapses": collapses(seeds),
            "offline_evaluation_s": offline_seconds([*seeds, *shuffled, *adversarial]),
        },
        "controls": {},
        "runs": [_run_summary(r) for r in [*seeds, *shuffled, *adversarial]],
        "poisoning": _poisoning(seeds, adversarial),
    }
    if lending is not None:
        on, off = lending
        if on["config"]["seed"] != off["config"]["seed"] or not on["config"]["lending"] or off["config"]["lending"]:
            raise ValueError("the lending pair is one seed's run with lending on, then off")
        out["lending"] = {
            "seed": on["config"]["seed"],
            "diurnal_trough": on["config"]["diurnal_trough"],
            "on": lending_figures(on),
            "off": lending_figures(off),
        }
    unsplit = [_unsplit_gain(r) for r in seeds]
    if all(u is not None for u in unsplit):
        up = _over_seeds([u["points"] for u in unsplit if u is not None])
        out["unsplit_prompts"] = {
            "pass_rate_gain_points": up["points"],
            "pass_rate_gain_ci95": up["ci95"],
            "seeds": len(seeds),
            "prompts": unsplit[0]["n"] if unsplit[0] else 0,
            "per_seed": [{"seed": r["config"]["seed"], **u} for r, u in zip(seeds, unsplit, strict=True) if u],
        }
    if shuffled:
        g = [run_gain(r) for r in shuffled]
        out["controls"]["shuffled"] = {
            "seeds": len(shuffled),
            "pass_rate_gain": _seeds_of(g, "pass_rate"),
            "satisfaction_gain": _seeds_of(g, "satisfaction"),
            "promotions": sum(x["promotions"] for x in g),
            "promotions_worse_than_base": sum(len(worse_than_base(r)) for r in shuffled),
            "collapses": collapses(shuffled),
            "per_seed": [{"seed": r["config"]["seed"], **x} for r, x in zip(shuffled, g, strict=True)],
        }
    if adversarial:
        by_seed = {r["config"]["seed"]: r for r in seeds}
        costs = []
        for adv in adversarial:
            clean = by_seed.get(adv["config"]["seed"])
            if clean is None:
                raise ValueError(f"adversarial run of seed {adv['config']['seed']} has no clean run to pair with")
            a = clean["evaluations"][clean["promotions"][-1]]["per_task"]["satisfaction"]
            b = adv["evaluations"][adv["promotions"][-1]]["per_task"]["satisfaction"]
            costs.append({"seed": adv["config"]["seed"], **_paired(b, a), **{"gain": run_gain(adv)}})
        out["controls"]["adversarial_5pct"] = {
            "seeds": len(adversarial),
            "share": adversarial[0]["config"]["adversarial_share"],
            "satisfaction_cost": _over_seeds([c["points"] for c in costs]),
            "collapses": collapses(adversarial),
            "per_seed": costs,
        }
    return out


def _poisoning(clean: list[dict], adversarial: list[dict]) -> dict[str, Any]:
    """Updates of the clean runs with no honest user flagged, of the adversarial runs with one flagged."""

    def of(runs: list[dict], key: str) -> dict[str, Any]:
        p = [r["poisoning"] for r in runs if r.get("poisoning")]
        n, k = sum(x["updates"] for x in p), sum(x[key] for x in p)
        return {"runs": len(p), "updates": n, key: k}

    out = {
        "clean": of(clean, "updates_flagging_honest"),
        "adversarial": of(adversarial, "updates_flagging_adversarial"),
    }
    c, a = out["clean"], out["adversarial"]
    c["share_without_honest_flags"] = (
        round(1 - c["updates_flagging_honest"] / c["updates"], 3) if c["updates"] else None
    )
    a["share_flagging_adversarial"] = (
        round(a["updates_flagging_adversarial"] / a["updates"], 3) if a["updates"] else None
    )
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


def _ci(x: Any) -> str:
    return "inconclusive (one seed)" if x is None else f"[{x[0]}, {x[1]}]"


def markdown(s: dict[str, Any], command: str) -> str:
    r = s["report_split"]
    share = r.get("style_share_of_satisfaction_gain")
    lines = [
        "# The demo, through the running system",
        "",
        f"Made by `{command}`. Every number is on the report split ({r['prompts']} prompts per evaluation, "
        "never seen by pre-training, user traffic or the gate), paired per prompt against the base. "
        "Intervals over seeds are t-intervals of the seeds' gains; a seed's own interval is over prompts.",
        "",
        f"**Pass rate: {r['pass_rate_gain_points']:+} points** over {r['seeds']} seed(s), 95% CI "
        f"{_ci(r['pass_rate_gain_ci95'])}. Satisfaction: {r['satisfaction_gain_points']:+} points, "
        f"{_ci(r['satisfaction_gain_ci95'])}"
        + (f", of which {100 * share:.0f}% is house style rather than correctness." if share is not None else "."),
        "",
        "| | pass-rate gain (points) | 95% CI | satisfaction gain (points) | 95% CI | of it: correctness / style |",
        "|---|---:|---|---:|---|---|",
        f"| mean over {r['seeds']} seed(s) | {r['pass_rate_gain_points']} | {_ci(r['pass_rate_gain_ci95'])} | "
        f"{r['satisfaction_gain_points']} | {_ci(r['satisfaction_gain_ci95'])} | |",
    ]
    for g in r["per_seed"]:
        sp = g.get("satisfaction_split") or {}
        lines.append(
            f"| seed {g['seed']} ({g['base']} → {g['final']}, {g['promotions']} promotions) | "
            f"{g['pass_rate']['points']} | {g['pass_rate']['ci95']} | {g['satisfaction']['points']} | "
            f"{g['satisfaction']['ci95']} | {sp.get('correctness_points', '')} / {sp.get('style_points', '')} |"
        )
    un = s.get("unsplit_prompts")
    if un:
        lines += [
            "",
            f"**Prompts of no split** ({un['prompts']} per evaluation: a train phrasing with report values, or "
            "the held-out phrasing with train values; never served, trained on or gated): pass rate "
            f"{un['pass_rate_gain_points']:+} points {_ci(un['pass_rate_gain_ci95'])} over {un['seeds']} seed(s) ("
            + ", ".join(f"seed {u['seed']}: {u['points']:+}" for u in un["per_seed"])
            + ").",
        ]
    le = s.get("lending")
    if le:
        on, off = le["on"], le["off"]
        lines += [
            "",
            f"**Lending** (seed {le['seed']}, diurnal traffic from {le['diurnal_trough']:.0%} of the peak at night; "
            "the same traffic with lending on and off):",
            "",
            "| lending | gate cycles / h | promotions / h | pass-rate gain (points) | replica-seconds lent | "
            "rollouts | offline samples trained | failed requests |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, x in (("on", on), ("off", off)):
            lent = x["lending"]
            lines.append(
                f"| {name} | {x['gate_cycles_per_hour']} | {x['promotions_per_hour']} | "
                f"{x['pass_rate_gain']['points']} {x['pass_rate_gain']['ci95']} | {lent.get('lent_seconds', 0):.0f} | "
                f"{lent.get('rollouts', 0):.0f} | {lent.get('learner_trained_offline', 0):.0f} | {x['errors']} |"
            )
    c = s.get("controls", {})
    if "shuffled" in c:
        sh = c["shuffled"]
        lines += [
            "",
            f"**Shuffled-reward control** ({sh['seeds']} seeds): pass rate {sh['pass_rate_gain']['points']:+} "
            f"{_ci(sh['pass_rate_gain']['ci95'])}, satisfaction {sh['satisfaction_gain']['points']:+} "
            f"{_ci(sh['satisfaction_gain']['ci95'])}; {sh['promotions']} promotions, "
            f"{sh['promotions_worse_than_base']} of them worse than the base on the report split.",
        ]
    if "adversarial_5pct" in c:
        ad = c["adversarial_5pct"]
        lines += [
            "",
            f"**{ad['share']:.0%} adversarial users** ({ad['seeds']} seeds): they cost "
            f"{ad['satisfaction_cost']['points']} points of satisfaction {_ci(ad['satisfaction_cost']['ci95'])}, "
            "each seed's final version paired against the clean run's of the same seed.",
        ]
    missing = [name for key, name in CONTROL_NAMES if key not in c]
    if missing:
        lines += ["", f"**Not run in this report**: the {' and the '.join(missing)} control."]
    col = s.get("candidates", {}).get("collapses", [])

    def listed(xs: list[dict]) -> str:
        return ", ".join(f"seed {x['seed']} {x['version']} −{x['drop_points']}" for x in xs)

    controls = [(name, c[key].get("collapses") or []) for key, name in CONTROL_NAMES if key in c]
    lines += [
        "",
        f"**Collapses** (a candidate's offline pass rate more than {COLLAPSE_POINTS:g} points below its "
        f"incumbent's) in the seeds' runs: {len(col)}"
        + (f": {listed(col)}" if col else "")
        + "".join(f"; in the {name} control: {len(xs)}" + (f" ({listed(xs)})" if xs else "") for name, xs in controls)
        + ".",
    ]
    off = s.get("candidates", {}).get("offline_evaluation_s") or {}
    if off.get("evaluations"):
        within = off[f"within_{OFFLINE_TARGET_S:g}_s"]
        lines += [
            "",
            f"**Offline evaluations** of a candidate (the gate's suite; the incumbent's samples cached): "
            f"{off['evaluations']}, median {off['median']} s, {off['min']}-{off['max']} s; "
            f"{within} of {off['evaluations']} within {OFFLINE_TARGET_S:g} s.",
        ]
    po = s.get("poisoning") or {}
    if (po.get("clean") or {}).get("updates"):
        cl, ad = po["clean"], po.get("adversarial") or {}
        lines += [
            "",
            f"**Poisoning screen**: {cl['updates'] - cl['updates_flagging_honest']} of {cl['updates']} updates of the "
            f"clean runs flagged no honest user ({_share(cl['share_without_honest_flags'])})"
            + (
                f"; {ad['updates_flagging_adversarial']} of {ad['updates']} updates of the adversarial runs flagged "
                f"an adversarial user ({_share(ad['share_flagging_adversarial'])})."
                if ad.get("updates")
                else "."
            ),
        ]
    lines += ["", "![satisfaction per version](report.png)", "", "## Runs", ""]
    for run in s["runs"]:
        lines += _run_section(run)
    return "\n".join(lines) + "\n"


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


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
