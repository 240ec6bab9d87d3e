/* The q4 rows on AVX2: register tiles of QR weight rows x QA activation rows (q4.c is the entry point; a build
 * without AVX2 compiles q4_wide.c's rows instead and this file to nothing).
 *
 * Does not know: the activations' quantization (acts.c), other instruction sets.
 */
#include "q4.h"

#if SX_AVX2
/* ---- AVX2: register tiles of QR weight rows x QA activation rows.
 * Each weight chunk (CB code bytes = 2*CB weights) is loaded and unpacked once per tile and used by its QA
 * activation rows; each activation chunk is read from memory once per QR weight rows (then from L1). At G >= 64
 * a chunk lies inside one group (G = 64: it is the group), so s * d is a broadcast of one value, the products
 * made 8 groups at a time per (weight row, activation row) (q4_sd_block); at G = 32 a chunk spans two groups and
 * s and d are lane vectors. Per (n, m) the arithmetic is one fixed sequence, the same in every tile shape: lane sums over the
 * chunks in order of cvt(dot) * (s * d), the fixed pairwise fold, plus the zero terms, plus the bias. So a row's
 * bits depend neither on R, A nor on which tile or thread it falls in. */
#ifndef QR                      /* -DQR=.. -DQA=.. to try other shapes */
#define QR 1                    /* weight rows per tile (docs/algorithms.md §27) */
#endif
#ifndef QA
#define QA 4                    /* activation rows per tile */
#endif

/* The codes of chunk c of one weight row split into low and high nibbles. The last chunk of a row may be
 * partial (then only at G = 32: K/2 is a multiple of 16 bytes, a full chunk 32): its missing bytes read as 0. */
ALWAYS_INLINE void q4_chunk(const Q4Call *k, const uint8_t *codes, int64_t c, int partial, __m256i *wl,
                            __m256i *wh) {
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    __m256i w;
    if (!partial) {
        w = _mm256_loadu_si256((const __m256i *)(codes + c * CB));
    } else {                                              /* whole int32 lanes: the tail is 16 bytes */
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)((k->nbytes - c * CB) / 4)), lane);
        w = _mm256_maskload_epi32((const int *)(codes + c * CB), mask);
    }
    *wl = _mm256_and_si256(w, lo4);
    *wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), lo4);
}

/* G = 32: the lanes' s of one weight row for a chunk starting in group g0, the chunk's two groups' (one at a
 * row's partial last chunk), each lane picking its own through sel. (G >= 64 takes s * d from q4_sd_block.) */
ALWAYS_INLINE __m256 q4_scales(const Q4Call *k, const uint16_t *sz, int64_t g0) {
    int32_t pair;
    __m128i prs;
    if (k->ng - g0 >= 2) {
        prs = _mm_loadl_epi64((const __m128i *)(sz + 2 * g0));
    } else {
        memcpy(&pair, sz + 2 * g0, 4);
        prs = _mm_cvtsi32_si128(pair);
    }
    __m256i p32 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(prs), 16);
    return _mm256_permutevar8x32_ps(_mm256_castsi256_ps(p32), _mm256_loadu_si256((const __m256i *)k->sel));
}

/* Zero terms of one weight row, AVX2: sum over groups of (z - 8 s) * ds for A activation rows, 8 groups per
 * step (the (s, z) pairs as 32-bit lanes: s = low half, z = high half), the tail masked (its lanes add 0), then
 * the fixed pairwise fold. The order depends on ng alone. */
ALWAYS_INLINE void q4_zero_terms_avx2(const uint16_t *sz, int64_t ng, const Acts *a, int64_t m0, const int A,
                                      float *zt) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 eight = _mm256_set1_ps(8.0f);
    __m256 acc[QA];
    for (int i = 0; i < A; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g += 8) {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(ng - g < 8 ? ng - g : 8)), lane);
        __m256i p = _mm256_maskload_epi32((const int *)(sz + 2 * g), mask);
        __m256 mz = _mm256_fnmadd_ps(eight, _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)),
                                     _mm256_castsi256_ps(_mm256_and_si256(p, hi16)));      /* z - 8 s */
        for (int i = 0; i < A; i++)
            acc[i] = _mm256_fmadd_ps(mz, _mm256_maskload_ps(a->ds + (m0 + i) * a->nb + g, mask), acc[i]);
    }
    for (int i = 0; i < A; i++) zt[i] = hsum256(acc[i]);
}

/* sd[r][i][j] = s * d of group g + j (j < 8, past the last group 0) for weight row r and activation row i: the
 * product the tile multiplies each chunk's integer dot by (G >= 64: a group's chunks share one s and one d). */
ALWAYS_INLINE void q4_sd_block(const Q4Call *k, const uint16_t *sz, const float *const *dd, int64_t g, const int R,
                               const int A, float sd[QR][QA][8]) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k->ng - g < 8 ? k->ng - g : 8)), lane);
    for (int r = 0; r < R; r++) {
        __m256i p = _mm256_maskload_epi32((const int *)(sz + r * k->ng * 2 + 2 * g), mask);
        __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
        for (int i = 0; i < A; i++) _mm256_store_ps(sd[r][i], _mm256_mul_ps(s, _mm256_maskload_ps(dd[i] + g, mask)));
    }
}

/* y for weight rows n0 .. n0 + R - 1 (codes, sz: row n0's) and activation rows m0 .. m0 + A - 1; R, A, one are
 * compile-time constants after inlining, so acc[][] lives in registers (2 x 4 tiles: 8 of the 16 ymm). */
ALWAYS_INLINE void q4_tile_avx2(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t n0,
                                int64_t m0, const int R, const int A, const int one) {
    const Acts *a = k->a;
    const int8_t *xq[QA];
    const float *dd[QA];
    for (int i = 0; i < A; i++) {
        xq[i] = a->q + (m0 + i) * a->kp;
        dd[i] = one ? a->d + (m0 + i) * a->nb : a->dl + (m0 + i) * a->nc * LANES;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[QR][QA];
    float sd[QR][QA][8] __attribute__((aligned(32)));    /* G >= 64: s * d of 8 groups, made 8 groups at a time */
    int64_t blk = -1;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < A; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < a->nc; c++) {                 /* acc[r][i] += cvt(dot) * (s * d), chunk by chunk */
        int64_t g0 = (c * 2 * CB) >> k->glog;
        int partial = !one && c >= k->full;                /* never at G >= 64 */
        if (one && g0 >> 3 != blk) {                      /* s * d for the next 8 groups, once per block */
            blk = g0 >> 3;
            q4_sd_block(k, sz, dd, blk * 8, R, A, sd);
        }
        for (int r = 0; r < R; r++) {
            __m256i wl, wh;
            _mm_prefetch((const char *)(codes + r * k->nbytes + c * CB + PREFETCH), _MM_HINT_T0);
            q4_chunk(k, codes + r * k->nbytes, c, partial, &wl, &wh);
            __m256 sv = one ? _mm256_setzero_ps() : q4_scales(k, sz + r * k->ng * 2, g0);
            for (int i = 0; i < A; i++) {
                const int8_t *x = xq[i] + c * 2 * CB;
#ifdef SX_VNNI256                                   /* the same int32 sums in 2 instructions instead of 4 */
                __m256i d32 = SX_VNNI256(SX_VNNI256(_mm256_setzero_si256(), wl,
                                                    _mm256_load_si256((const __m256i *)x)),
                                         wh, _mm256_load_si256((const __m256i *)(x + CB)));
#else
                __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_load_si256((const __m256i *)x)),
                                             _mm256_maddubs_epi16(wh, _mm256_load_si256((const __m256i *)(x + CB))));
                __m256i d32 = _mm256_madd_epi16(p, ones);
#endif
                __m256 sdv = one ? _mm256_broadcast_ss(&sd[r][i][g0 & 7])
                                 : _mm256_mul_ps(sv, _mm256_loadu_ps(dd[i] + c * LANES));
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), sdv, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float zt[QA];
        q4_zero_terms_avx2(sz + r * k->ng * 2, k->ng, a, m0, A, zt);
        float bn = bias_at(k->bias, k->bias_bf16, n0 + r);
        for (int i = 0; i < A; i++)
            store(k->out, k->out_bf16, (m0 + i) * k->N + n0 + r, hsum256(acc[r][i]) + zt[i] + bn);
    }
}

/* Weight rows n0 .. n0 + R - 1 against every activation row: tiles of QA rows, then of 4, 3 (a rest of exactly
 * 3 in one tile, not 2 + 1), 2 and 1 for the rest. */
ALWAYS_INLINE void q4_rows_avx2(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t n0,
                                int64_t M, const int R, const int one) {
    int64_t m0 = 0;
    for (; m0 + QA <= M; m0 += QA) q4_tile_avx2(k, codes, sz, n0, m0, R, QA, one);
    if (QA > 4 && m0 + 4 <= M) q4_tile_avx2(k, codes, sz, n0, m0, R, QA > 4 ? 4 : QA, one), m0 += 4;
    if (QA > 2 && m0 + 2 <= M) {
        if (QA > 3 && M - m0 == 3) {
            q4_tile_avx2(k, codes, sz, n0, m0, R, QA > 3 ? 3 : QA, one);
            return;
        }
        q4_tile_avx2(k, codes, sz, n0, m0, R, QA > 2 ? 2 : QA, one), m0 += 2;
    }
    if (QA > 1 && m0 < M) q4_tile_avx2(k, codes, sz, n0, m0, R, 1, one);
}

/* Tile t of weight rows (QR of them; the last tile of an N that QR does not divide goes row by row). */
static void q4_rows_tile(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t t, int64_t M) {
    int64_t n0 = t * QR, rows = k->N - n0 < QR ? k->N - n0 : QR;
    const uint8_t *cr = codes + n0 * k->nbytes;
    const uint16_t *sr = sz + n0 * k->ng * 2;
    if (rows == QR) {
        if (k->gpc == 1) q4_rows_avx2(k, cr, sr, n0, M, QR, 1);
        else q4_rows_avx2(k, cr, sr, n0, M, QR, 0);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (k->gpc == 1) q4_rows_avx2(k, cr + r * k->nbytes, sr + r * k->ng * 2, n0 + r, M, 1, 1);
        else q4_rows_avx2(k, cr + r * k->nbytes, sr + r * k->ng * 2, n0 + r, M, 1, 0);
    }
}

void q4_run(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t M, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < (k->N + QR - 1) / QR; t++) q4_rows_tile(k, codes, sz, t, M);
}
#endif
