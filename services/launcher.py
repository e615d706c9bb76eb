"""``tandem up``: the whole system as local processes, one command, no Docker.

Starts the tokenizer, ``--prefill N`` prefill workers, ``--decode M`` decode workers and (unless
``--no-gateway``, and when ``services/gateway/main.py`` exists) the HTTP gateway, each as a child
``python -m services serve <service> ...`` with its own ports, and supervises them.

Default ports (from ``services/common/ports.py``; the ``--*-port`` flags move them):

==============  ===================================  =============================
process         serves                               Prometheus ``/metrics``
==============  ===================================  =============================
gateway         HTTP 8000 (``--gateway-port``)       9102 (``--gateway-metrics-port``)
tokenizer       gRPC 50051 (``--tokenizer-port``)    9101 (``--tokenizer-metrics-port``)
prefill ``i``   gRPC 50061 + i (``--prefill-port``)  9111 + i (``--prefill-metrics-port``)
decode ``i``    gRPC 50071 + i (``--decode-port``)   9121 + i (``--decode-metrics-port``)
==============  ===================================  =============================

With the defaults, up to 10 workers per role fit; more need bases far enough apart (overlapping
ports are refused before anything starts).

Internal gRPC is mutual TLS with no setup: at start the launcher makes a throwaway CA and one
certificate per role (``services/common/cert_authority.py``, the ``cryptography`` package) in a
private temporary directory (mode 0700, keys 0600; the CA's key is never written), passes each
child its role's files, checks readiness with an ``operator`` certificate of its own, and removes
the directory when it exits. ``--certs DIR`` uses a directory ``tandem certs init DIR`` wrote
instead; ``--insecure-internal`` runs every hop in plaintext (a loud warning; never a default).

Lifecycle:
  1. Plan every child (command line, ports, addresses; ``launch_plan.py``) and refuse
     overlapping or busy ports with a one-line error, before anything starts.
  2. Start every child (``child_process.py``) in its own session / process group (a Ctrl-C in
     the terminal reaches only the launcher), with ``PR_SET_PDEATHSIG`` on Linux so that a child
     is killed even when the launcher itself is SIGKILLed. Children log to the launcher's stderr; its stdout carries only
     the address table.
  3. Wait until every gRPC service reports SERVING through ``grpc.health.v1`` and the gateway
     answers ``GET /ready`` with 200 and every worker it lists healthy (reachable from the
     gateway, not only from here; ``/health`` alone is mere liveness). A child exiting meanwhile, or
     ``--startup-timeout`` passing, stops everything with a one-line error (exit 2).
  4. Write the CPU plan, the address table and ``ready`` to stdout, then supervise.
  5. A child that dies after start-up is logged by name and started again with the same command
     line after a backoff (1 s, doubling per crash up to 30 s; back to 1 s once it has run for a
     minute), like a container restart policy. The gateway routes to a restarted worker again
     once its health check reports SERVING. ``--no-restart`` instead stops everything and exits
     1 on the first death.
  6. SIGINT / SIGTERM (also during a backoff): SIGTERM every child at once (in reverse start
     order), give them ``--stop-timeout`` seconds, SIGKILL what is left (the whole process group
     of each child), exit 0. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from services.child_process import Child, die_with_parent, signal_group, start_child
from services.common import ports
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.internal_tls import INSECURE_WARNING, InternalTls
from services.common.pooling_config import POOLING_MODES
from services.cpu_plan import parse_threads, usable_cpus
from services.engine.core.speculative import SPECULATIVE_METHODS
from services.engine.runtime.worker_options import KV_CACHE_DTYPE_CHOICES, KV_TRANSPORTS
from services.launch_plan import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    MODES,
    LaunchConfig,
    check_ports_free,
    plan,
)

logger = logging.getLogger(__name__)

MODEL_ENV = "TANDEM_MODEL"
_POLL_S = 0.1
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, longest delay
RESTART_RESET_S = 60.0  # a child that ran this long restarts after the first delay again


# ------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem up``."""
    add = parser.add_argument
    add("--model", default=None,
        help=f"default | PATH to a .gguf file or HF folder | dummy:<shape> (env {MODEL_ENV})")
    add("--mode", choices=MODES, default="disaggregated",
        help="disaggregated (default): prefill and decode pools, the gateway sending long "
             "prompts to prefill workers and prefilling short ones on their decode worker | "
             "colocated: decode workers only, each prefilling its own prompts")
    add("--prefill", type=int, default=None, metavar="N",
        help="prefill workers (default 1; 0 with --mode colocated)")
    add("--decode", type=int, default=1, metavar="M",
        help="decode workers (default 1; 0 for an embedding model: its prefill workers serve "
             "/v1/embeddings alone)")
    add("--threads", action="append", default=[], metavar="ROLE=N",
        help="intra-op threads per prefill / decode worker, e.g. --threads decode=2 "
             "(default: planned from the cores, see services/cpu_plan.py)")
    add("--gateway", action=argparse.BooleanOptionalAction, default=True,
        help="also start the HTTP gateway (default: yes, when it is installed)")
    add("--host", default="127.0.0.1",
        help="interface every service binds (default 127.0.0.1; 0.0.0.0 exposes them)")
    add("--gateway-port", type=int, default=ports.GATEWAY_HTTP_PORT)
    add("--gateway-metrics-port", type=int, default=ports.GATEWAY_METRICS_PORT,
        help="the gateway's Prometheus /metrics port (default 9102; not the API's port)")
    add("--tokenizer-port", type=int, default=ports.TOKENIZER_GRPC_PORT)
    add("--tokenizer-metrics-port", type=int, default=ports.TOKENIZER_METRICS_PORT)
    add("--prefill-port", type=int, default=ports.PREFILL_GRPC_PORT_BASE,
        help="gRPC port of prefill worker 0; worker i gets this + i")
    add("--prefill-metrics-port", type=int, default=ports.PREFILL_METRICS_PORT_BASE)
    add("--decode-port", type=int, default=ports.DECODE_GRPC_PORT_BASE,
        help="gRPC port of decode worker 0; worker i gets this + i")
    add("--decode-metrics-port", type=int, default=ports.DECODE_METRICS_PORT_BASE)
    add("--dtype", default=None,
        help="worker weight dtype: auto | float32 | bfloat16 | float16 | q8_0 | q4 (default auto)")
    add("--device", default=None,
        help="device of every prefill and decode worker: auto | cpu | cuda | cuda:N (default "
             "auto: the workers' own default, env TANDEM_DEVICE)")
    add("--kv-cache-gib", type=float, default=None, help="KV cache size of each worker")
    add("--num-blocks", type=int, default=None, help="KV blocks of each worker")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default=None,
        help="KV cache dtype of every prefill and decode worker: auto | float32 | bfloat16 | "
             "float16 | q8_0 (CPU) | fp8 (CUDA) (default: the workers' own, auto)")
    add("--kv-transport", choices=KV_TRANSPORTS, default=None,
        help="how KV payloads travel from prefill to decode, passed to every worker: grpc | "
             "distributed (a torch.distributed pair group; Gloo on CPU) | cuda-ipc (CUDA "
             "workers sharing a GPU) | auto (the workers' default: cuda-ipc on CUDA, gRPC on "
             "CPU)")
    add("--tensor-parallel-size", type=int, default=1, metavar="N",
        help="split each prefill and decode worker's model over N ranks (processes) on its "
             "cores (or N GPUs); default 1 (docs/tensor-parallel.md)")
    add("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
        help="prefill workers' width, when it differs from --tensor-parallel-size (wide "
             "prefill, narrow decode)")
    add("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
        help="decode workers' width, when it differs from --tensor-parallel-size")
    add("--speculative", choices=SPECULATIVE_METHODS, default=None,
        help="speculative decoding on every decode worker: ngram (prompt lookup; greedy and "
             "seeded output unchanged). Default: off")
    add("--num-speculative-tokens", type=int, default=None, metavar="K",
        help="most draft tokens per sequence and step (the workers' default: 8)")
    add("--draft-model", default=None, metavar="MODEL",
        help="the draft model of --speculative draft (same vocabulary as --model)")
    add("--worker-args", default="", metavar="ARGS",
        help="more flags for every prefill and decode worker, one shell-quoted string")
    add("--gateway-args", default="", metavar="ARGS",
        help="more flags for the gateway, one shell-quoted string")
    add("--pooling", choices=POOLING_MODES, default=None,
        help="how the prefill workers pool /v1/embeddings: last | mean (default: the model "
             "folder's sentence-transformers config, else last)")
    add("--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template file the tokenizer renders chats with instead of the "
             "model's own")
    add("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
        help=f"seconds to wait for every service (default {DEFAULT_STARTUP_TIMEOUT_S:g})")
    add("--restart", action=argparse.BooleanOptionalAction, default=True,
        help="restart a child that dies after start-up, with backoff (default); --no-restart "
             "stops everything on the first death")
    add("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S,
        help=f"seconds children get to stop before SIGKILL (default {DEFAULT_STOP_TIMEOUT_S:g})")
    add("--certs", default=None, metavar="DIR",
        help="internal mutual TLS from a directory `tandem certs init DIR` wrote (default: a "
             "throwaway CA and certificates made at start, removed at exit)")
    add("--insecure-internal", action="store_true",
        help="plaintext, unauthenticated gRPC between the services: NOT for any shared network")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tandem up``."""
    colocated = args.mode == "colocated"
    config = LaunchConfig(
        model=args.model or os.environ.get(MODEL_ENV) or "default",
        mode=args.mode,
        num_prefill=args.prefill if args.prefill is not None else 0 if colocated else 1,
        num_decode=args.decode,
        gateway=args.gateway,
        host=args.host,
        gateway_port=args.gateway_port,
        gateway_metrics_port=args.gateway_metrics_port,
        tokenizer_port=args.tokenizer_port,
        tokenizer_metrics_port=args.tokenizer_metrics_port,
        prefill_port=args.prefill_port,
        prefill_metrics_port=args.prefill_metrics_port,
        decode_port=args.decode_port,
        decode_metrics_port=args.decode_metrics_port,
        dtype=args.dtype,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib,
        num_blocks=args.num_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_transport=args.kv_transport,
        pooling=args.pooling,
        speculative=_speculative_flags(args),
        worker_args=tuple(shlex.split(args.worker_args)),
        gateway_args=tuple(shlex.split(args.gateway_args)),
        chat_template=os.path.abspath(args.chat_template) if args.chat_template else None,
        log_level=getattr(args, "log_level", "INFO"),
        threads=tuple(parse_threads(args.threads).items()),
        startup_timeout=args.startup_timeout,
        stop_timeout=args.stop_timeout,
        restart=args.restart,
        tls_dir=args.certs,
        insecure_internal=args.insecure_internal,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
    )
    if config.insecure_internal and config.tls_dir:
        raise InvalidArgumentError("--certs and --insecure-internal exclude each other",
                                   param="insecure_internal")  # fmt: skip
    return asyncio.run(Launcher(config).run())


def _speculative_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The decode workers' flags for ``--speculative`` / ``--num-speculative-tokens``."""
    if args.speculative is None:
        if args.num_speculative_tokens is not None or args.draft_model is not None:
            raise InvalidArgumentError("--num-speculative-tokens and --draft-model need "
                                       "--speculative", param="speculative")  # fmt: skip
        return ()
    flags = ["--speculative", args.speculative]
    if args.draft_model is not None:
        flags += ["--draft-model", args.draft_model]
    if args.num_speculative_tokens is not None:
        flags += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    return tuple(flags)


# ------------------------------------------------------------------------------------- supervisor


class Launcher:
    """Starts, watches and stops the children of one ``tandem up`` (the module lifecycle)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self._stop_requested = asyncio.Event()  # SIGINT / SIGTERM
        self._kill_now = asyncio.Event()  # a second signal: skip the grace period
        self._not_ready: set[str] = set()
        self._preexec: Callable[[], None] | None = None
        self._tls = InternalTls.plaintext()  # the launcher's own (operator) identity
        self._own_certs: str | None = None  # the throwaway directory, removed at exit
        self._own_share: str | None = None  # the shared-cores file's directory, removed at exit

    async def run(self) -> int:
        """The whole lifecycle; returns the exit code or raises a one-line TandemError."""
        plan(self.config)  # a bad configuration fails before any certificate is made
        try:
            self.config = self._with_certs(self.config)
            self._own_share = tempfile.mkdtemp(prefix="tandem-up-cores-")
            self.config = replace(self.config, core_share=os.path.join(self._own_share, "cores"))
            specs = plan(self.config)
            check_ports_free(specs, self.config.host)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            try:
                self._preexec = die_with_parent()
                for spec in specs:
                    self.children.append(start_child(spec, self._preexec))
                return await self._supervise()
            finally:
                await self._stop_all()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
        finally:
            for own in (self._own_certs, self._own_share):
                if own is not None:
                    shutil.rmtree(own, ignore_errors=True)
            self._own_certs = self._own_share = None

    def _with_certs(self, config: LaunchConfig) -> LaunchConfig:
        """``config`` with a certificate directory (a throwaway one unless ``--certs`` named
        one) and the launcher's own identity loaded; plaintext with ``--insecure-internal``."""
        if config.insecure_internal:
            logger.warning(INSECURE_WARNING)
            return config
        if config.tls_dir is None:
            from services.common.cert_authority import write_deployment_certs

            self._own_certs = tempfile.mkdtemp(prefix="tandem-up-certs-")  # mode 0700
            write_deployment_certs(Path(self._own_certs))
            logger.info("internal mutual TLS: throwaway CA and certificates in %s",
                        self._own_certs)  # fmt: skip
            config = replace(config, tls_dir=self._own_certs)
        from services.common.cert_authority import role_files

        cert, key, ca = role_files(Path(config.tls_dir or ""), "operator")
        self._tls = InternalTls.from_files(cert, key, ca)
        return config

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop_requested.is_set():
            logger.warning("%s again: killing every child now", sig.name)
            self._kill_now.set()
        else:
            logger.info("%s: stopping every service", sig.name)
            self._stop_requested.set()

    async def _supervise(self) -> int:
        stop_task = asyncio.create_task(self._stop_requested.wait())
        death_task = asyncio.create_task(self._first_death())
        ready_task = asyncio.create_task(self._wait_ready())
        try:
            done, _ = await asyncio.wait(
                {stop_task, death_task, ready_task},
                timeout=self.config.startup_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if stop_task in done:
                return 0
            if death_task in done:
                child = death_task.result()
                raise UnavailableError(
                    f"{child.spec.name} (pid {child.pid}) {child.describe_exit()} while starting "
                    "(its log is above); stopped everything"
                )
            if ready_task not in done:
                waiting = ", ".join(sorted(self._not_ready)) or "?"
                raise UnavailableError(
                    f"not ready after {self.config.startup_timeout:g}s (still waiting for "
                    f"{waiting}); stopped everything"
                )
            ready_task.result()
            self._print_table()
            while True:
                done, _ = await asyncio.wait(
                    {stop_task, death_task}, return_when=asyncio.FIRST_COMPLETED
                )
                if stop_task in done:
                    return 0
                child = death_task.result()
                if not self.config.restart:
                    logger.error(
                        "%s (pid %d) %s unexpectedly; stopping the other services",
                        child.spec.name, child.pid, child.describe_exit(),
                    )  # fmt: skip
                    return 1
                if not await self._restart(child):
                    return 0  # a stop signal came during the backoff
                death_task = asyncio.create_task(self._first_death())
        finally:
            for task in (stop_task, death_task, ready_task):
                task.cancel()
            await asyncio.gather(stop_task, death_task, ready_task, return_exceptions=True)

    async def _restart(self, child: Child) -> bool:
        """Start ``child``'s command again after its backoff; False when a stop signal came
        first (then nothing is started)."""
        ran = time.monotonic() - child.started
        crashes = 1 if ran >= RESTART_RESET_S else child.crashes + 1
        first, longest = RESTART_BACKOFF_S
        delay = min(longest, first * 2 ** (crashes - 1))
        logger.error(
            "%s (pid %d) %s unexpectedly after %.0fs; restarting it in %gs (crash %d in a row)",
            child.spec.name, child.pid, child.describe_exit(), ran, delay, crashes,
        )  # fmt: skip
        try:
            await asyncio.wait_for(self._stop_requested.wait(), delay)
            return False
        except TimeoutError:
            pass
        new = start_child(child.spec, self._preexec)
        new.crashes = crashes
        self.children[self.children.index(child)] = new
        logger.info("restarted %s (pid %d)", new.spec.name, new.pid)
        return True

    async def _first_death(self) -> Child:
        """The first child that exits (polling: Popen objects have no awaitable exit)."""
        while True:
            for child in self.children:
                if child.process.poll() is not None:
                    return child
            await asyncio.sleep(_POLL_S)

    async def _wait_ready(self) -> None:
        self._not_ready = {child.spec.name for child in self.children}

        async def one(child: Child) -> None:
            if child.spec.grpc_service is not None:
                from services.common.grpc_channel import wait_healthy

                await wait_healthy(
                    child.spec.address,
                    child.spec.grpc_service,
                    tls=self._tls,
                    timeout=self.config.startup_timeout,
                    poll_interval=0.25,
                )
            else:
                # /health is liveness only; /ready also means the gateway reached every backend.
                url = f"{child.spec.address}/ready"
                # with API keys on, /ready shows its workers only to a caller with a key
                keys = os.environ.get("TANDEM_API_KEYS", "").split(",")
                key = next((k.strip() for k in keys if k.strip()), None)
                await _wait_gateway_ready(url, self.config.startup_timeout, api_key=key)
            self._not_ready.discard(child.spec.name)
            logger.info("%s is ready at %s", child.spec.name, child.spec.address)

        await asyncio.gather(*(one(child) for child in self.children))

    def _print_table(self) -> None:
        rows = [("service", "address", "metrics", "pid")]
        rows += [
            (c.spec.name, c.spec.address, c.spec.metrics_url, str(c.pid)) for c in self.children
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
            for row in rows
        ]
        placed = [f"  {c.spec.name}: {c.spec.placement.describe()}"
                  for c in self.children if c.spec.placement is not None]  # fmt: skip
        head = [f"tandem up: model {self.config.model}, mode {self.config.mode}",
                f"cpu plan ({len(self.config.cpus or usable_cpus())} cores):", *placed]  # fmt: skip
        sys.stdout.write("\n".join([*head, *lines, "ready"]) + "\n")
        sys.stdout.flush()

    async def _stop_all(self) -> None:
        """SIGTERM every running child (last started first), wait, SIGKILL the rest; reap all."""
        running = [c for c in reversed(self.children) if c.process.poll() is None]
        for child in running:
            logger.info("stopping %s (pid %d)", child.spec.name, child.pid)
            signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout
        while any(c.process.poll() is None for c in running):
            if self._kill_now.is_set() or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        for child in self.children:
            if child.process.poll() is None:
                logger.warning(
                    "%s (pid %d) did not stop in time: SIGKILL", child.spec.name, child.pid
                )
            # Also catches anything a child started in its group and left behind.
            signal_group(child, signal.SIGKILL)
        for child in self.children:
            await asyncio.to_thread(child.process.wait)
        if self.children:
            logger.info("every service stopped")


async def _wait_gateway_ready(url: str, timeout: float, api_key: str | None = None) -> None:
    """Poll the gateway's ``GET url`` (``/ready``) until it answers 200 with every worker it
    lists healthy; UnavailableError after ``timeout`` seconds. ``api_key``: one of the
    gateway's keys, when it has any (``/ready`` lists its workers only to a caller with one; a
    gateway with keys from a file only is taken as ready at its bare 200).

    Every worker started here, not one per pool: a gateway whose channel to a slow-starting worker
    is still in reconnect backoff must not be "ready" while a request could need that worker (a
    migration, say)."""
    import aiohttp

    deadline = time.monotonic() + timeout
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while time.monotonic() < deadline:
            try:
                headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
                async with session.get(url, headers=headers) as response:
                    if response.status != 200:
                        last = f"HTTP {response.status}"
                    else:
                        body = await response.json(content_type=None)
                        waiting = [str(w.get("address")) for pool in ("prefill", "decode")
                                   for w in body.get(pool, []) if not w.get("healthy")]  # fmt: skip
                        if not waiting:
                            return
                        last = f"workers not yet reachable from the gateway: {', '.join(waiting)}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
                last = type(err).__name__
            await asyncio.sleep(0.25)
    raise UnavailableError(f"{url} did not answer 200 within {timeout:g}s (last: {last})")
