"""The demo's simulated users, over HTTP: what `flywheel demo` (`demo.system.run_system`) plays.

Each of `cfg.users` users (`demo.users.SimulatedUser`, heterogeneous: accept probabilities jittered by
0.1, activity drawn from Pareto(1.5), an `adversarial_share` of them rewarding wrong completions) asks
for completions of train-split tasks through the `openai` client, sees them (`shown`, through the
feedback SDK) and reacts sparsely: an implicit signal on most completions, explicit ones on a minority,
each at a delay spread over the attribution window. With `diurnal_trough` the clients in flight follow
a compressed day (`DemoSystemConfig.active_clients`). `drive_users` returns what they did (`Traffic`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from demo.system import DemoSystemConfig

log = logging.getLogger(__name__)


@dataclass
class _User:
    sim: Any  # demo.users.SimulatedUser
    adversarial: bool
    activity: float


@dataclass
class Traffic:
    """What the users did: counts, and each completion's served version and outcome."""

    completions: int = 0
    errors: int = 0
    ended_early: bool = False  # set by the run once `stop_after_promotions` versions are promoted
    feedback: int = 0
    served: dict[str, int] = field(default_factory=dict)
    by_gateway: dict[str, int] = field(default_factory=dict)  # completions per gateway URL
    passed: dict[str, list[int]] = field(default_factory=dict)
    served_log: list[tuple[float, str, str, int]] = field(default_factory=list)
    """Each completion: (wall time it returned, user, the version that served it, gateway index)."""
    error_log: list[tuple[float, int]] = field(default_factory=list)  # (wall time, gateway index) per failure
    feedback_keys: list[str] = field(default_factory=list)  # every event's idempotency key, `shown` included
    feedback_given_up: set[str] = field(default_factory=set)  # keys the SDK handed to on_error: not accepted
    feedback_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (completion id, user)
    completed_at: dict[str, float] = field(default_factory=dict)  # completion id -> wall time it returned
    failovers: int = 0  # completions another gateway served because the user's own was unreachable


def _users(cfg: DemoSystemConfig) -> list[_User]:
    from demo.users import SimulatedUser, UserPrefs

    rng = random.Random(f"users:{cfg.seed}")
    n_adv = round(cfg.users * cfg.adversarial_share)
    out = []
    for i in range(cfg.users):
        prefs = UserPrefs(noise=0.1)  # heterogeneous: each user's accept probabilities jittered by 0.1
        out.append(_User(SimulatedUser(f"user-{cfg.seed}-{i}", cfg.seed, prefs), i < n_adv, rng.paretovariate(1.5)))
    rng.shuffle(out)
    return out


def _signals(user: _User, task: Any, text: str, check: Any, cfg: DemoSystemConfig, rng: random.Random) -> list:
    """The signals this user sends about one completion: sparse, as a product sees them."""
    from demo.checker import CheckResult

    seen = check
    if user.adversarial:  # rewards wrong completions, punishes right ones
        seen = CheckResult(not check.passed, check.n_tests - check.n_passed, check.n_tests, check.error)
    out = []
    for s in user.sim.react(task, text, seen):
        explicit = s.kind in ("thumb_up", "thumb_down", "rating")
        keep = cfg.p_explicit if explicit else (1.0 if s.kind == "dwell" else cfg.p_implicit)
        if rng.random() < keep:
            out.append(s)
    return out


async def drive_users(
    cfg: DemoSystemConfig, urls: list[str], deadline: float, progress: Callable[[Traffic], None] | None = None
) -> Traffic:
    """The users until `deadline`; each user goes to one gateway of `urls` (by index), as a load
    balancer with sticky sessions would send them, and to the next one while theirs cannot be reached
    or has no engine (connection refused, 502-504): counted in `failovers`. Feedback on a completion
    goes to the gateway that served it (its completion index knows the id)."""
    import openai

    from demo.checker import check_batch
    from demo.split import sample_tasks
    from feedback.sdk.client import FeedbackClient

    users = _users(cfg)
    weights = [u.activity for u in users]
    rng = random.Random(f"traffic:{cfg.seed}")
    if not urls:
        raise ValueError("drive_users needs at least one gateway URL")
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="local", max_retries=2, timeout=30) for u in urls]
    traffic = Traffic()

    def given_up(exc: BaseException, events: list[dict]) -> None:
        traffic.feedback_given_up.update(e["idempotency_key"] for e in events)
        log.warning("demo user: %d feedback event(s) given up: %r", len(events), exc)

    feedbacks = [FeedbackClient(u, batch_size=200, flush_interval_s=0.5, on_error=given_up) for u in urls]
    gateway = {id(u): i % len(urls) for i, u in enumerate(users)}  # each user's gateway
    pending: list[tuple[_User, Any, str, str, int]] = []  # (user, task, completion id, text, gateway)
    traffic_model: dict[str, str] = {}  # completion id -> the version that served it
    later: list[asyncio.Task] = []
    task_seed = [cfg.seed * 1_000_003]

    def running() -> bool:
        return time.monotonic() < deadline and not traffic.ended_early

    start = time.monotonic()

    async def one_user(slot: int) -> None:
        while running():
            if slot >= cfg.active_clients(time.monotonic() - start):  # night: this client is idle
                await asyncio.sleep(0.25)
                continue
            user = rng.choices(users, weights)[0]
            task_seed[0] += 1
            task = sample_tasks(1, seed=task_seed[0])[0]
            g = gateway[id(user)]
            try:
                r, g = await _complete(clients, g, traffic, dict(
                    model="flywheel",
                    prompt=task.prompt,
                    max_tokens=cfg.max_tokens,
                    temperature=1.0,
                    user=user.sim.user_id,
                    seed=task_seed[0],
                    extra_body={"metadata": {"context": task.family}},  # the reward baseline's key
                ))  # fmt: skip
            except openai.OpenAIError as e:
                traffic.errors += 1
                traffic.error_log.append((time.time(), g))
                log.warning("demo user: completion failed: %r", e)
                await asyncio.sleep(0.5)
                continue
            traffic.completions += 1
            traffic.served[r.model] = traffic.served.get(r.model, 0) + 1
            traffic.by_gateway[urls[g]] = traffic.by_gateway.get(urls[g], 0) + 1
            traffic.served_log.append((time.time(), user.sim.user_id, r.model, g))
            traffic.completed_at[r.id] = time.time()
            key = feedbacks[g].shown(r.id, user=user.sim.user_id)
            if key is not None:
                traffic.feedback_keys.append(key)
                traffic.feedback_of[key] = (r.id, user.sim.user_id)
            pending.append((user, task, r.id, r.choices[0].text, g))
            traffic_model[r.id] = r.model

    async def react() -> None:
        while running() or pending:
            await asyncio.sleep(0.3)
            batch, pending[:] = pending[:], []
            if not batch:
                continue
            checks = await asyncio.to_thread(check_batch, [b[1] for b in batch], [b[3] for b in batch])
            seen = list(range(len(batch)))  # what each reaction is about: its own completion...
            if cfg.shuffle_rewards:  # ...or, in the control, another one (its task, text and outcome)
                rng.shuffle(seen)
            for (user, _, cid, _, served_by), real, j in zip(batch, checks, seen):
                model = traffic_model.pop(cid, "?")
                traffic.passed.setdefault(model, []).append(int(real.passed))
                _, task, _, text, _ = batch[j]
                for s in _signals(user, task, text, checks[j], cfg, rng):
                    # the user reacts this long after the completion returned, not after the checker
                    # (which lags under load): else a third of the feedback came after its window here
                    delay = rng.uniform(0.0, cfg.window_s * 0.8) - (time.time() - traffic.completed_at[cid])
                    fb = feedbacks[served_by]
                    later.append(asyncio.create_task(_send_later(fb, s, cid, user.sim.user_id, delay, traffic)))
            if progress is not None:
                progress(traffic)

    try:
        await asyncio.gather(*(one_user(i) for i in range(cfg.concurrency)), react())
        await asyncio.gather(*later)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the gateways are going away, give up at once
        for fb in feedbacks:
            fb.close(1.0)
        raise
    for fb in feedbacks:
        await asyncio.to_thread(fb.close, 30)
    for client in clients:
        await client.close()
    return traffic


async def _complete(clients: list, g: int, traffic: Traffic, request: dict) -> tuple[Any, int]:
    """One completion from gateway `g`, else from the next gateways in turn while `g` cannot be
    reached or has no engine; (the response, the index of the gateway that answered). The last
    gateway's error is raised."""
    import openai

    for k in range(len(clients)):
        at = (g + k) % len(clients)
        try:
            r = await clients[at].completions.create(**request)
        except openai.APITimeoutError:  # it may have been served there: not sent again elsewhere
            raise
        except (openai.APIConnectionError, openai.InternalServerError) as e:
            status = getattr(e, "status_code", None)
            if k == len(clients) - 1 or status not in (None, 502, 503, 504):
                raise
            continue
        traffic.failovers += k > 0
        return r, at
    raise AssertionError("unreachable: at least one gateway")


async def _send_later(fb: Any, s: Any, cid: str, user: str, delay: float, traffic: Traffic) -> None:
    await asyncio.sleep(max(delay, 0.0))
    key = fb.send(s.kind, cid, s.value, user=user)
    if key is not None:
        traffic.feedback += 1
        traffic.feedback_keys.append(key)
        traffic.feedback_of[key] = (cid, user)
