"""The dashboard in a real browser: Debian's headless Chromium driven by Selenium through
/usr/bin/chromedriver (never a downloaded browser; Selenium Manager is made unusable so it cannot run).

The world is the whole loop at a tiny size, every part real: a gateway with 2 replicas serves the demo
product's tasks to simulated users (`demo.users`), their feedback goes through /v1/feedback, the
joiner turns it into samples, the learner trains and publishes a candidate, the gate evaluates it
offline (G=2, 20 prompts of the demo suite) and runs its canary (two one-second steps) on live,
routed traffic until it awaits approval. Then, in the browser: a viewer sees it and can do nothing
(and the API says 403); a POST without the CSRF token is 403; an admin approves it with a reason and
the fleet serves it (through /v1/completions); a rollback from the page restores the base.

FLYWHEEL_SCREENSHOTS=<dir> also saves a screenshot of each page there, on the demo model instead of the
random tiny one: `flywheel bootstrap`'s under FLYWHEEL_HOME if it is there, else the shorter pre-training
of `small_trained_checkpoint` (a minute or more).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from api.fleet import GatewayFleet
from api.main import create_app
from core.harness import wait_until
from core.settings import Settings
from demo.checker import check
from demo.split import sample_tasks, split_tasks
from demo.suite import demo_suite
from demo.users import SimulatedUser
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.joiner import JoinerService
from feedback.rewards import RewardSpec
from gating.canary import CanaryConfig
from gating.gate import Gate, GateConfig
from gating.gate_process import verifier_scorer, weight_store_loader
from gating.lease import GateLease
from learner.service import LearnerConfig, LearnerService
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from serving.tokenizer import Tokenizer
from tests.conftest import LiveServer

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SHOTS = os.environ.get("FLYWHEEL_SCREENSHOTS")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # the whole loop, then a browser
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason="needs Debian's chromium and chromium-driver (scripts/setup-venv.sh installs them as root)",
    ),
]
CANARY = CanaryConfig(steps=(0.35, 0.5), min_users_per_arm=3, min_step_s=1.0, max_step_s=120.0, margin=1.0,
                      rho=2.0, min_users_for_harm=3)  # fmt: skip
"""Tiny but real: two one-second steps; 20 users (at 35%, fewer than 3 in an arm has odds of about 1%)
cannot resolve a smaller margin than 1 reward point."""
GATE = GateConfig(G=2, max_tokens=24, margin=0.15, n_resamples=200, poll_s=0.1, nice=0, canary=CANARY)
"""G=2 on 20 prompts: a pass rate resolves to about ±0.1, so the offline margin is 0.15 here."""


def twenty_tasks() -> list:
    """20 prompts of the gate split: 2 of each of ten families."""
    from demo.tasks import FAMILIES

    return split_tasks("gate", 20, FAMILIES[:10])


class Product:
    """The demo product on the live gateway: users ask for completions of demo tasks, see them (`shown`,
    the exposure the canary counts) and react; the product reports it all at once, as a product would."""

    WINDOW_S = 1.0  # the joiner's attribution window

    def __init__(self, url: str, bus: EmbeddedBus, fleet: GatewayFleet, n_users: int = 20):
        self.url, self.http, self.fleet = url, httpx.Client(base_url=url, timeout=60), fleet
        self.users = [SimulatedUser(f"user-{i}", seed=i) for i in range(n_users)]
        self.joiner = JoinerService(bus, RewardSpec(), window_s=self.WINDOW_S)
        self.round = 0

    def serve(self) -> int:
        """One round: every user gets a completion and reacts to it; returns the samples joined."""
        self.round += 1
        served: set[str] = set()
        for user, task in zip(self.users, sample_tasks(len(self.users), seed=1000 + self.round)):
            choice = self.complete(task.prompt, user.user_id)["choices"][0]
            served.add(choice["completion_id"])
            seen = [("shown", None)] + [
                (s.kind, s.value) for s in user.react(task, choice["text"], check(task, choice["text"]))
            ]
            events = [{"completion_id": choice["completion_id"], "kind": kind, "user": user.user_id,
                       **({"value": value} if value is not None else {})} for kind, value in seen]  # fmt: skip
            r = self.http.post("/v1/feedback", json={"events": events})
            assert r.status_code == 200, r.text
        joined: set[str] = set()  # every completion was shown: each is a sample once its window closes

        def all_joined() -> bool:
            joined.update(s.completion.completion_id for s in self.joiner.run_once(timeout_s=0.2))
            return served <= joined

        wait_until(all_joined, 30, what="the joiner's samples of this round", interval_s=0)
        return len(joined)

    def routes_to(self, reg: Registry, version: str) -> bool:
        """The gateway's cached view of the canary (`CANARY_TTL_S`) is `version` at its current share."""
        c, share = self.fleet.canary(), (reg.get(version).gate.get("canary") or {}).get("share")
        return c is not None and c.version == version and c.share == share

    def complete(self, prompt: str, user: str | None) -> dict:
        body = {"model": "flywheel", "prompt": prompt, "max_tokens": 24, **({"user": user} if user else {})}
        r = self.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.joiner.close()
        self.http.close()


def next_candidate(learner: LearnerService, gate: Gate, product: Product, reg: Registry) -> str:
    """Serve and train until the learner's candidate passes the offline gate (a near copy of its parent
    can still lose a family by chance: then the lineage rebases and trains on); then run its canary on
    live traffic until it awaits approval."""

    def trained() -> str | None:
        if (version := learner.run_once(timeout_s=0.2)) is None:
            product.serve()
        return version

    for _ in range(4):
        candidate = wait_until(trained, 300, what="a candidate from the learner", interval_s=0)
        if (offline := gate.step()).action == "passed":
            break
        assert offline.action == "rejected", offline
    assert offline.action == "passed", reg.get(candidate).gate["offline"]["numbers"]["failed"]
    wait_until(lambda: all(candidate in r.holds for r in reg.fleet().replicas), 30, what="the replicas to load it")

    def canary_passed() -> bool:
        step = gate.step()  # the first one starts the canary at its first share
        if step.action == "awaiting_approval":
            return True
        assert step.action in ("canary", "next_step"), step
        wait_until(lambda: product.routes_to(reg, candidate), 30, what="the gateway routing the canary's share")
        product.serve()
        return False

    wait_until(canary_passed, 120, what="the canary to pass", interval_s=0)
    return candidate


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """A candidate awaiting approval after the learner, the offline gate and a routed canary (with
    screenshots, two earlier cycles too, approved, so the pages have a history to show)."""
    ckpt = request.getfixturevalue("tiny_checkpoint")
    if SHOTS:  # the demo model: `flywheel bootstrap`'s under FLYWHEEL_HOME if there is one, else a shorter one
        demo = Settings().served_model_dir
        ckpt = demo if (demo / "config.json").is_file() else request.getfixturevalue("small_trained_checkpoint")
    home = tmp_path_factory.mktemp("dashboard")
    settings = Settings(
        home=home, model_dir=ckpt, engine="embedded", replicas=2, heartbeat_s=0.5, gateway_id="gateway-a"
    )
    reg, bus, index = Registry(settings.db_url), EmbeddedBus(home / "bus"), CompletionIndex(home / "index.db")
    keys = KeyStore(settings.db_url)
    t0 = time.monotonic()
    app = create_app(settings, bus=bus, index=index, registry=reg)
    with LiveServer(app) as server:
        product = Product(server.url, bus, app.state.gateway.fleet)
        learner = LearnerService(bus, reg, settings.learner_models_dir, settings.served_model_dir,
                                 LearnerConfig(update_every_samples=16, min_samples=1))  # fmt: skip
        suite = demo_suite(twenty_tasks())
        gate = Gate(reg, lambda: EmbeddedEngine(max_batch=64, max_model_len=128),
                    weight_store_loader(settings.learner_models_dir, home / "gate-cache"), suite, GATE, bus=bus,
                    score=verifier_scorer(suite.verifier, Tokenizer.from_file(ckpt)))  # fmt: skip
        lease = GateLease(reg, beat_s=1.0, stuck_s=3600).start()  # the gate's lease, as run_gate holds it
        try:
            for _ in range(2 if SHOTS else 0):
                earlier = next_candidate(learner, gate, product, reg)
                reg.approve(earlier, "screenshot run", "an earlier cycle, approved to give the pages a history")
                wait_until(lambda: reg.fleet(interval_s=0.5).complete, 30, what="the fleet to serve it")
            incumbent = reg.promoted().id
            candidate = next_candidate(learner, gate, product, reg)
        finally:
            lease.stop()
            learner.close()
        server.settings, server.reg, server.product = settings, reg, product
        server.incumbent, server.candidate, server.setup_s = incumbent, candidate, time.monotonic() - t0
        server.admin = keys.create(["admin"], label="alice")
        server.viewer = keys.create(["viewer"], label="bob")
        yield server
        product.close()
    bus.close()
    index.close()
    reg.close()


@pytest.fixture(scope="module")
def browser():
    os.environ["SE_MANAGER_PATH"] = "/nonexistent/selenium-manager"  # any attempt to download fails loudly
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--window-size=1400,1000", "--force-device-scale-factor=1"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(str(CHROMEDRIVER)))
    driver.implicitly_wait(2)
    yield driver
    driver.quit()


def click(driver, element) -> None:
    """Click, and wait until the page it leads to has replaced this one."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.wait import WebDriverWait

    def gone(e: Exception) -> bool:
        """The element's page was replaced: stale, or chromedriver's word for the same race."""
        return isinstance(e, StaleElementReferenceException) or "does not belong to the document" in str(e)

    old = driver.find_element("tag name", "html")
    try:
        element.click()
    except WebDriverException as e:
        if not gone(e):  # else: the page it submitted already replaced this one
            raise

    def replaced(_) -> bool:
        try:
            old.is_enabled()
        except WebDriverException as e:
            if gone(e):
                return True
            raise
        return False

    WebDriverWait(driver, 15).until(replaced)


def sign_in(driver, world, token: str) -> None:
    driver.delete_all_cookies()
    driver.get(world.url + "/dashboard/versions")
    assert "/dashboard/login" in driver.current_url  # anonymous: the sign-in page, no data
    shot(driver, "login")
    driver.find_element("id", "key").send_keys(token)
    click(driver, driver.find_element("id", "sign-in"))
    assert driver.current_url.endswith("/dashboard/versions"), driver.page_source[:2000]


def shot(driver, name: str) -> None:
    """A full-page screenshot into FLYWHEEL_SCREENSHOTS, if set."""
    if not SHOTS:
        return
    Path(SHOTS).mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(900, height))
    driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))
    driver.set_window_size(1400, 1000)


def post_from_page(driver, path: str, fields: dict) -> int:
    """A POST made by script on the page (its cookies go along): the status code it gets."""
    script = """const [path, fields, done] = arguments;
    fetch(path, {method: "POST", body: new URLSearchParams(fields), credentials: "same-origin", redirect: "manual"})
      .then(r => done(r.status), e => done(String(e)));"""
    return driver.execute_async_script(script, path, fields)


def test_the_candidate_went_through_the_learner_the_gate_and_a_canary(world):
    v = world.reg.get(world.candidate)
    assert v.parent_id == world.incumbent and "reward_mean" in v.metrics and v.data_range
    numbers = v.gate["offline"]["numbers"]
    assert (numbers["suite"]["n_prompts"], numbers["sampling"]["G"]) == (20, 2)
    steps = [(a.action, a.to_status.value) for a in world.reg.audit(world.candidate)]
    assert ("transition", "canary") in steps and steps[-1] == ("transition", "awaiting_approval")
    reasons = [a.reason for a in world.reg.audit(world.candidate) if a.action == "record_gate"]
    assert any(r.startswith("canary started") for r in reasons) and not any("look" in r for r in reasons)
    assert len(v.gate["canary"]["history"]) >= 2  # the canary's history is state on the version, look by look
    print(f"the world took {world.setup_s:.1f} s")


def test_a_viewer_sees_the_candidate_but_its_buttons_do_nothing(world, browser):
    sign_in(browser, world, world.viewer[0])
    assert world.candidate in browser.find_element("id", "versions").text
    shot(browser, "versions")
    click(browser, browser.find_element("link text", world.candidate))
    verdict = browser.find_element("id", "verdict").text
    assert f"compared with {world.incumbent}, which is promoted now" in verdict and "Canary difference" in verdict
    approve = browser.find_element("id", "approve")
    assert not approve.is_enabled() and not browser.find_element("id", "reason-approve").is_enabled()
    assert "only an admin key can approve" in browser.find_element("id", "actions").text
    page = browser.current_url
    browser.execute_script("arguments[0].click()", approve)  # even a click on the disabled button
    assert browser.current_url == page
    csrf = browser.find_element("name", "csrf").get_attribute("value")
    path = f"/dashboard/versions/{world.candidate}/approve"
    assert post_from_page(browser, path, {"reason": "viewer tries", "csrf": csrf}) == 403
    r = httpx.post(f"{world.url}/admin/versions/{world.candidate}/approve", json={"reason": "viewer tries"},
                   headers={"Authorization": f"Bearer {world.viewer[0]}"}, timeout=30)  # fmt: skip
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    assert world.reg.get(world.candidate).status == "awaiting_approval"


def test_a_forged_post_without_the_csrf_token_gets_403(world, browser):
    sign_in(browser, world, world.admin[0])  # a signed-in admin: the session cookie goes with the POST
    browser.get(f"{world.url}/dashboard/versions/{world.candidate}")
    before = world.reg.last_seq()
    for fields in ({"reason": "forged"}, {"reason": "forged", "csrf": "not-the-token"}):
        assert post_from_page(browser, f"/dashboard/versions/{world.candidate}/approve", fields) == 403
    assert world.reg.last_seq() == before and world.reg.get(world.candidate).status == "awaiting_approval"


def test_an_admin_approves_with_a_reason_and_the_fleet_serves_it(world, browser):
    sign_in(browser, world, world.admin[0])
    click(browser, browser.find_element("link text", world.candidate))
    shot(browser, "version")
    assert "Promotes" in browser.find_element("id", "about-approve").text
    browser.find_element("id", "reason-approve").send_keys("offline and canary both within the margin")
    click(browser, browser.find_element("id", "approve"))
    assert "Approved" in browser.find_element("id", "notice").text
    assert world.reg.promoted().id == world.candidate
    row = world.reg.audit(world.candidate)[-1]
    assert (row.action, row.actor) == ("approve", f"key:{world.admin[1].key_id} (alice)")
    assert row.reason == "offline and canary both within the margin"
    served = lambda: {world.product.complete("# add 1 to x\ndef f(x):\n", f"user-{i}")["model"] for i in range(6)}  # noqa: E731
    wait_until(lambda: served() == {world.candidate}, 30, what="the fleet to serve the approved version")
    wait_until(lambda: world.reg.fleet(interval_s=0.5).complete, 30, what="the fleet to report it")
    browser.get(world.url + "/dashboard/fleet")
    assert "Complete" in browser.find_element("id", "fleet-state").text
    assert len(browser.find_elements("css selector", "table.replicas tbody tr")) == 2
    shot(browser, "fleet")


def test_a_rollback_from_the_page_restores_the_previous_version(world, browser):
    if world.reg.get(world.candidate).status == "awaiting_approval":  # run on its own: approve first
        world.reg.approve(world.candidate, "test", "set up the rollback")
    sign_in(browser, world, world.admin[0])
    browser.get(f"{world.url}/dashboard/versions/{world.candidate}")
    assert f"restores {world.incumbent}" in browser.find_element("id", "about-rollback").text
    browser.find_element("id", "reason-rollback").send_keys("users complain")
    click(browser, browser.find_element("id", "rollback"))
    assert "Rolled back" in browser.find_element("id", "notice").text
    assert browser.current_url.endswith(f"/dashboard/versions/{world.incumbent}?done=rollback")
    assert world.reg.promoted().id == world.incumbent and world.reg.get(world.candidate).status == "rolled_back"
    served = lambda: {world.product.complete("# add 1 to x\ndef f(x):\n", f"user-{i}")["model"] for i in range(6)}  # noqa: E731
    wait_until(lambda: served() == {world.incumbent}, 30, what="the fleet to serve the base again")
    click(browser, browser.find_element("id", "logout"))
    assert "/dashboard/login" in browser.current_url
    browser.get(world.url + "/dashboard/versions")
    assert "/dashboard/login" in browser.current_url  # signed out
