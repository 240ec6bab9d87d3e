/* Choosing a 4-bit weight's codes (the layer cache's conversion): for each group of G weights of each output row,
 * the range [lo, hi] with the least squared error among a few candidates, then the codes packed in the q4 layout
 * (cpu_kernels/ops.py). The same search as offload/quant/int4.py's pure-torch one, group by group in registers
 * instead of a pass over the whole weight per operation:
 *   start     [min, max] of the group
 *   clips     [min, max] * f for each further factor f (clips[1..]), kept where the error is lower
 *   refits    the least-squares fit w ~ a q + b to the current best range's codes, (lo, hi) = (b, b + 15 a), kept
 *             where the error is lower
 * scale s = bf16((hi - lo) / 15) (at least 1e-8), zero z = bf16(lo + 8 s), codes q = clamp(rint((w - (z - 8 s)) /
 * s), 0, 15), error sum ((q - 8) s + z - w)^2: each the fp32 operations int4.py names, in that order (the library is
 * built with -ffp-contract=off); sums over a group run in one fixed order (8 partial sums, then pairwise), so the
 * result is the same on every machine and for every thread count. torch sums in its own order, so a group whose
 * candidates tie to the last bit may choose another one than the twin does (tests hold the errors, not the bits).
 *
 * Does not know: files, layers, which weights are quantized, CUDA's layout.
 */
#include "isa.h"

#define QG_MAX 128

/* sum of x[0..n) (n a multiple of 8) in 8 partial sums, then pairwise: a fixed order whatever the compiler does */
ALWAYS_INLINE float fixed_sum(const float *x, int n) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) p[l] += x[i + l];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

ALWAYS_INLINE void scale_zero(float lo, float hi, float *s, float *z) {
    float sc = (hi - lo) / 15.0f;
    if (sc < 1e-8f) sc = 1e-8f;                              /* torch's clamp(min=1e-8): NaN stays NaN */
    *s = round_bf16(sc);
    *z = round_bf16(lo + 8.0f * *s);
}

/* float codes of w[0..G) on [lo, hi] into q; returns the squared error */
ALWAYS_INLINE float codes_error(const float *w, int G, float lo, float hi, float *q, float *e) {
    float s, z;
    scale_zero(lo, hi, &s, &z);
    float c = z - 8.0f * s;
    for (int i = 0; i < G; i++) {
        float t = nearbyintf((w[i] - c) / s);
        q[i] = t < 0.0f ? 0.0f : t > 15.0f ? 15.0f : t;
    }
    for (int i = 0; i < G; i++) {
        float d = (q[i] - 8.0f) * s + z - w[i];
        e[i] = d * d;
    }
    return fixed_sum(e, G);
}

/* least-squares range for the codes q of w: (lo, hi) */
ALWAYS_INLINE void refit(const float *w, const float *q, int G, float wsum, float *lo, float *hi, float *tmp) {
    float n = (float)G;
    float mq = fixed_sum(q, G) / n, mw = wsum / n;
    float num[QG_MAX];
    for (int i = 0; i < G; i++) {
        float dq = q[i] - mq;
        num[i] = dq * (w[i] - mw);
        tmp[i] = dq * dq;
    }
    float den = fixed_sum(tmp, G);
    float a = fixed_sum(num, G) / (den < 1e-12f ? 1e-12f : den);
    if (a < 1e-8f) a = 1e-8f;
    *lo = mw - a * mq;
    *hi = *lo + 15.0f * a;
}

ALWAYS_INLINE void quantize_group(const float *w, int G, const float *clips, int nclip, int refits, uint8_t *codes,
                           uint16_t *sz) {
    float qa[QG_MAX], qb[QG_MAX], e[QG_MAX];
    float *q = qa, *cand = qb, *swap;                        /* q: the best range's codes; cand: a candidate's */
    float lo0 = w[0], hi0 = w[0];
    for (int i = 1; i < G; i++) {
        lo0 = fminf(lo0, w[i]);
        hi0 = fmaxf(hi0, w[i]);
    }
    float lo = lo0 * clips[0], hi = hi0 * clips[0];
    float err = codes_error(w, G, lo, hi, q, e);
    for (int c = 1; c < nclip; c++) {
        float clo = lo0 * clips[c], chi = hi0 * clips[c];
        float cerr = codes_error(w, G, clo, chi, cand, e);
        if (cerr < err) lo = clo, hi = chi, err = cerr, swap = q, q = cand, cand = swap;
    }
    if (refits > 0) {
        float wsum = fixed_sum(w, G);
        for (int r = 0; r < refits; r++) {
            float clo, chi;
            refit(w, q, G, wsum, &clo, &chi, e);
            float cerr = codes_error(w, G, clo, chi, cand, e);
            if (cerr < err) lo = clo, hi = chi, err = cerr, swap = q, q = cand, cand = swap;
        }
    }
    float s, z;
    scale_zero(lo, hi, &s, &z);
    int half = G / 2;
    for (int j = 0; j < half; j++) codes[j] = (uint8_t)((int)q[j] | ((int)q[j + half] << 4));
    sz[0] = f32_to_bf16(s);
    sz[1] = f32_to_bf16(z);
}

/* w [N, K] (fp32, or bf16 when w_bf16) -> codes uint8 [N, K/2] and sz bf16 [N, K/G, 2] in the q4 layout.
 * clips[0] scales the starting [min, max] (1 for the plain range), clips[1..nclip) are the further factors tried,
 * then `refits` least-squares refits. Rows run in parallel on `threads` threads. 0, or -2 for bad arguments. */
int sx_q4_quantize(const void *w, int w_bf16, int64_t N, int64_t K, int G, const float *clips, int nclip,
                   int refits, uint8_t *codes, uint16_t *sz, int threads) {
    if (G <= 0 || G > QG_MAX || G % 16 || K % G || N < 0 || nclip < 1 || refits < 0) return -2;
    int64_t ng = K / G;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        float wf[QG_MAX];
        for (int64_t g = 0; g < ng; g++) {
            int64_t at = n * K + g * G;
            if (w_bf16)
                for (int i = 0; i < G; i++) wf[i] = bf16_to_f32(((const uint16_t *)w)[at + i]);
            else
                memcpy(wf, (const float *)w + at, sizeof(float) * G);
            uint8_t *c = codes + at / 2;
            uint16_t *z = sz + 2 * (n * ng + g);
            if (G == 64) quantize_group(wf, 64, clips, nclip, refits, c, z);      /* G a constant: loops unrolled */
            else if (G == 32) quantize_group(wf, 32, clips, nclip, refits, c, z);
            else if (G == 128) quantize_group(wf, 128, clips, nclip, refits, c, z);
            else quantize_group(wf, G, clips, nclip, refits, c, z);
        }
    }
    return 0;
}
