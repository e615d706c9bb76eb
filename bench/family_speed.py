"""Tandem's default configuration next to llama.cpp on the shapes people run on CPUs, one table.

    python bench/family_speed.py GGUF [GGUF ...] [--decode-tokens 64] [--prefill-length 512]
        [--rounds 2]

For each GGUF (e.g. the Q4_K_M files ``bench/family_ggufs.py`` writes): Tandem with
``--dtype auto`` (as ``tandem up`` serves it) and llama.cpp (llama-cpp-python, in a fresh
process, same threads) measure batch-1 decode and a ``--prefill-length`` prompt's prefill, with
the rows of all files taking turns over ``--rounds`` and each cell keeping its best round (see
``engine_throughput.py``). Then per file: Tandem over llama.cpp, the bytes one decoded token
reads (the file's tensors; Tandem's weights as held) and the memory-bandwidth ceiling they give;
and, round by round, Tandem's weight read rate as a share of the better of two bandwidth reads
either side of it.
The methods are ``engine_throughput.py``'s, so the rows compare with its tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import (  # noqa: E402 - the sibling script's measurements
    Row,
    _ratio,
    best_of,
    cpu_model_name,
    decode_weight_bytes,
    llama_cpp_row,
    memory_bandwidth_gbs,
    tandem_row,
)

from services.common.model_source import resolve_model  # noqa: E402
from services.engine.core.kernels.native_build import selected_isa  # noqa: E402
from services.engine.core.loaders import load_model  # noqa: E402


def file_tensor_bytes(path: str) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    args.batches = [1]
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model_name()}; kernels: {selected_isa()}; threads: {threads}; "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    rounds: list[dict[str, Row]] = []
    held: dict[str, tuple[str, int, int]] = {}
    paired: dict[str, list[tuple[float, float]]] = {}  # per round: (weights GB/s, bandwidth GB/s)
    for _ in range(args.rounds):
        measured: dict[str, Row] = {}
        for model in args.models:
            source = resolve_model(model)
            loaded = load_model(source, "auto")
            # a shared machine's bandwidth can swing by half within a minute: the share is of the
            # better of two reads either side of the decode, not of one probe for the whole run
            before = memory_bandwidth_gbs()[0]
            row = measured[f"{source.name} Tandem"] = tandem_row(loaded, args)
            held[source.name] = (loaded.weight_format, decode_weight_bytes(loaded),
                                 file_tensor_bytes(source.path))  # fmt: skip
            paired.setdefault(source.name, []).append(
                (row["decode b=1"] * held[source.name][1] / 1e9,
                 max(before, memory_bandwidth_gbs()[0])))
            del loaded
            measured[f"{source.name} llama.cpp"] = llama_cpp_row(source, args, threads)
            print(f"measured {source.name}", file=sys.stderr, flush=True)
        rounds.append(measured)
    rows = best_of(rounds)
    read_bw, _ = memory_bandwidth_gbs()
    print(f"\nbest of {args.rounds} rounds; memory read bandwidth {read_bw:.1f} GB/s\n")
    print("| model | Tandem auto decode tok/s | llama.cpp decode tok/s | ratio | Tandem prefill "
          f"tok/s ({args.prefill_length}) | llama.cpp prefill | ratio | Tandem weights "
          "(dtype, MB/token) | file tensors MB | bandwidth ceiling tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (fmt, ours_bytes, file_bytes) in held.items():
        ours, base = rows[f"{name} Tandem"], rows[f"{name} llama.cpp"]
        d, p = "decode b=1", "prefill"
        dr, pr = _ratio(ours.get(d), base.get(d)), _ratio(ours.get(p), base.get(p))
        print(f"| {name} | {ours[d]:.1f} | {base[d]:.1f} | {dr:.2f}x | {ours[p]:.1f} | "
              f"{base[p]:.1f} | {pr:.2f}x | {fmt}, {ours_bytes / 1e6:.0f} | "
              f"{file_bytes / 1e6:.0f} | {read_bw * 1e9 / ours_bytes:.0f} |")
    print("\nTandem's batch-1 weight read next to the better of the bandwidths read just before and "
          "after it, per round:\n")
    print("| model | weights read GB/s / bandwidth GB/s, each round | share, each round | best |")
    print("|---|---|---|---|")
    for name, pairs in paired.items():
        shares = [read / bandwidth for read, bandwidth in pairs]
        print(f"| {name} | {', '.join(f'{r:.1f} / {b:.1f}' for r, b in pairs)} | "
              f"{', '.join(f'{s:.0%}' for s in shares)} | {max(shares):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
