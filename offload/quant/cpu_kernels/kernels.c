/* specexec's CPU linears: 4-bit and 8-bit weights times int8 activations quantized on the fly, with integer
 * dot products (AVX2 register tiles with 256-bit VNNI vpdpbusd where the CPU has it (AVX512-VL VNNI or
 * AVX-VNNI), else vpmaddubsw; the wide AVX-512 VNNI path when built with -DSX_WIDE; or plain C), threaded over
 * output rows with OpenMP (the libgomp torch already loaded, so torch's own thread pool runs them).
 * Why the tiles win on AVX-512 machines too (Xeon, 2 threads, q4 8960x1536, us at 1 / 4 / 9 rows): the wide
 * path (one weight row x MT rows) 557-925 / 1300-1900 / 2100-3300, the tiles with VNNI 510-620 / 600-950 /
 * 1050-1270: at 4 rows VNNI makes the tile cost what one row costs (memory-bound), where decode and small
 * trees live. The wide path still wins at 16 rows of K = 8960 (compute-bound): -DSX_WIDE keeps it buildable.
 * vpdpbusd and vpmaddubsw + vpmaddwd give the same int32 sums (4 u8 x s8 products per lane, no int16
 * saturation at 15 x 127 x 4), so the bits of every variant are the same.
 *
 * Weights (offload/quant/cpu_kernels/__init__.py documents the layouts; offload/quant/int4.py and int8.py
 * make them once, when a layer is quantized):
 *   q4: codes uint8 [N, K/2]: group g of G weights (G = 32, 64, 128) is the G/2 bytes at g*G/2; byte j holds
 *       weight g*G + j in its low nibble and g*G + G/2 + j in its high one. sz bf16 [N, K/G, 2] = (s, z) per
 *       group: w = (q - 8) * s + z.
 *   q8: codes int8 [N, K], scale bf16 [N]: w = q * s.
 * Activations: each row of x is cut into blocks of B values (q4: B = G; q8: B = 64) and each block gets
 * d = amax / 127 and codes round_half_even(x * (127 / amax)) in [-127, 127] (exactly what torch's ops compute
 * in fp32: the pure-torch reference reproduces them bit for bit).
 * y[m, n] = sum over blocks of d * s * (integer dot) + (zero terms) + bias[n], in one fixed order of fp32
 * operations per (m, n) whatever M, the thread count or the tile a row falls in: a row's result never depends
 * on the other rows (the target's tree pass gives the same bits as its one-token pass).
 * Tiles: a weight row is read once per tile of activation rows (q4 on AVX2: QR weight rows x QA activation rows
 * with the accumulators in registers; otherwise one weight row x MT rows), so 16 rows cost 4 reads of the
 * weight, not 16; the code stream is prefetched PREFETCH bytes ahead (decode, 1 row, is bandwidth-bound).
 *
 * Does not know: torch, tensors, modules, files; Python hands it raw pointers (ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "fastexp.h"
#include "kernels.h"

#if defined(SX_WIDE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SX_AVX512 1
#include <immintrin.h>
#define CB 64                   /* code bytes per chunk: one zmm */
#elif defined(__AVX2__) && defined(__FMA__)
#define SX_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SX_VNNI256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define SX_VNNI256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif
#define CB 32                   /* one ymm */
#else
#define CB 32
#endif
#define LANES (CB / 4)          /* int32 lanes of a chunk's dot product */
#define MT 8                    /* activation rows per pass over a weight row (the rest: more passes) */
#define Q8B 64                  /* activation block of the q8 kernel: two AVX2 chunks (q8_block_avx2) */
#if SX_AVX2 && Q8B != 2 * CB
#error "q8_block_avx2 reads a q8 block as two chunks"
#endif
#ifndef PREFETCH
#define PREFETCH 2048           /* code bytes read ahead (AVX2): ~10-15 % more bandwidth at 1 row on Zen 3 */
#endif

const char *sx_isa(void) {
#if SX_AVX512
    return "avx512vnni";
#elif SX_AVX2 && defined(SX_VNNI256)
    return "avx2-vnni";
#elif SX_AVX2
    return "avx2";
#else
    return "scalar";
#endif
}

int sx_chunk_bytes(void) { return CB; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if SX_AVX2
static inline float hsum256(__m256 v) {                  /* a fixed pairwise order */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

static inline uint16_t f32_to_bf16(float f) {            /* round to nearest even, as torch's .to(bf16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);     /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------------------------------------ activations */

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

/* Quantized activations of M rows: per row `kp` code bytes (zero-padded; q4: in the kernel's order), per block
 * d and d * sum(q) (ds), and per chunk the LANES-wide vector of each lane's d (dl). */
typedef struct {
    int8_t *q;
    float *d, *ds, *dl;
    int64_t kp, nb, nc;
} Acts;

/* Row m of x (fp32 or bf16) as fp32: x itself, or converted into buf[K]. */
static const float *row_f32(const void *x, int bf16, int64_t m, int64_t K, float *buf) {
    if (!bf16) return (const float *)x + m * K;
    const uint16_t *h = (const uint16_t *)x + m * K;
    for (int64_t k = 0; k < K; k++) buf[k] = bf16_to_f32(h[k]);
    return buf;
}

/* The block of lane l's first byte, relative to the chunk's first block (q4: code bytes, blocks of B/2 bytes;
 * q8: activations, blocks of B): the same for every chunk, as chunks and blocks nest. */
static int lane_block(int l, int B, int q4) {
    int per = q4 ? B / 2 : B;
    return CB >= per ? 4 * l / per : 0;
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

static int quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int B, int q4, Acts *a) {
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

static inline void store(void *out, int out_bf16, int64_t i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((float *)out)[i] = v;
}

static inline float bias_at(const void *bias, int bias_bf16, int64_t n) {
    if (!bias) return 0.0f;
    return bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
}

/* ------------------------------------------------------------------------------------------ q4 rows */

/* What every row of one call shares. */
typedef struct {
    const Acts *a;
    int64_t K, ng, nbytes, half, full;   /* full: chunks with all CB code bytes */
    int gpc;                            /* groups whose (s, z) a chunk reads */
    int glog;                           /* log2(G): chunk c starts in group (c * 2 * CB) >> glog (no division) */
    const void *bias;
    int bias_bf16, out_bf16;
    void *out;
    int64_t N;
    int sel[16];                        /* lane -> index of its group's s among the chunk's (s, z) pairs */
} Q4Call;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if !SX_AVX512 && !SX_AVX2
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
#define QR 1                    /* weight rows per tile: 2 measured 1.3-1.5x slower at 1-4 rows on Zen 3 (AVX2,
                                   two code streams per thread) and no faster at 16 */
#endif
#ifndef QA
#define QA 4                    /* activation rows per tile (8 measured the same) */
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
 * 3: a 3-row tree pass, 10-15 % faster than 2 + 1 on a Xeon), 2 and 1 for the rest. */
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
#endif

#if !SX_AVX2
/* ---- AVX-512 and plain C: one weight row at a time against tiles of MT activation rows. */

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
#endif

/* y [M, N] = x [M, K] @ W.T (+ bias) for a q4 weight. x, y: fp32 or bf16 (flags); bias: fp32/bf16 or NULL. */
int sx_q4_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
                 int64_t N, int G, const void *bias, int bias_bf16, void *out, int out_bf16, int threads) {
    if (K % G || (G != 32 && G != 64 && G != 128) || M < 0 || N < 0) return -2;
    Acts a;
    if (quantize_acts(x, x_bf16, M, K, G, 1, &a)) return -1;
    Q4Call k = {.a = &a, .K = K, .ng = K / G, .nbytes = K / 2, .half = G / 2, .full = K / 2 / CB,
                .gpc = CB >= G / 2 ? CB / (G / 2) : 1, .bias = bias, .bias_bf16 = bias_bf16, .out_bf16 = out_bf16,
                .out = out, .N = N, .glog = G == 32 ? 5 : G == 64 ? 6 : 7};
    for (int l = 0; l < 16; l++) k.sel[l] = l < LANES ? 2 * lane_block(l, G, 1) : 0;
#if SX_AVX2
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < (N + QR - 1) / QR; t++) q4_rows_tile(&k, codes, sz, t, M);
#else
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) q4_rows(&k, codes + n * (K / 2), sz + n * k.ng * 2, n, M);
#endif
    return 0;
}

/* ------------------------------------------------------------------------------------------ q8 rows */

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

/* ------------------------------------------------------------------------------------------ probes */

/* Reads nbytes at p with `threads` threads (64-byte loads, xor-folded so nothing is optimised away): the
 * machine's memory read bandwidth when nbytes is far beyond the last-level cache. Returns the fold. */
uint64_t sx_read(const uint8_t *p, int64_t nbytes, int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = nbytes / nt / 64 * 64, b0 = t * per, b1 = t == nt - 1 ? nbytes / 64 * 64 : b0 + per;
#if SX_AVX512
        __m512i f0 = _mm512_setzero_si512(), f1 = f0, f2 = f0, f3 = f0;
        int64_t i = b0;
        for (; i + 256 <= b1; i += 256) {
            f0 = _mm512_xor_si512(f0, _mm512_load_si512(p + i));
            f1 = _mm512_xor_si512(f1, _mm512_load_si512(p + i + 64));
            f2 = _mm512_xor_si512(f2, _mm512_load_si512(p + i + 128));
            f3 = _mm512_xor_si512(f3, _mm512_load_si512(p + i + 192));
        }
        for (; i < b1; i += 64) f0 = _mm512_xor_si512(f0, _mm512_load_si512(p + i));
        f0 = _mm512_xor_si512(_mm512_xor_si512(f0, f1), _mm512_xor_si512(f2, f3));
        uint64_t lanes[8];
        _mm512_storeu_si512(lanes, f0);
        for (int l = 0; l < 8; l++) total ^= lanes[l];
#else
        uint64_t f[8] = {0};
        for (int64_t i = b0; i < b1; i += 64)
            for (int l = 0; l < 8; l++) { uint64_t v; memcpy(&v, p + i + 8 * l, 8); f[l] ^= v; }
        for (int l = 0; l < 8; l++) total ^= f[l];
#endif
    }
    return total;
}

/* ------------------------------------------------------------------------------------------ attention rows */

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
 * on masked slots, or on how the threads share the work (attend_heads: a KV head's query heads together, 12 heads
 * over 4000 slots 2.1x faster than head by head on a Xeon, or some of them when there are more threads than
 * (row, KV head) pairs). */
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
 * slot or two in flight (the 0.5B draft's layer at 200 slots: 59 -> 31 us on a Xeon; 4 and 16 ahead no better). */
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
