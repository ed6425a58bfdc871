"""What a demo run runs on: `flywheel up` on a config file of the run's own, in one of two shapes.

- `embedded` (the default): one gateway with `replicas` engines, the joiner, the learner and the gate
  (`flywheel up`), on the embedded bus and SQLite files under the run's home.
- `kafka-postgres`, the production shape: a Kafka-protocol broker (tansu, in memory, started for the
  run: `core.harness.start_tansu`) and a PostgreSQL database made for the run on `postgres_server`;
  `flywheel up` (gateway A, the joiner, the learner, the gate) and `gateways - 1` more gateways
  (`flywheel serve`, each its own home), all on the same file: one bus, one registry and completion
  index, one session secret, one weights folder (the learner's). The users are spread over the gateways.

`demo_config` turns a `demo.system.DemoSystemConfig` into the file's tables; `start` starts the shape
under one `core.supervisor.Supervisor` and returns a `Stack`. Each process logs to `<home>/<name>.log`.

`start(..., separate=True)` runs the kafka-postgres shape as a process manager (systemd, Kubernetes)
would: every gateway is a `flywheel serve` (`gateway-1`, `gateway-2`, ...), and the joiner, the
learner and the gate are processes of their own (`Stack.start_services`, once the first gateway has
published the base), each of which can be killed and started again by name (`Stack.start_child`).
With `durable_broker`, the broker keeps its records in an S3 bucket (`core.harness.Tansu`), so it can
be killed and restarted too. The fault harness (`bench/faults.py`) runs on this.
"""

from __future__ import annotations

import os
import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.config_file import FILE_NAME, dump_toml
from core.harness import Tansu, free_port, http_ok, wait_until
from core.settings import Settings
from core.supervisor import Supervisor

if TYPE_CHECKING:
    from demo.system import DemoSystemConfig

SERVICES = ("joiner", "learner", "gate")  # what `flywheel up` runs beside its gateway


@dataclass
class Stack:
    supervisor: Supervisor
    urls: list[str]
    """Every gateway; the first is `flywheel up`'s (the admin API the run approves through)."""
    db_url: str
    settings: Settings
    """The run's deployment settings (the bus, the registry), as its services read them."""
    config: Path
    commands: dict[str, tuple[list[str], dict[str, str], Path]] = field(default_factory=dict)
    """Each process `start_child` can start (again): its `flywheel` arguments, environment and log."""
    broker: Tansu | None = None

    def start_child(self, name: str) -> None:
        """Start the process `name` (again, after it was killed): the same command, environment and log."""
        argv, env, log_path = self.commands[name]
        self.supervisor.start_flywheel(name, argv, env=env, log_path=log_path)

    def start_services(self) -> None:
        """`separate` stacks: the joiner, the learner and the gate, each a process (`SERVICES`)."""
        for name in SERVICES:
            self.start_child(name)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        for url in self.urls:
            health = url + "/healthz"
            wait_until(
                lambda: http_ok(health),  # noqa: B023 (called before the loop moves on)
                timeout_s,
                what=f"the demo gateway at {url}",
                interval_s=0.5,
                check=self.supervisor.check,
            )


def demo_config(cfg: DemoSystemConfig, port: int, shape: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The run's `flywheel.toml` (as tables): what `flywheel up` and each of its services read.
    `shape`: the production shape's `[bus]`, `[database]` and extra `[gateway]` keys (`start`)."""
    shape = shape or {}
    tables: dict[str, dict[str, Any]] = {
        "gateway": {
            "port": port,
            "replicas": cfg.replicas,
            "heartbeat_s": 1.0,
            "torch_threads": 1,  # every process of the demo shares 2 cores: no oversubscribed thread pools
            "engine_nice": cfg.serving_nice,
            **shape.get("gateway", {}),
        },
        **{k: v for k, v in shape.items() if k != "gateway"},
        "rewards": {"window_s": cfg.window_s},
        "learner": {
            "update_every_samples": cfg.learner_every_samples,
            "update_every_s": max(30.0, cfg.window_s * 10),
            "min_samples": 32,
            "min_updates_per_candidate": cfg.updates_per_candidate,
            "max_lag_updates": cfg.max_lag_updates,
            # After a wait at the lag bound, an ordinary update rather than 8 updates' worth of the stalest
            # samples in one (about a minute of the gate cycle here: docs/learner.md#lag-bound).
            "lag_wait_updates": 1,
            "trainer": {"lr": cfg.lr, "loss": {"kl_coef": cfg.kl_coef, "kl_estimator": cfg.kl_estimator}},
        },
        "gate": {
            "suite": "demo.suite:demo_suite",
            "suite_kwargs": {"n": cfg.gate_prompts},
            "G": cfg.gate_G,
            "guardrails": {"kl_samples_per_prompt": cfg.gate_kl_samples},
            "seed": cfg.seed,
            "n_resamples": 500,
            "poll_s": 1.0,
            "nice": 0,  # on a machine saturated by the simulated users a niced gate would starve
        },
        "canary": {
            "steps": list(cfg.canary_steps),
            "min_users_per_arm": cfg.canary_min_users,
            "min_step_s": cfg.window_s * 2,
            "margin": cfg.canary_margin,
            "max_step_s": cfg.canary_max_step_s,
            "min_users_for_harm": max(2, cfg.canary_min_users // 2),
            "watch_s": cfg.traffic_s,
        },
    }
    if cfg.lending:  # thresholds on the run's compressed clock: its night lasts a minute or two
        tables["lending"] = {
            "enabled": True,
            "target_concurrency": cfg.concurrency / cfg.replicas,  # the day's peak fills every replica
            "lend_after_s": 20.0,
            "reclaim_after_s": 3.0,
            "max_rollout_concurrency": 8,
        }
        tables["learner"] |= {
            "offline_prompts": "demo.suite:demo_offline_prompts",  # train-split prompts only
            "offline": {
                "enabled": True,
                "prompts_per_job": 16,
                "group_size": 8,
                "shard_size": 2,
                "max_tokens": cfg.max_tokens,
                "seed": cfg.seed,
            },  # fmt: skip
        }
        tables["gate"]["lend_eval"] = True
    return tables


def create_database(server: str, prefix: str = "flywheel_demo") -> str:
    """A new, empty PostgreSQL database on `server` (a URL without a database name, whose user may
    create databases); its SQLAlchemy URL. ValueError naming the server if it cannot be reached."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(server)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    conninfo = f"host={u.host or '127.0.0.1'} port={u.port or 5432} user={u.username or 'postgres'} dbname=postgres"
    if u.password:
        conninfo += f" password={u.password}"
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as e:
        raise ValueError(f"cannot create a database on PostgreSQL {u.render_as_string()!r}: {e}") from None
    return u.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)


def start(
    cfg: DemoSystemConfig, home: Path, base: Path, *, separate: bool = False, durable_broker: bool = False
) -> Stack:
    """The run's shape (module docstring), started: `flywheel up` and the extra gateways, or with
    `separate` every gateway as `flywheel serve` (the services wait for `Stack.start_services`); not yet ready."""
    if (separate or durable_broker) and cfg.shape != "kafka-postgres":
        raise ValueError(f"separate processes and a durable broker need shape 'kafka-postgres', got {cfg.shape!r}")
    supervisor = Supervisor("flywheel demo")
    ports = [free_port() for _ in range(cfg.gateways)]
    shape: dict[str, Any] = {}
    db_url = f"sqlite:///{home / 'registry.db'}"
    broker = None
    commands: dict[str, tuple[list[str], dict[str, str], Path]] = {}
    try:
        if cfg.shape == "kafka-postgres":
            broker = Tansu(supervisor, home, durable=durable_broker)
            bootstrap = broker.start()
            db_url = create_database(cfg.postgres_server)
            shape = {
                "bus": {"kind": "kafka", "kafka_bootstrap": bootstrap},
                "database": {"url": db_url, "index_url": db_url},
                "gateway": {
                    "session_secret": secrets.token_hex(32),  # one for every gateway: a session works on each
                    "weights_url": str(home / "models" / "learner"),  # one weights folder for every replica
                },
            }
        config = home / FILE_NAME
        tables = demo_config(cfg, ports[0], shape)
        config.write_text("# flywheel demo: this run's config (demo.stack.demo_config)\n" + dump_toml(tables))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")},
            "FLYWHEEL_HOME": str(home),
            "FLYWHEEL_MODEL_DIR": str(base),
        }
        on_file = ["--config", str(config)]
        if separate:
            commands = {name: ([*on_file, name], env, home / f"{name}.log") for name in SERVICES}
        else:
            commands["up"] = ([*on_file, "up"], env, home / "up.log")
        for i, port in enumerate(ports, start=1):
            name = f"gateway-{i}"
            if i == 1 and not separate:
                continue  # `flywheel up` serves the first gateway
            own = {**env, "FLYWHEEL_PORT": str(port), "FLYWHEEL_GATEWAY_ID": name}
            if i > 1:  # gateway-1 shares the services' home: the learner's weights folder is the one published
                own["FLYWHEEL_HOME"] = str(home / name)
            commands[name] = ([*on_file, "serve"], own, home / f"{name}.log")
    except BaseException:
        supervisor.stop()
        raise
    settings = Settings(home=home, model_dir=base, env="local", database_url=db_url, **_bus(shape))
    stack = Stack(supervisor, [f"http://127.0.0.1:{p}" for p in ports], db_url, settings, config, commands, broker)
    try:
        for name in commands:
            if name not in SERVICES:
                stack.start_child(name)
    except BaseException:
        supervisor.stop()
        raise
    return stack


def _bus(shape: dict[str, Any]) -> dict[str, Any]:
    bus = shape.get("bus")
    return {"bus": "kafka", "kafka_bootstrap": bus["kafka_bootstrap"]} if bus else {"bus": "embedded"}
