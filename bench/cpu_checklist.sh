#!/usr/bin/env bash
# Issue 44's measurements on the CPU this runs on, as one run: meant for a CPU kind not measured
# yet (AVX-512 with VNNI / BF16 above all), each step under its own time limit so a slow one
# cannot starve the rest. Run from the repository root after `scripts/install.sh --test`, on an
# idle machine (the steps run one at a time; nothing else should). Logs go to $OUT, one per step,
# and each step's tail is printed as it ends.
#
#   bash bench/cpu_checklist.sh                   # everything (~1.5 h on 2 cores, builds included)
#   BUILD_S=0 LLAMA_CPP=DIR bash bench/cpu_checklist.sh   # reuse a built llama.cpp tree: DIR has
#                                                 # build/ (native) and build-avx2/ (AVX2 only)
#   VLLM_PYTHON=/venv/bin/python bash bench/cpu_checklist.sh   # vLLM's CPU build as an anchor
#                                                 # (see bench/serve_compare.py's docstring)
#
# A step is skipped with its limit set to 0 (e.g. SERVE_S=0). What each step answers:
#   tests     the VNNI builds give the base builds' bits here (real vpdpbusd on a VNNI CPU), every
#             instruction set's kernels against their references, the VNNI choice's selection
#   build     llama.cpp from the llama-cpp-python sdist (its vendored tree), twice: native
#             (GGML_NATIVE: AVX-512 VNNI where present) and AVX2 only (Tandem's avx2 set's rival)
#   ggufs     the Llama-3.2-1B / Qwen3-1.7B / Gemma-3-1B Q4_K_M shapes, made by llama.cpp's own
#             converter and quantizer (bench/family_ggufs.py)
#   tune      `tandem tune`: the VNNI choice (VNNI against its base set, same bits) and the
#             prefetch distances on this CPU (decode_step runs before and after it)
#   isa       the batch-1 decode step per instruction set this CPU runs, sets taking turns
#   family    batch-1 decode / 512-token prefill next to llama.cpp (llama-cpp-python on each
#             llama.cpp build: native against Tandem's best set, AVX2-only against TANDEM_CPU_ISA=avx2)
#   bench     llama-bench on the same files, both builds
#   kv        q8_0 KV against 16-bit at a 4,096-token context (decode speed, bytes per token)
#   serve     bench/serve_compare.py: the default model at concurrency 1/4/16/32 and the 1B shape
#             at 1/8, next to llama-server (and vLLM with VLLM_PYTHON)
#   startup   the first `tandem up` with the kernel cache removed, then a later one
set -u
OUT=${OUT:-/tmp/cpu_checklist}
WORK=${WORK:-/tmp/cpu_checklist_work}
PY=$(realpath -s "${PY:-.venv/bin/python}")  # -s: the venv's python, not its base interpreter
LLAMA_CPP_PY_VERSION=${LLAMA_CPP_PY_VERSION:-0.3.36}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    if [ "$limit" = 0 ]; then echo "== $name: skipped"; return 0; fi
    local start=$SECONDS
    # through bash -c: a step may be one of this script's functions (exported below)
    timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s ($(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    return $rc
}

lscpu | grep -E "^(Model name|CPU family|Model|CPU\(s\)|L2|L3)" | tee "$OUT/cpu.txt"
grep -o -w -E "avx2|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_int8|amx_tile" /proc/cpuinfo \
    | sort -u | tr '\n' ' ' | tee -a "$OUT/cpu.txt"
echo
"$PY" -c 'from services.engine.core.kernels import native_build as n; print("Tandem sets:", n.supported_isas(), "selected:", n.selected_isa())' \
    | tee -a "$OUT/cpu.txt"
ISAS=$("$PY" -c 'from services.engine.core.kernels import native_build as n; print(" ".join(i for i in n.supported_isas() if i != "generic"))')

TAIL=4 step tests "${TESTS_S:-900}" "$PY" -m pytest -q -p no:cacheprovider tests/test_isa_tuning.py \
    tests/test_int8_decode.py tests/test_cpu_isa.py tests/test_cpu_q4a8_gemm.py tests/test_cpu_decode_layers.py

build_llama_cpp() {  # the sdist's vendored llama.cpp, native and AVX2-only, with its shared lib
    if [ ! -d "$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION" ]; then
        "$PY" -m pip download -q --no-binary :all: --no-deps \
            "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$WORK" || return 1
        tar xzf "$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$WORK" || return 1
    fi
    local tree="$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
    local common=(-DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release -G Ninja)
    cmake -S "$tree" -B "$tree/build" "${common[@]}" -DGGML_NATIVE=ON || return 1
    cmake -S "$tree" -B "$tree/build-avx2" "${common[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF || return 1
    for b in build build-avx2; do
        cmake --build "$tree/$b" --target llama llama-bench llama-server llama-quantize -j "$(nproc)" \
            || return 1
    done
}
export -f build_llama_cpp
export PY WORK OUT LLAMA_CPP_PY_VERSION
if [ -z "${LLAMA_CPP:-}" ]; then
    LLAMA_CPP="$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
    TAIL=3 step build "${BUILD_S:-3600}" build_llama_cpp
fi
LLAMA_PY_SRC=$(cd "$LLAMA_CPP/../.." && pwd)  # the sdist root: its llama_cpp package
export LLAMA_CPP LLAMA_PY_SRC
F1=$WORK/ggufs/llama-3.2-1b-q4_k_m.gguf F2=$WORK/ggufs/qwen3-1.7b-q4_k_m.gguf
F3=$WORK/ggufs/gemma-3-1b-q4_k_m.gguf
export F1 F2 F3
ggufs() {  # llama.cpp's converter imports sentencepiece (before it falls back to BPE)
    "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece || return 1
    "$PY" bench/family_ggufs.py --llama-cpp "$LLAMA_CPP" --out "$WORK/ggufs"
}
export -f ggufs
TAIL=4 step ggufs "${GGUFS_S:-1200}" ggufs

decode_steps() {  # the batch-1 step of the 1B and 1.7B shapes, the table only (logs: NAME-stderr.log;
    # decode_step.py prints its table through logging, on stderr)
    "$PY" bench/decode_step.py "$F1" "$F2" --rounds 3 --steps 64 2>&1 | tee -a "$OUT/$1-stderr.log" \
        | grep "^|"
}
tune_all() {  # the VNNI choice and prefetch distances, then each model's kernel paths
    for model in default "$F1" "$F2" "$F3"; do
        "$(dirname "$PY")/tandem" tune --model "$model" 2>&1 | grep -E "VNNI|prefetch|decisions cached"
    done
}
export -f decode_steps tune_all
step decode_before_tune "${ISA_S:-600}" decode_steps decode_before_tune
step tune "${TUNE_S:-900}" tune_all
step decode_after_tune "${ISA_S:-600}" decode_steps decode_after_tune

isa_rounds() {  # the step per instruction set, the sets taking turns, twice
    for round in 1 2; do
        for isa in $ISAS; do
            echo "-- round $round, TANDEM_CPU_ISA=$isa"
            TANDEM_CPU_ISA=$isa "$PY" bench/decode_step.py "$F1" --rounds 2 --steps 64 2>&1 \
                | tee -a "$OUT/isa-stderr.log" | grep "^|"
        done
    done
}
export -f isa_rounds
export ISAS
TAIL=40 step isa "${ISA_S:-600}" isa_rounds

family() {  # the three files next to llama-cpp-python on one llama.cpp build (BUILD), Tandem's set ISA
    local build=$1 isa=$2
    # the sdist's Python package is used from its source tree: its own dependencies
    "$PY" -c "import diskcache, jinja2" 2>/dev/null || "$PY" -m pip install -q diskcache jinja2 || return 1
    PYTHONPATH="$LLAMA_PY_SRC" LLAMA_CPP_LIB_PATH="$LLAMA_CPP/$build/bin" LD_LIBRARY_PATH="$LLAMA_CPP/$build/bin" \
        TANDEM_CPU_ISA=$isa "$PY" bench/family_speed.py "$F1" "$F2" "$F3" --rounds 2
}
export -f family
BEST=${ISAS%% *}
TAIL=20 step family_native "${FAMILY_S:-1200}" family build "$BEST"
case " $ISAS " in *" avx512"*)
    TAIL=20 step family_avx2 "${FAMILY_S:-1200}" family build-avx2 avx2 ;;
esac

llama_bench() {
    for b in build build-avx2; do
        echo "-- $b"
        LD_LIBRARY_PATH="$LLAMA_CPP/$b/bin" "$LLAMA_CPP/$b/bin/llama-bench" -t "$(nproc)" -p 512 -n 64 -r 3 \
            -m "$F1" -m "$F2" -m "$F3"
    done
}
export -f llama_bench
TAIL=30 step bench "${BENCH_S:-1200}" llama_bench
TAIL=12 step kv "${KV_S:-600}" "$PY" bench/kv_cache_q8.py speed "$F1" --context 4096 --steps 24 --rounds 3

serve() {
    local anchors=(llama-server) extra=()
    if [ -n "${VLLM_PYTHON:-}" ]; then anchors+=(vllm); extra=(--vllm-python "$VLLM_PYTHON"); fi
    LD_LIBRARY_PATH="$LLAMA_CPP/build/bin" "$PY" bench/serve_compare.py --stacks tandem \
        --anchors "${anchors[@]}" "${extra[@]}" --llama-server "$LLAMA_CPP/build/bin/llama-server" \
        --output-dir "$WORK/serve-default"
    LD_LIBRARY_PATH="$LLAMA_CPP/build/bin" "$PY" bench/serve_compare.py --model "$F1" \
        --concurrency 1 8 --num-prompts 16 --stacks tandem --anchors "${anchors[@]}" "${extra[@]}" \
        --llama-server "$LLAMA_CPP/build/bin/llama-server" --output-dir "$WORK/serve-1b"
}
export -f serve
export VLLM_PYTHON=${VLLM_PYTHON:-}
TAIL=40 step serve "${SERVE_S:-3000}" serve
TAIL=12 step startup "${STARTUP_S:-600}" "$PY" bench/startup.py --later 1 --no-old --log "$OUT/startup-tandem.log"
echo "logs in $OUT"
