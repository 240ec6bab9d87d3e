/* The private header of the CPU kernels' sources (never included from outside csrc/): which instruction set a
 * build uses, the chunk sizes that follow from it, the small conversions every kernel shares, and the activations
 * every linear quantizes first (acts.c).
 *
 * Instruction sets, chosen at compile time from the compiler's target (-march=native):
 *   SX_AVX512  -DSX_WIDE on a CPU with AVX-512 F/BW/VL/VNNI: one weight row x MT activation rows, 64-byte chunks
 *   SX_AVX2    AVX2 + FMA: q4 register tiles (q4_avx2.c), 32-byte chunks; SX_VNNI256 names the 256-bit vpdpbusd
 *              when the CPU has one (AVX512-VL VNNI or AVX-VNNI), else vpmaddubsw + vpmaddwd (the same int32 sums)
 *   neither    plain C, 32-byte chunks (the same lanes and the same order of fp32 operations)
 *
 * Does not know: torch, tensors, files; what a layer is.
 */
#ifndef SX_ISA_H
#define SX_ISA_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define PREFETCH 2048           /* code bytes read ahead (AVX2; docs/algorithms.md §27) */
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

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

static inline void store(void *out, int out_bf16, int64_t i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((float *)out)[i] = v;
}

static inline float bias_at(const void *bias, int bias_bf16, int64_t n) {
    if (!bias) return 0.0f;
    return bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
}

/* The block of lane l's first byte, relative to the chunk's first block (q4: code bytes, blocks of B/2 bytes;
 * q8: activations, blocks of B): the same for every chunk, as chunks and blocks nest. */
static inline int lane_block(int l, int B, int q4) {
    int per = q4 ? B / 2 : B;
    return CB >= per ? 4 * l / per : 0;
}

/* Quantized activations of M rows: per row `kp` code bytes (zero-padded; q4: in the kernel's order), per block
 * d and d * sum(q) (ds), and per chunk the LANES-wide vector of each lane's d (dl). */
typedef struct {
    int8_t *q;
    float *d, *ds, *dl;
    int64_t kp, nb, nc;
} Acts;

/* x [M, K] (fp32, or bf16 when bf16) quantized in blocks of B (q4 != 0: the codes in the q4 kernels' order) into
 * the calling thread's scratch (a stays valid until that thread's next call); 0, or -1 when out of memory. */
int quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int B, int q4, Acts *a);
#endif
