"""``tandem serve decode``: the decode worker process.

Start-up: load the model and its tokenizer (for stop strings and text deltas; token ids only
when the model has none), start the engine thread, the KV receiver with its reaper (parked KV,
reservation leases) and, with ``--kv-transport distributed``, the KV channel (its rendezvous
store is the ``Decode.KVStore`` RPC), the gRPC server (Decode + health + reflection) and the
Prometheus endpoint; then serve until SIGINT / SIGTERM and stop gracefully (in-flight streams get
a grace period, then every parked transfer and running request is freed and the engine thread
stops).

Only flags live here, so building the ``tandem`` parser never imports torch; the worker
itself is started by :func:`services.decode.server.start_decode_worker` (tests call it directly).
"""

from __future__ import annotations

import argparse
import os

from services.common import ports
from services.decode.options import (
    DEFAULT_RESERVATION_LEASE_SECONDS,
    DEFAULT_WAIT_FOR_KV_SECONDS,
    check_reservation_lease,
)
from services.engine.runtime.worker_options import add_worker_arguments, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(
        parser, port=ports.decode_grpc_port(0), metrics_port=ports.decode_metrics_port(0)
    )
    parser.add_argument(
        "--wait-for-kv-seconds", type=float,
        default=float(os.environ.get("TANDEM_WAIT_FOR_KV_SECONDS", DEFAULT_WAIT_FOR_KV_SECONDS)),
        help="how long Generate waits for a request's KV, and how long committed KV waits for "
             "its Generate before it is freed (default 30)",
    )
    parser.add_argument(
        "--reservation-lease-seconds", type=float,
        default=float(os.environ.get("TANDEM_RESERVATION_LEASE_SECONDS",
                                     DEFAULT_RESERVATION_LEASE_SECONDS)),
        help="how long blocks reserved for a request (Decode.Reserve, before its prefill) wait "
             "for its KV before they are freed: the lease when the caller asks for none, and the "
             "longest a caller may ask for (default 30, at most 600)",
    )
    parser.add_argument(
        "--max-reserved-fraction", type=float, default=None, metavar="F",
        help="the most of the KV pool that reservations (Decode.Reserve) hold together, so "
             "running requests keep the rest to grow into (default 0.5)",
    )
    parser.add_argument(
        "--max-reserved-per-caller", type=float, default=None, metavar="F",
        help="the most of the KV pool one caller's reservations hold (one gateway process: peer "
             "address and certificate), so one cannot starve another (default 0.25)",
    )


def run(args: argparse.Namespace) -> int:
    from services.engine.runtime.worker_runtime import run_worker  # torch: only when serving
    from services.decode.server import start_decode_worker

    lease = check_reservation_lease(args.reservation_lease_seconds)
    from services.engine.kv_transfer.reservation_quota import ReservationQuota

    defaults = ReservationQuota()
    quota = ReservationQuota(
        total_fraction=defaults.total_fraction if args.max_reserved_fraction is None
        else args.max_reserved_fraction,
        caller_fraction=defaults.caller_fraction if args.max_reserved_per_caller is None
        else args.max_reserved_per_caller,
    ).validate()  # a bad fraction fails before the model loads
    options = options_from_args(args, "decode")
    return run_worker(lambda: start_decode_worker(
        options, wait_for_kv_seconds=args.wait_for_kv_seconds, reservation_lease_seconds=lease,
        reservation_quota=quota,
    ))
