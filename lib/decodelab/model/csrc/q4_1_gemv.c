/* y[M, N] = x[M, K] @ W^T for W stored as llama.cpp's Q4_1 blocks, float32 activations.
 *
 * W's row n, block b (32 weights) is d[n, b], m[n, b] (float32) and 16 bytes qs[n, 16*b ..]:
 * byte j's low nibble is weight j of the block, its high nibble weight j + 16 (gguf's order);
 * weight = d * q + m. Each block is dequantized in registers with a multiply and an add (two
 * roundings, as gguf.quants.dequantize does; -ffp-contract=off keeps them two), so the weights
 * are bit for bit the float32 weights, and the result differs from F.linear only in the order
 * of the sums. The threads split the output rows N; each weight block is dequantized once for
 * up to 4 rows of x, which share it.
 *
 * Plain C with AVX2/FMA intrinsics and OpenMP; no torch headers (called through ctypes).
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows [0, R) of x (R <= 4, a constant after inlining) against W's row n: R dot products.
 * Each row sums into `chains` independent accumulators (4 for R <= 2, else 2): one chain would
 * wait an FMA's latency (4 cycles) per 8 weights. */
static inline void row_dots(const uint8_t *qs, const float *d, const float *m, const float *x,
                            int64_t K, int R, float *out) {
    const int chains = R <= 2 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; b++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
        __m128i lo = _mm_and_si128(bytes, low_mask);                     /* weights 0..15 */
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  /* weights 16..31 */
        __m256 scale = _mm256_set1_ps(d[b]), offset = _mm256_set1_ps(m[b]);
        __m256 w[4];
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int k = 0; k < 4; k++) w[k] = _mm256_add_ps(_mm256_mul_ps(w[k], scale), offset);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + 32 * b;
            for (int k = 0; k < 4; k++)
                acc[r][k % chains] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xb + 8 * k), acc[r][k % chains]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 sum = acc[r][0];
        for (int c = 1; c < chains; c++) sum = _mm256_add_ps(sum, acc[r][c]);
        out[r] = hsum(sum);
    }
}

/* x [M, K], qs [N, K/2], d and m [N, K/32], y [M, N]; all contiguous. K a multiple of 32. */
void q4_1_matmul(const float *x, const uint8_t *qs, const float *d, const float *m, float *y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = qs + n * (K / 2);
        const float *dn = d + n * blocks, *mn = m + n * blocks;
        float out[4];
        for (int64_t i = 0; i < M; i += 4) {
            const int64_t left = M - i;
            const float *xi = x + i * K;
            int R = left >= 4 ? 4 : (int)left;
            switch (R) {  /* constant R, so the compiler unrolls each case */
                case 4: row_dots(qn, dn, mn, xi, K, 4, out); break;
                case 3: row_dots(qn, dn, mn, xi, K, 3, out); break;
                case 2: row_dots(qn, dn, mn, xi, K, 2, out); break;
                default: row_dots(qn, dn, mn, xi, K, 1, out); break;
            }
            for (int r = 0; r < R; r++) y[(i + r) * N + n] = out[r];
        }
    }
}
