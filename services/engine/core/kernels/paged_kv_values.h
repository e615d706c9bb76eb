/* Paged KV cache values for the CPU attention kernels (cpu_paged_attention.c): the element types a
 * cache holds (float32, bfloat16, float16, q8_0 rows), widening them to float32 as they are read,
 * rounding new rows to the cache type as they are stored, and the soft-cap of Gemma 2's scores.
 * A header, not a .c file: native_build.py builds every .c beside it as a kernel library of its own,
 * and these belong to cpu_paged_attention.c's (which includes them once). */
#ifndef TANDEM_PAGED_KV_VALUES_H
#define TANDEM_PAGED_KV_VALUES_H

#include <math.h>
#include <string.h>

#include "tandem_simd.h"

/* the cache's element type (cpu_paged_attention.py's KV_DTYPE_CODES) */
enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2, KV_Q8_0 = 3 };
#define Q8_GROUP 32 /* values per q8_0 scale */

static inline int64_t kv_bytes(int kv_dtype) {
    return kv_dtype == KV_FLOAT32 ? 4 : kv_dtype == KV_Q8_0 ? 1 : 2;
}

/* Element ``index`` of a cache of type kv_dtype (strides count elements, not bytes). */
static inline void *kv_at(void *cache, int64_t index, int kv_dtype) {
    return (char *)cache + index * kv_bytes(kv_dtype);
}

/* A float16's value (exact), one at a time: F16C where the set has it, else the bits moved into
 * place and rebiased by 2^112, as f16_to_float does for a vector. */
static inline float kv_half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t bits = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    if ((h & 0x7c00u) == 0x7c00u) {
        bits |= 0x7f800000u;
        memcpy(&f, &bits, sizeof f);
    } else {
        memcpy(&f, &bits, sizeof f);
        f *= 0x1p112f;
    }
    return h & 0x8000u ? -f : f;
#endif
}

/* The scale of value d of the q8_0 row at byte `row` (quants first, then a float16 per group). */
static inline float kv_q8_scale(const void *cache, int64_t row, int64_t d, int64_t head_dim) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)cache + row + head_dim + 2 * (d / Q8_GROUP), sizeof h);
    return kv_half_to_float(h);
}

/* The head_dim values of the cache row at element `row`, as floats (a tail shorter than a
 * vector through a copy). */
static void kv_widen(float *dst, const void *cache, int64_t row, int64_t n, int kv_dtype) {
    if (kv_dtype == KV_Q8_0) {
        const int8_t *q = (const int8_t *)cache + row;
        int64_t d = 0;
        for (; d + LANES <= n; d += LANES) store_vec(dst + d, s8_to_float(q + d) * kv_q8_scale(cache, row, d, n));
        for (; d < n; d++) dst[d] = (float)q[d] * kv_q8_scale(cache, row, d, n);
        return;
    }
    const uint16_t *src = (const uint16_t *)cache + row;
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        store_vec(dst + d, kv_dtype == KV_BFLOAT16 ? bf16_to_float(src + d) : f16_to_float(src + d));
    if (d < n) {
        uint16_t tail[LANES] = {0};
        float wide[LANES];
        memcpy(tail, src + d, (size_t)(n - d) * sizeof(uint16_t));
        store_vec(wide, kv_dtype == KV_BFLOAT16 ? bf16_to_float(tail) : f16_to_float(tail));
        memcpy(dst + d, wide, (size_t)(n - d) * sizeof(float));
    }
}

/* float32 -> bfloat16, to nearest even; a NaN becomes the quiet NaN 0x7fc0 (as PyTorch rounds). */
static inline uint16_t kv_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* float32 -> IEEE float16, to nearest even, overflowing to infinity: F16C's vcvtps2ph, else the
 * FP16 library's fp16_ieee_from_fp32_value (the conversion PyTorch uses), which lets the float
 * unit round: scaling by 2^112 then 2^-110 leaves the bits float16 keeps, rounded. */
static inline uint16_t kv_to_f16(float x) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, 0); /* 0: round to nearest even */
#else
    uint32_t w, bits;
    float base = (fabsf(x) * 0x1p+112f) * 0x1p-110f;
    memcpy(&w, &x, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_float;
    memcpy(&bias_float, &bias_bits, sizeof bias_float);
    base = bias_float + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
#endif
}

/* n floats as a q8_0 row at dst (kv_quant.quantize's arithmetic: per group of 32, d = max|x| /
 * 127, quants rint(x * (1 / d)) (to nearest even; 0 for an all-zero group), d stored as float16). */
static void kv_q8_store(uint8_t *dst, const float *src, int64_t n) {
    for (int64_t g0 = 0; g0 < n; g0 += Q8_GROUP) {
        const int64_t end = g0 + Q8_GROUP < n ? g0 + Q8_GROUP : n;
        float amax = 0.f;
        for (int64_t d = g0; d < end; d++) amax = fabsf(src[d]) > amax ? fabsf(src[d]) : amax;
        const float scale = amax / 127.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
        for (int64_t d = g0; d < end; d++) {
            float x = src[d] * inverse;
            x = rintf(x);
            x = x > 127.f ? 127.f : x < -127.f ? -127.f : x;
            ((int8_t *)dst)[d] = (int8_t)x;
        }
        const uint16_t h = kv_to_f16(scale);
        memcpy(dst + n + 2 * (g0 / Q8_GROUP), &h, sizeof h);
    }
}

/* n floats into a cache row of type kv_dtype. */
static void kv_store(void *dst, const float *src, int64_t n, int kv_dtype) {
    if (kv_dtype == KV_Q8_0) {
        kv_q8_store(dst, src, n);
        return;
    }
    if (kv_dtype == KV_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = dst;
    for (int64_t d = 0; d < n; d++)
        h[d] = kv_dtype == KV_BFLOAT16 ? kv_to_bf16(src[d]) : kv_to_f16(src[d]);
}

/* tanh of LANES floats as 1 - 2 / (exp(2y) + 1), y clamped to +-9 (tanh(9) is 1 in float32,
 * and vexp's input stays in range): within ~1e-7 of tanh, absolute. */
static inline vec vtanh(vec y) {
    const vec top = splat(9.f), bottom = splat(-9.f);
    y = vselect(y > top, top, y);
    y = vselect(y < bottom, bottom, y);
    return splat(1.f) - splat(2.f) / (vexp(y + y) + splat(1.f));
}

/* a * b + c rounded once where the set has a fused multiply-add, else twice. Every score and value
 * accumulation of the decode and prefill kernels goes through it rather than through the
 * compiler's contraction of `c += a * b`, which GCC applied in some inlined shapes and not in
 * others (measured: a score's bits depended on how many keys shared its register block, and a
 * q8_0 row's values on the cache type), so a position's bits never depend on the code path. */
static inline __attribute__((always_inline)) vec fused_madd(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return (vec)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
#endif
}

/* fused_madd for one float: the scalar tails of head sizes that are not whole vectors (decode_task)
 * go through it for the same reason. */
static inline __attribute__((always_inline)) float fused_madd1(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* x[0:n] = cap * tanh(x / cap): attention-logit soft-capping (Gemma 2). */
static void soft_cap(float *x, int64_t n, float cap) {
    const float inv = 1.f / cap;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store_vec(x + i, splat(cap) * vtanh(load_vec(x + i) * inv));
    for (; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* LANES values d .. d + LANES - 1 of the cache row at element `row` (head_dim values; d a multiple
 * of LANES), as floats (kv a constant: inlined per type). */
static inline __attribute__((always_inline)) vec load_kv(const void *cache, int64_t row, int64_t d,
                                                         int64_t head_dim, const int kv) {
    if (kv == KV_FLOAT32) return load_vec((const float *)cache + row + d);
    if (kv == KV_BFLOAT16) return bf16_to_float((const uint16_t *)cache + row + d);
    if (kv == KV_Q8_0) return s8_to_float((const int8_t *)cache + row + d) * kv_q8_scale(cache, row, d, head_dim);
    return f16_to_float((const uint16_t *)cache + row + d);
}

/* Value d of the cache row at element `row`, as a float (the tail of a head size that is not
 * whole vectors). */
static inline __attribute__((always_inline)) float load_kv1(const void *cache, int64_t row, int64_t d,
                                                            int64_t head_dim, const int kv) {
    if (kv == KV_FLOAT32) return ((const float *)cache)[row + d];
    if (kv == KV_Q8_0) return (float)((const int8_t *)cache)[row + d] * kv_q8_scale(cache, row, d, head_dim);
    const int64_t i = row + d;
    uint16_t h[LANES] = {0};
    float wide[LANES];
    h[0] = ((const uint16_t *)cache)[i];
    store_vec(wide, kv == KV_BFLOAT16 ? bf16_to_float(h) : f16_to_float(h));
    return wide[0];
}


#endif /* TANDEM_PAGED_KV_VALUES_H */
