/* The CPU kernels' library: what its sources export to each other; Python reaches every exported function through
 * ctypes (cpu_kernels/abi.py mirrors their signatures and block.c's structs). docs/layout.md maps the sources.
 *
 * The linears (q4.c with q4_avx2.c or q4_wide.c, q8.c): 4-bit and 8-bit weights times int8 activations
 * quantized on the fly (acts.c), with integer dot products (isa.h names the instruction set), threaded over output
 * rows with OpenMP (the libgomp torch already loaded, so torch's own thread pool runs them). Every instruction set
 * gives the same int32 sums and one fixed order of fp32 operations per output, so a row's result never depends on
 * the other rows, the thread count or the tile it falls in: a tree pass gives the same bits as a one-token pass.
 * Weight layouts: cpu_kernels/ops.py (offload/quant/int4.py and int8.py make them once, when a layer is quantized).
 * Row attention (attend.c), one decoder layer (block.c), the bandwidth probe (probe.c).
 *
 * Does not know: torch, tensors, modules, files; Python hands it raw pointers.
 */
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
