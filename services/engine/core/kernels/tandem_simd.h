/* Vector width and register blocking per instruction set, shared by Tandem's CPU kernels.
 *
 * Each kernel is written once over GCC/Clang's generic vector extension and compiled once per
 * instruction set by native_build.py (-march=x86-64-v4 for AVX-512, x86-64-v3 for AVX2+FMA, each
 * also with VNNI where the CPU has it, the architecture's baseline for "generic": SSE2 on x86-64,
 * NEON on aarch64, where "neondot" adds Armv8.2's sdot as VNNI adds vpdpbusd). The macros below
 * pick what fits each set's register file, so a vector never spans several hardware registers and
 * the accumulators of a row block stay in registers:
 *
 *   set      vector registers   LANES (floats)   GEMM row block
 *   AVX-512  32 x 512-bit       16               8 rows x 2 vectors = 16 accumulators
 *   AVX2     16 x 256-bit        8               4 rows x 2 vectors =  8 accumulators
 *   generic  16 (SSE2) or 32    4               4 rows x 2 vectors =  8 accumulators
 *            (NEON) x 128-bit
 *
 * A weight tile is always two vectors wide (TILE = 2 * LANES output features).
 */
#ifndef TANDEM_SIMD_H
#define TANDEM_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#if defined(__AVX512VNNI__)
#define TANDEM_ISA "avx512vnni" /* AVX-512 with vpdpbusd: cpu_q4a8_gemm.c's integer dots */
#else
#define TANDEM_ISA "avx512"
#endif
#define LANES 16
#define DEFAULT_ROW_BLOCK 8
#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__)
#define TANDEM_ISA "avxvnni" /* AVX2 with AVX-VNNI's vpdpbusd */
#else
#define TANDEM_ISA "avx2"
#endif
#define LANES 8
#define DEFAULT_ROW_BLOCK 4
#else
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define TANDEM_ISA "neondot" /* NEON with sdot (Armv8.2's dot product): cpu_q4a8_gemm.c's dots */
#else
#define TANDEM_ISA "generic"
#endif
#define LANES 4
#define DEFAULT_ROW_BLOCK 4
#endif
#ifndef ROW_BLOCK
#define ROW_BLOCK DEFAULT_ROW_BLOCK
#endif

#define VECS 2
#define TILE (VECS * LANES)

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef uint8_t bytes_vec __attribute__((vector_size(LANES)));
typedef int8_t sbytes_vec __attribute__((vector_size(LANES)));
/* unaligned, aliasing views for loads and stores (a memcpy into a vector can go through the stack) */
typedef float vec_u __attribute__((vector_size(LANES * 4), aligned(1), may_alias));
typedef uint8_t bytes_vec_u __attribute__((vector_size(LANES), aligned(1), may_alias));
typedef int8_t sbytes_vec_u __attribute__((vector_size(LANES), aligned(1), may_alias));

static inline vec load_vec(const float *p) { return *(const vec_u *)p; }

static inline void store_vec(float *p, vec v) { *(vec_u *)p = v; }

typedef int32_t int_vec __attribute__((vector_size(LANES * 4)));

/* LANES bytes at p widened to 32-bit lanes. Written with the x86 widening loads where there are
 * some: GCC lowers a generic byte-to-int vector conversion lane by lane in some shapes. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int_vec widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (int_vec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (int_vec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const bytes_vec_u *)p, int_vec);
#endif
}

static inline int_vec widen_s8(const int8_t *p) {
#if defined(__AVX512F__)
    return (int_vec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (int_vec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const sbytes_vec_u *)p, int_vec);
#endif
}

/* LANES 16-bit values at p widened (zero-extended) to 32-bit lanes. */
static inline int_vec widen_u16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (int_vec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (int_vec)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    typedef uint16_t u16_vec_u __attribute__((vector_size(LANES * 2), aligned(1), may_alias));
    return __builtin_convertvector(*(const u16_vec_u *)p, int_vec);
#endif
}

/* LANES signed bytes at p as floats. */
static inline vec s8_to_float(const int8_t *p) { return __builtin_convertvector(widen_s8(p), vec); }

/* The low and the high nibbles of LANES bytes at p as floats (masks and shifts on 32-bit lanes:
 * x86 has no byte shift). */
static inline void nibbles_to_float(const uint8_t *p, vec *low, vec *high) {
    const int_vec wide = widen_u8(p);
    *low = __builtin_convertvector(wide & 15, vec);
    *high = __builtin_convertvector(wide >> 4, vec);
}


/* x in every lane. Not (vec){0} + x: 0 + x is not x for x = -0, so that compiles to a scalar add
 * before the broadcast (a broadcast in a kernel's inner loop then costs two instructions). */
static inline vec splat(float x) {
#if LANES == 16
    return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif LANES == 8
    return (vec){x, x, x, x, x, x, x, x};
#else
    return (vec){x, x, x, x};
#endif
}

/* Sum of the lanes as a tree (halves, then quarters, ...), not LANES dependent adds. */
static inline float hsum(vec v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] += a[i + width];
    return a[0];
}

/* a where mask (all ones), else b, lane by lane (the generic vector extension has no ternary
 * in C). */
static inline int_vec iselect(int_vec mask, int_vec a, int_vec b) {
    return (a & mask) | (b & ~mask);
}

static inline vec vselect(int_vec mask, vec a, vec b) {
    return (vec)iselect(mask, (int_vec)a, (int_vec)b);
}

static inline vec vmin(vec a, vec b) { return vselect(a < b, a, b); }

/* LANES bfloat16 values at p as floats: the upper half of a float's bits, so a shift (exact). */
static inline vec bf16_to_float(const uint16_t *p) { return (vec)(widen_u16(p) << 16); }

/* LANES IEEE float16 values at p as floats, exactly (subnormals, infinities and NaNs included):
 * F16C's vcvtph2ps where the instruction set has it (AVX2 builds, x86-64-v3, and AVX-512), else
 * moving exponent and mantissa into place and rebiasing the exponent with one multiply by 2^112,
 * which also scales float16 subnormals (float32 subnormals then) exactly. */
static inline vec f16_to_float(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    const int_vec h = widen_u16(p);
    const int_vec bits = (h & 0x7fff) << 13;
    const int_vec scaled = (int_vec)((vec)bits * splat(0x1p112f));
    const int_vec inf_nan = (h & 0x7c00) == 0x7c00; /* all ones where the exponent is 31 */
    return (vec)(iselect(inf_nan, bits | 0x7f800000, scaled) | ((h & 0x8000) << 16));
#endif
}

/* exp of LANES floats (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2], within
 * 2 ulp of expf); inputs below -87.3 give 0, as softmax's exp(score - max) needs; callers keep
 * inputs under 88.7, where expf overflows. libm's scalar expf was most of a decode step's
 * attention time. */
static inline vec vexp(vec x) {
    const vec big = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vec t = x * splat(1.44269504088896341f) + big;
    const vec n = t - big;
    vec r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vec poly = splat(1.9875691500e-4f);
    poly = poly * r + splat(1.3981999507e-3f);
    poly = poly * r + splat(8.3334519073e-3f);
    poly = poly * r + splat(4.1665795894e-2f);
    poly = poly * r + splat(1.6666665459e-1f);
    poly = poly * r + splat(5.0000001201e-1f);
    poly = poly * r * r + r + splat(1.0f);
    const int_vec exponent = ((int_vec)t - (int_vec)big + 127) << 23; /* 2^n */
    const int_vec keep = x >= splat(-87.3f); /* all ones where the result is a normal float */
    return (vec)((int_vec)(poly * (vec)exponent) & keep);
}

#endif
