"""CUDA-graph decode settings that hold without a GPU: the buckets captured, the flag that turns
graphs off, and a CPU engine that captures nothing and keeps no scratch block (the replays
themselves are tested on the device, tests/test_gpu.py)."""

from __future__ import annotations

from pathlib import Path

from services.cli import build_parser
from services.engine.core.cuda_graphs import graph_batches
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from services.engine.runtime.worker_options import options_from_args
from tests.tls_identities import tls_flags


def test_buckets_cover_every_batch_up_to_the_limit() -> None:
    assert graph_batches(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batches(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batches(1) == [1]
    for limit in (1, 3, 20, 64, 100):
        buckets = graph_batches(limit)
        assert all(any(b >= n for b in buckets) for n in range(1, limit + 1))
        assert max(buckets) == limit


def test_enforce_eager_turns_graphs_off() -> None:
    argv = ["serve", "decode", "--device", "cpu", "--enforce-eager", *tls_flags("decode")]
    options = options_from_args(build_parser(argv).parse_args(argv), "decode")
    assert options.engine_config().cuda_graphs is False
    argv = ["serve", "decode", "--device", "cpu", *tls_flags("decode")]
    options = options_from_args(build_parser(argv).parse_args(argv), "decode")
    assert options.engine_config().cuda_graphs is True


def test_a_cpu_engine_captures_nothing(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(load_model(str(tiny_llama_dir)), EngineConfig(num_blocks=32))
    assert engine.runner.graphs is None
    assert engine.kv.num_blocks == engine.block_manager.num_blocks == 32
