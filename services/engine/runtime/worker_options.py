"""The flags and options every engine worker (prefill, decode) shares. Torch-free: ``tandem``
builds every subcommand's parser, so importing this must stay cheap.

Environment variables supply defaults (``TANDEM_MODEL``, ``TANDEM_DTYPE``, ``TANDEM_DEVICE``,
``TANDEM_KV_CACHE_DTYPE``, ``TANDEM_KV_TRANSPORT``), read in :func:`add_worker_arguments` when
the parser is built, never at import.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.cpu_list import parse_cpus
from services.common.errors import InvalidArgumentError
from services.engine.core.speculative import SPECULATIVE_METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from services.common.internal_tls import InternalTls
    from services.engine.core.engine import EngineConfig

GIB = 1 << 30
DEFAULT_GRACE_SECONDS = 5.0
DEFAULT_MAX_STEP_MS = 500.0  # a stream's longest wait for a step beside a prompt (step_pacer.py)
# the names services.engine.core.loaders.DTYPE_CHOICES accepts (kept here: flag parsing imports no torch)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "q8_0", "q4", "q4_a8", "q4_a8_decode")
# the names services.engine.core.kv_cache.KV_CACHE_DTYPES accepts (kept here for the same reason)
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "q8_0", "fp8")
# --kv-transport: how a request's KV payload travels from prefill to decode (docs/kv-handoff.md)
KV_TRANSPORTS = ("grpc", "distributed", "cuda-ipc", "auto")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Flags shared by prefill and decode workers.

    Attributes:
        model: ``default``, a GGUF file, a Hugging Face folder or ``dummy:<shape>``.
        dtype: weight dtype: ``auto`` (the fastest the device supports: a GGUF's own quantized
            format on CPU, 4-bit ones as ``q4_a8``), ``float32``, ``bfloat16``, ``float16``,
            ``q8_0``, ``q4`` (float32 activations), ``q4_a8`` (q4 with int8 prompt activations;
            see ``services.engine.core.loaders``).
        device: ``cpu``, ``cuda``, ``cuda:N``; ``auto`` picks CUDA when available.
        host / port: where the gRPC server binds (port 0 picks a free one).
        metrics_port: Prometheus endpoint port; None serves no endpoint (tests).
        worker_id: stable id reported in stats and logs.
        advertise_address: ``host:port`` others should use; default the bound address.
        kv_cache_gib / num_blocks: KV pool size (``num_blocks`` wins when set).
        kv_cache_dtype: the KV pool's dtype, one of :data:`KV_CACHE_DTYPE_CHOICES`: ``auto`` (a
            16-bit cache for a float32 model on CPUs where the attention kernel reads it at least
            as fast, else the model's dtype), or a dtype (16-bit ones under a float32 model;
            ``q8_0``: int8 with a float16 scale per 32 values, float32 models on CPU only;
            ``fp8``: float8 e4m3, CUDA only).
            Prefill and decode workers must agree on it to hand KV over.
        block_size / max_num_seqs / max_batched_tokens / enable_prefix_caching: engine limits.
        max_step_ms: the time a step with decode rows gives prompt chunks at most (their tokens
            sized by the engine's measured speed: ``services/engine/core/step_pacer.py``);
            0 leaves the token budget alone.
        threads: intra-op threads of the engine (PyTorch and the native kernels); None keeps
            PyTorch's default (one per core it may run on).
        cpus: cores to pin the engine to; None runs anywhere.
        grace: seconds in-flight RPCs get to finish when the worker stops (SIGTERM): it first
            reports NOT_SERVING, so routers send it nothing new, and drains.
        kv_transport: how KV payloads travel, one of :data:`KV_TRANSPORTS` (see
            :func:`resolve_kv_transport`).
        enforce_eager: on CUDA, decode without CUDA graphs (``cuda_graphs.py``).
        tls: this worker's internal-TLS identity (``services/common/internal_tls.py``): its
            server and its channels to decode workers use it. None is not "plaintext": a worker
            refuses to start without one (``InternalTls.plaintext()`` is plaintext).
        health_port: also serve plaintext ``grpc.health.v1`` alone on this port (None: no).
        speculative: speculative decoding (``--speculative ngram`` and its knobs;
            ``services/engine/core/speculative.py``); None decodes one token per step.
        tensor_parallel_size: ranks (processes) the model is split over (docs/tensor-parallel.md):
            this process is rank 0 and starts the others, pinned to disjoint runs of
            :attr:`cpus` (or of the cores it may run on); 1 runs the model whole, as ever.
    """

    model: str = "default"
    dtype: str = "auto"
    device: str = "cpu"
    host: str = "0.0.0.0"
    port: int = 0
    metrics_port: int | None = None
    worker_id: str = ""
    advertise_address: str | None = None
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 1024
    max_step_ms: float = DEFAULT_MAX_STEP_MS
    enable_prefix_caching: bool = True
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    grace: float = DEFAULT_GRACE_SECONDS
    kv_transport: str = "auto"
    enforce_eager: bool = False
    tls: InternalTls | None = None
    health_port: int | None = None
    speculative: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1

    def internal_tls(self) -> InternalTls:
        """:attr:`tls`, or InvalidArgumentError when none was given (mTLS is not optional)."""
        if self.tls is None:
            raise InvalidArgumentError(
                "a worker needs an internal TLS identity (--tls-cert/--tls-key/--tls-ca, or "
                "--insecure-internal)", param="tls")
        return self.tls

    def reachable_host(self) -> str | None:
        """The host peers reach this worker at: ``--advertise-address``'s, else ``--host``
        unless it is a wildcard (None: the machine's own name)."""
        if self.advertise_address:
            host = self.advertise_address.rsplit(":", 1)[0]
            return host.strip("[]") or None
        return None if self.host in ("", "0.0.0.0", "::", "[::]") else self.host.strip("[]")

    def engine_config(self) -> EngineConfig:
        """The engine limits these options describe (imports the engine, i.e. torch)."""
        from services.engine.core.engine import EngineConfig

        if self.kv_cache_gib <= 0:
            raise InvalidArgumentError("--kv-cache-gib must be positive", param="kv_cache_gib")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InvalidArgumentError("--num-blocks must be at least 2", param="num_blocks")
        if not self.max_step_ms >= 0:  # NaN too
            raise InvalidArgumentError("--max-step-ms must be >= 0", param="max_step_ms")
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_cache_bytes=int(self.kv_cache_gib * GIB),
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_batched_tokens,
            max_step_ms=self.max_step_ms or None,
            enable_prefix_caching=self.enable_prefix_caching,
            cuda_graphs=not self.enforce_eager,
            prefix_salt=self.tls.prefix_salt if self.tls is not None else b"",
            speculative=self.speculative.validate() if self.speculative is not None else None,
        )


def add_worker_arguments(parser: argparse.ArgumentParser, *, port: int, metrics_port: int) -> None:
    """Add the shared flags; ``port`` / ``metrics_port`` are the role's defaults."""
    env = os.environ.get
    parser.add_argument("--model", default=env("TANDEM_MODEL", "default"),
                        help="default | PATH to a .gguf file or HF folder | dummy:<shape> "
                             "(env TANDEM_MODEL)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=env("TANDEM_DTYPE", "auto"),
                        help="auto (default: a GGUF's own quantized format on CPU, bfloat16 on "
                             "CUDA) | float32 | bfloat16 | float16 | q8_0 | q4 (env TANDEM_DTYPE)")
    parser.add_argument("--device", default=env("TANDEM_DEVICE", "auto"),
                        help="cpu | cuda | cuda:N | auto (default)")
    parser.add_argument("--host", default="0.0.0.0", help="gRPC bind host (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port})")
    parser.add_argument("--metrics-port", type=int, default=metrics_port,
                        help=f"Prometheus /metrics port (default {metrics_port}; -1 disables)")
    parser.add_argument("--worker-id", default="", help="id reported in stats (default role-port)")
    parser.add_argument("--advertise-address", default=None,
                        help="host:port other services should use to reach this worker")
    parser.add_argument("--tensor-parallel-size", type=int,
                        default=env("TANDEM_TENSOR_PARALLEL_SIZE", "1"), metavar="N",
                        help="split the model over N ranks (processes) of this worker: Gloo on "
                             "CPU (ranks pinned to disjoint cores of --cpus), NCCL on CUDA (one "
                             "GPU each); quantized GGUF blocks split on block boundaries (default 1; env "
                             "TANDEM_TENSOR_PARALLEL_SIZE; docs/tensor-parallel.md)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool size in GiB")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool size in blocks (overrides --kv-cache-gib)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES,
                        default=env("TANDEM_KV_CACHE_DTYPE", "auto"),
                        help="KV cache dtype: auto (default: 16-bit for a float32 model on CPUs "
                             "whose attention kernel reads it at least as fast, else the model's "
                             "dtype) | float32 | bfloat16 | float16 (16-bit under a float32 "
                             "model: half the memory per token and half the bytes per hand-off) "
                             "| q8_0 (CPU, float32 models: int8 with a float16 scale per 32 "
                             "values, about half of 16-bit's bytes again) | fp8 (CUDA: float8 "
                             "e4m3, half of 16-bit's bytes, saturated at +-448); prefill and "
                             "decode workers must agree (env TANDEM_KV_CACHE_DTYPE)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per batch")
    parser.add_argument("--max-batched-tokens", type=int, default=1024,
                        help="token budget per step (longer prompts are chunked)")
    parser.add_argument("--max-step-ms", type=float, default=DEFAULT_MAX_STEP_MS, metavar="MS",
                        help="a step that decodes running streams takes prompt tokens for about "
                             "this long at most, their number sized by the engine's measured "
                             "speed, so a long prompt prefilled beside streams delays each token "
                             f"by this much rather than seconds (default {DEFAULT_MAX_STEP_MS:g}; "
                             "0: the token budget alone)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, run decode steps op by op instead of replaying captured "
                             "CUDA graphs (slower; for debugging)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="disable the prefix cache")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the engine (default: one per usable core; "
                             "tandem up plans it per worker)")
    parser.add_argument("--cpus", type=parse_cpus, default=None, metavar="LIST",
                        help="pin the engine to these cores, e.g. 0-3,6 (default: anywhere)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                        help="on SIGTERM: report NOT_SERVING, then let in-flight requests finish "
                             f"for this long before cancelling them (default {DEFAULT_GRACE_SECONDS:g})")
    parser.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=env("TANDEM_KV_TRANSPORT",
                                                                             "auto"),
                        help="how KV payloads travel from prefill to decode: grpc (in the "
                             "TransferKV stream) | distributed (a torch.distributed pair group: "
                             "Gloo on CPU) | cuda-ipc (CUDA workers: decode copies the blocks "
                             "out of prefill's pool, mapped through CUDA IPC, when both share "
                             "one GPU; gRPC per transfer otherwise) | auto (default: cuda-ipc on "
                             "CUDA workers, gRPC on CPU workers; NCCL across GPUs is not built: "
                             "it needs a multi-GPU machine to be tested); control always stays on "
                             "gRPC (env TANDEM_KV_TRANSPORT)")
    add_speculative_arguments(parser)
    from services.common.internal_tls import add_tls_arguments

    add_tls_arguments(parser)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The speculative-decoding flags (workers and ``tandem generate``)."""
    env = os.environ.get
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS,
                        default=env("TANDEM_SPECULATIVE") or None,
                        help="speculative decoding: ngram (prompt lookup: propose the tokens that "
                             "followed the last n tokens' most recent earlier occurrence) | draft "
                             "(a smaller model with the same vocabulary, --draft-model, proposes "
                             "greedily); the model verifies the guesses in one forward pass, "
                             "greedy and seeded output unchanged. Default: off (env "
                             "TANDEM_SPECULATIVE)")
    parser.add_argument("--num-speculative-tokens", type=int, default=8, metavar="K",
                        help="most draft tokens per sequence and step (default 8; each "
                             "sequence's drafts adapt: one more than it accepted last)")
    parser.add_argument("--ngram-max", type=int, default=4,
                        help="longest suffix prompt lookup matches (default 4)")
    parser.add_argument("--ngram-min", type=int, default=1,
                        help="shortest suffix prompt lookup matches (default 1)")
    parser.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="the draft model of --speculative draft: default | a .gguf file | a "
                             "Hugging Face folder, with the served model's vocabulary (e.g. the "
                             "same model's 4-bit GGUF drafting for its float32 or 16-bit form)")
    parser.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default="auto",
                        help="the draft model's weight dtype (default auto)")
    parser.add_argument("--draft-kv", choices=("auto", "build"), default="auto",
                        help="how the draft gets a prompt's KV it has not seen (a hand-off's): "
                             "auto adopts the target's KV when the draft is the target's own "
                             "shape (a quantized self-draft: a memory copy), else builds it with "
                             "the draft's forward on this worker; build always does (default "
                             "auto)")
    parser.add_argument("--speculative-max-batch", type=int, default=4, metavar="N",
                        help="speculate only while at most N sequences run (default 4: larger "
                             "batches already use the weight read)")


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative-decoding settings the flags ask for (validated), None when off."""
    if not getattr(args, "speculative", None):
        return None
    return SpeculativeConfig(
        method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        max_batch=args.speculative_max_batch,
        draft_model=getattr(args, "draft_model", None), draft_dtype=getattr(args, "draft_dtype", "auto"),
        draft_kv=getattr(args, "draft_kv", "auto"),
    ).validate()


def resolve_kv_transport(choice: str, device: str) -> str:
    """The KV transport a worker on ``device`` runs for ``--kv-transport choice``: ``grpc``,
    ``distributed`` or ``cuda-ipc`` (a prefill worker then offers the channel, a decode worker
    serves it; a transfer uses it only when both ends do, else gRPC; docs/kv-handoff.md).

    ``auto`` is CUDA IPC on CUDA workers and gRPC on CPU workers. CUDA IPC is safe across GPUs
    too: a decode worker copies over it only when the prefill worker's GPU is its own, and lets
    any other transfer's bytes travel over gRPC. (The rule's third case, NCCL between GPUs, is
    not built: it needs a multi-GPU machine to be tested.)

    Raises:
        InvalidArgumentError: an unknown choice, or ``cuda-ipc`` on a worker that is not CUDA.
    """
    if choice not in KV_TRANSPORTS:
        raise InvalidArgumentError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, "
                                   f"got {choice!r}", param="kv_transport")
    cuda = device.startswith("cuda")
    if choice == "cuda-ipc" and not cuda:
        raise InvalidArgumentError(
            f"--kv-transport cuda-ipc needs CUDA workers, and this one runs on {device}; "
            "use --kv-transport grpc or distributed", param="kv_transport")
    if choice in ("cuda-ipc", "auto"):
        return "cuda-ipc" if cuda else "grpc"
    return choice


def options_from_args(args: argparse.Namespace, role: str) -> WorkerOptions:
    """Options from parsed flags (``--device auto`` is resolved here, importing torch)."""
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolve_kv_transport(args.kv_transport, device)  # a bad choice fails before the model loads
    from services.common.internal_tls import tls_from_args

    tls = tls_from_args(args)  # unreadable certificates fail before the model loads too
    return WorkerOptions(
        model=args.model, dtype=args.dtype, device=device, host=args.host, port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        worker_id=args.worker_id or f"{role}-{args.port}",
        advertise_address=args.advertise_address, kv_cache_gib=args.kv_cache_gib,
        num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, max_step_ms=args.max_step_ms,
        enable_prefix_caching=not args.no_prefix_caching,
        threads=args.threads, cpus=args.cpus, grace=args.grace, kv_transport=args.kv_transport,
        enforce_eager=args.enforce_eager, tls=tls,
        health_port=None if args.health_port < 0 else args.health_port,
        speculative=speculative_from_args(args),
        tensor_parallel_size=check_tensor_parallel_size(args.tensor_parallel_size),
    )


def check_tensor_parallel_size(size: int) -> int:
    """``--tensor-parallel-size`` checked (a positive integer) before any model loads."""
    if not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(
            f"--tensor-parallel-size must be a positive integer, got {size!r}",
            param="tensor_parallel_size",
        )
    return size
