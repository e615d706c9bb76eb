"""``tandem serve tokenizer``: the tokenizer gRPC service as one process, torch-free.

Flags (``--model`` falls back to the ``TANDEM_MODEL`` environment variable, read in :func:`run`,
then to ``default``, the bundled SmolLM2):

  --model MODEL        default | PATH to a .gguf file or a Hugging Face folder
  --host HOST          interface to bind (default 0.0.0.0)
  --port PORT          gRPC port (default 50051, ``ports.TOKENIZER_GRPC_PORT``; 0 = any free)
  --metrics-port PORT  Prometheus ``/metrics`` port (default 9101; 0 = any free)
  --grace SECONDS      how long in-flight RPCs get when stopping (default 5)
  --chat-template FILE a Jinja chat template that replaces the model's own (read at start-up)
  --tls-cert/--tls-key/--tls-ca PEM, --insecure-internal, --health-port PORT: internal mutual
                       TLS (``common/internal_tls.py``; only a gateway may call the tokenizer)

Lifecycle:
  1. Install SIGINT / SIGTERM handlers (a signal at any later point stops the process cleanly).
  2. Resolve the model, load its tokenizer (and ``--chat-template``, which must compile) and
     compute the model fingerprint (in a thread).
  3. Start the gRPC server (Tokenizer + health + reflection, see ``common/grpc_server.py``) and
     the metrics endpoint; health reports SERVING from here on.
  4. Wait for a signal; then report NOT_SERVING, give in-flight RPCs ``--grace`` seconds, stop.

The model fingerprint is ``ModelConfig.fingerprint()`` of the engine (``KVLayout.model_fingerprint``
on the KV path), computed here without torch: ``services/common/model_config.py`` is plain Python,
and the GGUF / ``config.json`` shape fields are read the way the engine's loaders read them
(:func:`model_fingerprint` mirrors ``loaders/gguf_file.gguf_config``, whose module imports torch;
a test checks both agree). Reading it costs one memory-mapped open of the GGUF header. It fails
closed: when the shape or a model file cannot be read (an architecture the engine does not run,
an unreadable file) the tokenizer does not start (:class:`ModelLoadError`), rather than serve
with no fingerprint, which would let the gateway route to workers serving any model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field

from services.common import ports
from services.common.errors import ModelLoadError
from services.common.grpc_server import DEFAULT_GRACE_SECONDS, start_grpc_server
from services.common.internal_tls import InternalTls, add_tls_arguments, tls_from_args
from services.common.metrics import TandemMetrics, serve_metrics_http
from services.common.model_source import ModelSource, resolve_model
from services.common.pb import tokenizer_pb2_grpc
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MODEL_ENV = "TANDEM_MODEL"
DEFAULT_MODEL = "default"


@dataclass(frozen=True, slots=True)
class TokenizerServiceConfig:
    """Everything the tokenizer process needs; built from the flags in :func:`run`."""

    model: str = DEFAULT_MODEL
    host: str = "0.0.0.0"
    port: int = ports.TOKENIZER_GRPC_PORT
    metrics_port: int = ports.TOKENIZER_METRICS_PORT
    grace: float = DEFAULT_GRACE_SECONDS
    tls: InternalTls = field(default_factory=InternalTls)  # empty: refused by the server
    health_port: int | None = None
    chat_template: str | None = None  # a template file replacing the model's own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem serve tokenizer`` (see the module docstring)."""
    parser.add_argument(
        "--model",
        default=None,
        help=f"default | PATH to a .gguf file or Hugging Face folder (env {MODEL_ENV}; "
        f"default {DEFAULT_MODEL!r}: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="interface to bind (default 0.0.0.0)")
    parser.add_argument(
        "--port",
        type=int,
        default=ports.TOKENIZER_GRPC_PORT,
        help=f"gRPC port (default {ports.TOKENIZER_GRPC_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=ports.TOKENIZER_METRICS_PORT,
        help=f"Prometheus /metrics port (default {ports.TOKENIZER_METRICS_PORT}; 0 picks one)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help=f"seconds in-flight RPCs get on shutdown (default {DEFAULT_GRACE_SECONDS:g})",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file that replaces the model's own (default: the model's)",
    )
    add_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tandem serve tokenizer``."""
    config = TokenizerServiceConfig(
        model=args.model or os.environ.get(MODEL_ENV) or DEFAULT_MODEL,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grace=args.grace,
        tls=tls_from_args(args),
        health_port=None if args.health_port < 0 else args.health_port,
        chat_template=args.chat_template,
    )
    return asyncio.run(serve(config))


async def serve(config: TokenizerServiceConfig) -> int:
    """Run the service until SIGINT / SIGTERM (the module lifecycle); returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        source = resolve_model(config.model)
        tokenizer = await asyncio.to_thread(Tokenizer.load, source)
        if config.chat_template:
            tokenizer.use_chat_template(read_chat_template(config.chat_template))
            logger.info("chat template from %s", config.chat_template)
        fingerprint = await asyncio.to_thread(model_fingerprint, source)
        logger.info("loaded tokenizer %r (fingerprint %s)", tokenizer, fingerprint)
        if stop.is_set():
            return 0
        servicer = TokenizerServicer(tokenizer, model_fingerprint=fingerprint)
        metrics = TandemMetrics()
        handle = await start_grpc_server(
            [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, SERVICE_NAME)],
            host=config.host,
            port=config.port,
            grace=config.grace,
            tls=config.tls,
            health_port=config.health_port,
        )
        try:
            metrics_server = await serve_metrics_http(metrics, config.host, config.metrics_port)
        except BaseException:
            await handle.stop(0)
            raise
        logger.info(
            "tokenizer service ready on %s (metrics %s)", handle.address, metrics_server.url
        )
        try:
            await stop.wait()
            logger.info("stopping tokenizer service")
        finally:
            await handle.stop()
            await metrics_server.close()
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def model_fingerprint(source: ModelSource) -> str:
    """The model fingerprint of ``source`` (shape and the digest of its weights, tokenizer and
    chat template, ``services/common/model_fingerprint.py``) without torch.

    Raises:
        ModelLoadError: it cannot be computed (fail closed: the tokenizer does not start).
    """
    from services.common.config_reader import read_model_config  # plain Python + gguf, no torch
    from services.common.model_fingerprint import fingerprint, weights_digest

    try:
        return fingerprint(read_model_config(source).fingerprint(), weights_digest(source))
    except ModelLoadError as exc:
        raise ModelLoadError(
            f"cannot compute the model fingerprint of {source.name}, so the gateway could not "
            f"check that every worker serves this model: {exc.message}") from exc
    except (OSError, ValueError) as exc:  # a malformed file the readers did not type
        raise ModelLoadError(
            f"cannot compute the model fingerprint of {source.name}: {exc}") from exc


def read_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file; ModelLoadError when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from exc
    if not text.strip():
        raise ModelLoadError(f"the chat template {path} is empty")
    return text
