"""Deployment settings: the one place that reads the environment (prefix `FLYWHEEL_`).

Algorithm and experiment knobs (learning rates, corpus mixes, reward specs) are *not* here: they
are typed config models next to the code that uses them (and sections of the config file, `cli.config`).
This class holds where things live and which real component backs each part. Every process gets its
settings from `get_settings()`: the environment over the config file's `gateway`, `bus`, `database`, `limits`
sections (`core.config_file`; `FILE_KEYS` maps them) over the defaults. A bad value is a `ConfigError`
naming the file's key and line, or the variable.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from core.config_file import ConfigError, read_config, where

SECTIONS = {
    "bus": {"kind": "bus", "kafka_bootstrap": "kafka_bootstrap"},
    "database": {"url": "database_url", "index_url": "index_url"},
    "limits": {
        "completions_per_s": "limit_completions_per_s",
        "completions_burst": "limit_completions_burst",
        "feedback_events_per_s": "limit_feedback_events_per_s",
        "feedback_burst": "limit_feedback_burst",
    },
}
NOT_IN_FILE = ("home",)  # where the file itself is found


def file_keys() -> dict[str, str]:
    """Settings field -> its dotted key in the config file: `bus.*`, `database.*`, the rest `gateway.*`."""
    out = {field: f"{section}.{key}" for section, keys in SECTIONS.items() for key, field in keys.items()}
    return {name: out.get(name, f"gateway.{name}") for name in Settings.model_fields if name not in NOT_IN_FILE}


class _FileSource(PydanticBaseSettingsSource):
    """The config file's `gateway`, `bus`, `database` and `limits` sections as field values; an unknown key there
    is a `ConfigError` naming it."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        path, data, text = read_config()
        by_key = {dotted: field for field, dotted in file_keys().items()}
        out: dict[str, Any] = {}
        for section in ("gateway", *SECTIONS):
            table = data.get(section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{where(path, text, section)}: must be a table ([{section}])")
            for key, value in table.items():
                dotted = f"{section}.{key}"
                if dotted not in by_key:
                    raise ConfigError(f"{where(path, text, dotted)}: unknown key (docs/config.md lists them)")
                out[by_key[dotted]] = value
        return out


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)

    env: Literal["local", "test", "production"] = Field(
        "local",
        description="Deployment kind. Outside local mode the gateway needs a session secret, and in production "
        "API keys too (`check_production`).",
    )
    home: Path = Field(Path("var"), description="Root folder for models, logs and embedded stores.")
    model_dir: Path | None = Field(
        None, description="Checkpoint folder served by default; None means <home>/models/demo-base."
    )
    seed: int = Field(0, description="Seed of the demo bootstrap (corpus, tokenizer, initial weights).")
    host: str = Field("127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway binds to (0: any free port).")
    access_log: bool = Field(
        False, description="uvicorn's access log line per request (requests are counted at /metrics either way)."
    )
    engine: Literal["embedded", "process", "vllm"] = Field(
        "process",
        description="Inference backend: the embedded engine on a thread of the gateway, the embedded "
        "engine in a process of its own, or vLLM.",
    )
    replicas: int = Field(
        1, ge=1, le=64, description="Engines (replicas) this gateway drives, each following the registry."
    )
    local_tenant: str = Field(
        "default",
        min_length=1,
        max_length=64,
        description="The one tenant of local mode (no FLYWHEEL_API_KEYS): a request without a key belongs to it, "
        "and X-Flywheel-Tenant may name only it; more tenants need keys.",
    )
    gateway_id: str | None = Field(None, description="This gateway's name in replica heartbeats; None: host-pid.")
    heartbeat_s: float = Field(5.0, gt=0, description="Seconds between a replica's heartbeats (down after 3 missed).")
    max_batch: int = Field(64, ge=1, le=1024, description="Sequences the embedded engine decodes at once.")
    max_model_len: int = Field(256, ge=16, description="Longest prompt + completion a request may ask for.")
    max_request_bytes: int = Field(
        512 << 10,
        ge=1 << 10,
        description="Largest request body the gateway reads: a longer one gets 413 before it is parsed. "
        "The default holds a max_model_len prompt of the longest tokens (about 12 characters each for the "
        "demo's tokenizer) a hundred times over, and bounds how long parsing one body can hold the event "
        "loop (JSON parsing is linear in the size, on the loop).",
    )
    limit_completions_per_s: float | None = Field(
        None,
        gt=0,
        description="Completions per second one key may ask for (`api.limits`; over it: 429 with Retry-After); "
        "None: no limit (refused in production).",
    )
    limit_completions_burst: float | None = Field(
        None, ge=1, description="Completions one key may ask for at once before the rate applies; None: 2 s' worth."
    )
    limit_feedback_events_per_s: float | None = Field(
        None,
        gt=0,
        description="Feedback events per second one key may send (a batch counts each event); None: no limit "
        "(refused in production).",
    )
    limit_feedback_burst: float | None = Field(
        None, ge=1, description="Feedback events one key may send at once before the rate applies; None: 2 s' worth."
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of an engine's compute thread, and of `flywheel learner`; None: 2 for an engine "
        "process (the default engine, and the gate's; a gateway's on a machine of 2 cores or fewer: 1, the other core "
        "left to the gateway), 1 for the embedded engine (see serving/engine.py), torch's own default for the learner.",
    )
    engine_nice: int = Field(
        0,
        ge=0,
        le=19,
        description='Niceness of the gateway\'s engine processes (`engine = "process"` only): above 0 the '
        "processes that share the machine with them, such as the learner and the gate, get the CPU first "
        "(the demo on 2 cores); 0: live traffic is not deprioritised.",
    )
    batch_invariant: bool = Field(
        True,
        description="The embedded engine decodes float32 models with batch-invariant kernels, so recorded "
        "log-probs equal the trainer's recomputation bit for bit (serving/model.py); off: torch's "
        "default kernels, faster decode, float32 noise between the two.",
    )
    bus: Literal["embedded", "kafka"] = Field("embedded", description="Event bus implementation.")
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (comma separated).")
    learner_distributed: bool = Field(
        False,
        description="`flywheel learner` runs as one rank of a data-parallel job (torchrun sets RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the ranks split the sample partitions.",
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy URL of the registry; None means a SQLite file under <home>."
    )
    index_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the completion index (completions and feedback idempotency keys); "
        "None means a SQLite file under <home>. Point every gateway at one PostgreSQL database "
        "to share it.",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted bearer tokens; empty means no auth (local only)."
    )

    weights_url: str | None = Field(
        None,
        description="Where replicas fetch versions from: a folder, or the http(s) URL of a gateway's "
        "/v1/weights on the machine holding the learner's models folder; None: that folder under <home>.",
    )
    weights_token: str | None = Field(
        None, description="Bearer token for an http(s) FLYWHEEL_WEIGHTS_URL: a key with the weights:read scope."
    )
    session_secret: SecretStr | None = Field(
        None,
        description="Signs the dashboard's session cookies and CSRF tokens (32+ characters); required outside "
        "local mode; in local mode None: one is made per home in <home>/session.secret (mode 0600).",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v):
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("engine_nice")
    @classmethod
    def _nice_needs_a_process(cls, v: int, info: ValidationInfo) -> int:
        engine = info.data.get("engine")
        if v and engine != "process":
            raise ValueError(
                f"engine_nice={v} needs engine 'process' (got {engine!r}): only a process engine runs apart "
                "from the gateway's own process"
            )
        return v

    @property
    def served_model_dir(self) -> Path:
        return self.model_dir or self.home / "models" / "demo-base"

    @property
    def learner_models_dir(self) -> Path:
        """The learner's checkpoints and weight store (the folder `/v1/weights` serves)."""
        return self.home / "models" / "learner"

    @property
    def completion_index_url(self) -> str:
        return self.index_url or f"sqlite:///{self.home / 'completion_index.db'}"

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'registry.db'}"

    @property
    def session_secret_path(self) -> Path:
        """Local mode's generated session secret (`core.security.load_or_create_secret`)."""
        return self.home / "session.secret"

    def check_production(self) -> None:
        """Refuse to start a gateway without API keys or rate limits in production, without a session secret outside
        local mode, or with a session secret shorter than 32 characters."""
        if self.env == "production" and not self.api_keys:
            raise ValueError("FLYWHEEL_API_KEYS must be set when FLYWHEEL_ENV=production")
        if self.env != "local" and self.session_secret is None:
            raise ValueError(
                f"FLYWHEEL_SESSION_SECRET must be set when FLYWHEEL_ENV={self.env}: outside local mode "
                "there is no default secret for the dashboard's sessions"
            )
        if self.session_secret is not None and len(self.session_secret.get_secret_value()) < 32:
            # checked here, not by a field constraint, whose error would print the value
            raise ValueError(
                f"FLYWHEEL_SESSION_SECRET has {len(self.session_secret.get_secret_value())} characters; "
                "a session secret needs at least 32 (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
            )
        if self.env == "production" and None in (self.limit_completions_per_s, self.limit_feedback_events_per_s):
            raise ValueError(
                "limits.completions_per_s and limits.feedback_events_per_s must be set when FLYWHEEL_ENV=production: "
                "without them one key can flood the gateway and the feedback that trains the model"
            )


def load_settings() -> Settings:
    """Settings from the environment and the config file; a bad value is a `ConfigError` naming where it
    was set (the file's key and line, or the variable)."""
    try:
        return Settings()
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        env = f"FLYWHEEL_{field.upper()}"
        path, data, text = read_config()
        dotted = file_keys().get(field, "")
        section, _, key = dotted.partition(".")
        in_file = key in (data.get(section) or {}) and env not in os.environ
        place = where(path, text, dotted) if in_file else env
        raise ConfigError(f"{place}: {err['msg']}") from None


@lru_cache
def get_settings() -> Settings:
    return load_settings()
