/* The q4 rows without AVX2's tiles: one weight row at a time against tiles of MT activation rows, on AVX-512 VNNI
 * (-DSX_WIDE: 64-byte chunks) or in plain C (q4.c is the entry point; an AVX2 build compiles q4_avx2.c's rows
 * instead and this file to nothing).
 *
 * Does not know: the activations' quantization (acts.c), the AVX2 tiles.
 */
#include "q4.h"

#if !SX_AVX2
#if !SX_AVX512
/* Zero terms of one weight row, plain C: sum over groups of (z - 8 s) * ds, for mt activation rows. */
ALWAYS_INLINE void q4_zero_terms(const uint16_t *sz, int64_t ng, const Acts *a, int64_t m0, const int mt,
                                 float *zt) {
    for (int i = 0; i < mt; i++) zt[i] = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        float mz = fmaf(-8.0f, bf16_to_f32(sz[2 * g]), bf16_to_f32(sz[2 * g + 1]));
        for (int i = 0; i < mt; i++) zt[i] = fmaf(mz, a->ds[(m0 + i) * a->nb + g], zt[i]);
    }
}
#endif

/* y for weight row n and activation rows m0 .. m0 + MTC - 1 (MTC a compile-time constant after inlining):
 * main terms sum over chunks and lanes of s * d * dot, then the zero terms sum over groups of (z - 8 s) * ds. */
ALWAYS_INLINE void q4_tile(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t n, int64_t m0,
                           const int MTC) {
    const Acts *a = k->a;
    float res[MT], zt[MT];
#if SX_AVX512
    __m512 acc[MT];
    for (int i = 0; i < MTC; i++) acc[i] = _mm512_setzero_ps();
    const __m512i sel = _mm512_loadu_si512(k->sel), lo4 = _mm512_set1_epi8(0x0f);
    for (int64_t c = 0; c < a->nc; c++) {
        int64_t b0 = c * CB, g0 = b0 / k->half;
        __m512i w;
        __m128i pr;
        if (c < k->full) {
            w = _mm512_loadu_si512(codes + b0);
            pr = _mm_maskz_loadu_epi16((__mmask8)((1u << (2 * k->gpc)) - 1), sz + 2 * g0);
        } else {                                          /* the last, partial chunk: masked loads */
            int64_t left = k->nbytes - b0, gl = k->ng - g0 < k->gpc ? k->ng - g0 : k->gpc;
            w = _mm512_maskz_loadu_epi8((((__mmask64)1 << left) - 1), codes + b0);
            pr = _mm_maskz_loadu_epi16((__mmask8)((1u << (2 * gl)) - 1), sz + 2 * g0);
        }
        __m512i wl = _mm512_and_si512(w, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4);
        __m512 s8 = _mm512_castps256_ps512(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(pr), 16)));
        __m512 sv = _mm512_permutexvar_ps(sel, s8);
        for (int i = 0; i < MTC; i++) {
            const int8_t *xq = a->q + (m0 + i) * a->kp + c * 2 * CB;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, _mm512_load_si512(xq));
            dot = _mm512_dpbusd_epi32(dot, wh, _mm512_load_si512(xq + CB));
            __m512 sd = _mm512_mul_ps(sv, _mm512_loadu_ps(a->dl + ((m0 + i) * a->nc + c) * LANES));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, acc[i]);
        }
    }
    for (int i = 0; i < MTC; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
    for (int i = 0; i < MTC; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k->ng; g += 16) {
        __mmask16 mk = k->ng - g >= 16 ? 0xffff : (__mmask16)((1u << (k->ng - g)) - 1);
        __m512i p2 = _mm512_maskz_loadu_epi32(mk, sz + 2 * g);
        __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(p2, 16));
        __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p2, _mm512_set1_epi32((int)0xffff0000u)));
        __m512 mz = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
        for (int i = 0; i < MTC; i++)
            acc[i] = _mm512_fmadd_ps(mz, _mm512_maskz_loadu_ps(mk, a->ds + (m0 + i) * a->nb + g), acc[i]);
    }
    for (int i = 0; i < MTC; i++) zt[i] = _mm512_reduce_add_ps(acc[i]);
#else
    float acc[MT][LANES];
    memset(acc, 0, sizeof acc);
    for (int64_t c = 0; c < a->nc; c++)
        for (int l = 0; l < LANES; l++) {
            int64_t b0 = c * CB + 4 * l;
            if (b0 >= k->nbytes) break;
            float s = bf16_to_f32(sz[2 * (b0 / k->half)]);
            for (int i = 0; i < MTC; i++) {
                const int8_t *xq = a->q + (m0 + i) * a->kp + c * 2 * CB;
                int dot = 0;
                for (int t = 0; t < 4; t++) {
                    uint8_t w = codes[b0 + t];
                    dot += (w & 15) * xq[4 * l + t] + (w >> 4) * xq[CB + 4 * l + t];
                }
                float sd = s * a->dl[((m0 + i) * a->nc + c) * LANES + l];
                acc[i][l] = fmaf((float)dot, sd, acc[i][l]);
            }
        }
    for (int i = 0; i < MTC; i++) {
        float t = 0.0f;
        for (int l = 0; l < LANES; l++) t += acc[i][l];
        res[i] = t;
    }
    q4_zero_terms(sz, k->ng, a, m0, MTC, zt);
#endif
    float bn = bias_at(k->bias, k->bias_bf16, n);
    for (int i = 0; i < MTC; i++) store(k->out, k->out_bf16, (m0 + i) * k->N + n, res[i] + zt[i] + bn);
}

/* Every activation row against weight row n, in tiles of MT (each tile size its own unrolled copy). */
static void q4_rows(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t n, int64_t M) {
    int64_t m0 = 0;
    for (; m0 + MT <= M; m0 += MT) q4_tile(k, codes, sz, n, m0, MT);
    switch (M - m0) {
    case 1: q4_tile(k, codes, sz, n, m0, 1); break;
    case 2: q4_tile(k, codes, sz, n, m0, 2); break;
    case 3: q4_tile(k, codes, sz, n, m0, 3); break;
    case 4: q4_tile(k, codes, sz, n, m0, 4); break;
    case 5: q4_tile(k, codes, sz, n, m0, 5); break;
    case 6: q4_tile(k, codes, sz, n, m0, 6); break;
    case 7: q4_tile(k, codes, sz, n, m0, 7); break;
    default: break;
    }
}

void q4_run(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t M, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < k->N; n++) q4_rows(k, codes + n * k->nbytes, sz + n * k->ng * 2, n, M);
}
#endif
