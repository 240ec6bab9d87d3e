/* What a build is and how fast this machine reads memory: sx_isa (the instruction set compiled in, isa.h),
 * sx_chunk_bytes, and sx_read, the bandwidth probe `specexec bench kernels` and `specexec doctor` time.
 *
 * Does not know: the kernels' arithmetic, timing (the caller times sx_read).
 */
#include <omp.h>

#include "isa.h"

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
