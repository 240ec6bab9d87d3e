/* e^x in fp32 for the kernels' softmax (attend.c) and SiLU (block.c): one fixed sequence of operations whatever
 * the lane, so the 8-lane form and the scalar one give the same bits. x is clamped to [-87, 88] (below, e^x is under
 * fp32's normal range: 0 is within its rounding; above, it overflows), written x = n ln2 + r with |r| <= ln2 / 2 (ln2
 * in two parts), e^r by its degree-6 Taylor polynomial in Horner form (relative error ~2e-7) times 2^n built in the
 * exponent bits, without fused multiply-adds. A NaN stays NaN. */
#ifndef SX_FASTEXP_H
#define SX_FASTEXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float sx_exp(float x) {
    if (x != x) return x;
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float e = 1.0f / 720.0f;
    e = e * r + 1.0f / 120.0f;
    e = e * r + 1.0f / 24.0f;
    e = e * r + 1.0f / 6.0f;
    e = e * r + 0.5f;
    e = e * r + 1.0f;
    e = e * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return e * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 sx_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));   /* NaN: x (2nd operand) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 e = _mm256_set1_ps(1.0f / 720.0f);
    const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(c[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}
#endif
#endif
