"""``tandem serve prefill``: the prefill worker process.

Start-up: load the model, start the engine thread, the KV sender (gRPC transport by default;
``--kv-transport distributed`` offers decode workers a torch.distributed pair channel) with its
lease reaper, the gRPC server (Prefill + health + reflection) and the Prometheus
endpoint; then serve until SIGINT / SIGTERM and stop gracefully (in-flight requests get a grace
period, then every lease and block is freed and the engine thread stops).

Only flags live here, so building the ``tandem`` parser never imports torch; the worker
itself is started by :func:`services.prefill.server.start_prefill_worker` (tests call it directly).
"""

from __future__ import annotations

import argparse
import os

from services.common import ports
from services.common.pooling_config import POOLING_MODES
from services.prefill.options import DEFAULT_LEASE_SECONDS
from services.engine.runtime.worker_options import add_worker_arguments, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(
        parser, port=ports.prefill_grpc_port(0), metrics_port=ports.prefill_metrics_port(0)
    )
    parser.add_argument(
        "--lease-seconds", type=float,
        default=float(os.environ.get("TANDEM_LEASE_SECONDS", DEFAULT_LEASE_SECONDS)),
        help="free a request's KV if decode has not acknowledged it by then (default 30)",
    )
    parser.add_argument(
        "--decode-members", action="append", default=None, metavar="ADDR",
        help="the decode workers this worker may ship KV to, host:port (a name stands for every "
             "address it resolves to, re-resolved as the pool changes); repeat or comma-separate; "
             "a Prefill naming another decode_address is refused (env TANDEM_DECODE_MEMBERS; "
             "default: any server holding a decode certificate)",
    )
    parser.add_argument(
        "--pooling", choices=POOLING_MODES, default=os.environ.get("TANDEM_POOLING") or None,
        help="how /v1/embeddings pools the final hidden states: last (the last token's) or mean "
             "(over the input's tokens); default: the model folder's sentence-transformers "
             "config (modules.json, 1_Pooling/config.json), else last (env TANDEM_POOLING)",
    )


def run(args: argparse.Namespace) -> int:
    from services.engine.runtime.worker_runtime import run_worker  # torch: only when serving
    from services.prefill.server import start_prefill_worker

    options = options_from_args(args, "prefill")
    values = args.decode_members or [os.environ.get("TANDEM_DECODE_MEMBERS", "")]
    members = tuple(a.strip() for v in values for a in v.split(",") if a.strip())
    return run_worker(lambda: start_prefill_worker(options, lease_seconds=args.lease_seconds,
                                                   decode_members=members,
                                                   pooling=args.pooling))
