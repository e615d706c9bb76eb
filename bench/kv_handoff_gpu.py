"""GPU KV hand-off benchmark: a prompt's KV handed from a prefill to a decode worker on the same
GPU, over CUDA IPC and over gRPC (docs/kv-handoff.md).

What runs: real workers. ``tandem serve prefill`` and ``tandem serve decode`` are two OS
processes on this machine's GPU (CUDA IPC needs two: a handle cannot be opened by the process
that made it), with ``dummy:llama-3-8b`` weights in bfloat16 by default: the real Llama-3-8B KV
layout (32 layers, 8 KV heads, head_dim 128, 2 MiB per 16-token block, so a 4,096-token prompt
is 512 MiB of KV) with random values, no checkpoint. For each ``--kv-transport`` in turn a fresh
pair is started with that flag on both workers. Each request is what the gateway does:
``Decode.Generate`` opened, ``Prefill.Prefill`` computes the prompt and hands its KV to decode,
decode answers with prefill's token (``max_tokens=1``). One warm-up request per pair (the pool
mapped, the channel opened), then ``--reps`` distinct prompts per length, no prefix cache.

Columns (medians over the repetitions):
  * ``KV MiB``      bytes handed over per request (blocks x block_bytes);
  * ``prefill s``   prefill compute (the prefill worker's clock);
  * ``transfer s``  the prefill worker's ``transfer_seconds``: first write of the header to
                    decode's ack. cuda-ipc: the offer, decode's allocation, the device-to-device
                    copy and its synchronisation; grpc: the pool read to the host with crc32s,
                    4 MiB messages over loopback, the checks and the writes into decode's pool;
  * ``GB/s``        KV bytes / transfer seconds;
  * ``copy GB/s``   ``torch.clone`` of as many bytes on this GPU, in this process: the
                    device's own ceiling for moving the payload once (same byte count).

A cuda-ipc row at gRPC speed means decode fell back to bytes; its log (under ``--log-dir``)
says why (another GPU, or a pool it could not map).

Usage::

    python bench/kv_handoff_gpu.py                        # 4096 tokens, 5 reps, cuda-ipc, grpc
    python bench/kv_handoff_gpu.py --tokens 1024 4096 --reps 10 --json results.json

Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, too

import torch  # noqa: E402

from services.common.cert_authority import role_files, write_deployment_certs  # noqa: E402
from services.common.grpc_channel import open_channel, wait_healthy  # noqa: E402
from services.common.internal_tls import InternalTls  # noqa: E402
from services.common.pb import decode_pb2_grpc, prefill_pb2_grpc  # noqa: E402
from bench.kv_transfer import one_request  # noqa: E402  (one request: Generate, then Prefill)

logger = logging.getLogger("bench.kv_handoff_gpu")

SERVICES = {"prefill": "tandem.v1.Prefill", "decode": "tandem.v1.Decode"}


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    tokens: int
    kv_bytes: int
    prefill_s: float
    transfer_s: float
    gbps: float
    copy_gbps: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def device_copy_gbps(num_bytes: int, reps: int = 10) -> float:
    """Median GB/s of ``torch.clone`` of ``num_bytes`` on the GPU (payload bytes per second)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    source.clone()  # warm the allocator
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        source.clone()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return num_bytes / statistics.median(times) / 1e9


def certs_dir(args: argparse.Namespace) -> Path:
    """A CA and every role's certificate under the log directory (mutual TLS, as served)."""
    directory = args.log_dir / "certs"
    if not (directory / "ca.pem").exists():
        write_deployment_certs(directory)
    return directory


def tls_flags(args: argparse.Namespace, role: str) -> list[str]:
    cert, key, ca = role_files(certs_dir(args), role)
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]


def identity(args: argparse.Namespace, role: str) -> InternalTls:
    return InternalTls.from_files(*role_files(certs_dir(args), role))


@contextlib.contextmanager
def worker_pair(args: argparse.Namespace, transport: str) -> Iterator[dict[str, str]]:
    """Start a prefill and a decode worker process with ``--kv-transport transport``; yields
    their addresses and stops both afterwards."""
    addresses: dict[str, str] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role in ("decode", "prefill"):
            port = free_port()
            command = [
                sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", role,
                "--model", args.model, "--dtype", args.dtype, "--device", "cuda",
                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1",
                "--kv-cache-gib", str(args.kv_cache_gib),
                "--max-batched-tokens", str(max(args.tokens)), "--no-prefix-caching",
                "--worker-id", f"{role}-bench", "--kv-transport", transport,
                *tls_flags(args, role),
            ]  # fmt: skip
            with (args.log_dir / f"{role}-{transport}.log").open("wb") as log:
                procs[role] = subprocess.Popen(command, cwd=ROOT, stdout=log,
                                               stderr=subprocess.STDOUT)  # fmt: skip
            addresses[role] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


async def wait_ready(args: argparse.Namespace, addresses: dict[str, str], transport: str) -> None:
    deadline = time.monotonic() + args.startup_timeout
    for role, address in addresses.items():
        while True:
            try:
                await wait_healthy(address, SERVICES[role], timeout=5,
                                   tls=identity(args, "operator"))
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    log = (args.log_dir / f"{role}-{transport}.log").read_text(errors="replace")
                    raise SystemExit(f"the {role} worker did not start:\n{log[-4000:]}") from None


async def measure(args: argparse.Namespace, transport: str) -> list[Row]:
    rows: list[Row] = []
    with worker_pair(args, transport) as addresses:
        await wait_ready(args, addresses, transport)
        gateway = identity(args, "gateway")
        prefill_channel = open_channel(addresses["prefill"], tls=gateway, server_role="prefill")
        decode_channel = open_channel(addresses["decode"], tls=gateway, server_role="decode")
        prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode = decode_pb2_grpc.DecodeStub(decode_channel)
        rng = random.Random(0)
        try:
            await one_request(prefill, decode, addresses["decode"], "warmup",
                              [rng.randrange(3, args.vocab) for _ in range(256)])  # fmt: skip
            for tokens in args.tokens:
                results = []
                for rep in range(args.reps):
                    prompt = [rng.randrange(3, args.vocab) for _ in range(tokens)]
                    r = await one_request(prefill, decode, addresses["decode"],
                                          f"{transport}-{tokens}-{rep}", prompt)  # fmt: skip
                    logger.info("%s, %d tokens: prefill %.3fs, transfer %.4fs, %d bytes",
                                transport, tokens, r.prefill_seconds, r.transfer_seconds,
                                r.kv_bytes)  # fmt: skip
                    results.append(r)
                kv_bytes = results[0].kv_bytes
                rows.append(Row(
                    transport=transport, tokens=tokens, kv_bytes=kv_bytes,
                    prefill_s=statistics.median(r.prefill_seconds for r in results),
                    transfer_s=statistics.median(r.transfer_seconds for r in results),
                    gbps=statistics.median(r.kv_bytes / r.transfer_seconds / 1e9 for r in results),
                    copy_gbps=device_copy_gbps(kv_bytes),
                ))  # fmt: skip
        finally:
            await prefill_channel.close()
            await decode_channel.close()
    return rows


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(f"{'transport':>10} {'tokens':>7} {'KV MiB':>8} {'prefill s':>10} {'transfer s':>11} "
          f"{'GB/s':>9} {'copy GB/s':>10}")
    for r in rows:
        print(f"{r.transport:>10} {r.tokens:>7} {r.kv_bytes / 2**20:>8.1f} {r.prefill_s:>10.3f} "
              f"{r.transfer_s:>11.4f} {r.gbps:>9.2f} {r.copy_gbps:>10.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3-8b",
                        help="any model the workers load (default: the Llama-3-8B shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128000, help="token ids drawn below this")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="each worker's KV pool")
    parser.add_argument("--kv-transport", nargs="+", default=["cuda-ipc", "grpc"],
                        choices=["cuda-ipc", "grpc"], help="transports to measure, in turn")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where the workers' logs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("services").setLevel(logging.WARNING)
    if not torch.cuda.is_available():
        print("kv_handoff_gpu: no CUDA device here; nothing to measure")
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-kv-bench-") as scratch:
        args.log_dir = args.log_dir or Path(scratch)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        rows: list[Row] = []
        for transport in args.kv_transport:
            rows += asyncio.run(measure(args, transport))
    name = torch.cuda.get_device_name()
    print_table(rows, f"KV hand-off on one GPU ({name}), {args.model} {args.dtype}, worker "
                      "processes, medians")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
