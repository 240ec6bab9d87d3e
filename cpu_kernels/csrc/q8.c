/* The q8 linear: y [M, N] = x [M, K] @ W.T (+ bias) for an 8-bit weight (codes int8 [N, K], scale bf16 [N]:
 * w = q * s), activations in blocks of Q8B; per instruction set, one weight row against tiles of MT activation
 * rows, each row's result one fixed order of fp32 operations (never depending on the other rows).
 *
 * Does not know: how the weights were quantized (offload/quant/int8.py), tensors.
 */
#include "isa.h"

/* sum over chunks of d * dot(q, xq) for one weight row. AVX-512 and plain C read the weight's bytes as q + 128
 * (xor 0x80: unsigned for vpdpbusd), whose extra Q8_OFFSET * sum(xq) per block the caller subtracts; AVX2
 * multiplies |q| by xq with q's sign (vpmaddubsw would saturate on q + 128). */
#if SX_AVX2
#define Q8_OFFSET 0.0f
#else
#define Q8_OFFSET 128.0f
#endif

typedef struct {
    const Acts *a;
    int64_t K, full, N;
    const float *corr;                  /* Q8_OFFSET * sum of ds per activation row */
    const int32_t *ncorr;               /* AVX2 with VNNI: q8_ncorr's lane corrections */
    const uint16_t *scale;
    const void *bias;
    int bias_bf16, out_bf16;
    void *out;
} Q8Call;

#if SX_AVX2
/* AVX2 q8, one 64-value block (two chunks) at a time: each lane's int32 dot over the block's two chunks is exact,
 * then one cvt and one fma with the block's d per activation row. With VNNI the weight reads as q + 128 (xor
 * 0x80: unsigned for vpdpbusd, once per chunk for every row) and the accumulator starts at the lane's
 * -128 * sum(xq) (ncorr, made once per call), so the int32 is the same exact sum; without VNNI |q| times xq with
 * q's sign (vpmaddubsw would saturate on q + 128). Both give the same int32 per lane, so the same bits. */
ALWAYS_INLINE __m256i q8_load(const Q8Call *k, const int8_t *codes, int64_t c) {
    if (c < k->full) return _mm256_loadu_si256((const __m256i *)(codes + c * CB));
    int8_t tmp[CB] = {0};                                 /* the row's partial last chunk, zero-padded */
    memcpy(tmp, codes + c * CB, (size_t)(k->K - c * CB));
    return _mm256_loadu_si256((const __m256i *)tmp);
}

ALWAYS_INLINE __m256i q8_dot(__m256i w, __m256i x) {     /* maddubs: lanes of 4 exact products */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                             _mm256_set1_epi16(1));
}

ALWAYS_INLINE void q8_block_avx2(const Q8Call *k, const int8_t *codes, int64_t b, int64_t m0, __m256 *acc,
                                 const int MTC) {
    const Acts *a = k->a;
    int64_t c0 = 2 * b;
    int two = c0 + 1 < a->nc;
    _mm_prefetch((const char *)(codes + c0 * CB + PREFETCH), _MM_HINT_T0);
    __m256i w0 = q8_load(k, codes, c0), w1 = two ? q8_load(k, codes, c0 + 1) : _mm256_setzero_si256();
#ifdef SX_VNNI256
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    w0 = _mm256_xor_si256(w0, flip), w1 = _mm256_xor_si256(w1, flip);
#endif
    for (int i = 0; i < MTC; i++) {
        const int8_t *xq = a->q + (m0 + i) * a->kp + c0 * CB;
#ifdef SX_VNNI256
        __m256i dot = SX_VNNI256(_mm256_loadu_si256((const __m256i *)(k->ncorr + ((m0 + i) * a->nb + b) * LANES)),
                                 w0, _mm256_load_si256((const __m256i *)xq));
        if (two) dot = SX_VNNI256(dot, w1, _mm256_load_si256((const __m256i *)(xq + CB)));
#else
        __m256i dot = q8_dot(w0, _mm256_load_si256((const __m256i *)xq));
        if (two) dot = _mm256_add_epi32(dot, q8_dot(w1, _mm256_load_si256((const __m256i *)(xq + CB))));
#endif
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(a->d + (m0 + i) * a->nb + b), acc[i]);
    }
}

/* ncorr [M, nb, LANES]: -128 x the sum of the activation codes each lane of each block meets (VNNI only). */
static int32_t *q8_ncorr(const Acts *a, int64_t M) {
    int32_t *nc = malloc(sizeof(int32_t) * (size_t)(M * a->nb * LANES + 1));
    if (!nc) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < a->nb; b++)
            for (int l = 0; l < LANES; l++) {
                int t = 0;
                for (int64_t c = 2 * b; c < 2 * b + 2 && c < a->nc; c++)
                    for (int j = 0; j < 4; j++) t += a->q[m * a->kp + c * CB + 4 * l + j];
                nc[(m * a->nb + b) * LANES + l] = -128 * t;
            }
    return nc;
}
#endif

ALWAYS_INLINE void q8_tile(const Q8Call *k, const int8_t *codes, int64_t n, int64_t m0, const int MTC) {
    const Acts *a = k->a;
    float res[MT];
#if SX_AVX512
    __m512 acc[MT];
    for (int i = 0; i < MTC; i++) acc[i] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < a->nc; c++) {
        int64_t k0 = c * CB;
        __m512i w = c < k->full ? _mm512_loadu_si512(codes + k0)
                                : _mm512_maskz_loadu_epi8((((__mmask64)1 << (k->K - k0)) - 1), codes + k0);
        w = _mm512_xor_si512(w, flip);                    /* padding: 0x80 * 0 */
        for (int i = 0; i < MTC; i++) {
            const int8_t *xq = a->q + (m0 + i) * a->kp + k0;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(xq));
            __m512 d = _mm512_loadu_ps(a->dl + ((m0 + i) * a->nc + c) * LANES);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i]);
        }
    }
    for (int i = 0; i < MTC; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
#elif SX_AVX2
    __m256 acc[MT];
    for (int i = 0; i < MTC; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) q8_block_avx2(k, codes, b, m0, acc, MTC);
    for (int i = 0; i < MTC; i++) res[i] = hsum256(acc[i]);
#else
    float acc[MT][LANES];
    memset(acc, 0, sizeof acc);
    for (int64_t c = 0; c < a->nc; c++)
        for (int l = 0; l < LANES; l++) {
            int64_t k0 = c * CB + 4 * l;
            for (int i = 0; i < MTC; i++) {
                const int8_t *xq = a->q + (m0 + i) * a->kp + k0;
                int dot = 0;
                for (int t = 0; t < 4 && k0 + t < k->K; t++) dot += ((int)codes[k0 + t] + 128) * xq[t];
                acc[i][l] = fmaf((float)dot, a->dl[((m0 + i) * a->nc + c) * LANES + l], acc[i][l]);
            }
        }
    for (int i = 0; i < MTC; i++) {
        float t = 0.0f;
        for (int l = 0; l < LANES; l++) t += acc[i][l];
        res[i] = t;
    }
#endif
    float s = bf16_to_f32(k->scale[n]), bn = bias_at(k->bias, k->bias_bf16, n);
    for (int i = 0; i < MTC; i++) store(k->out, k->out_bf16, (m0 + i) * k->N + n, s * (res[i] - k->corr[m0 + i]) + bn);
}

static void q8_rows(const Q8Call *k, const int8_t *codes, int64_t n, int64_t M) {
    int64_t m0 = 0;
    for (; m0 + MT <= M; m0 += MT) q8_tile(k, codes, n, m0, MT);
    switch (M - m0) {
    case 1: q8_tile(k, codes, n, m0, 1); break;
    case 2: q8_tile(k, codes, n, m0, 2); break;
    case 3: q8_tile(k, codes, n, m0, 3); break;
    case 4: q8_tile(k, codes, n, m0, 4); break;
    case 5: q8_tile(k, codes, n, m0, 5); break;
    case 6: q8_tile(k, codes, n, m0, 6); break;
    case 7: q8_tile(k, codes, n, m0, 7); break;
    default: break;
    }
}

/* y [M, N] = x [M, K] @ W.T (+ bias) for a q8 weight (per-channel scale). */
int sx_q8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scale,
                 int64_t N, const void *bias, int bias_bf16, void *out, int out_bf16, int threads) {
    if (M < 0 || N < 0 || K <= 0) return -2;
    Acts a;
    if (quantize_acts(x, x_bf16, M, K, Q8B, 0, &a)) return -1;
    float *corr = malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    if (!corr) return -1;
    for (int64_t m = 0; m < M; m++) {
        float t = 0.0f;
        for (int64_t b = 0; b < a.nb; b++) t += a.ds[m * a.nb + b];
        corr[m] = Q8_OFFSET * t;
    }
    int32_t *ncorr = NULL;
#if SX_AVX2 && defined(SX_VNNI256)
    if (!(ncorr = q8_ncorr(&a, M))) return free(corr), -1;
#endif
    Q8Call k = {.a = &a, .K = K, .full = K / CB, .N = N, .corr = corr, .ncorr = ncorr, .scale = scale,
                .bias = bias, .bias_bf16 = bias_bf16, .out_bf16 = out_bf16, .out = out};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) q8_rows(&k, codes + n * K, n, M);
    free(corr);
    free(ncorr);
    return 0;
}
