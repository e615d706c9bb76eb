#!/usr/bin/env bash
# The GPU checklist (../shared/GPU.md) as one run on a lent device machine, each step under its
# own time limit so a slow one cannot starve the rest. Run from the repository root there, with
# the Python packages the image lacks carried as wheels in .gpu/whl and SmolLM2's tokenizer.json
# in .gpu/ (see docs/benchmarks.md, "GPU"). Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_checklist}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
export TANDEM_TEST_TOKENIZER_JSON=$PWD/.gpu/tokenizer.json
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    if [ "$limit" = 0 ]; then echo "== $name: skipped"; return; fi
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
# PYTEST_FILES: a subset to run instead (e.g. after a change to one path)
TAIL=6 step pytest "${PYTEST_S:-190}" python3 -m pytest -q -p no:cacheprovider ${PYTEST_FILES:-\
    tests/test_gpu.py tests/test_gpu_families.py tests/test_cuda_ipc_gpu.py tests/test_cuda_ipc.py \
    tests/test_cuda_ipc_failures.py tests/test_gpu_fused.py tests/test_triton_attention.py \
    tests/test_cuda_graphs.py tests/test_gpu_fp8_kv.py}
# DET_ARGS: e.g. "--kv-cache-dtype fp8"
TAIL=30 step determinism "${DET_S:-70}" python3 bench/gpu_determinism.py ${DET_ARGS:-}
# the fp8 KV cache against bfloat16: agreement per family at 4k tokens, decode speed (issue 44)
TAIL=22 step kv_fp8 "${KV_FP8_S:-0}" python3 bench/kv_cache_fp8_gpu.py ${KV_FP8_ARGS:-}
TAIL=8 step handoff "${HANDOFF_S:-80}" python3 bench/kv_handoff_gpu.py --tokens 4096 --reps 3
TAIL=12 step served "${SERVED_S:-170}" python3 bench/gpu_served.py \
    --tokenizer-json .gpu/tokenizer.json --concurrency 1 64 --mode disaggregated \
    --profile "${PROFILE_S:-6}" --out /tmp/gpu_served_out
TAIL=200 step profile 30 python3 bench/pyspy_top.py --top 18 \
    /tmp/gpu_served_out/disaggregated/profile-decode.txt \
    /tmp/gpu_served_out/disaggregated/profile-gateway.txt \
    /tmp/gpu_served_out/disaggregated/profile-prefill.txt
TAIL=14 step speculative "${SPEC_S:-150}" python3 bench/gpu_speculative.py --tokens 128
