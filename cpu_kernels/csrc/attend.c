/* Row-by-row attention (sx_attend_rows, sx_attend_into): each query row attends over its own list of cache slots
 * in the listed order, with arithmetic that depends only on that row's query and the keys and values it sees
 * (cpu_kernels/attend.py says why: a tree pass gives the one-token decode's bits). e^x from fastexp.h.
 *
 * Does not know: trees, masks (the slot lists come made), the cache's layout beyond the strides it is given.
 */
#include "fastexp.h"
#include "isa.h"
#include "kernels.h"

/* Scratch of an OpenMP worker for one attention row: the scores, the fp32 query and the output accumulator. */
static __thread float *attn_buf;
static __thread size_t attn_cap;

static float *attn_scratch(size_t n) {
    if (n > attn_cap) {
        free(attn_buf);
        attn_buf = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
        attn_cap = attn_buf ? n : 0;
    }
    return attn_buf;
}

/* 8 consecutive values of a row (fp32 or bf16) as fp32. */
#if SX_AVX2
static inline __m256 load8(const void *p, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

static inline float at(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* q[D] (fp32) . key[D] in one order fixed by D alone: 8-lane fused sums in four chains (32 values a step: a
 * head of 128 is 4 fused steps deep, not 16), the chains added pairwise, the 8-wide rest into the first, a pairwise
 * fold, then the tail. */
static float attn_dot(const float *q, const void *key, int bf16, int64_t D) {
    int64_t d = 0;
    float s = 0.0f;
#if SX_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; d + 32 <= D; d += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(key, bf16, d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(key, bf16, d + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), load8(key, bf16, d + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), load8(key, bf16, d + 24), a3);
    }
    __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(key, bf16, d), acc);
    s = hsum256(acc);
#endif
    for (; d < D; d++) s = fmaf(q[d], at(key, bf16, d), s);
    return s;
}

/* p[j] = e^(sc[j] - mx) (fastexp.h) in place for j < n; returns their sum: 8 lane sums in order, the pairwise
 * fold, then the tail in order (the order depends on n alone). */
static float softmax_exp(float *sc, int32_t n, float mx) {
    int32_t j = 0;
    float sum = 0.0f;
#if SX_AVX2
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) {
        __m256 p = sx_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
        _mm256_storeu_ps(sc + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    sum = hsum256(acc);
#endif
    for (; j < n; j++) {
        sc[j] = sx_exp(sc[j] - mx);
        sum += sc[j];
    }
    return sum;
}

/* acc[D] += p * val[D]. */
static void attn_axpy(float *acc, float p, const void *val, int bf16, int64_t D) {
    int64_t d = 0;
#if SX_AVX2
    __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(val, bf16, d), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < D; d++) acc[d] = fmaf(p, at(val, bf16, d), acc[d]);
}

/* out [B, H, T, D] (contiguous, q's dtype) = softmax over the listed cache slots of scale * (q . k), times v:
 * row (b, h, t) reads the slots idx[b', t, 0 .. len[b', t]) (b' = b, or 0 when the list is shared: nb == 1) in
 * their listed order, query head h reading KV head h / (H / Hkv). q, k, v: fp32 or bf16 (one flag), the last
 * dimension contiguous, the others at the given element strides (qs: b, h, t; ks, vs: b, h, slot). Every row is
 * three passes over its slots in that order (scores and their max; exp and its sum; the weighted values),
 * sequential, so a row's bits depend only on its query and the keys and values it sees, never on the other rows,
 * on masked slots, or on how the threads share the work (attend_heads: a KV head's query heads together, or
 * some of them when there are more threads than (row, KV head) pairs). */
int sx_attend_rows(const void *q, const void *k, const void *v, void *out, int bf16, int64_t B, int64_t H,
                   int64_t Hkv, int64_t T, int64_t D, const int64_t *qs, const int64_t *ks, const int64_t *vs,
                   const int32_t *idx, const int32_t *len, int64_t nb, int64_t L, float scale, int threads) {
    const int64_t os[3] = {H * T * D, T * D, D};
    return sx_attend_into(q, k, v, out, os, bf16, B, H, Hkv, T, D, qs, ks, vs, idx, len, nb, L, scale, threads);
}

/* Query heads h0 .. h0 + nh - 1 (one KV head's, so they read the same keys and values) of row (b, t): each key and
 * value is loaded once for all of them (from L1 after the first), each head's arithmetic the same sequence as alone. */
typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *os, *qs, *ks, *vs;
    int bf16;
    int64_t D;
    float scale;
} AttendCall;

/* Slots read ahead (prefetched) in both passes over a row's keys and values: in a decode step they come from
 * wherever the layers' weight streams left them, and each slot's ~150 instructions would otherwise keep only a
 * slot or two in flight (docs/algorithms.md §27). */
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 8
#endif
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static int attend_heads(const AttendCall *c, int64_t b, int64_t t, int64_t h0, int64_t nh, int64_t hk,
                        const int32_t *sl, int32_t n) {
    int64_t D = c->D;
    size_t es = c->bf16 ? 2 : 4;
    float *buf = attn_scratch((size_t)nh * (size_t)(n + 2 * D + 1));
    if (!buf) return 1;
    float *sc = buf, *qf = buf + nh * n, *acc = qf + nh * D, *mx = acc + nh * D;
    const char *kb = (const char *)c->k + (b * c->ks[0] + hk * c->ks[1]) * es;
    const char *vb = (const char *)c->v + (b * c->vs[0] + hk * c->vs[1]) * es;
    for (int32_t j = 0; j < n && j < ATTN_AHEAD; j++) prefetch_row(kb + (int64_t)sl[j] * c->ks[2] * es, D * es);
    for (int64_t i = 0; i < nh; i++) {
        const char *qrow = (const char *)c->q + (b * c->qs[0] + (h0 + i) * c->qs[1] + t * c->qs[2]) * es;
        for (int64_t d = 0; d < D; d++) qf[i * D + d] = at(qrow, c->bf16, d);
        mx[i] = -INFINITY;
    }
    for (int32_t j = 0; j < n; j++) {
        const char *key = kb + (int64_t)sl[j] * c->ks[2] * es;
        if (j + ATTN_AHEAD < n) prefetch_row(kb + (int64_t)sl[j + ATTN_AHEAD] * c->ks[2] * es, D * es);
        for (int64_t i = 0; i < nh; i++) {
            float s = attn_dot(qf + i * D, key, c->bf16, D) * c->scale;
            sc[i * n + j] = s;
            mx[i] = fmaxf(mx[i], s);
        }
    }
    for (int32_t j = 0; j < n && j < ATTN_AHEAD; j++) prefetch_row(vb + (int64_t)sl[j] * c->vs[2] * es, D * es);
    memset(acc, 0, (size_t)(nh * D) * 4);
    for (int64_t i = 0; i < nh; i++) mx[i] = softmax_exp(sc + i * n, n, mx[i]);     /* mx[i] := the sum */
    for (int32_t j = 0; j < n; j++) {
        const char *val = vb + (int64_t)sl[j] * c->vs[2] * es;
        if (j + ATTN_AHEAD < n) prefetch_row(vb + (int64_t)sl[j + ATTN_AHEAD] * c->vs[2] * es, D * es);
        for (int64_t i = 0; i < nh; i++) attn_axpy(acc + i * D, sc[i * n + j], val, c->bf16, D);
    }
    for (int64_t i = 0; i < nh; i++) {
        float inv = n > 0 ? 1.0f / mx[i] : 0.0f;
        int64_t o = b * c->os[0] + (h0 + i) * c->os[1] + t * c->os[2];
        for (int64_t d = 0; d < D; d++) store(c->out, c->bf16, o + d, acc[i * D + d] * inv);
    }
    return 0;
}

/* sx_attend_rows with the output at element strides os (b, h, t) instead of contiguous (block.c's rows). */
int sx_attend_into(const void *q, const void *k, const void *v, void *out, const int64_t *os, int bf16, int64_t B,
                   int64_t H, int64_t Hkv, int64_t T, int64_t D, const int64_t *qs, const int64_t *ks,
                   const int64_t *vs, const int32_t *idx, const int32_t *len, int64_t nb, int64_t L, float scale,
                   int threads) {
    if (B < 0 || H <= 0 || Hkv <= 0 || H % Hkv || T < 0 || D <= 0 || L < 0) return -2;
    int64_t G = H / Hkv, units = B * Hkv * T;
    /* heads per task: a KV head's G together, split where that leaves threads idle (the bits never depend on it) */
    int64_t parts = units >= threads ? 1 : (threads + units - 1) / units;
    if (parts > G) parts = G;
    int64_t per = (G + parts - 1) / parts, blocks = (G + per - 1) / per;
    AttendCall c = {q, k, v, out, os, qs, ks, vs, bf16, D, scale};
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : failed)
    for (int64_t r = 0; r < units * blocks; r++) {
        int64_t u = r / blocks, blk = r % blocks;
        int64_t b = u / (Hkv * T), hk = u / T % Hkv, t = u % T;
        int64_t h0 = hk * G + blk * per, nh = G - blk * per < per ? G - blk * per : per;
        const int32_t *sl = idx + ((nb == 1 ? 0 : b) * T + t) * L;
        failed |= attend_heads(&c, b, t, h0, nh, hk, sl, len[(nb == 1 ? 0 : b) * T + t]);
    }
    return failed ? -1 : 0;
}
