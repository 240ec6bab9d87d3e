/* What the q4 kernel's parts share (q4.c, q4_avx2.c, q4_wide.c): one call's constants, and the rows of one
 * instruction set's path (exactly one of the two ISA files compiles it). */
#ifndef SX_Q4_H
#define SX_Q4_H
#include "isa.h"

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

/* y for every weight row and activation row of the call, threaded over weight rows (`threads` OpenMP threads). */
void q4_run(const Q4Call *k, const uint8_t *codes, const uint16_t *sz, int64_t M, int threads);
#endif
