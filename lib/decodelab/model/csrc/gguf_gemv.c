/* y[M, N] = x[M, K] @ W^T for W stored as llama.cpp's blocks of 32 weights, float32 activations:
 * `q4_1_matmul` for Q4_1 blocks, `q8_0_matmul` for Q8_0 blocks.
 *
 * Q4_1: W's row n, block b is d[n, b], m[n, b] (fp16, as the GGUF stores them) and 16 bytes
 * qs[n, 16*b ..]: byte j's
 * low nibble is weight j of the block, its high nibble weight j + 16 (gguf's order);
 * weight = d * q + m.
 * Q8_0: W's row n, block b is d[n, b] (float32) and 32 signed bytes qs[n, 32*b ..];
 * weight = d * q.
 *
 * Q8_0 blocks are dequantized in registers with the same float32 operations as
 * gguf.quants.dequantize (-ffp-contract=off keeps a multiply and an add two roundings), so the
 * weights are bit for bit the float32 weights, and the result differs from F.linear only in the
 * order of the sums. The threads split the output rows N; each weight block is dequantized once
 * for up to 4 rows of x, which share it.
 *
 * Q4_1 products read x as 16-bit integers instead (see `quantize_rows`): each block of 32 of x's
 * values becomes scale * xq with xq in [-32767, 32767], so a block's dot product with the nibbles is
 * exact integer arithmetic (two vpmaddwd), and
 *     sum_j (d q_j + m) x_j  ~  d * scale * sum_j q_j xq_j  +  m * sum_j x_j,
 * the second term from x's own float sum. A dequantized block costs some 30 instructions, this
 * some 12: the products ran at that rate, not at the memory's. Each x_j moves by at most scale / 2 =
 * max|x_block| / 65534, so the result is within sum_j |w_j| scale_b(j) / 2 of the float32 product
 * (plus the float32 rounding of the sums): a relative 1.5e-5 of the block's largest value, 256 times
 * finer than llama.cpp's 8-bit activations (Q8_1).
 *
 * Plain C with AVX2/FMA/F16C intrinsics and OpenMP; no torch headers (called through ctypes).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

/* An IEEE half (fp16) as its 16 bits: Q4_1's d and m, stored as the GGUF stores them (F16C widens them). */
typedef uint16_t half_bits;

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

enum format { Q8_0, F32 };  /* F32: a weight row already dequantized (below) */

/* Q4_1 block b: 16 bytes of nibbles -> 32 weights d * q + m, as 4 vectors of 8. */
static inline void dequantize_q4_1(const uint8_t *qs, const half_bits *d, const half_bits *m, int64_t b, __m256 w[4]) {
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
    __m128i lo = _mm_and_si128(bytes, low_mask);                     /* weights 0..15 */
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  /* weights 16..31 */
    __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[b])), offset = _mm256_set1_ps(_cvtsh_ss(m[b]));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    for (int k = 0; k < 4; k++) w[k] = _mm256_add_ps(_mm256_mul_ps(w[k], scale), offset);
}

/* Q8_0 block b: 32 signed bytes -> 32 weights d * q, as 4 vectors of 8. */
static inline void dequantize_q8_0(const uint8_t *qs, const float *d, int64_t b, __m256 w[4]) {
    const int8_t *q = (const int8_t *)qs + 32 * b;
    __m256 scale = _mm256_set1_ps(d[b]);
    for (int k = 0; k < 4; k++) {
        __m128i eight = _mm_loadl_epi64((const __m128i *)(q + 8 * k));
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), scale);
    }
}

/* Rows [0, R) of x (R <= 4, row r at x + r * stride) against blocks [first, end) of one weight row
 * of format `f` (Q8_0 or F32): R dot products over those blocks' 32 * (end - first) columns. `f` and
 * `R` are constants after inlining, so each (format, R) gets its own unrolled loop. Each row sums into
 * `chains` independent accumulators (4 for R <= 2, else 2): one chain would wait an FMA's latency
 * (4 cycles) per 8 weights. */
static inline __attribute__((always_inline)) void block_dots(enum format f, const uint8_t *qs, const float *d,
                                                             const float *x, int64_t stride, int64_t first,
                                                             int64_t end, int R, float *out) {
    const int chains = R <= 2 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = first; b < end; b++) {
        __m256 w[4];
        if (f == Q8_0)
            dequantize_q8_0(qs, d, b, w);
        else
            for (int k = 0; k < 4; k++) w[k] = _mm256_loadu_ps((const float *)qs + 32 * b + 8 * k);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * stride + 32 * b;
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

/* The whole weight row: rows [0, R) of x [., K] against all K / 32 blocks. */
static inline __attribute__((always_inline)) void row_dots(enum format f, const uint8_t *qs, const float *d,
                                                           const float *x, int64_t K, int R, float *out) {
    block_dots(f, qs, d, x, K, 0, K / 32, R, out);
}

/* Rows [0, M) of x against one weight row, 4 rows of x at a time: y[i, n] for every i (y's row
 * stride N). The weight row is in format `f` (F32: floats). */
static inline __attribute__((always_inline)) void column(enum format f, const uint8_t *qn, const float *dn,
                                                         const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    float out[4];
    for (int64_t i = 0; i < M; i += 4) {
        const int64_t left = M - i;
        const float *xi = x + i * K;
        int R = left >= 4 ? 4 : (int)left;
        switch (R) {  /* constant R, so the compiler unrolls each case */
            case 4: row_dots(f, qn, dn, xi, K, 4, out); break;
            case 3: row_dots(f, qn, dn, xi, K, 3, out); break;
            case 2: row_dots(f, qn, dn, xi, K, 2, out); break;
            default: row_dots(f, qn, dn, xi, K, 1, out); break;
        }
        for (int r = 0; r < R; r++) y[(i + r) * N] = out[r];
    }
}

/* Rows of x beyond which a weight row is dequantized once into a float buffer (on the stack, in L1)
 * and every 4 rows of x read it there, instead of dequantizing it again for each 4 rows. */
#define ROWS_FOR_A_BUFFER 4
#define BUFFER_MAX_K 8192

/* y [M, N] = x [M, K] @ W^T for Q8_0 blocks (K bytes of qs a row of W); the threads split W's rows. */
static void q8_0_rows(const float *x, const int8_t *qs, const float *d, float *y, int64_t M, int64_t N, int64_t K,
                      int threads) {
    const int64_t blocks = K / 32;
    const int buffered = M > ROWS_FOR_A_BUFFER && K <= BUFFER_MAX_K;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = (const uint8_t *)qs + n * K;
        const float *dn = d + n * blocks;
        if (!buffered) {
            column(Q8_0, qn, dn, x, y + n, M, N, K);
            continue;
        }
        float row[BUFFER_MAX_K] __attribute__((aligned(32)));
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            dequantize_q8_0(qn, dn, b, w);
            for (int k = 0; k < 4; k++) _mm256_store_ps(row + 32 * b + 8 * k, w[k]);
        }
        column(F32, (const uint8_t *)row, 0, x, y + n, M, N, K);
    }
}

/* x's rows as 16-bit integers, for the Q4_1 products. Block b of row i, x[i, 32b .. 32b + 32), is
 * scale[i, b] * q[i, 32b ..] with scale = max|x_block| / 32767 (0 for a block of zeros) and q rounded
 * to the nearest integer; sum[i, b] is the block's float32 sum. q [M, K], scale and sum [M, K/32], all
 * in scratch the caller gives (`int16_rows_in`). */
typedef struct {
    int16_t *q;
    float *scale, *sum;
    int64_t K;
} int16_rows;

/* Room for M rows of length K carved from the front of *q (M * K values) and *f (2 * M * K/32
 * floats), both advanced past it. */
static int16_rows int16_rows_in(int16_t **q, float **f, int64_t M, int64_t K) {
    int16_rows rows = {*q, *f, *f + M * (K / 32), K};
    *q += M * K;
    *f += 2 * M * (K / 32);
    return rows;
}

/* Blocks [first, end) of rows [0, M) of x [M, K] (K = out.K) into `out`. */
static void quantize_rows(const float *x, int64_t M, int64_t first, int64_t end, int16_rows out) {
    const int64_t blocks = out.K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M; i++) {
        for (int64_t b = first; b < end; b++) {
            const int64_t at = i * out.K + 32 * b;
            __m256 v[4], largest = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm256_loadu_ps(x + at + 8 * k);
                largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[k]));
                sum = _mm256_add_ps(sum, v[k]);
            }
            __m128 top = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
            top = _mm_max_ps(top, _mm_movehl_ps(top, top));
            const float amax = _mm_cvtss_f32(_mm_max_ss(top, _mm_movehdup_ps(top)));
            out.scale[i * blocks + b] = amax / 32767.0f;
            out.sum[i * blocks + b] = hsum(sum);
            const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
            /* packs works within 128-bit lanes; the permute puts the 16 values back in order */
            _mm256_storeu_si256((__m256i *)(out.q + at), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(out.q + at + 16),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
        }
    }
}

/* h[0..8) widened to floats. */
static inline __attribute__((always_inline)) __m256 eight_halves(const half_bits *h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Q4_1 block b's 32 nibbles as 16-bit lanes: lo holds weights 0..15, hi weights 16..31. The 16 bytes
 * widen to 16-bit lanes, each holding two nibbles (its low nibble weight j, its high nibble weight
 * j + 16), so one mask and one shift give both halves. */
static inline __attribute__((always_inline)) void q4_1_nibbles(const uint8_t *qs, int64_t b, __m256i *lo,
                                                               __m256i *hi) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * b)));
    *lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    *hi = _mm256_srli_epi16(bytes, 4);
}

/* The integer dot of a block's nibbles (lo, hi) with 32 int16 values xb: 8 int32 partial sums. */
static inline __attribute__((always_inline)) __m256i nibble_dot(__m256i lo, __m256i hi, const int16_t *xb) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 16))));
}

/* nibble_dot of Q4_1 block b with xb. */
static inline __attribute__((always_inline)) __m256i q4_1_int_dot(const uint8_t *qs, int64_t b, const int16_t *xb) {
    __m256i lo, hi;
    q4_1_nibbles(qs, b, &lo, &hi);
    return nibble_dot(lo, hi, xb);
}

/* The 8 int32 lanes of each of p[0..8) summed: lane k of the result is p[k]'s total. */
static inline __attribute__((always_inline)) __m256i sum_lanes_of_8(const __m256i p[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    /* a = [p0..p3 over lanes 0-3 | p0..p3 over lanes 4-7], b the same for p4..p7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Q4_1 block b against rows row0 .. row0 + R of x, R >= 2: the nibbles widened once for all R rows,
 * acc[r][c] += (q . xq) * (d * scale), offset[r][c] += m * sum. `c` picks one of two chains. */
static inline __attribute__((always_inline)) void q4_1_block_rows(const uint8_t *qs, const half_bits *d,
                                                                  const half_bits *m, int16_rows x, int64_t row0,
                                                                  int64_t b, int R, int c, __m256 acc[4][2],
                                                                  float offset[4][2]) {
    const int64_t blocks = x.K / 32;
    __m256i lo, hi;
    q4_1_nibbles(qs, b, &lo, &hi);
    for (int r = 0; r < R; r++) {
        const int64_t row = row0 + r;
        const __m256i dots = nibble_dot(lo, hi, x.q + row * x.K + 32 * b);
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[b]) * x.scale[row * blocks + b]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[r][c]);
        offset[r][c] += _cvtsh_ss(m[b]) * x.sum[row * blocks + b];
    }
}

/* Rows row0 .. row0 + R of x (R <= 4) against blocks [first, end) of one Q4_1 weight row: R dot
 * products into out. One row (a decode step at batch 1): eight blocks at a time, their integer dots
 * summed into one vector (lane k: block b + k), then acc += dots * (d * scale) + m * sum, 8 blocks per
 * multiply-add, the last < 8 blocks one by one. More rows: block by block, each block's nibbles widened
 * once for all of them (measured faster there: bench/q4_products.py). */
static inline __attribute__((always_inline)) void q4_1_dots(const uint8_t *qs, const half_bits *d, const half_bits *m,
                                                            int16_rows x, int64_t row0, int64_t first, int64_t end,
                                                            int R, float *out) {
    const int64_t blocks = x.K / 32;
    if (R > 1) {
        __m256 acc[4][2];
        float offset[4][2];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 2; c++) acc[r][c] = _mm256_setzero_ps(), offset[r][c] = 0.0f;
        int64_t b = first;
        for (; b + 1 < end; b += 2) {
            q4_1_block_rows(qs, d, m, x, row0, b, R, 0, acc, offset);
            q4_1_block_rows(qs, d, m, x, row0, b + 1, R, 1, acc, offset);
        }
        if (b < end) q4_1_block_rows(qs, d, m, x, row0, b, R, 0, acc, offset);
        for (int r = 0; r < R; r++)
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + (offset[r][0] + offset[r][1]);
        return;
    }
    const int16_t *xr = x.q + row0 * x.K;
    const float *scale = x.scale + row0 * blocks, *sum = x.sum + row0 * blocks;
    __m256 acc = _mm256_setzero_ps();
    int64_t b = first;
    for (; b + 8 <= end; b += 8) {
        __m256i p[8];
        for (int k = 0; k < 8; k++) p[k] = q4_1_int_dot(qs, b + k, xr + 32 * (b + k));
        const __m256 scales = _mm256_mul_ps(eight_halves(d + b), _mm256_loadu_ps(scale + b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes_of_8(p)), scales, acc);
        acc = _mm256_fmadd_ps(eight_halves(m + b), _mm256_loadu_ps(sum + b), acc);
    }
    float total = hsum(acc);
    for (; b < end; b++) {
        const __m256i p = q4_1_int_dot(qs, b, xr + 32 * b);
        const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        const __m128i pair = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
        const int32_t dot = _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0xB1)));
        total += (float)dot * (_cvtsh_ss(d[b]) * scale[b]) + _cvtsh_ss(m[b]) * sum[b];
    }
    out[0] = total;
}

/* q4_1_dots with R = rows (1..4) made a constant, so each gets its unrolled loop. */
static inline void q4_1_dots_of(const uint8_t *qs, const half_bits *d, const half_bits *m, int16_rows x, int64_t row0,
                                int64_t first, int64_t end, int rows, float *out) {
    switch (rows) {
        case 4: q4_1_dots(qs, d, m, x, row0, first, end, 4, out); break;
        case 3: q4_1_dots(qs, d, m, x, row0, first, end, 3, out); break;
        case 2: q4_1_dots(qs, d, m, x, row0, first, end, 2, out); break;
        default: q4_1_dots(qs, d, m, x, row0, first, end, 1, out); break;
    }
}

/* Columns [first, end) of y [M, N] = x @ W^T, for x's M rows as int16_rows and W's N rows of Q4_1
 * blocks (K = x.K), on the calling thread; each weight block is read once for up to 4 rows of x. */
static void q4_1_rows_range(int16_rows x, const uint8_t *qs, const half_bits *d, const half_bits *m, float *y,
                            int64_t M, int64_t N, int64_t first, int64_t end) {
    const int64_t K = x.K, blocks = K / 32;
    for (int64_t n = first; n < end; n++) {
        float out[4];
        for (int64_t i = 0; i < M; i += 4) {
            const int rows = M - i >= 4 ? 4 : (int)(M - i);
            q4_1_dots_of(qs + n * (K / 2), d + n * blocks, m + n * blocks, x, i, 0, blocks, rows, out);
            for (int r = 0; r < rows; r++) y[(i + r) * N + n] = out[r];
        }
    }
}

/* All of y [M, N] = x @ W^T, the threads splitting W's rows. */
static void q4_1_rows(int16_rows x, const uint8_t *qs, const half_bits *d, const half_bits *m, float *y, int64_t M,
                      int64_t N, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        q4_1_rows_range(x, qs, d, m, y, M, N, N * t / team, N * (t + 1) / team);
    }
}

/* x [M, K], qs uint8 [N, K/2], d and m [N, K/32], y [M, N]; all contiguous. K a multiple of 32.
 * Scratch: xq int16 [M, K], xf float [2, M, K/32] (x as int16_rows). */
void q4_1_matmul(const float *x, const uint8_t *qs, const half_bits *d, const half_bits *m, float *y, int16_t *xq,
                 float *xf, int64_t M, int64_t N, int64_t K, int threads) {
    int16_rows rows = int16_rows_in(&xq, &xf, M, K);
    quantize_rows(x, M, 0, K / 32, rows);
    q4_1_rows(rows, qs, d, m, y, M, N, threads);
}

/* x [M, K], qs int8 [N, K], d [N, K/32], y [M, N]; all contiguous. K a multiple of 32. */
void q8_0_matmul(const float *x, const int8_t *qs, const float *d, float *y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    q8_0_rows(x, qs, d, y, M, N, K, threads);
}

/* The float32 weights themselves, w [N, K], for products of many rows (a prefill), which a
 * float GEMM does faster than the row kernel: the same operations as above, so bit for bit
 * gguf's dequantization. qs uint8 [N, K/2], d and m [N, K/32]. */
void q4_1_dequantize(const uint8_t *qs, const half_bits *d, const half_bits *m, float *w, int64_t N, int64_t K,
                     int threads) {
    const int64_t blocks = N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[4];
        dequantize_q4_1(qs, d, m, b, v);  /* block b of the whole matrix: rows are whole blocks */
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(w + 32 * b + 8 * k, v[k]);
    }
}

/* w [N, K] from Q8_0 blocks: qs int8 [N, K], d [N, K/32]. */
void q8_0_dequantize(const int8_t *qs, const float *d, float *w, int64_t N, int64_t K, int threads) {
    const int64_t blocks = N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[4];
        dequantize_q8_0((const uint8_t *)qs, d, b, v);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(w + 32 * b + 8 * k, v[k]);
    }
}

/* A barrier for the threads of one parallel region that spins while it waits, whatever
 * OMP_WAIT_POLICY says: OpenMP's own barrier puts a waiting thread to sleep under PASSIVE, and the
 * wake-up (~20 µs here) cost more than the MLP's second half saved. The threads are all running in
 * the region, so the wait is their imbalance, a few µs; past SPINS_BEFORE_YIELD pauses (a thread
 * descheduled on a busy machine) a waiter yields its core instead of burning it. */
#define SPINS_BEFORE_YIELD 100000
typedef struct {
    atomic_int arrived, phase;
} spin_barrier;

/* Returns once all `team` threads have called it; what each wrote before is visible to all after. */
static void spin_barrier_wait(spin_barrier *barrier, int team) {
    const int phase = atomic_load_explicit(&barrier->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&barrier->arrived, 1, memory_order_acq_rel) == team - 1) {
        atomic_store_explicit(&barrier->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&barrier->phase, phase + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&barrier->phase, memory_order_acquire) == phase; spins++) {
        if (spins < SPINS_BEFORE_YIELD)
            _mm_pause();
        else
            sched_yield();
    }
}

/* A SwiGLU MLP whose three weights are Q4_1 blocks, for M rows of x (as int16_rows, 4 at a time):
 *     y [M, E] = (silu(x @ G^T) * (x @ U^T)) @ D^T,   G, U [F, E], D [E, F],
 * in one parallel region, so a sleeping OpenMP team wakes once instead of three times. First each
 * thread takes a range of the F hidden units (whole blocks of 32): their gate and up sums, h =
 * silu(g) * u there, and those blocks of h as int16 in hq. Then, past a spin barrier, each thread
 * takes a range of the E outputs, whole rows of D over all of h. (Splitting D by the hidden units
 * instead, which needs no barrier, had each thread read half of every row of D and add its share
 * afterwards: 1.3x slower with the weights coming from memory, as a decode step's do.) h is scratch
 * [M, F], hq int16_rows [M, F]. silu(g) = g / (1 + exp(-g)). `swiglu_share` is thread t's part, inside a
 * parallel region of `team` threads (the decode step's); `swiglu` opens the region. */
static void swiglu_share(int16_rows x, const uint8_t *gq, const half_bits *gd, const half_bits *gm, const uint8_t *uq,
                         const half_bits *ud, const half_bits *um, const uint8_t *dq, const half_bits *dd,
                         const half_bits *dm, float *h, int16_rows hq, float *y, int64_t M, int64_t F, int t, int team,
                         spin_barrier *barrier) {
    const int64_t E = x.K, in_blocks = E / 32, hidden_blocks = F / 32;
    const int64_t first = hidden_blocks * t / team, end = hidden_blocks * (t + 1) / team;
    for (int64_t n = 32 * first; n < 32 * end; n++) {
        for (int64_t i = 0; i < M; i += 4) {
            const int rows = M - i >= 4 ? 4 : (int)(M - i);
            float g[4], u[4];
            q4_1_dots_of(gq + n * (E / 2), gd + n * in_blocks, gm + n * in_blocks, x, i, 0, in_blocks, rows, g);
            q4_1_dots_of(uq + n * (E / 2), ud + n * in_blocks, um + n * in_blocks, x, i, 0, in_blocks, rows, u);
            for (int r = 0; r < rows; r++) h[(i + r) * F + n] = g[r] / (1.0f + expf(-g[r])) * u[r];
        }
    }
    quantize_rows(h, M, first, end, hq);
    spin_barrier_wait(barrier, team);
    for (int64_t e = E * t / team; e < E * (t + 1) / team; e++) {
        for (int64_t i = 0; i < M; i += 4) {
            const int rows = M - i >= 4 ? 4 : (int)(M - i);
            float s[4];
            q4_1_dots_of(dq + e * (F / 2), dd + e * hidden_blocks, dm + e * hidden_blocks, hq, i, 0, hidden_blocks,
                         rows, s);
            for (int r = 0; r < rows; r++) y[(i + r) * E + e] = s[r];
        }
    }
}

static void swiglu(int16_rows x, const uint8_t *gq, const half_bits *gd, const half_bits *gm, const uint8_t *uq,
                   const half_bits *ud, const half_bits *um, const uint8_t *dq, const half_bits *dd,
                   const half_bits *dm, float *h, int16_rows hq, float *y, int64_t M, int64_t F, int threads) {
    spin_barrier barrier = {0, 0};
#pragma omp parallel num_threads(threads)
    swiglu_share(x, gq, gd, gm, uq, ud, um, dq, dd, dm, h, hq, y, M, F, omp_get_thread_num(), omp_get_num_threads(),
                 &barrier);
}

/* The MLP above for x float32 [M, E]. Scratch: h [M, F], q int16 [M, E + F] and f float
 * [2, M, (E + F) / 32] (x and h as int16_rows). */
void q4_1_swiglu(const float *x, const uint8_t *gq, const half_bits *gd, const half_bits *gm, const uint8_t *uq,
                 const half_bits *ud, const half_bits *um, const uint8_t *dq, const half_bits *dd, const half_bits *dm,
                 float *h, int16_t *q, float *f, float *y, int64_t M, int64_t E, int64_t F, int threads) {
    int16_rows xq = int16_rows_in(&q, &f, M, E), hq = int16_rows_in(&q, &f, M, F);
    quantize_rows(x, M, 0, E / 32, xq);
    swiglu(xq, gq, gd, gm, uq, ud, um, dq, dd, dm, h, hq, y, M, F, threads);
}

/* A decoder layer's two halves around its attention, for M rows of x whose weights are all Q4_1:
 * the operations between one attention and the next run here in two calls instead of some forty
 * torch operations. Each is written to give what the torch modules give (llama.py): RMSNorm as
 * weight * (x * (1 / sqrt(mean(x^2) + eps))), RoPE as x * cos + rotate_half(x) * sin with the same
 * float32 roundings (-ffp-contract=off), so only the order of the sums differs. */

/* h [M, E] = RMSNorm(x [M, E]) with weight w [E]. */
static void rms_norm_rows(const float *x, const float *w, float eps, float *h, int64_t M, int64_t E) {
    for (int64_t i = 0; i < M; i++) {
        const float *xi = x + i * E;
        float squares = 0.0f;
        for (int64_t e = 0; e < E; e++) squares += xi[e] * xi[e];
        const float scale = 1.0f / sqrtf(squares / (float)E + eps);
        for (int64_t e = 0; e < E; e++) h[i * E + e] = w[e] * (xi[e] * scale);
    }
}

/* In place on x [M, heads * D]: each head of row i rotated by cos, sin [T, D] row i % T (rows are
 * [B, T] flattened, every sequence at the same positions). rotate_half(v) = cat(-v[D/2:], v[:D/2]). */
static void rope_rows(float *x, const float *cos, const float *sin, int64_t M, int64_t T, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < M; i++) {
        const float *c = cos + (i % T) * D, *s = sin + (i % T) * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (i * heads + h) * D;
            for (int64_t j = 0; j < half; j++) {
                const float a = v[j], b = v[j + half];
                v[j] = a * c[j] + (-b) * s[j];
                v[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
    }
}

/* The half before the attention: h = RMSNorm(x) (scratch [M, E]), then q [M, H*D], k and v
 * [M, H_kv*D] = h @ W^T of the Q4_1 blocks of q_proj, k_proj, v_proj, with RoPE applied to q and k.
 * Scratch: hq int16 [M, E], hf float [2, M, E/32] (h as int16_rows, shared by the three products). */
void q4_1_attention_inputs(const float *x, const float *norm_weight, float eps, const uint8_t *qq, const half_bits *qd,
                           const half_bits *qm, const uint8_t *kq, const half_bits *kd, const half_bits *km,
                           const uint8_t *vq, const half_bits *vd, const half_bits *vm, const float *cos,
                           const float *sin, float *h, int16_t *hq, float *hf, float *q, float *k, float *v, int64_t M,
                           int64_t T, int64_t E, int64_t H,
                           int64_t H_kv, int64_t D, int threads) {
    rms_norm_rows(x, norm_weight, eps, h, M, E);
    int16_rows rows = int16_rows_in(&hq, &hf, M, E);
    quantize_rows(h, M, 0, E / 32, rows);
    q4_1_rows(rows, qq, qd, qm, q, M, H * D, threads);
    q4_1_rows(rows, kq, kd, km, k, M, H_kv * D, threads);
    q4_1_rows(rows, vq, vd, vm, v, M, H_kv * D, threads);
    rope_rows(q, cos, sin, M, T, H, D);
    rope_rows(k, cos, sin, M, T, H_kv, D);
}

/* The half after it: mid = x + attention [M, A] @ O^T (o_proj's Q4_1 blocks, [E, A]), then
 * y = mid + MLP(RMSNorm(mid)) through the SwiGLU above (M <= its 16 rows). Scratch: mid, normed
 * and mlp [M, E], the MLP's h [M, F], and q int16
 * [M, A + E + F], f float [2, M, (A + E + F) / 32] (attention, normed and h as int16_rows). */
void q4_1_attention_output_and_mlp(const float *x, const float *attention, const uint8_t *oq, const half_bits *od,
                                   const half_bits *om, const float *norm_weight, float eps, const uint8_t *gq,
                                   const half_bits *gd, const half_bits *gm, const uint8_t *uq, const half_bits *ud,
                                   const half_bits *um, const uint8_t *dq, const half_bits *dd, const half_bits *dm,
                                   float *mid, float *normed, float *mlp, float *h, int16_t *q, float *f, float *y,
                                   int64_t M, int64_t A, int64_t E, int64_t F, int o_threads, int mlp_threads) {
    int16_rows aq = int16_rows_in(&q, &f, M, A), nq = int16_rows_in(&q, &f, M, E), hq = int16_rows_in(&q, &f, M, F);
    quantize_rows(attention, M, 0, A / 32, aq);
    q4_1_rows(aq, oq, od, om, mid, M, E, o_threads);
    for (int64_t j = 0; j < M * E; j++) mid[j] = x[j] + mid[j];
    rms_norm_rows(mid, norm_weight, eps, normed, M, E);
    quantize_rows(normed, M, 0, E / 32, nq);
    swiglu(nq, gq, gd, gm, uq, ud, um, dq, dd, dm, h, hq, mlp, M, F, mlp_threads);
    for (int64_t j = 0; j < M * E; j++) y[j] = mid[j] + mlp[j];
}

/* paged_decode.c: some of the tasks (b * H + h) of one new query per sequence over one layer of a paged
 * or a contiguous cache, on the calling thread. */
void paged_decode_attention_tasks(const float *q, const float *keys, const float *values, const int64_t *tables,
                                  const int64_t *lengths, float *out, int64_t H, int64_t H_kv, int64_t D,
                                  int64_t block_size, int64_t max_blocks, int64_t window, float scale, float *scores,
                                  int64_t first, int64_t end);
void cached_decode_attention_tasks(const float *q, const float *keys, const float *values, float *out, int64_t H,
                                   int64_t H_kv, int64_t D, int64_t S_max, int64_t length, int64_t window, float scale,
                                   float *scores, int64_t first, int64_t end);

/* Where a decode step's keys and values go, and what each new query attends to. Contiguous (a KVCache):
 * keys, values [L, B, H_kv, S_max, D], layer l holding held[l] positions of every sequence (tables NULL).
 * Paged (the engine's store): keys, values [L, slots, H_kv, D], sequence b's new key written at slot
 * slots[b], its lengths[b] keys (the new one included) read through tables [B, max_blocks] of block ids. */
typedef struct {
    float *keys, *values;
    int64_t layer_size; /* floats per layer */
    const int64_t *held;
    int64_t S_max;
    const int64_t *tables, *lengths, *slots;
    int64_t block_size, max_blocks;
    int64_t window; /* the last `window` keys only; 0: all */
} decode_cache;

/* Layer l's new k, v [B, H_kv * D] into the cache. */
static void write_keys_values(decode_cache c, int64_t l, const float *k, const float *v, int64_t B, int64_t H_kv,
                              int64_t D) {
    float *keys = c.keys + l * c.layer_size, *values = c.values + l * c.layer_size;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < H_kv; g++) {
            const int64_t from = (b * H_kv + g) * D;
            const int64_t at = c.tables ? (c.slots[b] * H_kv + g) * D : ((b * H_kv + g) * c.S_max + c.held[l]) * D;
            for (int64_t i = 0; i < D; i++) keys[at + i] = k[from + i], values[at + i] = v[from + i];
        }
}

/* Tasks [first, end) (task = b * H + h) of layer l's attention: q [B, H * D] over the cache into out. */
static void attend_tasks(decode_cache c, int64_t l, const float *q, float *out, int64_t H, int64_t H_kv, int64_t D,
                         float scale, float *scores, int64_t first, int64_t end) {
    const float *keys = c.keys + l * c.layer_size, *values = c.values + l * c.layer_size;
    if (c.tables)
        paged_decode_attention_tasks(q, keys, values, c.tables, c.lengths, out, H, H_kv, D, c.block_size, c.max_blocks,
                                     c.window, scale, scores, first, end);
    else
        cached_decode_attention_tasks(q, keys, values, out, H, H_kv, D, c.S_max, c.held[l] + 1, c.window, scale, scores,
                                      first, end);
}

/* Rows [first, end) of the stacked outputs of several products, on the calling thread: the product
 * whose outputs are rows [offset, offset + n) of the stack, y [M, n] = x @ W^T (W: qs, d, m), gets
 * the part of the range that falls on it. */
static void stacked_range(int16_rows x, const void *const *w, float *y, int64_t M, int64_t n, int64_t offset,
                          int64_t first, int64_t end) {
    const int64_t lo = first > offset ? first - offset : 0, hi = end < offset + n ? end - offset : n;
    if (lo < hi) q4_1_rows_range(x, w[0], w[1], w[2], y, M, n, lo, hi);
}

/* A decode step through all L decoder layers: x [B, E] (one new token per sequence; cos, sin [T, D]
 * with T = 1, every sequence at one position, or T = B, row b at its own) goes through each layer
 * in turn, in place:
 *     h = RMSNorm(x);  q, k, v = h @ W^T;  RoPE on q and k;  k, v into the cache;
 *     attention of q over the cache;  mid = x + attention @ O^T;  x = mid + MLP(RMSNorm(mid)),
 * the same operations as the two halves `q4_1_attention_inputs` and `q4_1_attention_output_and_mlp`.
 * All of it runs in ONE parallel region of `threads` threads, each phase split between them (the
 * products by output rows, the attention by (sequence, head), the MLP as `swiglu_share`) and a spin
 * barrier between phases; the small serial parts (norms, RoPE, the cache write, the int16 rows) run
 * on thread 0. A sleeping OpenMP team (OMP_WAIT_POLICY=PASSIVE) then wakes once a step, not some six
 * times a layer, and every product of the layer runs on all the threads.
 * Each layer's 23 pointers are a row of weights [L, 23] (int64 addresses, `Q4DecoderLayer.c_weights`'
 * order): input_layernorm's weight; q_proj, k_proj, v_proj, o_proj as (nibbles, d, m);
 * post_attention_layernorm's weight; gate_proj, up_proj, down_proj as (nibbles, d, m). The caller
 * advances the cache's lengths after. Scratch: h [B, E], hq int16 [B, E], hf [2, B, E/32]; q [B, H*D],
 * k, v [B, H_kv*D]; attention [B, H*D]; scores [threads, context] (context: the most keys a query
 * reads); mid, normed, mlp [B, E]; hidden [B, F]; mq int16 [B, H*D + E + F], mf [2, B, (H*D + E + F)/32]. */
static void decode_layers(float *x, const int64_t *weights, int64_t L, float eps, const float *cos, const float *sin,
                          int64_t T, decode_cache cache, float scale, float *h, int16_t *hq, float *hf, float *q,
                          float *k, float *v, float *attention, float *scores, float *mid, float *normed, float *mlp,
                          float *hidden, int16_t *mq, float *mf, int64_t B, int64_t E, int64_t F, int64_t H,
                          int64_t H_kv, int64_t D, int64_t context, int threads) {
    const int64_t A = H * D, KV = H_kv * D;
    const int16_rows h_rows = int16_rows_in(&hq, &hf, B, E), attention_rows = int16_rows_in(&mq, &mf, B, A);
    const int16_rows normed_rows = int16_rows_in(&mq, &mf, B, E), hidden_rows = int16_rows_in(&mq, &mf, B, F);
    spin_barrier barrier = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        float *my_scores = scores + (int64_t)t * context;
        const int64_t qkv_first = (A + 2 * KV) * t / team, qkv_end = (A + 2 * KV) * (t + 1) / team;
        const int64_t e_first = E * t / team, e_end = E * (t + 1) / team;
        for (int64_t l = 0; l < L; l++) {
            const void *const *w = (const void *const *)(weights + 23 * l);
            if (t == 0) {
                rms_norm_rows(x, w[0], eps, h, B, E);
                quantize_rows(h, B, 0, E / 32, h_rows);
            }
            spin_barrier_wait(&barrier, team);
            stacked_range(h_rows, w + 1, q, B, A, 0, qkv_first, qkv_end);
            stacked_range(h_rows, w + 4, k, B, KV, A, qkv_first, qkv_end);
            stacked_range(h_rows, w + 7, v, B, KV, A + KV, qkv_first, qkv_end);
            spin_barrier_wait(&barrier, team);
            if (t == 0) {
                rope_rows(q, cos, sin, B, T, H, D);
                rope_rows(k, cos, sin, B, T, H_kv, D);
                write_keys_values(cache, l, k, v, B, H_kv, D);
            }
            spin_barrier_wait(&barrier, team);
            attend_tasks(cache, l, q, attention, H, H_kv, D, scale, my_scores, B * H * t / team, B * H * (t + 1) / team);
            spin_barrier_wait(&barrier, team);
            if (t == 0) quantize_rows(attention, B, 0, A / 32, attention_rows);
            spin_barrier_wait(&barrier, team);
            q4_1_rows_range(attention_rows, w[10], w[11], w[12], mid, B, E, e_first, e_end);
            spin_barrier_wait(&barrier, team);
            if (t == 0) {
                for (int64_t j = 0; j < B * E; j++) mid[j] = x[j] + mid[j];
                rms_norm_rows(mid, w[13], eps, normed, B, E);
                quantize_rows(normed, B, 0, E / 32, normed_rows);
            }
            spin_barrier_wait(&barrier, team);
            swiglu_share(normed_rows, w[14], w[15], w[16], w[17], w[18], w[19], w[20], w[21], w[22], hidden,
                         hidden_rows, mlp, B, F, t, team, &barrier);
            for (int64_t i = 0; i < B; i++) /* this thread's outputs of the MLP */
                for (int64_t e = e_first; e < e_end; e++) x[i * E + e] = mid[i * E + e] + mlp[i * E + e];
            spin_barrier_wait(&barrier, team);
        }
    }
}

/* Over a KVCache's keys, values [L, B, H_kv, S_max, D], layer l holding held[l] positions. */
void q4_1_decode_layers(float *x, const int64_t *weights, int64_t L, float eps, const float *cos, const float *sin,
                        int64_t T, float *keys, float *values, const int64_t *held, int64_t S_max, int64_t window,
                        float scale, float *h, int16_t *hq, float *hf, float *q, float *k, float *v, float *attention,
                        float *scores, float *mid, float *normed, float *mlp, float *hidden, int16_t *mq, float *mf,
                        int64_t B, int64_t E, int64_t F, int64_t H, int64_t H_kv, int64_t D, int threads) {
    decode_cache cache = {keys, values, B * H_kv * S_max * D, held, S_max, 0, 0, 0, 0, 0, window};
    decode_layers(x, weights, L, eps, cos, sin, T, cache, scale, h, hq, hf, q, k, v, attention, scores, mid, normed,
                  mlp, hidden, mq, mf, B, E, F, H, H_kv, D, S_max, threads);
}

/* Over the engine's paged store: keys, values [L, num_slots, H_kv, D]; sequence b's new key at slot
 * slots[b], its lengths[b] keys through tables [B, max_blocks]. */
void q4_1_decode_layers_paged(float *x, const int64_t *weights, int64_t L, float eps, const float *cos,
                              const float *sin, int64_t T, float *keys, float *values, int64_t num_slots,
                              const int64_t *tables, const int64_t *lengths, const int64_t *slots, int64_t block_size,
                              int64_t max_blocks, int64_t window, float scale, float *h, int16_t *hq, float *hf,
                              float *q, float *k, float *v, float *attention, float *scores, float *mid, float *normed,
                              float *mlp, float *hidden, int16_t *mq, float *mf, int64_t B, int64_t E, int64_t F,
                              int64_t H, int64_t H_kv, int64_t D, int threads) {
    decode_cache cache = {keys, values, num_slots * H_kv * D, 0, 0, tables, lengths, slots, block_size, max_blocks,
                          window};
    decode_layers(x, weights, L, eps, cos, sin, T, cache, scale, h, hq, hf, q, k, v, attention, scores, mid, normed,
                  mlp, hidden, mq, mf, B, E, F, H, H_kv, D, max_blocks * block_size, threads);
}
