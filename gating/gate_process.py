"""The `flywheel gate` process: what `gating.gate.Gate` is given outside tests.

- `weight_store_loader`: a version's checkpoint folder rebuilt from the learner's weight store, its
  artifact checked against the registry's SHA-256 (a small cache of the latest few).
- `verifier_scorer`: canary samples scored by the product's verifier (the pass-rate guardrail).
- `run_gate`: the loop, at low priority, with a process engine per evaluation, holding the gate's
  lease (`gating.lease.GateLease`: beaten by the loop and a thread; no lease, no canary traffic).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from core.service_metrics import ServiceMetrics
from feedback.bus import EventBus
from feedback.events import SampleEvent
from gating.gate import EngineFactory, Gate, GateConfig, GateStep, SampleScorer, VersionLoader
from gating.lease import GateLease
from product.suites import EvalSuite, Verifier
from registry.models import WEIGHT_STORE_SUFFIXES, ModelVersionPublic
from registry.publish import sha256_of
from registry.registry import Registry
from serving.checkpoint import CONFIG, WEIGHTS, read_config
from serving.interface import Engine
from serving.tokenizer import Tokenizer
from serving.weight_store import WeightStore

log = logging.getLogger(__name__)


def weight_store_loader(models_dir: str | Path, cache_dir: str | Path, keep: int = 4) -> VersionLoader:
    """Loads a version as replicas will: from its weight-store artifact, not the learner's own weights.

    The learner (`learner.service`) keeps `<models_dir>/<id>/` (an HF folder: config, tokenizer,
    float32 weights) and `<models_dir>/store/<id>.snapshot.fws|.delta.fws` (the artifact: bf16
    shipping weights, rebuilt through its chain of deltas with every tensor verified). The loader checks
    the artifact file's SHA-256 against the registry's, rebuilds the weights with `WeightStore.get`, and
    writes them (in the folder's dtype) with the version's config and tokenizer to
    `<cache_dir>/<id>-<sha prefix>/`, the folder it returns; at most `keep` such folders are kept."""
    models, cache = Path(models_dir), Path(cache_dir)

    def load(v: ModelVersionPublic) -> Path:
        art = v.artifact
        if art is None or not art.path.endswith(WEIGHT_STORE_SUFFIXES):
            raise ValueError(f"version {v.id!r} has no weight-store artifact ({WEIGHT_STORE_SUFFIXES}) in its files")
        path = models / art.path
        if not path.is_file():
            raise ValueError(f"version {v.id!r}: its artifact {path} is missing")
        if (got := sha256_of(path)) != art.sha256:
            raise ValueError(f"version {v.id!r}: {path} has SHA-256 {got}, the registry says {art.sha256}")
        out = cache / f"{v.id}-{art.sha256[:16]}"
        if (out / CONFIG).is_file():  # renamed into place whole: complete
            os.utime(out)
            return out
        src = models / v.id
        _, dtype = read_config(src)
        state = WeightStore(path.parent).get(v.id)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(WEIGHTS, "*.pt"))
        save_file({n: t.to(dtype).contiguous() for n, t in state.items()}, str(tmp / WEIGHTS), {"format": "pt"})
        os.replace(tmp, out)
        held = sorted((p for p in cache.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
        for old in held[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return out

    return load


def verifier_scorer(verifier: Verifier, tokenizer: Tokenizer) -> SampleScorer:
    """Canary samples scored by the product's verifier: the prompt decoded from the completion event's
    token ids (all versions share the tokenizer), the completion its text. A prompt the verifier cannot
    check (not one of the product's tasks) gets None."""

    def prompt_of(ids: list[int]) -> str:
        if ids and ids[0] == tokenizer.bos_id:
            ids = ids[1:]
        return tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")

    def score(samples: list[SampleEvent]) -> list[float | None]:
        prompts = [prompt_of(s.completion.prompt_ids) for s in samples]
        texts = [s.completion.text for s in samples]
        try:
            return list(verifier.verify(prompts, texts))
        except ValueError:  # some prompt it cannot check: one at a time, None for those
            out: list[float | None] = []
            for p, t in zip(prompts, texts, strict=True):
                try:
                    out.append(verifier.verify([p], [t])[0])
                except ValueError:
                    out.append(None)
            return out

    return score


def run_gate(
    settings: Any,
    stop_event: threading.Event,
    suite: EvalSuite,
    cfg: GateConfig | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    load_version: VersionLoader | None = None,
    bus: EventBus | None = None,
) -> None:
    """`flywheel gate`: step until `stop_event` is set (waiting `cfg.poll_s` while there is nothing to do).

    `settings` is a `core.settings.Settings` (db_url, home, max_batch, max_model_len, torch_threads).
    The suite is the product's (the demo's: `demo.suite.demo_suite()`), passed in by the caller: gating
    holds no product code. Defaults: a `ProcessEngine` per evaluation, versions from
    `weight_store_loader(<home>/models/learner, <home>/gate/versions)`, the canary's joined samples from
    `bus` (None: candidates wait in canary), each scored by the suite's verifier for the pass-rate
    guardrail (`verifier_scorer`, the tokenizer of the served model folder). The loop holds the gate's
    lease throughout (`GateLease(registry, cfg.lease_beat_s, cfg.lease_stuck_s)`, beaten at every turn
    and by its thread) and releases it on the way out: gateways route users to a canary only while it
    is live."""
    cfg = cfg or GateConfig()
    if cfg.sample_cache_dir is None:
        cfg = cfg.model_copy(update={"sample_cache_dir": settings.home / "gate" / "samples"})
    if cfg.nice:
        os.nice(cfg.nice)  # inherited by the engine processes spawned below: live traffic comes first
    if engine_factory is None:
        from serving.engine_process import ProcessEngine

        def process_engine() -> Engine:
            return ProcessEngine(
                max_batch=settings.max_batch, max_model_len=settings.max_model_len, threads=settings.torch_threads or 2
            )

        engine_factory = process_engine
    if cfg.lend_eval:  # lent replicas share the sampling through the registry's job queue
        from gating.lent_eval import QueueEngine
        from registry.jobs import JobQueue

        jobs = JobQueue(settings.db_url)
        own = engine_factory

        def lending_engine() -> Engine:
            return QueueEngine(own(), jobs)

        engine_factory = lending_engine

    if load_version is None:
        load_version = weight_store_loader(settings.learner_models_dir, settings.home / "gate" / "versions")
    registry = Registry(settings.db_url)
    score = None if bus is None else verifier_scorer(suite.verifier, Tokenizer.from_file(settings.served_model_dir))
    metrics = ServiceMetrics("gate", settings.home / "metrics")
    gate = Gate(registry, engine_factory, load_version, suite, cfg, bus=bus, score=score, metrics=metrics)
    lease = GateLease(registry, cfg.lease_beat_s, cfg.lease_stuck_s).start()
    gate.lease_s = lease.lease_s  # a canary step's time runs only while the lease is live
    log.info("gate: started on %s with suite %s", settings.db_url, suite.suite_version)
    metrics.report(force=True)  # up and in its loop: its first step may sample for minutes
    try:
        while not stop_event.is_set():
            lease.progress()
            try:
                done = gate.step()
            except Exception:
                log.exception("gate: step failed")
                done = GateStep("error")
            if done.action in ("passed", "rejected", "lost"):
                log.info("gate: %s %s: %s", done.version_id, done.action, done.detail)
                continue  # the next candidate at once
            stop_event.wait(cfg.poll_s)
    finally:
        lease.stop()
        registry.close()
