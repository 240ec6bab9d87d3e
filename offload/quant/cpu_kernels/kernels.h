/* What kernels.c exports to the other sources of the library (block.c); Python reaches all of them through
 * ctypes (build.py's SIGNATURES). */
#ifndef SX_KERNELS_H
#define SX_KERNELS_H
#include <stdint.h>

int sx_q4_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
                 int64_t N, int G, const void *bias, int bias_bf16, void *out, int out_bf16, int threads);
int sx_q8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scale,
                 int64_t N, const void *bias, int bias_bf16, void *out, int out_bf16, int threads);
int sx_attend_into(const void *q, const void *k, const void *v, void *out, const int64_t *os, int bf16, int64_t B,
                   int64_t H, int64_t Hkv, int64_t T, int64_t D, const int64_t *qs, const int64_t *ks,
                   const int64_t *vs, const int32_t *idx, const int32_t *len, int64_t nb, int64_t L, float scale,
                   int threads);
#endif
