/* y[M, N] = x[M, K] @ W^T for W stored as llama.cpp's blocks of 32 weights, float32 activations:
 * `q4_1_matmul` for Q4_1 blocks, `q8_0_matmul` for Q8_0 blocks.
 *
 * Q4_1: W's row n, block b is d[n, b], m[n, b] (float32) and 16 bytes qs[n, 16*b ..]: byte j's
 * low nibble is weight j of the block, its high nibble weight j + 16 (gguf's order);
 * weight = d * q + m.
 * Q8_0: W's row n, block b is d[n, b] (float32) and 32 signed bytes qs[n, 32*b ..];
 * weight = d * q.
 *
 * Each block is dequantized in registers with the same float32 operations as
 * gguf.quants.dequantize (-ffp-contract=off keeps a multiply and an add two roundings), so the
 * weights are bit for bit the float32 weights, and the result differs from F.linear only in the
 * order of the sums. The threads split the output rows N; each weight block is dequantized once
 * for up to 4 rows of x, which share it.
 *
 * Plain C with AVX2/FMA intrinsics and OpenMP; no torch headers (called through ctypes).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

enum format { Q4_1, Q8_0, F32 };  /* F32: a weight row already dequantized (below) */

/* Q4_1 block b: 16 bytes of nibbles -> 32 weights d * q + m, as 4 vectors of 8. */
static inline void dequantize_q4_1(const uint8_t *qs, const float *d, const float *m, int64_t b, __m256 w[4]) {
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
    __m128i lo = _mm_and_si128(bytes, low_mask);                     /* weights 0..15 */
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  /* weights 16..31 */
    __m256 scale = _mm256_set1_ps(d[b]), offset = _mm256_set1_ps(m[b]);
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
 * of format `f`: R dot products over those blocks' 32 * (end - first) columns. `f` and `R` are
 * constants after inlining, so each (format, R) gets its own unrolled loop. Each row sums into
 * `chains` independent accumulators (4 for R <= 2, else 2): one chain would wait an FMA's latency
 * (4 cycles) per 8 weights. */
static inline __attribute__((always_inline)) void block_dots(enum format f, const uint8_t *qs, const float *d,
                                                             const float *m, const float *x, int64_t stride,
                                                             int64_t first, int64_t end, int R, float *out) {
    const int chains = R <= 2 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = first; b < end; b++) {
        __m256 w[4];
        if (f == Q4_1)
            dequantize_q4_1(qs, d, m, b, w);
        else if (f == Q8_0)
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
                                                           const float *m, const float *x, int64_t K, int R,
                                                           float *out) {
    block_dots(f, qs, d, m, x, K, 0, K / 32, R, out);
}

/* Rows [0, M) of x against one weight row, 4 rows of x at a time: y[i, n] for every i (y's row
 * stride N). The weight row is in format `f` (F32: floats). */
static inline __attribute__((always_inline)) void column(enum format f, const uint8_t *qn, const float *dn,
                                                         const float *mn, const float *x, float *y, int64_t M,
                                                         int64_t N, int64_t K) {
    float out[4];
    for (int64_t i = 0; i < M; i += 4) {
        const int64_t left = M - i;
        const float *xi = x + i * K;
        int R = left >= 4 ? 4 : (int)left;
        switch (R) {  /* constant R, so the compiler unrolls each case */
            case 4: row_dots(f, qn, dn, mn, xi, K, 4, out); break;
            case 3: row_dots(f, qn, dn, mn, xi, K, 3, out); break;
            case 2: row_dots(f, qn, dn, mn, xi, K, 2, out); break;
            default: row_dots(f, qn, dn, mn, xi, K, 1, out); break;
        }
        for (int r = 0; r < R; r++) y[(i + r) * N] = out[r];
    }
}

/* Rows of x beyond which a weight row is dequantized once into a float buffer (on the stack, in L1)
 * and every 4 rows of x read it there, instead of dequantizing it again for each 4 rows. */
#define ROWS_FOR_A_BUFFER 4
#define BUFFER_MAX_K 8192

/* y [M, N] = x [M, K] @ W^T, W's rows in format `f`; the threads split W's rows. A row of W is
 * K/2 bytes of qs for Q4_1, K for Q8_0; m is read for Q4_1 only. */
static inline __attribute__((always_inline)) void matmul(enum format f, const float *x, const uint8_t *qs,
                                                         const float *d, const float *m, float *y, int64_t M,
                                                         int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32, row_bytes = f == Q4_1 ? K / 2 : K;
    const int buffered = M > ROWS_FOR_A_BUFFER && K <= BUFFER_MAX_K;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = qs + n * row_bytes;
        const float *dn = d + n * blocks, *mn = f == Q4_1 ? m + n * blocks : 0;
        if (!buffered) {
            column(f, qn, dn, mn, x, y + n, M, N, K);
            continue;
        }
        float row[BUFFER_MAX_K] __attribute__((aligned(32)));
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            if (f == Q4_1)
                dequantize_q4_1(qn, dn, mn, b, w);
            else
                dequantize_q8_0(qn, dn, b, w);
            for (int k = 0; k < 4; k++) _mm256_store_ps(row + 32 * b + 8 * k, w[k]);
        }
        column(F32, (const uint8_t *)row, 0, 0, x, y + n, M, N, K);
    }
}

/* x [M, K], qs uint8 [N, K/2], d and m [N, K/32], y [M, N]; all contiguous. K a multiple of 32. */
void q4_1_matmul(const float *x, const uint8_t *qs, const float *d, const float *m, float *y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    matmul(Q4_1, x, qs, d, m, y, M, N, K, threads);
}

/* x [M, K], qs int8 [N, K], d [N, K/32], y [M, N]; all contiguous. K a multiple of 32. */
void q8_0_matmul(const float *x, const int8_t *qs, const float *d, float *y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    matmul(Q8_0, x, (const uint8_t *)qs, d, 0, y, M, N, K, threads);
}

/* The float32 weights themselves, w [N, K], for products of many rows (a prefill), which a
 * float GEMM does faster than the row kernel: the same operations as above, so bit for bit
 * gguf's dequantization. qs uint8 [N, K/2], d and m [N, K/32]. */
void q4_1_dequantize(const uint8_t *qs, const float *d, const float *m, float *w, int64_t N, int64_t K,
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

/* block_dots of Q4_1 with R = rows (1..4) made a constant, so each gets its unrolled loop. */
static inline void q4_1_block_dots(const uint8_t *qs, const float *d, const float *m, const float *x,
                                   int64_t stride, int64_t first, int64_t end, int rows, float *out) {
    switch (rows) {
        case 4: block_dots(Q4_1, qs, d, m, x, stride, first, end, 4, out); break;
        case 3: block_dots(Q4_1, qs, d, m, x, stride, first, end, 3, out); break;
        case 2: block_dots(Q4_1, qs, d, m, x, stride, first, end, 2, out); break;
        default: block_dots(Q4_1, qs, d, m, x, stride, first, end, 1, out); break;
    }
}

/* A SwiGLU MLP whose three weights are Q4_1 blocks, for M rows of x (4 at a time):
 *     y [M, E] = (silu(x @ G^T) * (x @ U^T)) @ D^T,   G, U [F, E], D [E, F],
 * in one parallel region, so a sleeping OpenMP team wakes once instead of three times. Each thread
 * takes a range of the F hidden units (whole blocks of 32): their gate and up sums, h = silu(g) * u
 * there, then that range's share of every output, D[:, range] @ h[range]; thread 0 writes its share
 * into y, thread t > 0 into partial[t - 1], and the shares are added after the region (so y's sums
 * are in another order than three separate products'). h is scratch [M, F], partial [threads - 1, M, E].
 * silu(g) = g / (1 + exp(-g)). */
void q4_1_swiglu(const float *x, const uint8_t *gq, const float *gd, const float *gm, const uint8_t *uq,
                 const float *ud, const float *um, const uint8_t *dq, const float *dd, const float *dm, float *h,
                 float *partial, float *y, int64_t M, int64_t E, int64_t F, int threads) {
    const int64_t in_blocks = E / 32, hidden_blocks = F / 32;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        if (t == 0) used = team;
        const int64_t first = hidden_blocks * t / team, end = hidden_blocks * (t + 1) / team;
        for (int64_t n = 32 * first; n < 32 * end; n++) {
            for (int64_t i = 0; i < M; i += 4) {
                const int rows = M - i >= 4 ? 4 : (int)(M - i);
                float g[4], u[4];
                const float *xi = x + i * E;
                q4_1_block_dots(gq + n * (E / 2), gd + n * in_blocks, gm + n * in_blocks, xi, E, 0, in_blocks, rows, g);
                q4_1_block_dots(uq + n * (E / 2), ud + n * in_blocks, um + n * in_blocks, xi, E, 0, in_blocks, rows, u);
                for (int r = 0; r < rows; r++) h[(i + r) * F + n] = g[r] / (1.0f + expf(-g[r])) * u[r];
            }
        }
        float *share = t == 0 ? y : partial + (int64_t)(t - 1) * M * E;
        for (int64_t e = 0; e < E; e++) {
            for (int64_t i = 0; i < M; i += 4) {
                const int rows = M - i >= 4 ? 4 : (int)(M - i);
                float s[4];
                q4_1_block_dots(dq + e * (F / 2), dd + e * hidden_blocks, dm + e * hidden_blocks, h + i * F, F, first,
                                end, rows, s);
                for (int r = 0; r < rows; r++) share[(i + r) * E + e] = s[r];
            }
        }
    }
    for (int t = 1; t < used; t++)
        for (int64_t j = 0; j < M * E; j++) y[j] += partial[(int64_t)(t - 1) * M * E + j];
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
 * [M, H_kv*D] = h @ W^T of the Q4_1 blocks of q_proj, k_proj, v_proj, with RoPE applied to q and k. */
void q4_1_attention_inputs(const float *x, const float *norm_weight, float eps, const uint8_t *qq, const float *qd,
                           const float *qm, const uint8_t *kq, const float *kd, const float *km, const uint8_t *vq,
                           const float *vd, const float *vm, const float *cos, const float *sin, float *h, float *q,
                           float *k, float *v, int64_t M, int64_t T, int64_t E, int64_t H, int64_t H_kv, int64_t D,
                           int threads) {
    rms_norm_rows(x, norm_weight, eps, h, M, E);
    matmul(Q4_1, h, qq, qd, qm, q, M, H * D, E, threads);
    matmul(Q4_1, h, kq, kd, km, k, M, H_kv * D, E, threads);
    matmul(Q4_1, h, vq, vd, vm, v, M, H_kv * D, E, threads);
    rope_rows(q, cos, sin, M, T, H, D);
    rope_rows(k, cos, sin, M, T, H_kv, D);
}

/* The half after it: mid = x + attention [M, A] @ O^T (o_proj's Q4_1 blocks, [E, A]), then
 * y = mid + MLP(RMSNorm(mid)) through q4_1_swiglu (M <= its 16 rows). Scratch: mid, normed and
 * mlp [M, E], and q4_1_swiglu's h [M, F] and partial [max(mlp_threads - 1, 1), M, E]. */
void q4_1_attention_output_and_mlp(const float *x, const float *attention, const uint8_t *oq, const float *od,
                                   const float *om, const float *norm_weight, float eps, const uint8_t *gq,
                                   const float *gd, const float *gm, const uint8_t *uq, const float *ud,
                                   const float *um, const uint8_t *dq, const float *dd, const float *dm, float *mid,
                                   float *normed, float *mlp, float *h, float *partial, float *y, int64_t M,
                                   int64_t A, int64_t E, int64_t F, int o_threads, int mlp_threads) {
    matmul(Q4_1, attention, oq, od, om, mid, M, E, A, o_threads);
    for (int64_t j = 0; j < M * E; j++) mid[j] = x[j] + mid[j];
    rms_norm_rows(mid, norm_weight, eps, normed, M, E);
    q4_1_swiglu(normed, gq, gd, gm, uq, ud, um, dq, dd, dm, h, partial, mlp, M, E, F, mlp_threads);
    for (int64_t j = 0; j < M * E; j++) y[j] = mid[j] + mlp[j];
}
