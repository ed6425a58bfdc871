"""`flywheel`: one entry point per process.

  flywheel bootstrap [--force]    pre-train the demo base (cached under FLYWHEEL_HOME; reproduces models/demo-base)
  flywheel serve [--host --port]  the gateway on the served checkpoint (copies the shipped demo base first if absent)
  flywheel up [--host --port]     the main job on embedded defaults: the gateway, the joiner, the learner, the gate
  flywheel joiner                 feedback + completions -> rewarded samples (consumes and publishes on the bus)
  flywheel learner                samples -> policy-gradient updates -> candidate versions in the registry
  flywheel gate                   candidates -> offline regression evals -> canary or rejected (never promotes)
  flywheel demo [--report DIR]    the demo product through the whole system: simulated users, HTTP and the SDK
  flywheel keys create|list|revoke  API keys of this home's key store (shown once, stored hashed)

Each command imports what it runs only when it runs, so e.g. the joiner never loads FastAPI or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.config_file import ConfigError
from core.security import SCOPES
from core.service_metrics import ServiceMetrics
from core.settings import Settings, get_settings

log = logging.getLogger("flywheel.cli")


def _bootstrap(args, settings: Settings | None = None) -> dict:
    from demo.bootstrap import BootstrapConfig, bootstrap

    settings = settings or get_settings()
    overrides = {"seed": settings.seed}
    if args.steps:
        overrides["steps"] = args.steps
    report = bootstrap(settings.served_model_dir, BootstrapConfig(**overrides), force=args.force)
    ev = report["eval"]
    print(
        json.dumps(
            {
                "model_dir": str(settings.served_model_dir),
                "pass_rate": ev["pass_rate"],
                "satisfaction": ev["satisfaction"],
                "steps": report["steps"],
                "total_seconds": round(report["total_seconds"], 1),
            },
            indent=2,
        )
    )
    return report


def ensure_base(settings: Settings) -> None:
    """A home without its served checkpoint gets the shipped demo base (a copy: seconds), or, where
    the checkout has none, a fresh bootstrap (10-40 minutes)."""
    import shutil

    from demo.bootstrap import REPORT, SHIPPED_BASE

    target = settings.served_model_dir
    if (target / "config.json").is_file():
        return
    if settings.model_dir is not None:
        sys.exit(f"flywheel: no checkpoint at FLYWHEEL_MODEL_DIR={settings.model_dir}")
    if (SHIPPED_BASE / REPORT).is_file():
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(SHIPPED_BASE, tmp)
        os.replace(tmp, target)
        print(f"flywheel: serving the shipped demo base, copied to {target}", file=sys.stderr, flush=True)
        return
    _bootstrap(argparse.Namespace(force=False, steps=None), settings)


def serve_settings(args) -> Settings:
    """The deployment's settings with the command line's --host / --port in place of theirs."""
    overrides = {name: getattr(args, name) for name in ("host", "port") if getattr(args, name) is not None}
    return get_settings().model_copy(update=overrides)


def _serve(args) -> None:
    from api.main import serve
    from cli.product_config import eval_suite, load_product_config
    from core.supervisor import Supervisor

    settings = serve_settings(args)
    ensure_base(settings)
    product = load_product_config()  # a bad file stops here, before anything starts
    if args.cmd != "up":
        serve(settings, product.lending, product.rewards.window_s + product.rewards.grace_s)
        return
    from cli.config import reward_spec

    reward_spec(product.rewards)
    eval_suite(product)
    print(f"flywheel: admin API key for this session: {up_admin_key(settings)}", flush=True)
    supervisor = Supervisor("flywheel up")
    try:
        start_services(settings, supervisor)
        supervisor.watch()  # a dead service stops everything: the gateway too, and `up` exits 1
        serve(settings, product.lending, product.rewards.window_s + product.rewards.grace_s)
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop()
    if supervisor.died is not None:
        sys.exit(f"flywheel up: {supervisor.died.name} exited with code {supervisor.died.code}; stopped everything")


UP_SERVICES = ("joiner", "learner", "gate")


def start_services(settings: Settings, supervisor) -> None:
    """`flywheel up`'s other processes, each `flywheel <name>` with this environment, under
    `supervisor`: the joiner, the learner and the gate. The base is published first, so none of them
    races another to do it."""
    from registry.publish import publish_base
    from registry.registry import Registry

    with Registry(settings.db_url) as registry:
        publish_base(registry, settings.learner_models_dir, settings.served_model_dir)
    env = {**os.environ, "FLYWHEEL_HOME": str(settings.home), "FLYWHEEL_MODEL_DIR": str(settings.served_model_dir)}
    for name in UP_SERVICES:
        supervisor.start_flywheel(name, [name], env=env)


def up_admin_key(settings: Settings) -> str:
    """A fresh admin key for this `flywheel up` (printed, as Jupyter prints its token); the keys of
    earlier `up` sessions are revoked. Only its hash is stored."""
    from registry.keys import KeyStore

    store = KeyStore(settings.db_url)
    for key in store.list():
        if key.label == "flywheel up" and key.revoked is None:
            store.revoke(key.key_id)
    token, _ = store.create(["admin"], label="flywheel up")
    return token


@contextmanager
def joiner_service(settings: Settings, window_s: float | None = None) -> Iterator:
    """The joiner on the configured bus (a `feedback.joiner.JoinerService`) with the config file's reward
    table and window (`window_s` overrides it); both closed on exit."""
    from cli.config import RewardsSection, reward_spec, validate_section
    from feedback.connect import open_bus
    from feedback.joiner import JoinerService
    from registry.registry import Registry

    rewards = validate_section("rewards", RewardsSection)
    spec = reward_spec(rewards)
    bus = open_bus(settings, "joiner")
    try:
        metrics = ServiceMetrics("joiner", settings.home / "metrics")
        window = rewards.window_s if window_s is None else window_s
        registry = Registry(settings.db_url)
        watermark = producer_watermark(registry, rewards.producer_stale_s)
        service = JoinerService(
            bus, spec, window_s=window, metrics=metrics, watermark=watermark, grace_s=rewards.grace_s
        )
        try:
            yield service
        finally:
            service.close()
            registry.close()
    finally:
        bus.close()


def producer_watermark(registry, stale_s: float):
    """The joiner's `watermark`: the registry's bus watermark over live producers; a producer going
    stale, or none being live, is logged once per change (the joiner then closes on the clock)."""
    stale_seen: set[str] = set()
    state: dict[str, bool | None] = {"live": None}

    def watermark() -> float | None:
        w = registry.bus_watermark(stale_s)
        for p in set(w.stale) - stale_seen:
            log.warning("joiner: producer %s reported no bus watermark for over %g s; not waiting for it", p, stale_s)
        stale_seen.clear()
        stale_seen.update(w.stale)
        if bool(w.live) != state["live"]:
            was, state["live"] = state["live"], bool(w.live)
            if not w.live:
                log.warning("joiner: no producer reports a bus watermark; windows close on the clock alone")
            elif was is False:
                log.info("joiner: producers report a bus watermark again; windows close at it")
        return w.value

    return watermark


def _joiner(args) -> None:
    import threading

    stop = threading.Event()
    with joiner_service(get_settings(), args.window_s) as service:
        try:
            service.run(stop)
        except KeyboardInterrupt:
            stop.set()


def _learner(args) -> None:
    import time

    from cli.product_config import eval_suite, load_product_config
    from feedback.connect import open_bus
    from learner.service import LearnerService
    from registry.registry import Registry

    settings = get_settings()
    if settings.torch_threads is not None:  # processes sharing a machine: no oversubscribed thread pools
        import torch

        torch.set_num_threads(settings.torch_threads)
    if not (settings.served_model_dir / "config.json").is_file():
        sys.exit(f"flywheel learner: no base checkpoint at {settings.served_model_dir} (run `flywheel bootstrap`)")
    if settings.learner_distributed:  # one rank of a data-parallel learner: join the process group first
        from learner.distributed import init_process_group

        init_process_group()
    product = load_product_config()
    flags = {"update_every_samples": args.every_samples, "update_every_s": args.every_s}
    cfg = product.learner.learner_config().model_copy(update={k: v for k, v in flags.items() if v is not None})
    verifier = eval_suite(product).verifier  # the verifier of the suite the gate runs (`_gate`)
    bus = open_bus(settings, f"learner-{os.environ.get('RANK', '0')}")
    metrics = ServiceMetrics("learner", settings.home / "metrics")
    lent = None
    if cfg.offline.enabled:  # group rollouts on lent replicas, from the product's offline prompts
        from cli.product_config import offline_prompts
        from learner.lent_rollouts import LentRollouts
        from registry.jobs import JobQueue
        from serving.tokenizer import Tokenizer

        source = offline_prompts(product)
        if source is None:
            raise ConfigError("learner.offline.enabled needs learner.offline_prompts (the prompts to roll out)")
        tok = Tokenizer.from_file(settings.served_model_dir)
        lent = LentRollouts(JobQueue(settings.db_url), source, tok, cfg.offline)
    service = LearnerService(
        bus,
        Registry(settings.db_url),
        settings.learner_models_dir,
        settings.served_model_dir,
        cfg,
        metrics=metrics,
        verifier=verifier,
        lent=lent,
    )
    try:
        while True:
            v = service.run_once(timeout_s=1.0)
            if v and service.rank == 0:  # data-parallel ranks all know the version; one says it
                print(json.dumps({"new_version": v, "counters": dict(service.counters)}), flush=True)
            time.sleep(0.01)
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
        bus.close()


def _gate(args) -> None:
    import threading

    from cli.product_config import eval_suite, load_product_config
    from feedback.connect import open_bus
    from gating.gate_process import run_gate

    settings, stop = get_settings(), threading.Event()
    product = load_product_config()
    suite = eval_suite(product)
    bus = open_bus(settings, "gate")  # the canary reads the joined samples from it
    try:
        run_gate(settings, stop, suite, product.gate_config(), bus=bus)
    except KeyboardInterrupt:
        stop.set()
    finally:
        bus.close()


def _keys(args) -> None:
    """`flywheel keys create --scope S [--scope S ...] [--tenant T] [--label L]`: the new token on
    stdout (shown only now), what it is on stderr; `list`: one JSON object per key; `revoke KEY_ID`."""
    from registry.keys import KeyStore

    store = KeyStore(get_settings().db_url)
    try:
        if args.keys_cmd == "create":
            token, key = store.create(sorted(set(args.scope)), tenant=args.tenant, label=args.label)
            print(token, flush=True)
            print(
                f"flywheel keys: key {key.key_id} for tenant {key.tenant!r}, scopes {', '.join(key.scopes)}: "
                "the token above is shown once and stored only as a hash",
                file=sys.stderr,
            )
        elif args.keys_cmd == "list":
            for key in sorted(store.list(), key=lambda k: k.created):
                if key.revoked is None or args.all:
                    print(json.dumps({**dataclasses.asdict(key), "scopes": list(key.scopes)}))
        else:
            key = store.revoke(args.key_id)
            print(f"flywheel keys: revoked {key.key_id} ({key.label or 'no label'}); its sessions end now")
    except ValueError as e:
        sys.exit(f"flywheel keys: {e}")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flywheel", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config", metavar="PATH", default=None, help="the config file (default: $FLYWHEEL_HOME/flywheel.toml)"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="show the effective config (and where each value came from), or check it")
    c.add_argument("config_cmd", choices=("show", "check"))
    b = sub.add_parser("bootstrap", help="pre-train the demo base model")
    b.add_argument("--force", action="store_true", help="retrain even if a cached model exists")
    b.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    for name, what in (("serve", "run the gateway"), ("up", "the main job on embedded defaults")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--host", default=None, help="address to bind to (default: FLYWHEEL_HOST)")
        s.add_argument(
            "--port", type=_port, default=None, help="port to bind to, 0: any free one (default: FLYWHEEL_PORT)"
        )
    j = sub.add_parser("joiner", help="join feedback to completions into rewarded samples")
    j.add_argument("--window-s", type=float, default=None, help="attribution window in seconds (rewards.window_s)")
    le = sub.add_parser("learner", help="train on samples, publish candidate versions")
    le.add_argument("--every-samples", type=int, default=None, help="update after this many samples (learner.*)")
    le.add_argument("--every-s", type=float, default=None, help="...or after this many seconds (learner.*)")
    sub.add_parser("gate", help="evaluate candidates offline and move them on (a person approves)")
    d = sub.add_parser("demo", help="the demo product through the whole running system, with simulated users")
    d.add_argument("--seed", type=int, default=None, help="the run's seed (default: FLYWHEEL_SEED)")
    d.add_argument(
        "--minutes", type=float, default=None, help="minutes of user traffic (default 10; --quick: at most 25)"
    )
    d.add_argument("--users", type=int, default=None, help="simulated users (default 500)")
    d.add_argument("--adversarial-share", type=float, default=0.0, help="share of users who reward wrong code")
    d.add_argument("--shuffle-rewards", action="store_true", help="control: feedback about another completion")
    d.add_argument(
        "--kl-estimator",
        choices=("k2", "exact"),
        default=None,
        help="the learner's KL estimator (default k2, on the sampled tokens; exact: the KL over the vocabulary "
        "at each visited state)",
    )
    d.add_argument("--no-auto-approve", action="store_true", help="leave approvals to a person on the dashboard")
    d.add_argument("--exit", action="store_true", help="end when the run ends instead of leaving the dashboard up")
    d.add_argument("--quick", action="store_true", help="the short variant CI runs (fewer users and minutes)")
    d.add_argument(
        "--kafka-postgres",
        metavar="SERVER",
        nargs="?",
        const="postgresql://postgres@127.0.0.1:5432",
        default=None,
        help="the production shape: a tansu broker and a database made on this PostgreSQL server (default: "
        "the local one), two gateways (`demo.stack`) of one replica each unless --replicas says otherwise",
    )
    d.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engines per gateway (default: 2 embedded, 1 per gateway with --kafka-postgres: 2 engines either way)",
    )
    d.add_argument(
        "--diurnal",
        metavar="TROUGH",
        type=float,
        nargs="?",
        const=0.15,
        default=None,
        help="users come and go over one compressed day, from TROUGH (default 0.15) of the peak at night, and idle "
        "replicas are lent to the gate's evals and the learner's rollouts (docs/lending.md)",
    )
    d.add_argument("--no-lending", action="store_true", help="--diurnal without lending: every replica serves")
    d.add_argument(
        "--report", metavar="DIR", default=None, help="run --seeds seeds and both controls; write DIR/report.*"
    )
    d.add_argument("--seeds", type=int, default=3, help="seeds of --report (default 3)")
    d.add_argument(
        "--controls",
        default="shuffled,adversarial",
        help="--report: the controls to run on every seed, comma-separated (default shuffled,adversarial; "
        "one left out is reported as not run); 'lending' adds seed 0's diurnal traffic with lending on and off",
    )
    d.add_argument("--resume", action="store_true", help="--report: reuse runs already saved with the same config")
    k = sub.add_parser("keys", help="create, list and revoke API keys (hashed, in the shared registry database)")
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    kc = ks.add_parser("create", help="a new key; its token is printed once")
    kc.add_argument("--scope", action="append", required=True, choices=SCOPES, help="a scope (repeat for more)")
    kc.add_argument("--tenant", default="default", help="the tenant its completions and feedback belong to")
    kc.add_argument("--label", default="", help="who or what it is for (named in the audit log)")
    kl = ks.add_parser("list", help="live keys, one JSON object each (never a token)")
    kl.add_argument("--all", action="store_true", help="revoked keys too")
    kr = ks.add_parser("revoke", help="revoke a key; its dashboard sessions end at once")
    kr.add_argument("key_id", help="the key's id (from `flywheel keys list`)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.config is not None:  # every process this command starts reads the same file
        os.environ["FLYWHEEL_CONFIG"] = str(Path(args.config).resolve())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from core.supervisor import PARENT_ENV, die_with_parent, interrupt_on_sigterm

    if os.environ.get(PARENT_ENV):  # started by a supervisor (`flywheel up`, the demo, a test): die with it
        die_with_parent()
    interrupt_on_sigterm()  # SIGTERM stops a command the way Ctrl-C does: its `finally` blocks run
    try:
        _run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except ConfigError as e:
        sys.exit(f"flywheel {args.cmd}: {e}")


def _run(args: argparse.Namespace) -> None:
    if args.cmd == "bootstrap":
        _bootstrap(args)
    elif args.cmd in ("serve", "up"):
        _serve(args)
    elif args.cmd == "joiner":
        _joiner(args)
    elif args.cmd == "learner":
        _learner(args)
    elif args.cmd == "gate":
        _gate(args)
    elif args.cmd == "demo":
        from cli.demo import demo

        demo(args)
    elif args.cmd == "keys":
        _keys(args)
    elif args.cmd == "config":
        from cli.product_config import config_command

        config_command(args)


if __name__ == "__main__":
    main()
