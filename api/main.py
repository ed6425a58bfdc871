"""The gateway: a FastAPI app, served by uvicorn (`flywheel serve`).

`create_app()` wires settings, the inference engine, the completion sink, the event bus, the
completion index and the routes. Pass any of them to share them (tests, benchmarks); otherwise the
app builds them from the settings at start-up and closes, at shutdown, only what it built.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from api import dashboard, errors
from api.deps import Gateway, GatewayDep, MetricsReader
from api.fleet import GatewayFleet, gateway_id_of
from api.metrics import RequestCounter
from api.routes import admin, feedback, openai, weights
from api.transport import CoalescedHttpTools
from core.service_metrics import read_folder
from core.settings import Settings, get_settings
from feedback.bus import EventBus
from feedback.completion_index import CompletionIndex
from feedback.connect import open_bus
from feedback.sink import CompletionSink
from registry.keys import KeyStore
from registry.registry import Registry
from serving.lending import LendingConfig

if TYPE_CHECKING:
    from serving.interface import Engine

log = logging.getLogger(__name__)


def serving_threads() -> int:
    """Torch threads of a gateway's engine process when `FLYWHEEL_TORCH_THREADS` is unset: 2, or 1 on a
    machine of 2 cores or fewer, where the gateway needs the other core. Measured on a 2-core VM (the HTTP
    race, docs/benchmarks.md): an engine of 2 threads beside its gateway answered about 40 % fewer
    requests per second than one of 1, its second thread spinning in OpenMP's waits on the core the
    gateway needed."""
    return 2 if len(os.sched_getaffinity(0)) > 2 else 1  # the cores this process may run on (a container's cpuset)


def build_engine(settings: Settings, serve_checkpoint: bool = True):
    """The configured inference backend; `serve_checkpoint`: holding the served checkpoint as its
    default version (otherwise empty, for a replica to fill from the registry)."""
    folder = Path(settings.served_model_dir)
    engine: Engine
    if settings.engine == "vllm":
        from serving.vllm_engine import VLLMEngine  # heavy and optional: imported only when asked for

        engine = VLLMEngine(max_model_len=settings.max_model_len)
    elif settings.engine == "process":
        from serving.engine_process import ProcessEngine

        engine = ProcessEngine(
            max_batch=settings.max_batch,
            max_model_len=settings.max_model_len,
            threads=settings.torch_threads or serving_threads(),
            seed=settings.seed,
            nice=settings.engine_nice,
        )
    else:
        from serving.engine import EmbeddedEngine

        engine = EmbeddedEngine(
            max_batch=settings.max_batch,
            max_model_len=settings.max_model_len,
            threads=settings.torch_threads or 1,
            seed=settings.seed,
        )
    if serve_checkpoint:
        engine.add_version(folder.name, folder, default=True)
    return engine


def report_watermarks(gw: Gateway, stop: threading.Event) -> None:
    """Every heartbeat, this gateway's bus watermark into the registry (`registry.watermarks`): the
    receive time of its oldest feedback being accepted or record not yet on the bus, else now. A
    failed report is logged and retried at the next beat (the joiner waits meanwhile)."""
    producer = gateway_id_of(gw.settings)
    while True:
        now = time.time()  # first: what is stamped after this is at or above it
        mark = min(x for x in (now, gw.in_flight.oldest(), gw.bus.pending_since()) if x is not None)
        try:
            gw.registry.report_watermark(producer, mark)
            gw.metrics.bus_watermark_lag.set(max(0.0, now - mark))
        except Exception as e:
            log.warning("gateway: reporting the bus watermark failed: %r", e)
        if stop.wait(gw.settings.heartbeat_s):
            return


def create_app(
    settings: Settings | None = None,
    engine=None,
    bus: EventBus | None = None,
    index: CompletionIndex | None = None,
    registry: Registry | None = None,
    freeze_gc: bool = False,
    lending: LendingConfig | None = None,
    feedback_window_s: float | None = None,
) -> FastAPI:
    """`freeze_gc` (the `serve` process): once start-up is done, hide every object alive then from the
    garbage collector, so a full collection under load does not scan the model and modules."""
    settings = settings or get_settings()
    settings.check_production()
    owns_bus, owns_index = bus is None, index is None
    owns_registry = registry is None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        reg = registry if registry is not None else Registry(settings.db_url)
        # Built from the settings, the gateway runs replicas that follow the registry; an engine
        # passed in (tests, benchmarks) serves what it holds.
        fleet = None
        if engine is None:
            fleet = await asyncio.to_thread(
                GatewayFleet.start, settings, reg, lambda: build_engine(settings, serve_checkpoint=False), lending
            )
        eng = engine if fleet is None else fleet.engine
        try:
            bs = bus if bus is not None else open_bus(settings, f"gateway-{settings.gateway_id or settings.port}")
        except BaseException:
            if fleet is not None:  # nothing else will shut the engines (and their processes) down
                fleet.close()
            raise
        # Completion records go to the event bus (the joiner reads them there): fsynced to the embedded
        # log, or to the Kafka spool while the broker is away, and indexed, before the caller is answered.
        idx = index if index is not None else CompletionIndex(settings.completion_index_url)
        snk = CompletionSink(bs, idx)
        keys = KeyStore(settings.db_url)
        app.state.gateway = Gateway(settings, eng, snk, bs, idx, reg, keys, fleet)
        app.state.gateway.feedback_window_s = feedback_window_s
        snk.on_batch = lambda _n: app.state.gateway.metrics.record_batches.inc()
        stop_marks = threading.Event()
        marks = threading.Thread(
            target=report_watermarks, args=(app.state.gateway, stop_marks), name="bus-watermark", daemon=True
        )
        marks.start()
        log.info("gateway ready: versions %s, default %s", eng.versions, eng.default_version)
        if freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            stop_marks.set()
            marks.join(timeout=30)
            if fleet is not None:
                fleet.close()
            snk.close()  # before the bus and the index it writes to
            if owns_bus:
                bs.close()
            if owns_index:
                idx.close()
            if owns_registry:
                reg.close()
            keys.close()

    app = FastAPI(title="Flywheel gateway", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(feedback.router)
    app.include_router(admin.router)
    app.include_router(weights.router)
    dashboard.install(app, settings)

    # Inside the counter, so a body refused while it was read is counted as the 413 it got.
    app.add_middleware(errors.BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(RequestCounter, version_header=openai.VERSION_HEADER)

    @app.get("/healthz")
    async def healthz(gw: GatewayDep):
        ok = gw.engine.alive
        body = {
            "status": "ok" if ok else "engine_down",
            "versions": gw.engine.versions,
            "default_version": gw.engine.default_version,
            "time": time.time(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=[MetricsReader])
    async def metrics(gw: GatewayDep):
        services = await asyncio.to_thread(read_folder, gw.settings.home / "metrics")  # joiner, learner, gate
        if gw.fleet is not None and gw.fleet.lending is not None:
            gw.metrics.set_lending(gw.fleet.lending.manager.states, gw.fleet.lending.counters())
        return Response(gw.metrics.render() + services, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(
    settings: Settings | None = None, lending: LendingConfig | None = None, feedback_window_s: float | None = None
) -> None:
    """The gateway under uvicorn; `lending`: the config file's `[lending]` section, `feedback_window_s`
    its `rewards.window_s + rewards.grace_s` (`cli` reads them): feedback received later than that after its
    completion is not recorded (`window_closed` in the answer)."""
    import uvicorn

    settings = settings or get_settings()
    uvicorn.run(
        create_app(settings, freeze_gc=True, lending=lending, feedback_window_s=feedback_window_s),
        host=settings.host,
        port=settings.port,
        http=CoalescedHttpTools,  # a response's headers and body in one send (api/transport.py)
        log_level="info",
        access_log=settings.access_log,
    )
