/* One dense decoder layer of a Llama-family model on the CPU in a single call (sx_block): RMSNorm, the q/k/v
 * projections (fused or not, biases), optional per-head q/k RMSNorm, RoPE on the first rope_dim dimensions of each
 * head, the new K/V rows written into the layer's cache slots, row-by-row attention over each token's slot list
 * (attend.c's sx_attend_into), o_proj and the residual, RMSNorm, gate/up (fused or not), SiLU(gate) * up, down and
 * the residual (sx_blocks: a stack of such layers in one call). Every linear is q4.c's or q8.c's kernel
 * (int8 activations, threaded over output rows); the glue between them runs on the calling thread and allocates
 * one scratch buffer. The residual stream is fp32.
 *
 * Every step works on one token's row at a time (the norms, RoPE, the activation) or is row-exact (the linears,
 * the attention), so a token's output in a pass of T rows has the same bits as in a one-token pass that sees the
 * same slots. The order of the sums differs from torch's ops, so the result equals the module path (network/)
 * up to fp32 rounding, not bit for bit.
 *
 * Does not know: tensors, modules, which model or family (the caller checks that a layer has this shape:
 * specexec/runtime/cpu_blocks.py), sliding windows, sinks, soft-capping, MoE, bf16 activations, int8 KV rows. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastexp.h"
#include "kernels.h"

typedef struct {                /* one quantized linear in ops.py's layouts */
    const void *codes;          /* q4: uint8 [n, k/2]; q8: int8 [n, k] */
    const uint16_t *scales;     /* q4: bf16 (s, z) [n, k/G, 2]; q8: bf16 [n] */
    const void *bias;           /* fp32 or bf16 [n], or NULL */
    int64_t n, k;
    int32_t kind, group, bias_bf16, pad;    /* kind 4: q4, 8: q8 */
} SxLinear;

typedef struct {
    int64_t dim, heads, kv_heads, head_dim, rope_dim, inter;
    const float *attn_norm, *mlp_norm;      /* fp32 [dim] */
    const float *q_norm, *k_norm;           /* fp32 [head_dim] (per-head q/k RMSNorm) or NULL */
    float eps, scale;
    int32_t fused_qkv, fused_gate_up;       /* then `q` is qkv_proj and `gate` is gate_up_proj */
    SxLinear q, k, v, o, gate, up, down;
} SxBlock;

/* The structs' layout, for the ctypes mirrors (cpu_kernels/abi.py) to be checked against when the library loads:
 * sizeof SxLinear, sizeof SxBlock, and the offsets in SxBlock of eps, fused_qkv, q and down. Returns n. */
int sx_layout(int64_t *out, int n) {
    const int64_t v[6] = {sizeof(SxLinear), sizeof(SxBlock), offsetof(SxBlock, eps), offsetof(SxBlock, fused_qkv),
                          offsetof(SxBlock, q), offsetof(SxBlock, down)};
    for (int i = 0; i < n && i < 6; i++) out[i] = v[i];
    return 6;
}

static int linear(const SxLinear *l, const float *x, int64_t m, float *y, int threads) {
    if (l->kind == 4)
        return sx_q4_linear(x, 0, m, l->k, l->codes, l->scales, l->n, l->group, l->bias, l->bias_bf16, y, 0,
                            threads);
    return sx_q8_linear(x, 0, m, l->k, l->codes, l->scales, l->n, l->bias, l->bias_bf16, y, 0, threads);
}

/* y[n] = w * (x * rsqrt(mean(x^2) + eps)) (y may be x). */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* Rotate-half RoPE in place on the first R dimensions of each of `heads` heads of one row (sin's first half
 * negated, as Transformer.rope makes it). */
static void rope_row(float *x, int64_t heads, int64_t hd, int64_t R, const float *cos, const float *sin) {
    float tmp[R];
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * hd;
        memcpy(tmp, p, (size_t)R * 4);
        for (int64_t i = 0; i < R; i++) p[i] = tmp[i] * cos[i] + tmp[(i + R / 2) % R] * sin[i];
    }
}

/* Rows [T, nq + 2 nk] of a fused qkv projection -> q [T, nq], k, v [T, nk]. */
static void split_qkv(const float *qkv, int64_t T, int64_t nq, int64_t nk, float *q, float *k, float *v) {
    for (int64_t t = 0; t < T; t++) {
        const float *r = qkv + t * (nq + 2 * nk);
        memcpy(q + t * nq, r, (size_t)nq * 4);
        memcpy(k + t * nk, r + nq, (size_t)nk * 4);
        memcpy(v + t * nk, r + nq + nk, (size_t)nk * 4);
    }
}

/* q [T, nq], k and v [T, nk] of x's normed rows h, q/k normed per head and rotated. */
static int project(const SxBlock *b, const float *h, int64_t T, const float *cos, const float *sin, float *q,
                   float *k, float *v, float *tmp, int threads) {
    int64_t hd = b->head_dim, nq = b->heads * hd, nk = b->kv_heads * hd, R = b->rope_dim;
    int rc = 0;
    if (b->fused_qkv) {
        rc = linear(&b->q, h, T, tmp, threads);
        split_qkv(tmp, T, nq, nk, q, k, v);
    } else {
        rc = linear(&b->q, h, T, q, threads) | linear(&b->k, h, T, k, threads) | linear(&b->v, h, T, v, threads);
    }
    for (int64_t t = 0; t < T; t++) {
        if (b->q_norm) {                                  /* per head, in place */
            for (int64_t j = 0; j < b->heads; j++) {
                float *r = q + t * nq + j * hd;
                rms_norm(r, b->q_norm, hd, b->eps, r);
            }
            for (int64_t j = 0; j < b->kv_heads; j++) {
                float *r = k + t * nk + j * hd;
                rms_norm(r, b->k_norm, hd, b->eps, r);
            }
        }
        rope_row(q + t * nq, b->heads, hd, R, cos + t * R, sin + t * R);
        rope_row(k + t * nk, b->kv_heads, hd, R, cos + t * R, sin + t * R);
    }
    return rc;
}

/* act [T, I] = silu(gate) * up of the normed rows h: gate / (1 + e^-gate) * up, fastexp.h's e^x. */
static int gated(const SxBlock *b, const float *h, int64_t T, float *gu, float *act, int threads) {
    int64_t I = b->inter;
    int rc;
    const float *g = gu, *u = gu + T * I;
    int64_t gs = I;                                   /* row stride of g and u */
    if (b->fused_gate_up) {
        rc = linear(&b->gate, h, T, gu, threads);
        u = gu + I;
        gs = 2 * I;
    } else {
        rc = linear(&b->gate, h, T, gu, threads) | linear(&b->up, h, T, gu + T * I, threads);
    }
    for (int64_t t = 0; t < T; t++) {
        const float *gt = g + t * gs, *ut = u + t * gs;
        float *at = act + t * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 z = _mm256_loadu_ps(gt + i);
            __m256 e = sx_exp8(_mm256_sub_ps(zero, z));
            _mm256_storeu_ps(at + i, _mm256_mul_ps(_mm256_div_ps(z, _mm256_add_ps(one, e)), _mm256_loadu_ps(ut + i)));
        }
#endif
        for (; i < I; i++) at[i] = gt[i] / (1.0f + sx_exp(0.0f - gt[i])) * ut[i];     /* the same operations */
    }
    return rc;
}

/* x_in [T, dim] (fp32) through one decoder layer -> x [T, dim] (x may be x_in). cos, sin [T, rope_dim] fp32;
 * kv: the layer's cache rows, slot s's K at kv + s * slot_stride and its V v_off further ([kv_heads, head_dim]
 * each, fp32); the new rows go to slots[t]; row t attends over the slots idx[t * L .. + len[t]] (which include
 * its own). Returns 0, -1 when out of memory, or a kernel's error code. */
int sx_block(const SxBlock *b, const float *x_in, float *x, int64_t T, const float *cos, const float *sin, float *kv,
             int64_t slot_stride, int64_t v_off, const int64_t *slots, const int32_t *idx, const int32_t *len,
             int64_t L, int threads) {
    int64_t D = b->dim, hd = b->head_dim, nq = b->heads * hd, nk = b->kv_heads * hd, I = b->inter;
    if (T <= 0 || b->heads % b->kv_heads || b->rope_dim > hd || b->rope_dim % 2) return -2;
    size_t n = (size_t)T * (D + 2 * nq + 2 * nk + (nq + 2 * nk) + 3 * I);
    float *buf = malloc(n * 4);
    if (!buf) return -1;
    if (x != x_in) memcpy(x, x_in, (size_t)(T * D) * 4);
    float *h = buf, *q = h + T * D, *k = q + T * nq, *v = k + T * nk, *att = v + T * nk;
    float *tmp = att + T * nq, *gu = tmp + T * (nq + 2 * nk), *act = gu + 2 * T * I;
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * D, b->attn_norm, D, b->eps, h + t * D);
    int rc = project(b, h, T, cos, sin, q, k, v, tmp, threads);
    for (int64_t t = 0; t < T && !rc; t++) {
        memcpy(kv + slots[t] * slot_stride, k + t * nk, (size_t)nk * 4);
        memcpy(kv + slots[t] * slot_stride + v_off, v + t * nk, (size_t)nk * 4);
    }
    const int64_t qs[3] = {T * nq, hd, nq}, ks[3] = {nk, hd, slot_stride};
    if (!rc) rc = sx_attend_into(q, kv, kv + v_off, att, qs, 0, 1, b->heads, b->kv_heads, T, hd, qs, ks, ks, idx,
                                 len, 1, L, b->scale, threads);
    if (!rc) rc = linear(&b->o, att, T, h, threads);
    for (int64_t i = 0; i < T * D && !rc; i++) x[i] += h[i];
    for (int64_t t = 0; t < T && !rc; t++) rms_norm(x + t * D, b->mlp_norm, D, b->eps, h + t * D);
    if (!rc) rc = gated(b, h, T, gu, act, threads);
    if (!rc) rc = linear(&b->down, act, T, h, threads);
    for (int64_t i = 0; i < T * D && !rc; i++) x[i] += h[i];
    free(buf);
    return rc;
}

/* x_in [T, dim] through layers blocks[0 .. n) in order -> x [T, dim] (x may be x_in): sx_block on each, layer i's
 * cache rows at kv + kv_off[i] (floats), every layer attending over the same slot lists. One call for a whole
 * resident model's decoder stack: no Python between its layers. Returns what the first failing layer returned. */
int sx_blocks(const SxBlock *const *blocks, const int64_t *kv_off, int64_t n, const float *x_in, float *x, int64_t T,
              const float *cos, const float *sin, float *kv, int64_t slot_stride, int64_t v_off, const int64_t *slots,
              const int32_t *idx, const int32_t *len, int64_t L, int threads) {
    for (int64_t i = 0; i < n; i++) {
        int rc = sx_block(blocks[i], i ? x : x_in, x, T, cos, sin, kv + kv_off[i], slot_stride, v_off, slots, idx,
                          len, L, threads);
        if (rc) return rc;
    }
    return 0;
}
