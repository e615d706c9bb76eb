"""One worker runtime for every role: engine construction, start-up, the gRPC and metrics
servers, the running-worker handle and the run-until-signal loop. A role (prefill, decode)
supplies only what is its own: its worker object and servicer (``worker_servicer``), built
around the shared engine loop. (Flags live in the torch-free ``worker_options``.)

Worker start-up (:func:`start_worker`, every role):
  1. ``main.py`` parses flags into :class:`WorkerOptions` (``worker_options``).
  2. On the engine thread (``EngineLoop.build_and_start``, which says why): load the model (and
     its tokenizer when it has one), build the :class:`LLMEngine`, then run the engine loop.
  3. The role builds its worker (transfer machinery) and servicer; then
     the gRPC server (the role's service plus ``PrefixCache``, the prefix-cache feed KV-aware
     routers watch) and the metrics endpoint; return a handle.
  4. :func:`run_worker` / :func:`serve_until_signal` wait for SIGINT / SIGTERM, then stop the
     handle gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.core_share import CoreShare
from services.common.cpu_list import format_cpus
from services.common.errors import InvalidArgumentError, ModelLoadError
from services.common.grpc_server import AddServicerFn, GrpcServerHandle, ServicerSpec, start_grpc_server
from services.common.metrics import MetricsHttpServer, TandemMetrics, serve_metrics_http
from services.common.model_source import ModelSource
from services.common.pb import prefix_cache_pb2_grpc
from services.engine.core.engine import LLMEngine
from services.engine.core.grammar import GrammarCompiler
from services.engine.core.kernels.native_build import build_ahead
from services.engine.core.loaders import LoadedModel, load_model, parse_dtype
from services.engine.core.speculative import SpeculativeConfig
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.output_text import OutputText
from services.engine.runtime.prefix_cache_feed import PrefixCacheFeed
from services.engine.runtime.prefix_cache_servicer import SERVICE_NAME as PREFIX_CACHE_SERVICE
from services.engine.runtime.prefix_cache_servicer import PrefixCacheServicer
from services.engine.runtime.worker_servicer import RoleWorker, WorkerServicer
from services.engine.runtime.worker_options import WorkerOptions
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Closable(Protocol):
    """The role object of a worker (PrefillWorker, DecodeWorker): frees what it holds."""

    async def close(self) -> None: ...


RoleParts = tuple[RoleWorker, WorkerServicer, AddServicerFn, str]
"""What a role adds around the shared engine loop: its worker object, its servicer, the
generated ``add_XServicer_to_server`` and the full gRPC service name."""


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
    prefix_feed: PrefixCacheFeed | None = None

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds, then are cancelled and free what
        they hold), free every lease / parked transfer, stop the engine thread. Prefix-cache
        watchers are ended first: their streams never finish on their own."""
        if self.prefix_feed is not None:
            self.prefix_feed.close()
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
    if options.threads is not None:
        if options.threads < 1:
            raise InvalidArgumentError("--threads must be >= 1", param="threads")
        torch.set_num_threads(options.threads)  # before this thread opens a parallel region
    if loaded is None:
        loaded = load_worker_model(options)
    if tokenizer is None and load_tokenizer_too:
        tokenizer = load_tokenizer(loaded.source)
    eos = (tokenizer.eos_token_ids or None) if tokenizer is not None else None  # none: the model's
    grammars = GrammarCompiler.create(
        tokenizer.to_json() if tokenizer is not None else None, loaded.config.vocab_size,
        eos or loaded.config.eos_token_ids,
    )  # fmt: skip
    draft = load_draft(options.speculative, loaded, tokenizer, options.device)
    engine = LLMEngine(loaded, options.engine_config(), eos_token_ids=eos, grammars=grammars,
                       draft=draft)  # fmt: skip
    return engine, OutputText(tokenizer) if tokenizer is not None else None


def load_worker_model(options: WorkerOptions) -> LoadedModel:
    """The worker's model: whole, or with ``--tensor-parallel-size N`` this process's shard as
    rank 0 of N, the followers started (pinned to disjoint runs of ``--cpus`` or of the cores this
    thread may use; they exit with this process). A ``--speculative draft`` model is not split:
    :func:`load_draft` loads it whole in this process, where it runs on rank 0's cores while the
    target is split (docs/tensor-parallel.md)."""
    width = options.tensor_parallel_size
    if width == 1:
        return load_model(options.model, parse_dtype(options.dtype), options.device)
    from services.engine.core.tp_follower import ShardSource, start_tensor_parallel

    source = ShardSource(options.model, parse_dtype(options.dtype), options.device)
    loaded = start_tensor_parallel(source, width, cores=options.cpus)
    logger.info("model split over %d tensor-parallel ranks (this process is rank 0)", width)
    return loaded


def load_draft(spec: SpeculativeConfig | None, target: LoadedModel, tokenizer: Tokenizer | None,
               device: str) -> LoadedModel | None:  # fmt: skip
    """The draft model of ``--speculative draft`` (None for any other method), refused with
    InvalidArgumentError unless its tokenizer's vocabulary is the served model's token for
    token."""
    if spec is None or spec.method != "draft" or spec.draft_model is None:
        return None
    draft = load_model(spec.draft_model, parse_dtype(spec.draft_dtype), device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidArgumentError(
            f"--draft-model {spec.draft_model} has {draft.config.vocab_size} tokens, the served "
            f"model {target.config.vocab_size}: a draft model must share the tokenizer",
            param="draft_model")
    draft_tokenizer = load_tokenizer(draft.source) if tokenizer is not None else None
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.vocabulary() != draft_tokenizer.vocabulary():
            raise InvalidArgumentError(
                f"--draft-model {spec.draft_model}'s vocabulary differs from the served model's "
                "(same size, other tokens): a draft model must share the tokenizer",
                param="draft_model")
    logger.info("speculative decoding with draft model %s (%s)", draft.source.name, draft.weight_format)
    return draft


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
        if not options.grace >= 0:
            raise InvalidArgumentError("--grace must be >= 0", param="grace")
        server = await start_grpc_server(servicers, host=options.host, port=options.port,
                                         grace=options.grace, tls=options.internal_tls(),
                                         health_port=options.health_port)  # fmt: skip
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


async def start_worker(
    role: str,
    options: WorkerOptions,
    build_role: Callable[[EngineLoop, TandemMetrics], RoleParts],
    *,
    loaded: LoadedModel | None = None,
    tokenizer: Tokenizer | None = None,
    metrics: TandemMetrics | None = None,
    with_text: bool = False,
) -> WorkerHandle:
    """Start a worker of ``role`` in this process, the same way for every role: load the model
    (and tokenizer), start the engine thread (with the output text when ``with_text``), let
    ``build_role`` make the role's worker and servicer around it, then serve gRPC and metrics."""
    options.internal_tls()  # no identity: refuse before the model loads
    metrics = metrics or TandemMetrics()
    if options.cpus is not None:
        pin_this_thread(options.cpus)  # the engine thread, started below, inherits it

    if options.device == "cpu" and loaded is None:
        # Without prebuilt kernels the model's first uses compile them one by one: keep a second
        # compiler busy meanwhile (with them, this only looks). Not torch work: its own thread.
        threading.Thread(target=build_ahead, name="kernel-build", daemon=True).start()

    def build() -> tuple[LLMEngine, OutputText | None]:
        engine, text = build_engine(options, loaded=loaded, tokenizer=tokenizer)
        return engine, text if with_text else None

    try:
        share = CoreShare.from_env()  # tandem up's shared cores (cpu_plan.py), or None
    except OSError as err:  # its file: a worker still serves, with its own team every step
        logger.warning("cores not shared with co-located workers: %s", err)
        share = None
    engine_loop = await EngineLoop.build_and_start(
        build, metrics=metrics, name=f"engine-{options.worker_id or role}",
        step_scope=team_scope(share) if share is not None else None,
    )
    metrics.kv_blocks_total.set(engine_loop.engine.block_manager.num_blocks)
    threads = await engine_loop.call(lambda engine: torch.get_num_threads())
    where = format_cpus(options.cpus) if options.cpus is not None else "any core"
    logger.info("engine: %d intra-op threads on %s", threads, where)
    try:
        worker, servicer, add_servicer, service_name = build_role(engine_loop, metrics)
    except BaseException:
        await engine_loop.stop()
        raise
    worker.start()
    feed = PrefixCacheFeed(engine_loop)
    await feed.attach()
    prefix_servicer = PrefixCacheServicer(
        feed, worker_id=options.worker_id or role,
        block_size=engine_loop.engine.block_manager.block_size,
    )  # fmt: skip
    handle = await start_serving(
        role, options, engine_loop=engine_loop, worker=worker, metrics=metrics,
        servicers=[(add_servicer, servicer, service_name),
                   (prefix_cache_pb2_grpc.add_PrefixCacheServicer_to_server, prefix_servicer,
                    PREFIX_CACHE_SERVICE)],
    )  # fmt: skip
    handle.prefix_feed = feed
    servicer.address = handle.address
    report_unhealthy(engine_loop, handle.server)
    return handle


def report_unhealthy(engine_loop: EngineLoop, server: GrpcServerHandle) -> None:
    """Once an engine step fails, report the worker NOT_SERVING to gRPC health checks, so the
    gateway's router takes it out of rotation (its failed streams migrate: ``engine_loop``)."""
    loop = asyncio.get_running_loop()

    def unhealthy(reason: str) -> None:  # on the engine thread
        logger.error("worker unhealthy (%s): reporting NOT_SERVING", reason)
        try:
            asyncio.run_coroutine_threadsafe(server.set_serving(False), loop)
        except RuntimeError:  # the event loop is closed: the worker is stopping anyway
            pass

    engine_loop.on_unhealthy(unhealthy)


def team_scope(share: CoreShare) -> Callable[[], contextlib.AbstractContextManager[int]]:
    """Each engine step in ``share.stepping``: PyTorch's (and so the native kernels') threads set
    to the team the step takes, at most the worker's own count (read at its first step, on the
    engine thread, after ``build_engine`` set it)."""
    wanted = current = 0

    def set_threads(team: int) -> None:
        nonlocal current
        if team != current:
            torch.set_num_threads(team)
            current = team

    def scope() -> contextlib.AbstractContextManager[int]:
        nonlocal wanted, current
        if not wanted:
            wanted = current = torch.get_num_threads()
        return share.stepping(wanted, set_threads)

    return scope


def pin_this_thread(cpus: tuple[int, ...]) -> None:
    """Restrict the calling thread (and the threads it starts later) to ``cpus``."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, ValueError) as err:
        raise InvalidArgumentError(f"cannot pin to cpus {format_cpus(cpus)}: {err}",
                                   param="cpus") from err


UNHEALTHY_EXIT_CODE = 70  # EX_SOFTWARE: the engine's state can no longer be trusted
UNHEALTHY_LINGER_S = 2.0  # how long an unhealthy worker keeps answering NOT_SERVING before exiting


def run_worker(start: Callable[[], Awaitable[WorkerHandle]]) -> int:
    """A worker process's life (``tandem serve prefill|decode``): start, serve until SIGINT /
    SIGTERM, stop gracefully. A worker whose engine step failed (``EngineLoop`` turned unhealthy:
    its streams were failed over to other workers, it reports NOT_SERVING) exits with
    :data:`UNHEALTHY_EXIT_CODE` a moment later, so whatever supervises it — ``tandem up``'s
    launcher, compose's restart policy, Kubernetes — starts a fresh one."""
    code = 0

    async def serve() -> None:
        nonlocal code
        handle = await start()
        loop = asyncio.get_running_loop()
        unhealthy = asyncio.Event()
        handle.engine_loop.on_unhealthy(lambda _reason: loop.call_soon_threadsafe(unhealthy.set))

        async def exit_when_unhealthy() -> None:
            nonlocal code
            await unhealthy.wait()
            await asyncio.sleep(UNHEALTHY_LINGER_S)  # health checks see NOT_SERVING first
            logger.error("exiting with %d: an engine step failed (see above)", UNHEALTHY_EXIT_CODE)
            code = UNHEALTHY_EXIT_CODE
            signal.raise_signal(signal.SIGTERM)  # the usual graceful stop

        watcher = asyncio.create_task(exit_when_unhealthy())
        try:
            await serve_until_signal(handle.stop)
        finally:
            watcher.cancel()

    asyncio.run(serve())
    return code


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
