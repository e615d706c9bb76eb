"""What the prefill and decode workers share at run time: engine construction, the gRPC and
metrics servers, the stats message, the running-worker handle and the run-until-signal loop.
(Their flags live in the torch-free ``worker_options``.)

Worker start-up (both roles):
  1. ``main.py`` parses flags into :class:`WorkerOptions` (``worker_options``).
  2. Load the model (and its tokenizer when it has one) and build the :class:`LLMEngine`.
  3. The role starts its engine loop, its transfer machinery, the gRPC server and the metrics
     endpoint, and returns a handle.
  4. :func:`serve_until_signal` waits for SIGINT / SIGTERM, then stops the handle gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import ModelLoadError
from services.common.grpc_server import GrpcServerHandle, ServicerSpec, start_grpc_server
from services.common.metrics import MetricsHttpServer, TandemMetrics, serve_metrics_http
from services.common.model_source import ModelSource
from services.common.pb import common_pb2
from services.engine.core.engine import LLMEngine
from services.engine.core.loaders import LoadedModel, load_model, parse_dtype
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.engine_stats import EngineStats
from services.engine.runtime.output_text import OutputText
from services.engine.runtime.worker_options import WorkerOptions
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Closable(Protocol):
    """The role object of a worker (PrefillWorker, DecodeWorker): frees what it holds."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class WorkerHandle:
    """A running worker: its gRPC server, engine loop, role object and metrics endpoint."""

    role: str
    server: GrpcServerHandle
    engine_loop: EngineLoop
    worker: Closable
    metrics: TandemMetrics
    metrics_http: MetricsHttpServer | None
    address: str

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds, then are cancelled and free what
        they hold), free every lease / parked transfer, stop the engine thread."""
        await self.server.stop(grace)
        await self.worker.close()
        await self.engine_loop.stop()
        if self.metrics_http is not None:
            await self.metrics_http.close()
        logger.info("%s worker stopped", self.role)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The model's tokenizer (for stop strings, EOS ids and text), or None when it has none."""
    try:
        return Tokenizer.load(source)
    except ModelLoadError as err:
        logger.info("serving without a tokenizer (token ids only): %s", err.message)
        return None


def build_engine(
    options: WorkerOptions,
    *,
    loaded: LoadedModel | None = None,
    tokenizer: Tokenizer | None = None,
    load_tokenizer_too: bool = True,
) -> tuple[LLMEngine, OutputText | None]:
    """Load the model (unless ``loaded`` is given) and build an engine from ``options``, with
    the tokenizer's EOS ids, and the text of its outputs (None without a tokenizer: ids only)."""
    if loaded is None:
        loaded = load_model(options.model, parse_dtype(options.dtype), options.device)
    if tokenizer is None and load_tokenizer_too:
        tokenizer = load_tokenizer(loaded.source)
    eos = tokenizer.eos_token_ids if tokenizer is not None else None
    engine = LLMEngine(loaded, options.engine_config(), eos_token_ids=eos)
    return engine, OutputText(tokenizer) if tokenizer is not None else None


def worker_stats(
    stats: EngineStats, *, role: str, worker_id: str, address: str, extra_waiting: int = 0
) -> common_pb2.WorkerStats:
    """The ``GetStats`` answer for an engine snapshot."""
    return common_pb2.WorkerStats(
        worker_id=worker_id,
        role=role,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting + extra_waiting,
        kv_blocks_total=stats.num_blocks_total,
        kv_blocks_in_use=stats.num_blocks_in_use,
        kv_blocks_free=stats.num_blocks_free,
        kv_cache_usage=stats.kv_cache_usage,
        block_size=stats.block_size,
        address=address,
    )


async def start_serving(
    role: str,
    options: WorkerOptions,
    *,
    engine_loop: EngineLoop,
    worker: Closable,
    servicers: list[ServicerSpec],
    metrics: TandemMetrics,
) -> WorkerHandle:
    """Start the gRPC server (health + reflection) and the metrics endpoint for a worker whose
    engine loop already runs; on failure everything started here and before is stopped."""
    try:
        server = await start_grpc_server(servicers, host=options.host, port=options.port)
    except BaseException:
        await worker.close()
        await engine_loop.stop()
        raise
    address = options.advertise_address or server.address
    handle = WorkerHandle(role, server, engine_loop, worker, metrics, None, address)
    if options.metrics_port is not None:
        try:
            handle.metrics_http = await serve_metrics_http(metrics, options.host,
                                                           options.metrics_port)
        except BaseException:
            await handle.stop(0)
            raise
    logger.info("%s worker %s serving on %s", role, options.worker_id, address)
    return handle


async def serve_until_signal(stop: Callable[[], Awaitable[None]]) -> None:
    """Wait for SIGINT or SIGTERM (or the task being cancelled), then ``await stop()``."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
        logger.info("signal received; stopping")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await stop()
