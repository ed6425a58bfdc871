"""`flywheel demo`: one run of the demo product through the whole system (`demo.system`), or with
`--report DIR` the published set of runs (seeds, and both controls on as many seeds) and
`DIR/report.{md,json,png}`. Every run records its provenance (`demo.provenance`); `--resume` reuses a
saved run only when its config and its source hash match this checkout's."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from cli.main import ensure_base
from core.settings import get_settings


def demo(args) -> None:
    """One run of the demo through the whole system (`demo.system`), or with --report the published
    set of runs (seeds and the two controls) and `<dir>/report.{md,json,png}` (`demo.report`)."""
    import shutil
    import time

    from demo import report as demo_report
    from demo.provenance import provenance
    from demo.system import DemoSystemConfig, run_system, version_records

    for noisy in ("httpx", "httpx2", "openai"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = get_settings()
    ensure_base(settings)
    base = settings.served_model_dir
    runs_dir = settings.home / "demo"
    overrides = {k: v for k, v in (("users", args.users), ("traffic_s", args.minutes and args.minutes * 60)) if v}
    common = DemoSystemConfig.quick() if args.quick else DemoSystemConfig()
    if args.kafka_postgres is not None:  # two gateways of one replica: the embedded run's two engines
        overrides |= {"shape": "kafka-postgres", "gateways": 2, "replicas": 1, "postgres_server": args.kafka_postgres}
    if args.replicas is not None:
        overrides["replicas"] = args.replicas
    if args.kl_estimator is not None:
        overrides["kl_estimator"] = args.kl_estimator
    if args.diurnal is not None:
        overrides |= {"diurnal_trough": args.diurnal, "lending": not args.no_lending}
    common = DemoSystemConfig.model_validate(
        {**common.model_dump(), **overrides, "auto_approve": not args.no_auto_approve}
    )
    seed = settings.seed if args.seed is None else args.seed

    here = provenance()

    def one(name: str, cfg: DemoSystemConfig, keep: bool) -> dict:
        saved = runs_dir / f"{name}.json"
        if args.resume and saved.is_file():
            result = json.loads(saved.read_text())
            theirs = (result.get("provenance") or {}).get("source_sha256")
            if result["config"] != cfg.model_dump(mode="json"):
                print(f"flywheel demo: run {name!r} is not reused: its config differs", flush=True)
            elif theirs != here["source_sha256"]:
                print(f"flywheel demo: run {name!r} is not reused: made from other sources ({theirs})", flush=True)
            else:
                print(f"flywheel demo: run {name!r} reused from {saved} (same config and sources)", flush=True)
                db = result.get("registry_url") or f"sqlite:///{runs_dir / name / 'registry.db'}"
                if not db.startswith("sqlite") or (runs_dir / name / "registry.db").is_file():
                    result["versions"] = version_records(db)  # its versions as this code records them
                    saved.write_text(json.dumps(result, indent=2))
                return result
        home = runs_dir / name
        shutil.rmtree(home, ignore_errors=True)
        print(f"flywheel demo: run {name!r} in {home}", flush=True)
        result = run_system(cfg, home, base, keep_serving=_wait_for_ctrl_c if keep else None)
        result["provenance"] = here
        (runs_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
        gain = demo_report.run_gain(result) if len(result["promotions"]) > 1 else None
        print(json.dumps({"run": name, "promotions": result["promotions"], "gain": gain, "wall_s": result["wall_s"]}))
        return result

    if args.report is None:
        cfg = common.model_copy(
            update={"seed": seed, "adversarial_share": args.adversarial_share, "shuffle_rewards": args.shuffle_rewards}
        )
        name = f"seed{seed}" + ("-shuffled" if cfg.shuffle_rewards else "")
        name += f"-adversarial{round(cfg.adversarial_share * 100)}" if cfg.adversarial_share else ""
        name += f"-{cfg.shape}" if cfg.shape != "embedded" else ""
        name += ("-diurnal" + ("-lending" if cfg.lending else "")) if cfg.diurnal_trough else ""
        one(name, cfg, keep=not args.exit)
        return
    t0 = time.monotonic()
    n = range(args.seeds)
    seeds = [one(f"seed{s}", common.model_copy(update={"seed": s}), False) for s in n]
    controls = {c.strip() for c in args.controls.split(",") if c.strip()}
    known = {"shuffled", "adversarial", "lending"}
    if controls - known:
        sys.exit(f"flywheel demo: unknown control(s) {sorted(controls - known)}")
    shuffled = [
        one(f"seed{s}-shuffled", common.model_copy(update={"seed": s, "shuffle_rewards": True}), False)
        for s in (n if "shuffled" in controls else ())
    ]
    adversarial = [
        one(f"seed{s}-adversarial5", common.model_copy(update={"seed": s, "adversarial_share": 0.05}), False)
        for s in (n if "adversarial" in controls else ())
    ]
    pair = None
    if "lending" in controls:  # seed 0's diurnal day, lending on then off: the same users and traffic
        day = common.model_copy(update={"seed": 0, "diurnal_trough": args.diurnal or 0.15})
        on = one("seed0-diurnal-lending", day.model_copy(update={"lending": True}), False)
        pair = (on, one("seed0-diurnal", day.model_copy(update={"lending": False}), False))
    summary = demo_report.summarize(seeds, shuffled, adversarial, pair)
    summary["total_wall_s"] = round(time.monotonic() - t0, 1)
    summary["provenance"] = here
    command = "flywheel demo " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "flywheel demo --report docs/demo"
    for path in demo_report.write(summary, Path(args.report), command):
        print(f"flywheel demo: wrote {path}")


def _wait_for_ctrl_c(url: str, token: str) -> None:
    import time

    print(f"flywheel demo: the dashboard stays up at {url}/dashboard (admin key {token}); Ctrl-C ends it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
