/* Activation quantization, the first step of every linear: each row of x is cut into blocks of B values (q4:
 * B = G; q8: B = 64) and each block gets d = amax / 127 and codes round_half_even(x * (127 / amax)) in [-127,
 * 127], exactly what torch's ops compute in fp32 (cpu_kernels/ops.py's pure-torch reference reproduces them bit for
 * bit). The q4 kernels read a row's codes in their chunk order (place_q4); every chunk also gets the vector of
 * its lanes' d (dl).
 *
 * Does not know: weights, which kernel runs next.
 */
#include "isa.h"

/* One block of n values (fp32) -> codes q[n], d and d * sum(q). The vector paths give the same codes as the
 * scalar one (max is exact, then the same fp32 multiply and round-half-even conversion), so a partial block at
 * the end of a row may take the scalar path. */
static void quant_block(const float *x, int n, int8_t *q, float *d, float *ds) {
    float amax = 0.0f;
    int sum = 0;
#if SX_AVX512
    if (n % 16 == 0) {
        __m512 mx = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
        amax = _mm512_reduce_max_ps(mx);
        __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), acc = _mm512_setzero_si512();
        for (int i = 0; i < n; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), id));   /* MXCSR: nearest-even */
            v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
            acc = _mm512_add_epi32(acc, v);
        }
        sum = _mm512_reduce_add_epi32(acc);
        *d = amax / 127.0f;
        *ds = *d * (float)sum;
        return;
    }
#endif
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
        sum += (int)v;
    }
    *d = amax / 127.0f;
    *ds = *d * (float)sum;
}

/* Scratch of the calling thread (grown, never shrunk: no allocation once the largest call has been seen). */
static __thread uint8_t *scratch;
static __thread size_t scratch_size;

static void *scratch_get(size_t n) {
    if (n > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (n + 63) / 64 * 64);
        scratch_size = scratch ? n : 0;
    }
    return scratch;
}

/* Row m of x (fp32 or bf16) as fp32: x itself, or converted into buf[K]. */
static const float *row_f32(const void *x, int bf16, int64_t m, int64_t K, float *buf) {
    if (!bf16) return (const float *)x + m * K;
    const uint16_t *h = (const uint16_t *)x + m * K;
    for (int64_t k = 0; k < K; k++) buf[k] = bf16_to_f32(h[k]);
    return buf;
}

/* q4 order: chunk c of CB code bytes reads 2*CB activations, [CB for the low nibbles][CB for the high ones];
 * code byte b = c*CB + p is in block g = b / (B/2) at j = b % (B/2). A block's halves are copied in runs. */
static void place_q4(int8_t *qr, const int8_t *blk, int64_t b, int n, int B) {
    int half = B / 2, run = half < CB ? half : CB;
    for (int r = 0; r < half && r < n; r += run) {
        int64_t byte = (int64_t)b * half + r, c = byte / CB, p = byte % CB;
        int lo = n - r < run ? n - r : run, hi = n - half - r < run ? n - half - r : run;
        memcpy(qr + c * 2 * CB + p, blk + r, (size_t)lo);
        if (hi > 0) memcpy(qr + c * 2 * CB + CB + p, blk + half + r, (size_t)hi);
    }
}

int quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int B, int q4, Acts *a) {
    int64_t nb = (K + B - 1) / B;
    int64_t kp = q4 ? (K / 2 + CB - 1) / CB * CB * 2 : (K + CB - 1) / CB * CB;
    int64_t nc = q4 ? kp / (2 * CB) : kp / CB;
    size_t need = (size_t)(M * kp) + 4 * (size_t)(2 * M * nb + M * nc * LANES + K + B) + 256;
    uint8_t *s = scratch_get(need);
    if (!s) return -1;
    a->q = (int8_t *)s;
    a->d = (float *)(s + (M * kp + 63) / 64 * 64);
    a->ds = a->d + M * nb;
    a->dl = a->ds + M * nb;
    float *fbuf = a->dl + M * nc * LANES;
    int8_t *blk = (int8_t *)(fbuf + K);
    a->kp = kp, a->nb = nb, a->nc = nc;
    memset(a->q, 0, (size_t)(M * kp));
    int rel[LANES];
    for (int l = 0; l < LANES; l++) rel[l] = lane_block(l, B, q4);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = row_f32(x, bf16, m, K, fbuf);
        int8_t *qr = a->q + m * kp;
        float *d = a->d + m * nb, *ds = a->ds + m * nb;
        for (int64_t b = 0; b < nb; b++) {
            int n = (int)((b + 1) * B <= K ? B : K - b * B);
            quant_block(xr + b * B, n, q4 ? blk : qr + b * B, d + b, ds + b);
            if (q4) place_q4(qr, blk, b, n, B);
        }
        for (int64_t c = 0; c < nc; c++) {               /* lane l of chunk c: block first(c) + rel[l] */
            int64_t first = q4 ? c * CB / (B / 2) : c * CB / B;
            float *dl = a->dl + (m * nc + c) * LANES;
            for (int l = 0; l < LANES; l++) dl[l] = first + rel[l] < nb ? d[first + rel[l]] : 0.0f;
        }
    }
    return 0;
}
