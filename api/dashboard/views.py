"""What the dashboard's pages show, built from the registry's reads: plain dicts for the templates.

- `versions_page`: every version (or those of one status) with its status, parent, age, data range and
  headline numbers (the learner's reward mean, the offline pass rates, the canary's difference), the
  lineage as a tree, and the plots of reward and pass rate over versions.
- `version_page`: the verdict panel (`Check`s: pass, fail with a one-line why, wait, info), what each
  action would do or why it is not allowed, the offline eval per family and its guardrails, the canary
  over time, the learner's metrics for the updates behind the version, its audit log.
- `fleet_page`: the replicas' heartbeats (`Registry.fleet`), grouped by gateway.

The canary's plots come from its stored progress (`gate["canary"]["history"]`, one point per look,
written by `gating.canary_stage`): share, each arm's mean of its users' mean rewards, and the
difference with the always-valid band the gate computed at the step's own ρ and α. The audit log
holds only the gate's decisions. The final numbers in the verdict panel are the gate's own (the
details of its canary → awaiting_approval / aborted transition); during a canary they are
`gating.canary.decide` on the stored counts (at the stored ρ and step time) with the default
`CanaryConfig`, marked as such. The gate's lease (`lease_state`) is shown on the version page of a
canary and on the fleet page: while it is lapsed, gateways route nobody to the candidate.

Which step the lifecycle allows is asked of `gating` (`Registry.why_not_approve`, `LIFECYCLE`,
`Registry.last_superseded`), never restated here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from api.dashboard.svg import COLORS, Band, HLine, Series, chart, share_bar
from gating.canary import ARMS, CanaryConfig, CanaryOutcomes, decide
from gating.stats import DEFAULT_ALPHA
from registry.models import (
    AuditEntryPublic,
    CanaryProgress,
    ModelVersionPublic,
    OfflineVerdict,
    Status,
)
from registry.registry import LIFECYCLE, Registry

S = Status
State = Literal["pass", "fail", "wait", "info"]
LEARNER_METRICS = (
    ("reward_mean", "reward mean"),
    ("abs_dlogp_mean", "|Δlogprob| serving vs trainer (mean)"),
    ("abs_dlogp_max", "|Δlogprob| (max)"),
    ("ratio_mean", "ratio mean"),
    ("ratio_max", "ratio max"),
    ("clip_frac", "clip fraction"),
    ("clamp_frac", "clamped fraction"),
    ("truncated_frac", "behaviour weight truncated"),
    ("masked_frac", "masked share"),
    ("lag_updates_max", "lag max (updates)"),
    ("adv_std", "advantage std"),
    ("grad_norm", "grad norm"),
    ("tokens", "tokens"),
)

COUNTERS = (
    ("samples", "samples"),
    ("masked_tokens", "masked tokens"),
    ("masked_top_p_tokens", "masked by top-p"),
    ("truncated_tokens", "truncated tokens"),
    ("missing_routing_sequences", "sequences without routing"),
    ("replay_off_micro_batches", "micro-batches without replay"),
    ("poisoning_flagged_users", "users flagged"),
    ("dropped_lag", "dropped: lag"),
    ("dropped_stale", "dropped: stale"),
)
"""`metrics["since_parent"]`: the learner's counters summed over a version's updates (learner.update_stats)."""


@dataclass(frozen=True)
class Check:
    label: str
    state: State
    text: str
    why: str = ""  # one line: why it is red (or what it waits for)


@dataclass(frozen=True)
class Action:
    name: str  # approve | reject | rollback
    allowed: bool
    text: str  # what it will do, or why it is not allowed


def age(ts: datetime, now: datetime) -> str:
    s = max(0.0, (now - ts).total_seconds())
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit}"
    return f"{s:.0f} s"


def num(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, int | float) and math.isfinite(x) else "—"


def data_range_text(v: ModelVersionPublic) -> str:
    parts = []
    for topic, ranges in v.data_range.items():
        n = sum(end - start for start, end in ranges.values())
        parts.append(f"{topic}: {n} records from {len(ranges)} partition{'s' if len(ranges) != 1 else ''}")
    return "; ".join(parts) or "—"


# -- canary ------------------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def canary_look(progress: CanaryProgress) -> dict[str, Any]:
    """Users, samples, mean satisfaction, latency and errors per arm in the progress's current step."""
    out = CanaryOutcomes.from_dict(progress.counts)
    arms = {}
    for arm in ARMS:
        recs = list(out.users(progress.step, arm).values())
        arms[arm] = {
            "users": len(recs),
            "samples": int(sum(r[0] for r in recs)),
            "satisfaction": _mean(out.per_user(progress.step, arm, "reward")),
            "latency_ms": _mean(out.per_user(progress.step, arm, "latency_ms")),
            "error_rate": _mean(out.per_user(progress.step, arm, "error_rate")),
            "pass_rate": _mean(out.per_user(progress.step, arm, "pass_rate")),
        }
    c, i = arms["candidate"]["satisfaction"], arms["incumbent"]["satisfaction"]
    return {"step": progress.step, "share": progress.share, "arms": arms, "diff": None if c is None else c - (i or 0)}


def canary_decision(audit: list[AuditEntryPublic]) -> dict[str, Any] | None:
    """The gate's numbers at its last canary decision (the transition out of `canary`), if any."""
    rows = [a for a in audit if a.from_status is S.canary and a.to_status is not S.canary and "reward" in a.details]
    return rows[-1].details if rows else None


def canary_charts(progress: CanaryProgress | None, alpha: float, margin: float) -> dict[str, Any]:
    """The share, satisfaction per arm and difference plots from `progress.history` (module docstring)."""
    history = list(((progress.model_extra or {}) if progress is not None else {}).get("history", []))
    if not history:
        return {}
    share = [(float(p["t"]), float(p["share"])) for p in history]
    sat: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    diff, band = [], []
    for p in history:
        t = float(p["t"])
        for a in ARMS:
            if a in p.get("means", {}):
                sat[a].append((t, float(p["means"][a])))
        if "diff" in p:
            est, lo, hi = p["diff"]
            diff.append((t, float(est)))
            band.append((t, float(lo), float(hi)))
    return {
        "share": chart(
            "Canary share over time",
            [Series("candidate share", share, COLORS["share"], step=True)],
            x_title="seconds since the canary started",
            y_range=(0.0, max(0.1, max(s for _, s in share) * 1.15)),
        ),
        "satisfaction": chart(
            "Satisfaction per arm (mean of users' mean reward, current step)",
            [Series(a, sat[a], COLORS[a]) for a in ARMS],
            x_title="seconds since the canary started",
        ),
        "difference": chart(
            "Candidate − incumbent, with its always-valid band (at the step's ρ)",
            [Series("difference", diff, COLORS["candidate"])],
            bands=[Band(f"{1 - alpha:.0%} always-valid band", band, COLORS["candidate"])],
            hlines=[HLine(f"−margin ({margin:g})", -margin), HLine("0", 0.0, COLORS["axis"])],
            x_title="seconds since the canary started",
        ),
    }


def lease_state(reg: Registry, now: datetime) -> dict[str, Any]:
    """The gate's lease: `live` (a gate is watching), the latest beat's gate, host, pid and age."""
    last = next(iter(reg.gate_leases()), None)
    live = reg.gate_lease(now) is not None
    if last is None:
        return {"live": live, "text": "no gate has ever beaten: a canary is routed to nobody"}
    who = f"gate {last.gate_id} ({last.host} pid {last.pid})"
    text = f"{who}, last beat {last.age_s(now):.1f} s ago (lease {last.lease_s:g} s)"
    return {"live": live, "text": text if live else f"lapsed: {text}; a canary is routed to nobody"}


def step_time(progress: CanaryProgress | None) -> dict[str, Any] | None:
    """The step's time with a live lease, its lapsed time, extensions and ρ, as the gate stores them."""
    if progress is None:
        return None
    extra = progress.model_extra or {}
    keys = ("active_s", "lapsed_s", "extensions", "rho", "expected_users", "expected_from")
    return {k: extra.get(k) for k in keys}


# -- the verdict panel -------------------------------------------------------------------------------


def why_not_approve(reg: Registry, version_id: str) -> str | None:
    """The registry's own reason approval would be refused now, or None."""
    return reg.why_not_approve(version_id)


def last_superseded(reg: Registry) -> str | None:
    """The version a rollback restores (what `Registry.rollback(None, ...)` picks)."""
    return reg.last_superseded()


def actions(reg: Registry, v: ModelVersionPublic, promoted: ModelVersionPublic | None) -> list[Action]:
    blocked = why_not_approve(reg, v.id)
    sha = (v.artifact_sha256 or "")[:12]
    approve = Action(
        "approve",
        blocked is None,
        blocked
        or f"Promotes {v.id} (artifact {sha}…) to every replica of every gateway; "
        f"{promoted.id if promoted else 'nothing'}, promoted now, becomes superseded, and Roll back restores it.",
    )
    from_ = sorted(st.value for st, nxt in LIFECYCLE.items() if S.rejected in nxt)
    reject = Action(
        "reject",
        S.rejected in LIFECYCLE[v.status],
        f"Marks {v.id} rejected (final); its waiting descendants are withdrawn and the learner rebases."
        if S.rejected in LIFECYCLE[v.status]
        else f"{v.id} is {v.status.value}: only a version {' or '.join(from_)} can be rejected.",
    )
    target = last_superseded(reg) if v.status is S.promoted else None
    if v.status is not S.promoted:
        why = f"{v.id} is {v.status.value}: only the promoted version can be rolled back."
    elif target is None:
        why = f"Nothing to restore: no version was superseded by {v.id}'s promotion or before it."
    else:
        why = (
            f"Marks {v.id} rolled back and restores {target} on every replica; "
            f"{v.id}'s waiting descendants are withdrawn."
        )
    rollback = Action("rollback", v.status is S.promoted and target is not None, why)
    return [approve, reject, rollback]


def verdict(
    v: ModelVersionPublic,
    offline: OfflineVerdict | None,
    canary: dict[str, Any] | None,
    live: bool,
    look: dict[str, Any] | None,
    promoted: ModelVersionPublic | None,
) -> list[Check]:
    """The verdict panel. `canary`: the gate's decision numbers (or, `live`, a look at the stored counts);
    `look`: `canary_look` of the stored progress."""
    checks: list[Check] = []
    waiting = v.status in (S.candidate, S.evaluating, S.canary, S.awaiting_approval)
    if offline is None:
        checks.append(Check("Incumbent", "wait", "no offline verdict yet", "the gate has not evaluated it"))
    else:
        inc = offline.incumbent_id
        now_promoted = promoted is not None and promoted.id == inc
        if now_promoted:
            checks.append(Check("Incumbent", "pass", f"compared with {inc}, which is promoted now"))
        elif waiting:
            checks.append(
                Check(
                    "Incumbent",
                    "fail",
                    f"compared with {inc}, but {promoted.id if promoted else 'nothing'} is promoted now",
                    "approval needs a verdict against the version promoted now: the gate must evaluate it again",
                )
            )
        else:
            checks.append(Check("Incumbent", "info", f"compared with {inc}, which is no longer promoted"))
        n = offline.numbers
        ni, rw = n.get("non_inferiority", {}), n.get("reward", {})
        if ni:
            text = (
                f"pass rate {num(rw.get('candidate'))} vs {num(rw.get('incumbent'))}: "
                f"Δ {num(ni.get('mean_diff'), '+.3f')}, {1 - ni.get('alpha', DEFAULT_ALPHA):.0%} lower bound "
                f"{num(ni.get('lower_bound'), '+.3f')} vs −margin −{ni.get('margin')}"
            )
            why = (
                ""
                if ni.get("passed")
                else "the lower bound is at or below −margin: it may be worse by more than the margin"
            )
            checks.append(Check("Offline difference", "pass" if ni.get("passed") else "fail", text, why))
        fams = n.get("families", {})
        bad = sorted(f for f, r in fams.items() if not r.get("passed"))
        if fams:
            checks.append(
                Check(
                    "Offline families",
                    "fail" if bad else "pass",
                    f"{len(fams) - len(bad)} of {len(fams)} families without a regression beyond the margin (Holm)",
                    f"significantly worse than −margin in: {', '.join(bad)}" if bad else "",
                )
            )
        checks += _offline_guardrails(n)
    if canary:
        nums = canary
        tag = " (live look, default canary settings)" if live else ""
        margin = nums.get("margin", CanaryConfig().margin)
        rw = nums.get("reward")
        if rw:
            ok = rw["lower"] > -margin
            checks.append(
                Check(
                    "Canary difference",
                    "pass" if ok else ("wait" if live else "fail"),
                    f"satisfaction Δ {num(rw['estimate'], '+.3f')}, always-valid band "
                    f"[{num(rw['lower'], '+.3f')}, {num(rw['upper'], '+.3f')}] vs −margin −{margin}{tag}",
                    ""
                    if ok
                    else "the band's lower end is at or below −margin: not shown to be at most the margin worse",
                )
            )
        else:
            checks.append(Check("Canary difference", "wait", f"not estimated yet{tag}", "fewer than 2 users in an arm"))
        ran_out = nums.get("inconclusive")
        if ran_out is not None:
            ahead = "ahead" if ran_out.get("ahead") else "not ahead"
            checks.append(Check("Canary time", "fail",
                f"inconclusive: not passed within {num(nums.get('elapsed_s'), '.0f')} s "
                f"({ran_out.get('extensions', 0)} extension(s)), the candidate {ahead}",
                "the step ran out before the band cleared −margin: more traffic, a longer step or a larger "
                "margin would decide it"))  # fmt: skip
        srm = nums.get("srm")
        if srm:
            ok = srm["p_value"] >= srm["threshold"]
            checks.append(
                Check(
                    "Sample ratio (SRM)",
                    "pass" if ok else "fail",
                    f"users {_arms(nums.get('users', {}))} at share {nums.get('share', 0):.0%}: "
                    f"always-valid p = {srm['p_value']:.3g} (mismatch below {srm['threshold']:g})",
                    "" if ok else "the split itself is broken: users per arm do not match the share",
                )
            )
        rails = nums.get("guardrails")
        if rails is None:
            checks.append(
                Check(
                    "Canary guardrails", "wait", "TTFT, TPOT, errors, passes: not judged yet", "too few users per arm"
                )
            )
        for metric, g in (rails or {}).items():
            lower_worse = g.get("direction") == "lower_is_worse"
            checks.append(
                Check(
                    f"Canary guardrail: {metric}",
                    "fail" if g["harmed"] else "pass",
                    f"candidate − incumbent {num(g['estimate'], '+.4g')}, band [{num(g['lower'], '+.4g')}, "
                    f"{num(g['upper'], '+.4g')}] ({'lower' if lower_worse else 'higher'} is worse)",
                    f"significantly worse on the candidate: the band lies {'below' if lower_worse else 'above'} 0"
                    if g["harmed"]
                    else "",
                )
            )
    elif v.status in (S.canary, S.awaiting_approval):
        checks.append(Check("Canary difference", "wait", "no canary numbers yet", "no joined samples counted so far"))
    if look is not None:
        a = look["arms"]
        checks.append(
            Check(
                "Users and samples",
                "info",
                f"canary step {look['step']}: candidate {a['candidate']['users']} users / {a['candidate']['samples']} "
                f"samples, incumbent {a['incumbent']['users']} / {a['incumbent']['samples']}" + _offline_size(offline),
            )
        )
    elif offline is not None:
        checks.append(Check("Users and samples", "info", _offline_size(offline).lstrip("; ")))
    checks.append(_flagged(v))
    watch = v.gate.get("watch")
    if watch:
        alerts = watch.get("alerts", [])
        users = watch.get("users")
        checks.append(
            Check(
                "After promotion",
                "fail" if alerts else "pass" if watch.get("guardrails") else "wait",
                f"guardrails watched since {str(watch.get('promoted_at', '?'))[:19]}"
                + (f", users {users}" if users else "")
                + (" (watch over)" if watch.get("done") else ""),
                "alert: " + ", ".join(a["metric"] for a in alerts) + " harmed since promotion: consider rolling back"
                if alerts
                else ("" if watch.get("guardrails") else "too few users since promotion to judge"),
            )
        )
    return checks


def _flagged(v: ModelVersionPublic) -> Check:
    """The share of the update's reward that came from users the learner flagged (`metrics["poisoning"]`)."""
    p = v.metrics.get("poisoning")
    if not p:
        return Check("Reward from flagged users", "info", "not recorded for the update behind this version")
    share = p.get("flagged_reward_share", 0.0)
    text = f"{share:.1%} of the update reward, from {p.get('flagged_users', 0)} of {p.get('users', 0)} users"
    text += f" ({p.get('flagged_samples', 0)} samples, weighed down)"
    why = "; ".join(f"user {f.get('user', '?')[:8]}: {', '.join(f.get('reasons', []))}" for f in p.get("flags", [])[:3])
    return Check("Reward from flagged users", "wait" if p.get("flagged_users") else "info", text, why)


def _arms(users: dict[str, Any]) -> str:
    return ", ".join(f"{arm} {n}" for arm, n in users.items()) or "none"


def _offline_size(offline: OfflineVerdict | None) -> str:
    if offline is None:
        return ""
    n = offline.numbers
    prompts, g = n.get("suite", {}).get("n_prompts"), n.get("sampling", {}).get("G")
    return f"; offline: {prompts} prompts × G={g} samples per version on {offline.suite_version}"


def _offline_guardrails(n: dict[str, Any]) -> list[Check]:
    g, checks = n.get("guardrails", {}), n.get("checks", {})
    out = []
    if "length" in g:
        lg = g["length"]
        lo, hi = lg["bounds"]
        ok = checks.get("length", True)
        out.append(Check("Guardrail: length", "pass" if ok else "fail",
            f"mean tokens {num(lg['candidate_mean_tokens'], '.1f')} vs {num(lg['incumbent_mean_tokens'], '.1f')}: "
            f"ratio {num(lg['ratio'], '.2f')} within [{lo}, {hi}]",
            "" if ok else "outputs changed length beyond the bounds (reward hacking?)"))  # fmt: skip
    for key, label in (("malformed", "malformed"), ("repetition", "looping")):
        if key in g:
            r, ok = g[key], checks.get(key, True)
            out.append(Check(f"Guardrail: {label}", "pass" if ok else "fail",
                f"share {num(r['candidate_share'], '.1%')} vs {num(r['incumbent_share'], '.1%')} "
                f"(at most +{r['max_increase']:.0%})",
                "" if ok else f"more {label} outputs than the incumbent beyond the allowed increase"))  # fmt: skip
    if "kl" in g:
        k, ok = g["kl"], checks.get("kl", True)
        out.append(Check("Guardrail: KL", "pass" if ok else "fail",
            f"KL(candidate ‖ incumbent) {num(k['per_token'], '.4f')} nats/token (at most {k['max']})",
            "" if ok else "moved too far from the incumbent"))  # fmt: skip
    return out


# -- pages ---------------------------------------------------------------------------------------------


def _headline(v: ModelVersionPublic) -> dict[str, Any]:
    off = v.gate.get("offline")
    rw = (off or {}).get("numbers", {}).get("reward", {})
    look = canary_look(CanaryProgress.model_validate(v.gate["canary"])) if "canary" in v.gate else None
    return {
        "reward_mean": v.metrics.get("reward_mean"),
        "offline": None if off is None else {"passed": off["passed"], **rw},
        "canary_diff": None if look is None else look["diff"],
    }


def _tree(versions: list[ModelVersionPublic]) -> list[dict[str, Any]]:
    ids = {v.id for v in versions}
    kids: dict[str | None, list[ModelVersionPublic]] = {}
    for v in versions:
        kids.setdefault(v.parent_id if v.parent_id in ids else None, []).append(v)

    def node(v: ModelVersionPublic) -> dict[str, Any]:
        return {"v": v, "children": [node(c) for c in kids.get(v.id, [])]}

    return [node(v) for v in kids.get(None, [])]


def versions_page(reg: Registry, status: str | None, now: datetime | None = None) -> dict[str, Any]:
    """ValueError for an unknown status."""
    now = now or datetime.now(UTC)
    every = reg.list()
    shown = reg.list(status) if status else every
    rows = [{"v": v, "age": age(v.created_at, now), "data": data_range_text(v), **_headline(v)} for v in shown]
    index = {v.id: i for i, v in enumerate(every)}
    labels = {float(i): v.id for i, v in enumerate(every)}
    reward = [(float(index[v.id]), float(v.metrics["reward_mean"])) for v in every if "reward_mean" in v.metrics]
    passes: dict[str, list[tuple[float, float]]] = {"candidate": [], "incumbent": []}
    for v in every:
        rw = v.gate.get("offline", {}).get("numbers", {}).get("reward", {})
        for arm in passes:
            if arm in rw:
                passes[arm].append((float(index[v.id]), float(rw[arm])))
    return {
        "rows": rows,
        "status": status,
        "counts": Counter(v.status.value for v in every),
        "statuses": [s.value for s in S],
        "lineage_tree": _tree(every),
        "reward_chart": chart(
            "Learner reward mean per version", [Series("reward mean", reward, COLORS["reward"])], x_labels=labels
        ),
        "pass_chart": chart(
            "Offline pass rate: candidate vs the incumbent it was compared with",
            [Series(arm, pts, COLORS[arm]) for arm, pts in passes.items()],
            x_labels=labels,
            y_range=(0.0, 1.0),
        ),
    }


def version_page(reg: Registry, version_id: str, now: datetime | None = None) -> dict[str, Any]:
    """UnknownVersion for an unknown id."""
    now = now or datetime.now(UTC)
    v = reg.get(version_id)
    audit = reg.audit(version_id)
    promoted = reg.promoted()
    offline = OfflineVerdict.model_validate(v.gate["offline"]) if "offline" in v.gate else None
    progress = CanaryProgress.model_validate(v.gate["canary"]) if "canary" in v.gate else None
    decision = canary_decision(audit)
    live = None
    if decision is None and progress is not None and v.status is S.canary:
        live = decide(progress, CanaryOutcomes.from_dict(progress.counts), CanaryConfig(), now).numbers
    look = canary_look(progress) if progress is not None else None
    nums = decision or live or {}
    alpha, margin = nums.get("alpha", DEFAULT_ALPHA), nums.get("margin", CanaryConfig().margin)
    lineage = []
    for u in reg.lineage(version_id):  # the updates behind it: back to the version it was compared with
        if offline is not None and u.id == offline.incumbent_id or not u.metrics:
            break
        lineage.append(u)
    return {
        "v": v,
        "age": age(v.created_at, now),
        "data": data_range_text(v),
        "promoted": promoted,
        "offline": offline,
        "families": (offline.numbers.get("families", {}) if offline else {}),
        "look": look,
        "verdict": verdict(v, offline, decision or live, live is not None, look, promoted),
        "actions": actions(reg, v, promoted),
        "canary": canary_charts(progress, alpha, margin),
        "step_time": step_time(progress),
        "lease": lease_state(reg, now) if v.status is S.canary else None,
        "lineage": list(reversed(lineage)),
        "learner_metrics": LEARNER_METRICS,
        "counters": COUNTERS,
        "audit": audit,
    }


LENDING_ROWS = (
    ("lent_seconds", "replica-seconds lent"),
    ("lends", "lends"),
    ("reclaims", "reclaims"),
    ("panics", "panic reclaims"),
    ("rollouts", "rollouts done"),
    ("preempted", "shard runs preempted"),
    ("slow_first_tokens", "first tokens over the latency objective"),
    ("slow_first_tokens_lent", "… of them while a replica was lent"),
)


def lending_card(states: Mapping[str, str], counters: Mapping[str, float]) -> dict[str, Any]:
    """This gateway's lending (`api.lending.LendingLoop`): its replicas' states and its totals."""
    return {
        "states": dict(sorted(states.items())),
        "rows": [(label, float(counters.get(key, 0.0))) for key, label in LENDING_ROWS],
    }


def fleet_page(reg: Registry, interval_s: float) -> dict[str, Any]:
    st = reg.fleet(interval_s=interval_s)
    gateways: dict[str, list[dict[str, Any]]] = {}
    for r in st.replicas:
        wrong = set(st.mismatched.get(r.replica_id, []))
        holds = [{"version": vid, "sha": sha[:12], "ok": vid not in wrong, "share": r.serves.get(vid)}
                 for vid, sha in sorted(r.holds.items())]  # fmt: skip
        gateways.setdefault(r.gateway_id, []).append({"r": r, "holds": holds})
    flight = reg.in_flight()
    share = float((flight.gate.get("canary") or {}).get("share", 0.0)) if flight and flight.status is S.canary else 0.0
    parts = [(st.promoted_id or "none", 1.0 - share, COLORS["incumbent"])]
    if st.canary_id is not None:
        parts.append((st.canary_id, share, COLORS["candidate"]))
    lease = lease_state(reg, datetime.now(UTC))
    return {"fleet": st, "gateways": gateways, "split_bar": share_bar(parts), "interval_s": interval_s, "lease": lease}
