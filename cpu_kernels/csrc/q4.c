/* The q4 linear's entry point: y [M, N] = x [M, K] @ W.T (+ bias) for a 4-bit weight (cpu_kernels/ops.py's layout:
 * codes uint8 [N, K/2], group g of G weights the G/2 bytes at g*G/2, byte j holding weight g*G + j in its low
 * nibble and g*G + G/2 + j in its high one; sz bf16 [N, K/G, 2] = (s, z) per group: w = (q - 8) * s + z).
 * y[m, n] = sum over blocks of d * s * (integer dot) + the zero terms + bias[n], one fixed order of fp32 operations
 * per (m, n) whatever M, the thread count or the tile a row falls in: a row's result never depends on the other
 * rows. The rows run on one instruction set's path: q4_avx2.c (register tiles) or q4_wide.c (AVX-512, plain C).
 *
 * Does not know: how the weights were quantized (offload/quant/int4.py), tensors.
 */
#include "q4.h"

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
    q4_run(&k, codes, sz, M, threads);
    return 0;
}
