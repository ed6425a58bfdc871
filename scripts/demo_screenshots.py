"""Screenshots of the dashboard on a finished `flywheel demo` run: docs/dashboard/*.png.

Serves the run's home again (`flywheel serve` on its registry, bus and key store, the base it started
from), signs in with a fresh viewer key and saves the versions list, the last promoted version's page
and the fleet page, full length, with headless Chromium (/usr/bin/chromium, /usr/bin/chromedriver;
nothing is downloaded).

Usage: .venv/bin/python -m scripts.demo_screenshots var/demo-report/demo/seed0 [--out docs/dashboard]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from core.harness import LiveGateway
from registry.keys import KeyStore

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("home", type=Path, help="a demo run's FLYWHEEL_HOME (var/demo-report/demo/seed0)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard")
    a = ap.parse_args()
    run = json.loads(a.home.with_suffix(".json").read_text())
    base = a.home.parent.parent / "models" / "demo-base"
    token, _ = KeyStore(f"sqlite:///{a.home / 'registry.db'}").create(["viewer"], label="screenshots")
    env = {"FLYWHEEL_HOME": str(a.home), "FLYWHEEL_MODEL_DIR": str(base), "FLYWHEEL_REPLICAS": "1"}
    with LiveGateway(env, log_path=a.home / "screenshots-gateway.log", name="screenshots-gateway") as gw:
        shoot(gw.url, token, run["promotions"][-1], a.out)


def shoot(url: str, token: str, version: str, out: Path) -> None:
    os.environ["SE_MANAGER_PATH"] = "/nonexistent/selenium-manager"  # never download a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--window-size=1400,1000", "--force-device-scale-factor=1"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        driver.get(url + "/dashboard/login")
        shot(driver, out / "login.png")
        driver.find_element("id", "key").send_keys(token)
        driver.find_element("id", "sign-in").click()
        time.sleep(1.0)
        for name, path in (("versions", "/dashboard/versions"), ("version", f"/dashboard/versions/{version}"),
                           ("fleet", "/dashboard/fleet")):  # fmt: skip
            driver.get(url + path)
            time.sleep(1.0)
            shot(driver, out / f"{name}.png")
            print(f"saved {out / name}.png ({path})")
    finally:
        driver.quit()


def shot(driver, path: Path) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(900, height))
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)


if __name__ == "__main__":
    main()
