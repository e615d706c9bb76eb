"""llama.cpp baseline for ``engine_throughput.py``: the same GGUF and the same token prompts through
llama-cpp-python, measured the way the transformers row is.

Why a separate file: llama.cpp is an optional reference (``pip install llama-cpp-python``), and
its Python API drives one sequence at a time, so it only gives batch-1 decode and prefill.

Both measurements are greedy and deterministic, on ``threads`` threads, best of a few runs:

1. decode: evaluate the 32-token prompt, take the argmax token, then time ``new_tokens`` single
   token steps (evaluate, argmax); rate = tokens after the first / their time;
2. prefill: evaluate a ``length``-token prompt in one batch (``n_batch`` = ``n_ubatch`` =
   ``length``); rate = ``length`` / time.

The prompts come from :func:`random_prompts`, which Tandem's and transformers' rows use too.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from llama_cpp import Llama

DECODE_PROMPT = 32  # prompt tokens before a decode measurement
DECODE_REPEATS = 3
PREFILL_REPEATS = 3


def random_prompts(batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids, the same for every engine and run."""
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(100, 40000, (batch, length), generator=gen).tolist()


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python is installed and loads."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # an ImportError, or the shared library failing to load
        return False
    return True


def llama_cpp_quant_type(path: str | Path) -> str:
    """The file type llama.cpp reports for ``path`` (e.g. ``Q4_1``), from its model description."""
    import llama_cpp

    llm = _open(path, context=64, batch=8, threads=1)
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, buf, len(buf))
    return buf.value.decode().split(" ", 2)[-1]  # the description is "<arch> <size> <file type>"


def llama_cpp_decode(path: str | Path, new_tokens: int, threads: int) -> float:
    """Batch-1 decode tokens/s: ``new_tokens`` greedy steps after the first token."""
    prompt = random_prompts(1, DECODE_PROMPT)[0]
    llm = _open(path, context=DECODE_PROMPT + new_tokens + 16, batch=DECODE_PROMPT, threads=threads)
    best = float("inf")
    for _ in range(DECODE_REPEATS):  # the first run also warms up llama.cpp's buffers
        llm.reset()
        llm.eval(prompt)
        token = _greedy(llm)
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = _greedy(llm)
        best = min(best, time.perf_counter() - start)
    return new_tokens / best


def llama_cpp_prefill(path: str | Path, length: int, threads: int) -> float:
    """Prefill tokens/s: one ``length``-token prompt evaluated in one batch."""
    prompt = random_prompts(1, length)[0]
    llm = _open(path, context=length + 16, batch=length, threads=threads)
    best = float("inf")
    for _ in range(PREFILL_REPEATS):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        best = min(best, time.perf_counter() - start)
    return length / best


def _open(path: str | Path, context: int, batch: int, threads: int) -> Llama:
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=context,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def _greedy(llm: Llama) -> int:
    """The argmax of the last evaluated token's logits."""
    import llama_cpp

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))

