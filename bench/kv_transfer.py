"""KV hand-off benchmark: transfer throughput per KV transport (gRPC chunks, or the
``torch.distributed`` payload channel) next to a plain memory copy, and the transfer's share of
time to first token (docs/kv-handoff.md).

What runs: a prefill and a decode worker as real gRPC servers on 127.0.0.1 (in this process,
sharing one set of weights; or already running workers given by address), the SmolLM2-135M
float32 KV layout by default (``dummy:smollm2-135m``: real shapes, random weights, no tokenizer
needed). For each prompt length, ``--reps`` prompts (distinct, so the prefix cache never hits)
go through the real path: ``Decode.Generate`` opened, ``Prefill.Prefill`` computes the prompt and
ships its blocks over ``Decode.TransferKV``, decode admits the request (``max_tokens=1``). With
``--kv-transport grpc distributed`` (the default) each transport gets its own pair of workers, one
after the other, in the same run.

Columns:
  * ``KV MiB``            bytes shipped per request (blocks x block_bytes);
  * ``prefill s``         prefill compute (queue exit to first token, prefill worker's clock);
  * ``transfer s``        first write to decode's ack (read from the pool, crc32, send, write);
  * ``GB/s``              KV bytes / transfer seconds;
  * ``memcpy GB/s``       ``torch.clone`` of a tensor of the same size (the in-memory ceiling);
  * ``share of TTFT``     transfer / (prefill + transfer): what disaggregation adds to TTFT.
Medians over the repetitions. In-process mode puts both workers on the same CPU cores, so the
gRPC figure is a lower bound for two hosts with a fast link.

Usage::

    python bench/kv_transfer.py                      # 512 and 4096 tokens, 3 reps, both transports
    python bench/kv_transfer.py --tokens 512 --reps 5 --json results.json
    python bench/kv_transfer.py --prefill-address H:P --decode-address H:P --certs DIR  # running workers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

import torch  # noqa: E402

from services.common.cert_authority import issue_identities  # noqa: E402
from services.common.grpc_channel import open_channel  # noqa: E402
from services.common.internal_tls import InternalTls  # noqa: E402
from services.common.pb import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from services.common.prefix_hash import reservation_digest  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.wire import sampling_params_to_proto  # noqa: E402

logger = logging.getLogger("bench.kv_transfer")

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    tokens: int
    kv_bytes: int
    prefill_s: float
    transfer_s: float
    gbps: float
    memcpy_gbps: float
    ttft_share: float


def memcpy_gbps(num_bytes: int, reps: int = 5) -> float:
    """Median GB/s of ``torch.clone`` over ``num_bytes`` (float32 tensor, CPU)."""
    source = torch.empty(num_bytes // 4, dtype=torch.float32).uniform_()
    source.clone()  # warm the allocator
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        source.clone()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


async def one_request(
    prefill: prefill_pb2_grpc.PrefillStub,
    decode: decode_pb2_grpc.DecodeStub,
    decode_address: str,
    request_id: str,
    prompt: list[int],
) -> prefill_pb2.PrefillResponse:
    await decode.Reserve(decode_pb2.ReserveRequest(  # as the gateway does: KV needs a reservation
        request_id=request_id, num_tokens=len(prompt),
        prompt_digest=reservation_digest(prompt, PARAMS.cache_salt)))
    call = decode.Generate(decode_pb2.GenerateRequest(request_id=request_id, wait_for_kv_seconds=600))
    response = await prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, token_ids=prompt, params=sampling_params_to_proto(PARAMS),
        decode_address=decode_address,
    ))
    async for _ in call:
        pass
    return response


async def measure(
    args: argparse.Namespace, prefill_address: str, decode_address: str, transport: str,
    tls: InternalTls,
) -> list[Row]:
    """``tls``: the gateway identity the benchmark calls the workers with (mutual TLS)."""
    prefill_channel = open_channel(prefill_address, tls=tls, server_role="prefill")
    decode_channel = open_channel(decode_address, tls=tls, server_role="decode")
    prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
    decode = decode_pb2_grpc.DecodeStub(decode_channel)
    rng = random.Random(0)
    rows = []
    try:
        await one_request(prefill, decode, decode_address, "warmup", [1] * 32)
        for tokens in args.tokens:
            results = []
            for rep in range(args.reps):
                prompt = [rng.randrange(3, args.vocab) for _ in range(tokens)]
                results.append(await one_request(prefill, decode, decode_address,
                                                 f"bench-{tokens}-{rep}", prompt))
                r = results[-1]
                logger.info("%d tokens: prefill %.3fs, transfer %.3fs, %d bytes", tokens,
                            r.prefill_seconds, r.transfer_seconds, r.kv_bytes)
            prefill_s = statistics.median(r.prefill_seconds for r in results)
            transfer_s = statistics.median(r.transfer_seconds for r in results)
            kv_bytes = results[0].kv_bytes
            rows.append(Row(
                transport=transport, tokens=tokens, kv_bytes=kv_bytes, prefill_s=prefill_s, transfer_s=transfer_s,
                gbps=statistics.median(r.kv_bytes / r.transfer_seconds / 1e9 for r in results),
                memcpy_gbps=memcpy_gbps(kv_bytes),
                ttft_share=transfer_s / (prefill_s + transfer_s),
            ))
    finally:
        await prefill_channel.close()
        await decode_channel.close()
    return rows


async def run(args: argparse.Namespace) -> list[Row]:
    if args.prefill_address and args.decode_address:
        if not args.certs:
            raise SystemExit("--prefill-address/--decode-address need --certs DIR (the "
                             "deployment's `tandem certs init` directory: the gateway's files)")
        certs = Path(args.certs)
        tls = InternalTls.from_files(certs / "gateway.pem", certs / "gateway-key.pem",
                                     certs / "ca.pem")  # fmt: skip
        return await measure(args, args.prefill_address, args.decode_address, "as configured",
                             tls)  # fmt: skip
    from services.decode.server import start_decode_worker
    from services.engine.core.loaders import load_model, parse_dtype
    from services.engine.runtime.worker_options import WorkerOptions
    from services.prefill.server import start_prefill_worker

    loaded = load_model(args.model, parse_dtype(args.dtype))
    args.vocab = loaded.config.vocab_size
    rows: list[Row] = []
    identities = issue_identities()  # mutual TLS, as served
    for transport in args.kv_transport:
        options = WorkerOptions(
            model=args.model, dtype=args.dtype, host="127.0.0.1", port=0,
            kv_cache_gib=args.kv_cache_gib, max_batched_tokens=args.max_batched_tokens,
            enable_prefix_caching=False, kv_transport=transport,
        )
        decode = await start_decode_worker(replace(options, worker_id=f"decode-{transport}",
                                                   tls=identities["decode"]),
                                           loaded=loaded, wait_for_kv_seconds=600)  # fmt: skip
        prefill = await start_prefill_worker(replace(options, worker_id=f"prefill-{transport}",
                                                     tls=identities["prefill"]),
                                             loaded=loaded, lease_seconds=600,
                                             max_chunk_bytes=int(args.chunk_mib * 2**20))  # fmt: skip
        try:
            rows += await measure(args, prefill.address, decode.address, transport,
                                  identities["gateway"])
        finally:
            await prefill.stop(1)
            await decode.stop(1)
    return rows


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(f"{'transport':>13} {'tokens':>7} {'KV MiB':>8} {'prefill s':>10} {'transfer s':>11} "
          f"{'GB/s':>10} {'memcpy GB/s':>12} {'share of TTFT':>14}")
    for r in rows:
        print(f"{r.transport:>13} {r.tokens:>7} {r.kv_bytes / 2**20:>8.1f} {r.prefill_s:>10.3f} "
              f"{r.transfer_s:>11.4f} "
              f"{r.gbps:>10.2f} {r.memcpy_gbps:>12.2f} {r.ttft_share:>13.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="KV chunk budget (MiB)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152, help="token id range (remote mode)")
    parser.add_argument("--prefill-address", default=None)
    parser.add_argument("--decode-address", default=None)
    parser.add_argument("--certs", default=None, metavar="DIR",
                        help="with the addresses: the `tandem certs init` directory of their "
                             "deployment (the benchmark calls them as the gateway)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--kv-transport", nargs="+", default=["grpc", "distributed"],
                        choices=["grpc", "distributed"], help="transports to measure, in turn")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("services").setLevel(logging.WARNING)
    rows = asyncio.run(run(args))
    where = "running workers" if args.prefill_address else "in-process workers, loopback"
    print_table(rows, f"KV transfer, {args.model} {args.dtype}, {where}, "
                      f"{torch.get_num_threads()} torch threads")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
