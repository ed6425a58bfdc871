"""The poisoning screen on simulated traffic shaped as the demo's: 500 users with the demo's simulated
preferences (`demo.users.SimulatedUser`, accept probabilities jittered by 0.1 as `demo.system` does),
activity drawn from a Pareto(1.5) (as `demo.system`), 256 samples per update over 18 task families,
rewards from the reactions by the default reward table's values. Seeded, vectorised with numpy."""

import numpy as np
import pytest

from demo.users import SimulatedUser, UserPrefs
from feedback.events import CompletionEvent, RoutedExperts, SampleEvent
from learner.poisoning import VerifiedTally, screen

USERS, BATCH, UPDATES, FAMILIES = 500, 256, 60, 18
EXPERTS = RoutedExperts.from_bytes((1, 1, 1), b"\x00")


def event(user: str, family: int, reward: float, i: int) -> SampleEvent:
    c = CompletionEvent.model_construct(
        completion_id=f"c{i}",
        tenant="demo",
        user_id=user,
        model_version="v1",
        endpoint="completions",
        prompt_ids=[1],
        output_ids=[2],
        logprobs=[-0.1],
        routed_experts=EXPERTS,
        text="x",
        finish_reason="stop",
        params={},
        latency_ms={},
        context=f"f{family}",
    )
    return SampleEvent.model_construct(tenant="demo", completion=c, reward=reward, signals=[], reward_spec="x")


def run(
    seed: int,
    adversarial: set[int],
    flood: float = 0.0,
    verified: bool = False,
    batch: int = BATCH,
    arriving: int | list[int] = 0,
    updates: int = UPDATES,
) -> tuple[list[set[int]], np.ndarray]:
    """Per update, the users flagged; and which users are adversarial. `flood`: user 0's share of the
    traffic (0: the Pareto draw). `verified`: the screen gets the verifier's verdicts (the task's
    truth, as `demo.checker.DemoVerifier` gives it) and its scout's tally counts every sample that
    arrives. `batch` samples are trained per update, and `arriving` more arrive between two updates
    that it does not train on (they wait on the bus, or are dropped for lag): the scout counts them too;
    a list gives that number per update (its length is the number of updates)."""
    rng = np.random.default_rng(seed)
    prefs = [SimulatedUser(f"u{i}", seed, UserPrefs(noise=0.1)).prefs for i in range(USERS)]
    p_good = np.array([p.p_accept_correct_preferred for p in prefs])
    p_other = np.array([p.p_accept_correct_other for p in prefs])
    p_bad = np.array([p.p_accept_incorrect for p in prefs])
    activity = rng.pareto(1.5, USERS) + 1.0
    share = activity / activity.sum()
    if flood:
        share = np.r_[flood, share[1:] * (1 - flood) / share[1:].sum()]
    pass_rate = rng.uniform(0.3, 0.9, FAMILIES)
    adv = np.zeros(USERS, bool)
    adv[list(adversarial)] = True
    flagged, tally = [], VerifiedTally()
    for more in arriving if isinstance(arriving, list) else [arriving] * updates:
        n = batch + more
        u = rng.choice(USERS, n, p=share)
        fam = rng.integers(0, FAMILIES, n)
        passed = rng.random(n) < pass_rate[fam]
        seen = passed ^ adv[u]  # adversarial users react to the opposite of the truth
        style = rng.random(n) < 0.5
        p_acc = np.where(seen, np.where(style, p_good[u], p_other[u]), p_bad[u])
        acc = rng.random(n) < p_acc
        # accepted 0.75 (+0.25 copied at p_copy 0.5, +0.5 thumb up at 0.2 x 0.25 kept); else -0.25
        # (rejected or regenerated; -0.5 more for a thumb down at 0.25 x 0.25 kept); clipped to [-1, 1]
        up = 0.75 + 0.25 * (rng.random(n) < 0.5) + 0.5 * (rng.random(n) < 0.05)
        down = -0.25 - 0.5 * (rng.random(n) < 0.0625)
        reward = np.clip(np.where(acc, up, down), -1, 1)
        events = [event(f"u{a}", int(f), float(r), i) for i, (a, f, r) in enumerate(zip(u, fam, reward))]
        if verified:  # the scout: every sample that arrived, with the verifier's verdict
            for ev, ok in zip(events, passed, strict=True):
                tally.add((ev.tenant, ev.completion.user_id), bool(ok), ev.reward)
        screening = screen(events[:batch], None, tally if verified else None)
        flagged.append({int(f.user[1:]) for f in screening.flags})
    return flagged, adv


def share_of_updates(flagged: list[set[int]], users: set[int]) -> float:
    return sum(bool(f & users) for f in flagged) / len(flagged)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clean_run_flags_no_honest_user_in_nine_updates_of_ten(seed):
    flagged, _ = run(seed, set())
    assert share_of_updates(flagged, set(range(USERS))) <= 0.10, flagged


def test_adversaries_measured():
    # Printed, not asserted (docs/learner.md gives the numbers and why): a flooding adversary (user 0:
    # 20% of the traffic, rewarding wrong completions), and the demo's 25 adversarial users of 500 with
    # everyone's activity. With these families' pass rates (0.3-0.9) an inverted user's mean reward
    # differs from an honest one's by about (2p - 1) x 0.55 accept probability: little to see.
    flood, _ = run(3, {0}, flood=0.2)
    print(f"flooding adversary: flagged in {share_of_updates(flood, {0}):.2f} of updates")
    assert share_of_updates(flood, set(range(1, USERS))) <= 0.10
    flagged, _ = run(4, set(range(25)))
    adv, honest = share_of_updates(flagged, set(range(25))), share_of_updates(flagged, set(range(25, USERS)))
    print(f"5% adversarial: updates flagging an adversarial user {adv:.2f}, an honest one {honest:.2f}")
    assert honest <= 0.10


def test_with_the_verifier_clean_runs_flag_an_honest_user_in_at_most_one_update_in_ten():
    # Pooled over three runs, as the report pools its clean runs' updates. One run of 48 updates can
    # reach 5 (10.4%, seed 1: a user whose taste runs against correctness more than most) by itself.
    shares = [share_of_updates(run(seed, set(), verified=True, **DEMO)[0], set(range(USERS))) for seed in range(3)]
    assert np.mean(shares) <= 0.10 and max(shares) <= 0.15, shares


# The demo's shape, as its learner ran in the report at 733029e (`flywheel demo --report`, serving
# engines at nice 10, 18,700-22,800 completions in ten minutes): six blocks of 8 updates of 128
# samples, each block one candidate. The scout's count of scored samples over a block (the candidates'
# `since_parent.poisoning_verified_samples`): 1,046-1,194 in the first (the learner keeps up with the
# traffic: ~140 per update), 2,047-4,518 in the later ones (mean ~3,200), most of it arriving during
# the wait at the lag bound while the gate works, before the block's first update. An update trains
# the last 128 of what arrived before it.
FIRST_BLOCK = [170] + [135] * 7
LATER_BLOCK = [3200 - 7 * 140] + [140] * 7
DEMO = {"batch": 128, "arriving": [n - 128 for n in FIRST_BLOCK + LATER_BLOCK * 5]}


def test_with_the_verifier_the_five_percent_adversaries_are_flagged_in_four_updates_of_five():
    # The demo's 25 adversarial users of 500, with everyone's activity (Pareto), in the demo's shape:
    # the verified rule's evidence accumulates over updates, so an adversary who shows up often is
    # flagged in the updates they appear in. Which users are adversarial decides how soon: when all 25
    # happen to be light, the first flag comes later. So the target is on the mean over 8 activity
    # draws; the thresholds (4 samples, raw rewards) were chosen on seeds 4-9. In the demo's
    # shape of 2026-12-04 (26 updates, 600 samples arriving before each) these draws gave 0.81 with the
    # scout and 0.53 counting only the trained samples; in that of 2026-12-06 (four blocks, ~4,000
    # samples per gate wait) z 2.25 was chosen on seeds 4-9 (0.84; 2.0 flagged an honest user in up to
    # 9.4% of a clean run's updates). In today's shape (`DEMO`: six shorter blocks, a third fewer
    # samples each) the first block flags an adversary in ~0.25 of its updates and the second in ~0.7,
    # the later ones in ~0.98, by draw. On seeds 4-9: 0.81 at 2.25, 0.83 at 2.0, 0.86 at 1.75; clean
    # seeds 0-2 and 10-17, 26 flag an honest user in 1.2%, 2.1%, 4.7% of updates on average (at most
    # 10.4%, 10.4%, 14.6%). 2.0 it is. On these draws 2.25 gives 0.85 and 2.0 gives 0.87 (per draw
    # 0.77-0.96), an honest user in at most 4.2% of updates.
    adv, honest = [], []
    for seed in range(18, 26):
        flagged, _ = run(seed, set(range(25)), verified=True, **DEMO)
        adv.append(share_of_updates(flagged, set(range(25))))
        honest.append(share_of_updates(flagged, set(range(25, USERS))))
    print(f"updates flagging an adversarial user, per seed: {[round(a, 2) for a in adv]}; an honest one: {honest}")
    assert np.mean(adv) >= 0.80 and max(honest) <= 0.10


def test_with_the_verifier_a_flooding_adversary_is_flagged_and_weighed_down():
    flagged, _ = run(3, {0}, flood=0.2, verified=True)
    assert share_of_updates(flagged, {0}) >= 0.9
    assert share_of_updates(flagged, set(range(1, USERS))) <= 0.10
